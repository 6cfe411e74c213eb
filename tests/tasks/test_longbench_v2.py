"""LongBench-v2: prompt bytes, truncation, extraction, scoring and loading (CPU, offline)."""

import hashlib
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from evalkit.sample import aggregate
from tasks.longbench_v2 import longbench_v2 as lb

# sha256 of THUDM/LongBench prompts/*.txt (as pinned by an independent harness at upstream 2e00731).
UPSTREAM_SHA256 = {
    "PROMPT_0SHOT": "68a162252bc9ff71d5d7abca3d69bb31aac3c35f832d657a2866f2018b8a6950",
    "PROMPT_COT": "6cc33d92fd8f611662b756c1f10f302c541ca005b58c46d5f3188ac3a939bfe8",
    "PROMPT_COT_ANS": "85ec59df4ac0e27aabbc619a7ca5cf3ae1787dd5a76cf51a18944eb52c91955f",
}
BODY = "What is the correct answer to this question: Who?\nChoices:\n(A) a\n(B) b\n(C) c\n(D) d\n\n"
FORMAT = 'Format your response as follows: "The correct answer is (insert answer here)".'


def row(**kw) -> dict:
    base = {"_id": "x1", "domain": "Single-Document QA", "sub_domain": "Legal", "difficulty": "easy"}
    base |= {"length": "short", "question": " Who?\n", "choice_A": " a", "choice_B": "b ", "choice_C": "c"}
    base |= {"choice_D": "\td", "answer": "A", "context": "\n  The doc.  \n"}
    return base | kw


@pytest.mark.parametrize("name", sorted(UPSTREAM_SHA256))
def test_prompt_constants_are_upstream_bytes(name):
    text = getattr(lb, name)
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == UPSTREAM_SHA256[name]
    assert not text.endswith("\n")


def test_prompts_filled_with_stripped_values():
    assert lb.fill(lb.PROMPT_0SHOT, row()) == (
        "Please read the following text and answer the question below.\n\n<text>\nThe doc.\n</text>\n\n"
        + BODY
        + FORMAT
    )
    assert lb.fill(lb.PROMPT_COT, row()) == (
        "Please read the following text and answer the questions below.\n\n<text>\nThe doc.\n</text>\n\n"
        + BODY
        + "Let\u2019s think step by step:"
    )


def test_cot_followup_has_no_document_and_the_stripped_reasoning(tmp_path):
    first = lb.load(source=_write([row()], tmp_path), mode="cot").samples[0]
    assert first.max_new_tokens == 1024 and first.prompt == lb.fill(lb.PROMPT_COT, row())
    second = lb.cot_followup(first, "\n  Step 1: the doc says a.  \n")
    assert second.prompt == (
        "Please read the following text and answer the questions below.\n\n"
        "The text is too long and omitted here.\n\n"
        + BODY
        + "Let\u2019s think step by step: Step 1: the doc says a.\n\n"
        + "Based on the above, what is the single, most likely answer choice? "
        + FORMAT
    )
    assert second.max_new_tokens == 128 and second.id == first.id and "The doc." not in second.prompt


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The correct answer is (B)", "B"),
        ("The correct answer is C.", "C"),  # second regex
        ("**The correct answer is (D)**", "D"),  # asterisks removed first
        ("The correct answer is **(A)**", "A"),
        ("The correct answer is (A). Wait, The correct answer is (B)", "A"),  # first match wins
        ("The correct answer is B, not The correct answer is (C)", "C"),  # the (X) form is searched first
        ("the correct answer is (A)", None),  # case-sensitive
        ("The correct answer is (E)", None),
        ("The answer is (A)", None),
        ("", None),
    ],
)
def test_extract_answer(response, expected):
    assert lb.extract_answer(response) == expected


# --- truncation: a word-level tokenizer with a BOS, so "special tokens as HF default" is exercised ---

LONG = " ".join(f"w{i}" for i in range(400))


@pytest.fixture
def tokenizer():
    text = lb.fill(lb.PROMPT_0SHOT, row()) + lb.fill(lb.PROMPT_0SHOT, row(context=LONG))
    words = text.split()
    vocab = {"<s>": 0, "[UNK]": 1} | {w: i + 2 for i, w in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="[UNK]")


@pytest.mark.parametrize("max_len", [64, 65])
def test_truncate_middle_keeps_start_and_end(tokenizer, max_len):
    prompt = lb.fill(lb.PROMPT_0SHOT, row(context=LONG))
    out, truncated = lb.truncate_middle(prompt, tokenizer, max_len)
    assert truncated and out.startswith("Please read the following text") and "<s>" not in out
    assert out.endswith("(D) d " + FORMAT) and "Who?" in out and "w200" not in out
    # BOS counts in the head half and is dropped by the decode: re-encoding gives max_len again.
    assert len(tokenizer.encode(out)) == max_len
    assert lb.truncate_middle("Who?", tokenizer, max_len) == ("Who?", False)


