"""multi_question=true: several questions asked one after another on one compressed context, each its own
sample row, journaled per turn, so a killed run resumes mid-conversation (docs/query-agnostic.md)."""

from __future__ import annotations

import json

import pytest

import evalkit.run as runner
import tasks.longbench_v2.longbench_v2 as lb
import tasks.ruler.ruler as ruler
from evalkit.config import ConfigError, compose
from evalkit.sample import Sample
from tests.conftest import fresh_run, killed_run, planned_folder

# sampled (temperature 1): a random model's answers then differ with any difference in its cache
RULER = [
    "model=tiny_llama",
    "model.max_new_tokens=12",
    "task.load.n=1",
    "task.load.lengths=[1024]",
    "task.load.tasks=[niah_single_1,niah_multikey_2]",
    "+task.generation.do_sample=true",
    "+task.generation.temperature=1.0",
    "method=snapstream",
    "method.budget=64",
    "query_aware=false",
    "multi_question=true",
]


run = fresh_run  # conftest: one call stands for one process


def lines(folder) -> list[dict]:
    return [json.loads(x) for x in (folder / "generations.jsonl").read_text().splitlines()]


def test_each_needle_is_its_own_question_and_row(tmp_path):
    run(*RULER, results=tmp_path)
    out = planned_folder(tmp_path, *RULER)
    assert out.parts[-4].endswith("-multi_questiontrue-query_awarefalse")
    rows = {r["id"]: r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}
    base = "niah_multikey_2/1024/0"
    assert list(rows) == ["niah_single_1/1024/0", base, f"{base}/q1", f"{base}/q2", f"{base}/q3"]
    turns = {r["id"]: (r["stats"]["conversation"], r["stats"]["turn"]) for r in lines(out)}
    assert turns[f"{base}/q3"] == (base, 3) and turns["niah_single_1/1024/0"] == ("niah_single_1/1024/0", 0)


def test_questions_keep_the_context_and_ask_each_key_alone(tmp_path):
    context = "Some special magic numbers are hidden.\nOne of the special magic numbers for red-fox is: 11.\n"
    context += "One of the special magic numbers for blue-owl is: 22.\nOne of the special magic numbers for "
    context += "red-fox is: 33.\n"
    asks = "What are all the special magic numbers for blue-owl mentioned in the provided text?"
    s = Sample("m/0", "ruler", context + asks, ["22"], 8, meta={"task": "niah_multiquery"})
    s.answer_prefix = " The special magic numbers for blue-owl mentioned in the provided text are"
    q = ruler.questions(s)
    assert [x.id for x in q] == ["m/0/q0", "m/0/q1"]  # asked in the singular: not the sample's own question
    assert (
        q[0].prompt
        == context + "What is the special magic number for blue-owl mentioned in the provided text?"
    )
    assert q[0].answers == ["22"] and q[0].answer_prefix.endswith(
        "for blue-owl mentioned in the provided text is"
    )
    assert q[1].prompt.endswith(
        "What are all the special magic numbers for red-fox mentioned in the provided text?"
    )
    assert q[1].answers == ["11", "33"] and [x.meta["turn"] for x in q] == [0, 1]
    assert {x.meta["conversation"] for x in q} == {"m/0"}


def test_longbench_items_sharing_a_document_are_one_conversation():
    def item(i, doc):
        prompt = lb.fill(
            lb.PROMPT_0SHOT, {"context": doc, "question": f"Q{i}?"} | {f"choice_{c}": c for c in "ABCD"}
        )
        return Sample(f"id{i}", lb.TASK, prompt, ["A"], 8)

    out = lb.conversations([item(0, "doc one"), item(1, "doc two"), item(2, "doc one")])
    assert [(s.id, s.meta["conversation"], s.meta["turn"]) for s in out] == [
        ("id0", "id0", 0),
        ("id2", "id0", 1),
        ("id1", "id1", 0),
    ]


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """An uninterrupted run, and the same run killed after its second journal line (niah_single_1's one
    question, then the first of niah_multikey_2's four), then resumed: (whole folder, resumed folder, the
    kill, the killed journal)."""
    tmp_path = tmp_path_factory.mktemp("resume")
    whole = tmp_path / "whole"
    run(*RULER, results=whole)
    killed = tmp_path / "killed"
    done = killed_run(RULER, killed, after=2)
    out = planned_folder(killed, *RULER)
    at_kill = lines(out) if (out / "generations.jsonl").exists() else []
    run(*RULER, results=killed)
    return planned_folder(whole, *RULER), out, done, at_kill


