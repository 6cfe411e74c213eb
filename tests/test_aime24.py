"""AIME 2024: prompt, boxed-answer extraction, pass@1 / cons@k, loaders for both schemas (CPU, offline)."""

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evalkit.sample import Sample, aggregate
from tasks.aime24 import aime24

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


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>\nso 33</think>\nThe answer is $\\boxed{33}$.", (33, "boxed")),
        ("no think tags, just \\boxed{204}", (204, "boxed")),  # non-thinking model / prefilled <think>
        ("<think>maybe \\boxed{5}</think> final: \\boxed{7}", (7, "boxed")),  # thinking text is ignored
        ("<think>a</think> x <think>b</think> \\boxed{8}", (8, "boxed")),  # after the LAST </think>
        ("\\boxed{1} then \\boxed{2} and finally \\boxed{3}", (3, "boxed")),  # last box wins
        ("\\boxed{\\frac{1}{2}} no wait \\boxed{{12}}", (12, "boxed")),  # nested braces matched
        ("\\boxed{12} and a cut-off \\boxed{3", (12, "boxed")),  # an unclosed last box is passed over
        ("\\boxed{033}", (33, "boxed")),  # leading zeros
        ("\\boxed{\\text{204}}", (204, "boxed")),
        ("\\fbox{ 25 }", (25, "boxed")),
        ("$\\boxed{1,000}$", (1000, "boxed")),  # commas
        ("\\boxed{45^\\circ} or \\boxed{45^{\\circ}}", (45, "boxed")),
        ("\\boxed{\\$ 8\\!0}", (80, "boxed")),  # $ and \!
        ("\\boxed{x = 5}", (None, "boxed")),  # a box that is not an integer: wrong, but not "no box"
        ("The answer is 42.", (None, "no_box")),
        ("<think>\nlong reasoning that ran out of tok", (None, "thinking_truncated")),
        ("<think>\nI guess \\boxed{42} but let me check", (None, "thinking_truncated")),
        ("<think>x</think>", (None, "no_box")),
    ],
)
def test_judge(response, expected):
    assert aime24.judge(response) == expected


def _s(answer: str) -> Sample:
    return Sample("1", "aime24", "p", [answer], 32768)


def test_pass_at_1_and_cons_at_k():
    b = "\\boxed{{{}}}".format
    scores = [
        aime24.score([b(7), b(7), b(3), "no box"], _s("7")),  # 2/4 right, majority 7
        aime24.score([b(3), b(3), b(7), b(7)], _s("7")),  # tie 3-7: first seen (3) wins -> wrong
        aime24.score(["<think>cut", "none", "none", b(5)], _s("5")),  # a lone answer wins the vote
        aime24.score(["<think>cut", "<think>cut", "x", "y"], _s("5")),  # nothing to vote on
    ]
    assert scores[0] == {"pass@1": 50, "cons@k": 100, "no_box": 25, "thinking_truncated": 0}
    assert scores[1]["pass@1"] == 50 and scores[1]["cons@k"] == 0
    assert scores[2] == {"pass@1": 25, "cons@k": 100, "no_box": 50, "thinking_truncated": 25}
    assert scores[3] == {"pass@1": 0, "cons@k": 0, "no_box": 50, "thinking_truncated": 50}
    agg = aggregate(scores)
    assert agg["pass@1"]["mean"] == 31.25 and agg["cons@k"]["mean"] == 50 and agg["pass@1"]["n"] == 4


def test_k1_cons_equals_pass():
    assert aime24.score(["\\boxed{9}"], _s("9")) == {
        "pass@1": 100,
        "cons@k": 100,
        "no_box": 0,
        "thinking_truncated": 0,
    }
    with pytest.raises(ValueError):
        aime24.score([], _s("9"))


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
