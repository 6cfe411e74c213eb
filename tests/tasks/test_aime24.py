"""AIME 2024: prompt, last-box extraction, math-verify judging, pass@1 / cons@k, loaders for both schemas
(CPU, offline)."""

import hashlib
import json
import signal
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evalkit.sample import Sample, aggregate
from tasks.aime24 import aime24, grade

H4_ROW = {
    "id": 60,
    "problem": "Find the remainder when $2^{10}$ is divided by $1000$.\n",
    "solution": "$2^{10} = 1024$.",
    "answer": "24",
    "url": "https://example.org/aime/2024-I-1",
    "year": "2024",
}
MAXWELL_ROW = {"ID": "2024-I-1", "Problem": "Find $7 \\cdot 3$.", "Solution": "$21$.", "Answer": 21}


def test_prompt_is_problem_newline_r1_instruction():
    assert aime24.prompt(" What is $1+1$?\n") == (
        "What is $1+1$?\nPlease reason step by step, and put your final answer within \\boxed{}."
    )


# --- extraction: the last box (brace-matched, \fbox too, `\boxed N` without braces) -----------------
@pytest.mark.parametrize(
    "response, box",
    [
        ("\\boxed{1} then \\boxed{2} and finally \\boxed{3}", "3"),  # last box wins
        ("\\boxed{\\frac{1}{2}} no wait \\boxed{{12}}", "{12}"),  # nested braces matched
        ("\\boxed{12} and a cut-off \\boxed{3", "12"),  # an unclosed last box is passed over
        ("\\fbox{ 25 }", " 25 "),
        ("\\boxed {7}", "7"),  # spaces before the brace
        ("$\\boxed 73$", "73"),  # a reported case: no braces, ends with the math
        ("so \\boxed73.", "73"),  # TeX ends a control word at a digit; a sentence's full stop is dropped
        ("\\[\\boxed 5\\] and \\(\\boxed 6\\)", "6"),
        ("\\boxed 204\nThat is all.", "204"),  # a brace-less box ends with its line
        ("\\boxed{8} then \\boxed $", "8"),  # an empty last box is passed over
        ("\\boxedanswer{3}", None),  # another control word, not a box
        ("The answer is 42.", None),
    ],
)
def test_last_boxed(response, box):
    assert aime24.last_boxed(response) == box


def qwen_box(pred_str: str) -> str:
    """Reference: QwenLM/Qwen2.5-Math `evaluation/parser.py` extract_answer's box branch, whose lines are
    `ans = pred_str.split("boxed")[-1]` / `if ans[0] == "{":` (brace counting) / `else: a =
    ans.split("$")[0].strip()`."""
    ans = pred_str.split("boxed")[-1]
    if ans[0] != "{":
        return ans.split("$")[0].strip()
    depth, out = 1, ""
    for c in ans[1:]:
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth == 0:
            break
        out += c
    return out


@pytest.mark.parametrize(
    "response",
    ["$\\boxed 73$", "Thus $\\boxed{204}$.", "x $\\boxed{\\frac{1}{2}}$ y", "a \\boxed{1} b $\\boxed 9$ c"],
)
def test_box_matches_qwen_math_extraction(response):
    assert aime24.last_boxed(response) == qwen_box(response)


@pytest.mark.parametrize(
    "response, qwen, evalkit",
    [
        ("\\boxed 204\nThat is all.", "204\nThat is all.", "204"),  # evalkit: a bare box ends with its line
        ("\\boxed{12} then \\boxed{3", "3", "12"),  # evalkit: a cut-off last box is passed over
        ("so \\boxed 73.", "73.", "73"),  # Qwen drops the full stop later (`if pred[-1] == ".":`)
        # a space before the brace: Qwen reads a bare box and keeps the braces; evalkit, like math-verify's
        # extract_boxed_content (it skips whitespace before "{"), reads the group
        ("$\\boxed {\\frac{1}{2}}$", "{\\frac{1}{2}}", "\\frac{1}{2}"),
    ],
)
def test_box_deviations_from_qwen_math_are_deliberate(response, qwen, evalkit):
    assert (qwen_box(response), aime24.last_boxed(response)) == (qwen, evalkit)