def test_a_run_killed_mid_conversation_resumes_with_nothing_lost_or_duplicated(killed_and_resumed):
    whole, out, done, at_kill = killed_and_resumed
    expected = {r["key"]: r["text"] for r in lines(whole)}
    assert done.returncode == -9, done.stderr[-2000:]
    assert [r["stats"]["turn"] for r in at_kill] == [0, 0]
    got = lines(out)
    assert len(got) == len({r["key"] for r in got}) == 5  # nothing asked twice
    assert {r["key"]: r["text"] for r in got} == expected  # the resumed conversation answers as the whole one
    assert len(set(expected.values())) == 5  # sampled answers: a cache rebuilt wrong would show
    counts = json.loads((out / "metrics.json").read_text())
    assert json.dumps(counts).count('"generated_now": 3') == 1


def test_a_resumed_conversation_ends_with_the_uninterrupted_runs_figures(killed_and_resumed):
    """A resumed conversation feeds its answered turns back, but each turn still counts what an
    uninterrupted run counts (its prompt: the context and question for the first, its own question after):
    the same generation and KV figures but the clock (issue 31.6: mean prompt tokens differed)."""
    whole, out, _, _ = killed_and_resumed
    a, b = (json.loads((f / "metrics.json").read_text()) for f in (whole, out))
    clock = {"wall_time_s", "from_journal", "generated_now"}
    assert {k: v for k, v in b["generation"].items() if k not in clock} == {
        k: v for k, v in a["generation"].items() if k not in clock
    }
    assert b["kv"] == a["kv"]
    timing = {"wall_s", "tokens_per_s"}
    figures = {r["key"]: {k: v for k, v in r["stats"].items() if k not in timing} for r in lines(whole)}
    assert {r["key"]: {k: v for k, v in r["stats"].items() if k not in timing} for r in lines(out)} == figures


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["multi_question=true"],
            "multi_question=true asks several questions on one context compressed before",
        ),
        (["multi_question=yes"], "multi_question must be true or false, got 'yes'"),
        (
            ["multi_question=true", "query_aware=false", "+model.prompt_format=meta-llama3"],
            "multi_question=true: model tiny_llama renders ruler with its own single-turn template",
        ),
    ],
)
def test_multi_question_refuses_what_it_cannot_do_before_any_data(overrides, message, tmp_path):
    cfg = compose(overrides=[*RULER[:5], *overrides, f"results_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=message):
        runner.plan(cfg)


def test_longbench_cot_is_refused_in_multi_question_mode():
    with pytest.raises(ValueError, match="mode=cot makes a second call without it: use mode=0shot"):
        lb.load(mode="cot", multi_question=True)


def test_the_next_question_is_the_chat_templates_next_turn():
    from evalkit.config import model_spec
    from evalkit.request import next_turn_text
    from evalkit.sources import tokenizer_path
    from evalkit.task import get_tokenizer

    tok = get_tokenizer(tokenizer_path(model_spec("smollm2_135m")))
    s = Sample("x", "ruler", "P", [], 8, answer_prefix=" The number is")
    assert next_turn_text(tok, s, "Which number?") == (
        "<|im_end|>\n<|im_start|>user\nWhich number?<|im_end|>\n<|im_start|>assistant\n The number is"
    )
    s.meta["prompt_template"] = "[INST] {prompt} [/INST]"
    with pytest.raises(ValueError, match="x: multi_question asks the next question as a chat turn"):
        next_turn_text(tok, s, "Which number?")