def test_load_counts_truncations(tmp_path, tokenizer):
    long_row = row(_id="long", context=LONG)
    loaded = lb.load(source=_write([row(), long_row], tmp_path), tokenizer=tokenizer, max_len=80)
    assert loaded.stats == {"truncated": 1, "mode": "0shot", "max_len": 80}
    assert [s.meta["truncated"] for s in loaded.samples] == [False, True]
    assert lb.load(source=_write([long_row], tmp_path)).stats["max_len"] is None  # no tokenizer


# --- scoring and aggregation ---


# DeepSeek-R1's template ends the generation prompt with `{{'<｜Assistant｜><think>\\n'}}`
R1_CHAT = "{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}{{ '<｜Assistant｜><think>\\n' }}"


def test_cot_answer_call_gets_the_reasoning_as_produced(tmp_path, tokenizer):
    """An R1 template ends the prompt in `<think>\n`: the scorers see it put back in front of the output
    (finish_text), but pred.py's `$COT$` is the completion itself: `response = output.strip()`,
    `.replace('$COT$', response)` (THUDM/LongBench@2e00731 pred.py)."""
    from evalkit.request import Prompt, finish_text, followup_prompt, sample_prompt

    tokenizer.chat_template = R1_CHAT
    sample = lb.load(source=_write([row()], tmp_path), mode="cot").samples[0]
    first = Prompt(
        "k",
        sample_prompt(tokenizer, sample),
        1024,
        {},
        sample,
        "tasks.longbench_v2.longbench_v2:cot_followup",
    )
    assert first.text.endswith("<think>\n")
    output = finish_text(first, "Step 1: a.\n</think>\nThe correct answer is (A)", [])
    second = followup_prompt(first, output, tokenizer, lambda n: n)
    cot = "Step 1: a.\n</think>\nThe correct answer is (A)"
    assert second.sample.meta["cot"] == cot and f"step by step: {cot}\n\nBased" in second.text
    assert first.text.count("<think>") == 1 and second.text.count("<think>") == 1  # the template's own


def _s(subset, answer="A"):
    return lb.Sample("id", "longbench_v2", "p", [answer], 128, subset=subset)


def test_score_buckets_and_compensated():
    ok, wrong, none = "The correct answer is (A)", "The correct answer is (B)", "I cannot tell."
    scores = [
        lb.score([ok], _s("easy|short")),
        lb.score([wrong], _s("hard|short")),
        lb.score([none], _s("hard|medium")),
        lb.score([ok], _s("hard|long")),
    ]
    agg = aggregate(scores)
    assert agg["accuracy"]["mean"] == 50 and agg["accuracy"]["n"] == 4
    assert agg["accuracy/easy"]["mean"] == 100 and agg["accuracy/hard"]["mean"] == pytest.approx(100 / 3)
    assert agg["accuracy/short"]["mean"] == 50 and agg["accuracy/short"]["n"] == 2
    assert agg["accuracy/medium"]["mean"] == 0 and agg["accuracy/long"]["mean"] == 100
    assert agg["compensated"]["mean"] == pytest.approx((100 + 0 + 25 + 100) / 4)
    # result.py with compensated=True: `if compensated and pred["pred"] == None: acc = 0.25`, then that acc
    # is added to the difficulty column and to the length column alike
    assert agg["compensated/easy"]["mean"] == 100 and agg["compensated/hard"]["mean"] == pytest.approx(
        125 / 3
    )
    assert agg["compensated/short"]["mean"] == 50 and agg["compensated/medium"]["mean"] == 25
    assert agg["compensated/long"]["mean"] == 100
    assert agg["no_answer"]["mean"] == 25


def test_score_averages_over_k_predictions():
    got = lb.score(
        ["The correct answer is (A)", "The correct answer is (C)", "no idea", "x"], _s("easy|long")
    )
    assert got == {
        "accuracy": 25,
        "accuracy/easy": 25,
        "accuracy/long": 25,
        "compensated": 25 + 12.5,
        "compensated/easy": 25 + 12.5,
        "compensated/long": 25 + 12.5,
        "no_answer": 50,
    }


def test_unknown_labels_bucket_as_upstream(tmp_path):
    sample = lb.load(source=_write([row(difficulty="medium", length="")], tmp_path)).samples[0]
    assert sample.subset == "hard|long"  # result.py: not easy -> hard; not short/medium -> long


# --- loading ---


def _write(rows, tmp_path, name="data.json"):
    path = tmp_path / name
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return str(path)