# --- judging with math-verify (huggingface/Math-Verify 0.9.0, lighteval's pass_at_k_math targets) ---------
@pytest.mark.parametrize(
    "response, answer, expected",
    [
        # five reported cases: judged wrong (or not found) by the hand-written normaliser
        ("\\boxed{204 \\text{ minutes}}", "204", (True, "boxed")),  # README: "Units in text handling"
        ("\\boxed{23 \\text{ (p+q)}}", "23", (True, "boxed")),
        # README FAQ: gold `101` vs a chain `a+2z = 2z + a = 101` "will return True" (gold first: reversed,
        # "it will return False")
        ("\\boxed{n = 809}", "809", (True, "boxed")),
        ("\\boxed{a+2z = 2z + a = 101}", "101", (True, "boxed")),
        ("\\boxed{\\frac{408}{2}}", "204", (True, "boxed")),
        ("$\\boxed 73$", "73", (True, "boxed")),
        # kept from the old table
        ("<think>\nso 33</think>\nThe answer is $\\boxed{33}$.", "33", (True, "boxed")),
        (
            "no think tags, just \\boxed{204}",
            "204",
            (True, "boxed"),
        ),  # non-thinking model / prefilled <think>
        ("<think>maybe \\boxed{5}</think> final: \\boxed{7}", "7", (True, "boxed")),  # thinking is ignored
        ("<think>maybe \\boxed{5}</think> final: \\boxed{7}", "5", (False, "boxed")),
        ("<think>a</think> x <think>b</think> \\boxed{8}", "8", (True, "boxed")),  # after the LAST </think>
        ("<think>a</think> \\boxed{5} <think>b</think> final", "5", (False, "no_box")),  # not after the first
        ("<think>a</think> \\boxed{5} <think>b</think> \\boxed{6}", "6", (True, "boxed")),
        ("\\boxed{033}", "33", (True, "boxed")),  # leading zeros
        ("\\boxed{\\text{204}}", "204", (True, "boxed")),
        ("\\fbox{ 25 }", "25", (True, "boxed")),
        ("$\\boxed{1,000}$", "1000", (True, "boxed")),  # thousands separator
        ("\\boxed{45^\\circ} or \\boxed{45^{\\circ}}", "45", (True, "boxed")),
        ("\\boxed{\\$ 8\\!0}", "80", (True, "boxed")),
        ("\\boxed{2^{10}}", "1024", (True, "boxed")),  # math-verify evaluates
        # wrong answers stay wrong
        ("\\boxed{809, 810}", "809", (False, "boxed")),  # a set is not the integer
        ("\\boxed{809 \\text{ or } 810}", "809", (False, "boxed")),
        ("\\boxed{8090}", "809", (False, "boxed")),  # no partial match
        ("\\boxed{80}", "809", (False, "boxed")),
        ("\\boxed{-204}", "204", (False, "boxed")),
        ("\\boxed{204.5}", "204", (False, "boxed")),
        ("\\boxed{x = 5}", "6", (False, "boxed")),
        ("\\boxed{204 = 205}", "204", (False, "boxed")),
        ("\\boxed{204!}", "204", (False, "boxed")),
        ("\\boxed{}", "204", (False, "boxed")),  # an empty box is a box, read as nothing
        ("\\boxed{\\text{A}}", "204", (False, "boxed")),
        # math-verify's reading, kept as upstream reads it (evalkit's old normaliser accepted the last two)
        ("\\boxed{204.}", "204", (False, "boxed")),
        ("\\boxed{1\\,000}", "1000", (False, "boxed")),
        # outcomes other than a judged box
        ("The answer is 42.", "42", (False, "no_box")),  # no box: math-verify never sees the text
        ("<think>\nlong reasoning that ran out of tok", "42", (False, "thinking_truncated")),
        ("<think>\nI guess \\boxed{42} but let me check", "42", (False, "thinking_truncated")),
        ("<think>x</think>", "42", (False, "no_box")),
    ],
)
def test_judge(response, answer, expected):
    j = aime24.judge(response, answer)
    assert (j.correct, j.outcome) == expected


# Both readings of one response: the headline (R1: the last box after the last `</think>`) and lighteval's
# `pass_at_k_math` (math-verify over the whole stripped text, targets [ExprExtractionConfig(),
# LatexExtractionConfig()], precision 6), which reads unboxed answers and boxes inside the thinking.
READINGS = [
    ("<think>\n5 + 68 = 73\n</think>\n**Final Answer**\nThe number of ways is 73", "no_box", True),
    ("<think>\nwork 12 and 40\n</think>\nSo the answer is $73$.", "no_box", True),
    ("<think>\nSo it is \\boxed{73}.\n</think>\nThe result is seventy-three, as found.", "no_box", True),
    ("<think>\nmaybe \\boxed{70}\n</think>\nThus \\boxed{73}.", "boxed", True),
    ("<think>\nit is 73\n</think>\n\\boxed{72}", "boxed", False),  # the headline's box is wrong
]


@pytest.mark.parametrize(("response", "outcome", "lighteval"), READINGS)
def test_two_readings_never_mix(response, outcome, lighteval):
    headline = aime24.judge(response, "73")
    assert (headline.correct, headline.outcome) == (outcome == "boxed" and lighteval, outcome)
    scores = aime24.score([response], _s("73"))
    assert scores["lighteval_pass@1"] == 100 * lighteval
    assert scores["pass@1"] == 100 * headline.correct and scores["cons@k"] == scores["pass@1"]


def test_judge_runs_out_of_time_loudly(monkeypatch):
    monkeypatch.setattr(grade, "VERIFY_S", 0.5)  # sympy would evaluate this tower for ever
    assert aime24.judge("\\boxed{9^{9^{9^{9}}}}", "204") == aime24.Judged(False, "judge_timeout", None)
    scores = aime24.score(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{204}"], _s("204"))
    assert scores["judge_timeout"] == 50 and scores["pass@1"] == 50 and scores["cons@k"] == 100


def test_deadline_restores_an_outer_timer():
    def outer(*_):
        raise AssertionError("the outer timer fired early")

    previous = signal.signal(signal.SIGALRM, outer)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100)
        with grade.deadline(5):
            pass
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 90 < left <= 100 and signal.getsignal(signal.SIGALRM) is outer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_judging_works_off_the_main_thread(monkeypatch):
    """math-verify's own timers raise ValueError outside the main thread; evalkit judges there in a worker."""
    cases = [("204 \\text{ minutes}", "204"), ("809, 810", "809"), ("9^{9^{9^{9}}}", "204")]
    monkeypatch.setattr(grade, "VERIFY_S", 1.0)
    out = {}
    thread = threading.Thread(target=lambda: out.update(v=[grade.judge_box(b, g) for b, g in cases]))
    thread.start()
    thread.join(120)
    assert out["v"] == [(True, "204"), (False, "{809, 810}"), None]


def _s(answer: str) -> Sample:
    return Sample("1", "aime24", "p", [answer], 32768)


def test_versions():
    assert (aime24.VERSION, aime24.SCORER_VERSION) == (1, 4)  # a scorer-only change keeps the prompt version


def test_pass_at_1_and_cons_at_k():
    b = "\\boxed{{{}}}".format
    scores = [
        aime24.score([b(7), b(7), b(3), "no box"], _s("7")),  # 2/4 right, majority 7
        aime24.score([b(3), b(3), b(7), b(7)], _s("7")),  # tie 3-7: first seen (3) wins -> wrong
        aime24.score(["<think>cut", "none", "none", b(5)], _s("5")),  # a lone answer wins the vote
        aime24.score(["<think>cut", "<think>cut", "x", "y"], _s("5")),  # nothing to vote on
    ]
    assert scores[0] == {
        "pass@1": 50,
        "cons@k": 100,
        "no_box": 25,
        "thinking_truncated": 0,
        "no_answer": 25,
        "judge_timeout": 0,
        "lighteval_pass@1": 50,
    }
    assert scores[1]["pass@1"] == 50 and scores[1]["cons@k"] == 0
    assert scores[2] == {
        "pass@1": 25,
        "cons@k": 100,
        "no_box": 50,
        "thinking_truncated": 25,
        "no_answer": 75,
        "judge_timeout": 0,
        "lighteval_pass@1": 25,
    }
    assert scores[3] == {
        "pass@1": 0,
        "cons@k": 0,
        "no_box": 50,
        "thinking_truncated": 50,
        "no_answer": 100,
        "judge_timeout": 0,
        "lighteval_pass@1": 0,
    }
    agg = aggregate(scores)
    assert agg["pass@1"]["mean"] == 31.25 and agg["cons@k"]["mean"] == 50 and agg["pass@1"]["n"] == 4


def test_cons_at_k_votes_on_what_math_verify_reads():
    b = "\\boxed{{{}}}".format
    # three right answers in three forms outvote two identical wrong ones
    right = aime24.score(
        [b("204"), b("205"), b("\\frac{408}{2}"), b("205"), b("204 \\text{ min}")], _s("204")
    )
    assert right["pass@1"] == 60 and right["cons@k"] == 100
    # two wrong answers in two forms of one number outvote one right answer
    wrong = aime24.score([b("205"), b("204"), b("\\frac{410}{2}")], _s("204"))
    assert wrong["pass@1"] == pytest.approx(100 / 3) and wrong["cons@k"] == 0