def test_load_upstream_row(tmp_path):
    loaded = lb.load(source=_write([row(_id="66f36490821e116aacb2cc22", answer="C")], tmp_path))
    (s,) = loaded.samples
    assert loaded.source == f"local:{tmp_path / 'data.json'}" and not loaded.skipped
    assert loaded.data_hash == hashlib.sha256((tmp_path / "data.json").read_bytes()).hexdigest()
    assert (s.id, s.answers, s.subset, s.max_new_tokens) == (
        "66f36490821e116aacb2cc22",
        ["C"],
        "easy|short",
        128,
    )
    assert s.prompt == lb.fill(lb.PROMPT_0SHOT, row()) and s.meta["choices"][3] == "\td"
    jsonl = tmp_path / "data.jsonl"  # a JSON-lines dump of the same rows loads the same
    jsonl.write_text(json.dumps(row()) + "\n", encoding="utf-8")
    assert lb.load(source=str(jsonl)).samples[0].prompt == s.prompt


def test_bad_rows_are_skipped_by_id(tmp_path):
    rows = [row(_id="ok"), row(_id="bad-answer", answer="E"), row(_id="lower", answer="a"), row(_id="ok")]
    rows += [
        {k: v for k, v in row(_id="no-context").items() if k != "context"},
        row(_id="num", question=3),
        [1],
    ]
    loaded = lb.load(source=_write(rows, tmp_path))
    assert [s.id for s in loaded.samples] == ["ok"]
    reasons = {s.id: s.reason for s in loaded.skipped}
    assert list(reasons) == ["bad-answer", "lower", "ok", "no-context", "num", "row 6"]
    assert "not one of A-D" in reasons["bad-answer"] and "context" in reasons["no-context"]
    assert reasons["ok"] == "duplicate _id" and "question" in reasons["num"]


def test_bundled_sample():
    loaded = lb.load()
    assert loaded.source == "sample" and not loaded.skipped and len(loaded.samples) >= 12
    subsets = {x for s in loaded.samples for x in s.subset.split("|")}
    assert subsets == {"easy", "hard", "short", "medium", "long"}
    assert {s.answers[0] for s in loaded.samples} == set("ABCD")
    assert lb.SAMPLE.stat().st_size < 200_000
    sub = lb.load(n=5, seed=1)
    assert len(sub.samples) == 5 and [s.id for s in sub.samples] == sorted(s.id for s in sub.samples)
    assert [s.id for s in sub.samples] == [s.id for s in lb.load(n=5, seed=1).samples]


def test_mode_is_checked():
    with pytest.raises(ValueError, match="mode"):
        lb.load(mode="3shot")


def test_hub_reads_pinned_data_json_and_checks_its_hash(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, **kw):
        calls.append((repo_id, filename, kw))
        return _write([row()], tmp_path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    with pytest.raises(ValueError, match="sha256"):  # our stand-in file is not the pinned data.json
        lb.load(source="hub")
    assert calls == [("THUDM/LongBench-v2", "data.json", {"repo_type": "dataset", "revision": lb.REVISION})]
    monkeypatch.setattr(lb, "DATA_SHA256", hashlib.sha256((tmp_path / "data.json").read_bytes()).hexdigest())
    assert lb.load(source="hub").source == f"hub:THUDM/LongBench-v2@{lb.REVISION}"


def test_the_answer_call_reads_the_first_output_as_produced_through_the_lm(tmp_path, monkeypatch):
    """The same through the LM itself (issue 31.14): an R1 template opens the thinking block in the prompt,
    the engine generates the first call, and the follow-up turn builds the answer call from it: `$COT$` is
    the output as the model produced it, while the journal keeps the scorer's view (`<think>\n` put back)."""
    import copy
    from types import SimpleNamespace

    from evalkit.config import model_spec
    from evalkit.journal import Journal
    from evalkit.lm import EvalkitLM
    from evalkit.loading import load_model

    model, tok = load_model(model_spec("tiny_llama"))
    tok = copy.deepcopy(tok)
    tok.chat_template = R1_CHAT
    doc = lb.custom_dataset(source=_write([row()], tmp_path), mode="cot")["test"][0]
    seen, real = [], lb.cot_followup
    monkeypatch.setattr(lb, "cot_followup", lambda s, out: seen.append(out) or real(s, out))
    journal = Journal(tmp_path / "generations.jsonl")
    lm = EvalkitLM(model="tiny_llama", hf_model=model, tokenizer=tok, journal=journal)
    gen = {"until": [], "max_gen_toks": 12}  # the doc says a follow-up comes (the task's `followup` hook)
    req = SimpleNamespace(args=("", gen), doc=doc, task_name="evalkit_longbench_v2_cot", doc_id=0, idx=0)
    (text,) = lm.generate_until([req], disable_tqdm=True)
    (rec,) = journal.records.values()
    first = rec["stats"]["first_output"]
    assert first.startswith("<think>\n") and rec["text"] == text  # the scorer's view of the first call
    assert seen == [first.removeprefix("<think>\n")] and not seen[0].startswith("<think>")
    assert rec["stats"]["followup_method"] == "full" and rec["stats"]["prompt_tokens"] > 50