def test_k1_cons_equals_pass():
    assert aime24.score(["\\boxed{9}"], _s("9")) == {
        "pass@1": 100,
        "cons@k": 100,
        "no_box": 0,
        "thinking_truncated": 0,
        "no_answer": 0,
        "judge_timeout": 0,
        "lighteval_pass@1": 100,
    }
    with pytest.raises(ValueError):
        aime24.score([], _s("9"))


def test_lm_eval_hook_scores_a_doc():
    # lm-eval loads the module from its file, outside sys.modules (tasks/aime24/aime24.yaml's !function)
    from lm_eval.tasks._yaml_loader import _import_func_in_yml

    process_results = _import_func_in_yml("aime24.process_results", Path(aime24.__file__).parent)
    doc = _s("204").to_doc()
    assert process_results(doc, [["\\boxed{204 \\text{ minutes}}", "\\boxed{7}"]])["pass@1"] == 50


# --- loading ---


def test_load_h4_parquet_and_jsonl(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([H4_ROW]), path)
    loaded = aime24.load(source=str(path))
    (s,) = loaded.samples
    assert loaded.source == f"local:{path}" and not loaded.skipped
    assert loaded.data_hash == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (s.id, s.answers, s.max_new_tokens, s.system, s.answer_prefix) == ("60", ["24"], 32768, None, "")
    assert s.prompt == aime24.prompt(H4_ROW["problem"]) and s.meta["url"] == H4_ROW["url"]
    jsonl = tmp_path / "aime.jsonl"
    jsonl.write_text(json.dumps(H4_ROW) + "\n", encoding="utf-8")
    assert aime24.load(source=str(jsonl)).samples[0].prompt == s.prompt


def test_load_maxwell_jia_row(tmp_path):
    path = tmp_path / "aime_2024_problems.json"
    path.write_text(json.dumps([MAXWELL_ROW]), encoding="utf-8")
    (s,) = aime24.load(source=str(path)).samples
    assert (s.id, s.answers, s.meta["schema"]) == ("2024-I-1", ["21"], "Maxwell-Jia")
    assert s.prompt.startswith("Find $7 \\cdot 3$.\nPlease reason step by step")


def test_bad_rows_are_skipped_by_id(tmp_path):
    rows = [
        H4_ROW,
        H4_ROW | {"id": 61, "answer": "1000"},
        H4_ROW | {"id": 62, "answer": "12.5"},
        H4_ROW | {"id": 63, "answer": "-3"},
        {k: v for k, v in H4_ROW.items() if k != "problem"} | {"id": 64},
        H4_ROW | {"id": 65, "answer": None},
        MAXWELL_ROW | {"ID": "2024-II-9", "Answer": "abc"},
        H4_ROW,
        "not a row",
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows), encoding="utf-8")
    loaded = aime24.load(source=str(path))
    assert [s.id for s in loaded.samples] == ["60"]
    reasons = {s.id: s.reason for s in loaded.skipped}
    assert list(reasons) == ["61", "62", "63", "64", "65", "2024-II-9", "60", "row 8"]
    assert "not an integer 0-999" in reasons["61"] and "answer" in reasons["65"]
    assert reasons["60"] == "duplicate id"


def test_bundled_sample():
    loaded = aime24.load()
    assert loaded.source == "sample" and not loaded.skipped and len(loaded.samples) >= 8
    assert all(0 <= int(s.answers[0]) <= 999 for s in loaded.samples)
    sub = aime24.load(n=3, seed=2)
    assert len(sub.samples) == 3 and [s.id for s in sub.samples] == [
        s.id for s in aime24.load(n=3, seed=2).samples
    ]


def test_hub_reads_the_pinned_parquet(tmp_path, monkeypatch):
    import huggingface_hub

    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist([H4_ROW]), path)
    calls = []

    def fake_download(repo_id, filename, **kw):
        calls.append((repo_id, filename, kw))
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    loaded = aime24.load(source="hub")
    assert loaded.source == f"hub:HuggingFaceH4/aime_2024@{aime24.REVISION}" and len(loaded.samples) == 1
    assert calls == [
        (
            "HuggingFaceH4/aime_2024",
            "data/train-00000-of-00001.parquet",
            {"repo_type": "dataset", "revision": aime24.REVISION},
        )
    ]
