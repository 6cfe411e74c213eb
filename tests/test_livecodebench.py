"""LiveCodeBench: prompt bytes, extraction and comparison tables, pass@k, the loader on the upstream schema,
and grading of the bundled reference and deliberately wrong solutions in the sandbox."""

from __future__ import annotations

import base64
import json
import pickle
import time
import zlib
from pathlib import Path

import pytest

from evalkit import sandbox
from tasks.livecodebench import grade
from tasks.livecodebench import livecodebench as lcb
from tasks.livecodebench.grade import Cases

SOLUTIONS = json.loads((Path(lcb.__file__).parent / "data" / "solutions.json").read_text())


@pytest.fixture(scope="module", autouse=True)
def fast_sandbox():
    """1 s per test keeps the deliberate timeouts short; 2 workers as on a small CI machine."""
    iso = grade.configure(workers=2, timeout_s=1.0, memory_mb=1024)["isolation"]
    if iso["network"] is None:
        grade.configure(workers=2, timeout_s=1.0, memory_mb=1024, allow_unisolated=True)
    yield
    grade.configure()


@pytest.fixture(scope="module")
def loaded():
    return lcb.load()


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


# --- prompt --------------------------------------------------------------------------------------------------


def test_prompt_stdin_problem_bytes(loaded):
    s = next(x for x in loaded.samples if x.id == "lcbs_001")
    row = json.loads(lcb.SAMPLE.read_text().splitlines()[0])
    assert s.system == (
        "You are an expert Python programmer. You will be given a question (problem specification) and will "
        "generate a correct Python program that matches the specification and passes all tests."
    )
    assert s.prompt == (
        "### Question:\n" + row["question_content"] + "\n\n"
        "### Format: Read the inputs from stdin solve the problem and write the answer to stdout (do not directly "
        "test on the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python "
        "program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
        "```python\n# YOUR CODE HERE\n```\n\n"
        "### Answer: (use the provided format with backticks)\n\n"
    )
    assert (s.answer_prefix, s.max_new_tokens, s.subset) == ("", 2000, "easy|atcoder")


def test_prompt_functional_problem_bytes():
    text = lcb.prompt("Return 1.", "class Solution:\n    def one(self) -> int:\n        ")
    assert text == (
        "### Question:\nReturn 1.\n\n"
        "### Format: You will use the following starter code to write the solution to the problem and enclose "
        "your code within delimiters.\n"
        "```python\nclass Solution:\n    def one(self) -> int:\n        \n```\n\n"
        "### Answer: (use the provided format with backticks)\n\n"
    )


# --- extraction, comparison, pass@k ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "code"),
    [
        ("```python\nprint(1)\n```", "print(1)"),
        ("no code at all", ""),
        ("```python\nprint(1)", ""),  # one fence line only
        ("a\n```python\nx = 1\n```\nthen\n```\nprint(2)\n```\n", "print(2)"),  # the last block wins
        ("```python\nx = 1\n```\nprose\n```", "prose"),  # three fence lines: between #2 and #3 (upstream)
        ("<think>```python\nwrong\n```</think>\n```python\nright\n```", "right"),
        ("text ```python\nx = 1\nprint(x)\n``` trailing", "x = 1\nprint(x)"),  # fence lines may hold text
    ],
)
def test_extract_code(output, code):
    assert grade.extract_code(output) == code


@pytest.mark.parametrize(
    ("out", "expected", "equal"),
    [
        ("3\n", "3", True),
        ("  3  \n\n", "3\n", True),  # whole output and each line stripped
        ("3.0\n", "3\n", True),  # Decimal equality
        ("2.50 1e2\n", "2.5 100\n", True),
        ("1 2\n3\n", "1 2 3\n", False),  # line count differs
        ("0.1\n", "0.10000000001\n", False),  # no tolerance
        ("Yes\n", "yes\n", False),
        ("50000000000000000\n", "50000000000000001\n", False),  # exact, unlike np.isclose
        ("a b\n", "a  b\n", False),  # not identical, not numbers
        ("1  2\n", "1 2\n", True),  # numbers: whitespace-separated tokens
        ("NaN\n", "NaN\n", True),  # identical text wins before Decimal
    ],
)
def test_stdio_equal(out, expected, equal):
    assert grade.stdio_equal(out, expected) is equal


@pytest.mark.parametrize(
    ("out", "expected", "equal"),
    [("[1, 2]", "[1,2]", True), ("2", "2.0", True), ("true", "1", True), (None, "[1]", False),
     ('{"1": 2}', '{"1": 2}', True), ("[[1, 2]]", "[[1, 2]]", True), ("1.0000001", "1", False)],
)  # fmt: skip
def test_call_equal(out, expected, equal):
    assert grade.call_equal(out, expected) is equal


@pytest.mark.parametrize(
    ("n", "c", "k", "value"),
    [(10, 0, 1, 0.0), (10, 10, 5, 1.0), (5, 2, 1, 0.4), (5, 2, 2, 0.7), (5, 4, 2, 1.0), (8, 1, 8, 1.0),
     (8, 1, 4, 0.5), (3, 1, 2, 2 / 3)],
)  # fmt: skip
def test_pass_at_k(n, c, k, value):
    assert grade.pass_at_k(n, c, k) == pytest.approx(value)


def test_metrics_keys_and_percent():
    m = lcb.metrics(["passed", "wrong_answer", "no_code"], "hard")
    assert (m["pass@1"], m["pass@2"], m["pass@3"]) == (pytest.approx(100 / 3), pytest.approx(200 / 3), 100)
    assert m["pass@1/hard"] == m["pass@1"] and set(m) >= {f"outcome/{o}" for o in grade.OUTCOMES}
    assert m["outcome/no_code"] == pytest.approx(100 / 3) and m["outcome/timeout"] == 0


# --- loader --------------------------------------------------------------------------------------------------


def test_bundled_sample(loaded):
    assert loaded.source == "sample" and loaded.skipped == [] and len(loaded.samples) == 10
    assert [s.id for s in loaded.samples] == sorted(s.id for s in loaded.samples)
    assert {s.meta["difficulty"] for s in loaded.samples} == {"easy", "medium", "hard"}
    fns = [s.meta["fn_name"] for s in loaded.samples]
    assert 0 < sum(f is None for f in fns) < len(fns)
    private = [s.meta["private_test_cases"] for s in loaded.samples]
    assert any(p.startswith("[") for p in private) and any(not p.startswith("[") for p in private)


def row(qid="abc001_a", private="json", **over) -> dict:
    cases = [{"input": "2\n", "output": "4\n", "testtype": "stdin"}]
    text = json.dumps(cases)
    encoded = text if private == "json" else base64.b64encode(zlib.compress(pickle.dumps(text))).decode()
    r = {"question_title": "Double", "question_content": "Print twice N.", "platform": "atcoder",
         "question_id": qid, "contest_id": "abc001", "contest_date": "2024-05-04T00:00:00", "starter_code": "",
         "difficulty": "easy", "public_test_cases": json.dumps([{"input": "1\n", "output": "2\n", "testtype": "stdin"}]),
         "private_test_cases": encoded, "metadata": "{}"}  # fmt: skip
    return {**r, **over}


def test_loader_upstream_schema_both_encodings_and_malformed_rows(tmp_path):
    func_meta = json.dumps({"func_name": "f"})
    rows = [
        row("a_json"),
        row("b_pickled", private="pickle"),
        row("c_bad_difficulty", difficulty="impossible"),
        row("d_no_tests", public_test_cases="[]", private_test_cases="[]"),
        row("e_bad_payload", private_test_cases="bm90IHpsaWI="),  # base64 of "not zlib"
        row("f_functional_not_json", metadata=func_meta),  # stdin-style tests under a func_name
        {k: v for k, v in row("g_missing").items() if k != "starter_code"},
        row("a_json"),  # duplicate id
    ]
    path = tmp_path / "test.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    got = lcb.load(str(path))
    assert got.source == f"local:{path}" and [s.id for s in got.samples] == ["a_json", "b_pickled"]
    assert lcb.tests_of(got.samples[1].meta) == Cases(["1\n", "2\n"], ["2\n", "4\n"], None)
    reasons = {s.id: s.reason for s in got.skipped}
    assert set(reasons) == {"c_bad_difficulty", "d_no_tests", "e_bad_payload", "f_functional_not_json",
                            "g_missing", "a_json", "test.jsonl:9"}  # fmt: skip
    assert "duplicate" in reasons["a_json"] and "no test cases" in reasons["d_no_tests"]
    assert "starter_code" in reasons["g_missing"]


def test_date_window_and_release(tmp_path):
    got = lcb.load(start_date="2024-01-01", end_date="2024-12-31")
    assert [s.meta["contest_date"][:4] for s in got.samples] == ["2024"] * 4
    assert got.stats["outside_window"] == 6
    assert lcb.shards("release_v3") == ["test.jsonl", "test2.jsonl", "test3.jsonl"]
    assert lcb.shards("v6") == ["test6.jsonl"]
    assert lcb.shards("v2_v4") == ["test2.jsonl", "test3.jsonl", "test4.jsonl"]
    assert len(lcb.shards("release_latest")) == 6
    for bad in ("release_v7", "v3_v2", "latest"):
        with pytest.raises(ValueError):
            lcb.shards(bad)
    (tmp_path / "test2.jsonl").write_text(json.dumps(row("only_in_v2")) + "\n")
    assert [s.id for s in lcb.load(str(tmp_path), release="v2").samples] == ["only_in_v2"]


def test_hub_reads_pinned_raw_shards(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, repo_type=None, revision=None):
        calls.append((repo_id, filename, repo_type, revision))
        path = tmp_path / filename
        path.write_text(json.dumps(row(f"q_{filename}")) + "\n")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    got = lcb.load("hub", release="v2_v3")
    assert calls == [(lcb.REPO, f, "dataset", lcb.REVISION) for f in ("test2.jsonl", "test3.jsonl")]
    assert got.source == f"hub:livecodebench/code_generation_lite@{lcb.REVISION}" and len(got.samples) == 2


def test_n_subset_is_seeded():
    a, b = lcb.load(n=4, seed=1), lcb.load(n=4, seed=1)
    assert [s.id for s in a.samples] == [s.id for s in b.samples] and len(a.samples) == 4


# --- grading in the sandbox ----------------------------------------------------------------------------------


def test_reference_solutions_pass(loaded):
    items = [([fenced(SOLUTIONS[s.id]["reference"])], s) for s in loaded.samples]
    scores = lcb.score_many(items)
    assert [m["pass@1"] for m in scores] == [100.0] * len(items)


WRONG = [(qid, outcome, code) for qid, sol in SOLUTIONS.items() for outcome, code in sol["wrong"].items()]


@pytest.mark.parametrize(("qid", "outcome", "code"), WRONG, ids=[f"{q}-{o}" for q, o, _ in WRONG])
def test_wrong_solutions_fail_with_their_outcome(loaded, qid, outcome, code):
    sample = next(s for s in loaded.samples if s.id == qid)
    assert grade.grade(code, lcb.tests_of(sample.meta)).outcome == outcome


def test_all_outcomes_are_covered():
    assert {o for _, o, _ in WRONG} | {"passed", "no_code", "sandbox_kill"} == set(grade.OUTCOMES)


def test_timeout_ends_within_the_limit(loaded):
    sample = next(s for s in loaded.samples if s.id == "lcbs_105")
    t = time.monotonic()
    graded = grade.grade(SOLUTIONS["lcbs_105"]["wrong"]["timeout"], lcb.tests_of(sample.meta))
    assert graded.outcome == "timeout"
    assert time.monotonic() - t < 2.5  # 1 s limit + start-up


def test_k_predictions_of_one_sample(loaded):
    sample = next(s for s in loaded.samples if s.id == "lcbs_101")
    sol = SOLUTIONS["lcbs_101"]
    preds = [fenced(sol["reference"]), fenced(sol["wrong"]["wrong_answer"]), "I cannot solve this."]
    m = lcb.score(preds, sample)
    assert m["pass@1"] == pytest.approx(100 / 3) and m["pass@3"] == 100 and m["pass@1/easy"] == m["pass@1"]
    assert [m[f"outcome/{o}"] for o in ("passed", "wrong_answer", "no_code")] == [pytest.approx(100 / 3)] * 3


STDIN = Cases(["1 2\n", "5 7\n"], ["3\n", "12\n"], None)


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        ("a, b = map(int, input().split())\nprint(a + b)", "passed"),
        ("import sys\nprint(sum(map(int, sys.stdin.read().split())))", "passed"),
        ("import sys\nprint(sum(map(int, sys.stdin.buffer.read().split())))", "passed"),
        # upstream's prelude `from builtins import *` binds the real open() before its mock_open patch, so
        # open(0) reads the process's real (here empty) stdin
        ("print(sum(map(int, open(0).read().split())))", "wrong_answer"),
        ("def main():\n    print(sum(map(int, input().split())))\n\nif __name__ == '__main__':\n    main()", "passed"),
        ("import sys\nprint(sum(map(int, input().split())))\nsys.exit(0)\nprint('unreachable')", "passed"),
        ("counter = []\ncounter.append(1)\nprint(sum(map(int, input().split())) * len(counter))", "passed"),
        ("import sys\nfor line in sys.stdin:\n    print(sum(map(int, line.split())))", "runtime_error"),  # upstream
        ("print(sum(map(int, input().split())))\ninput()", "runtime_error"),  # EOFError
        ("import os\nos._exit(0)", "runtime_error"),  # gone before reporting
        ("import os\nos.kill(os.getpid(), 9)", "sandbox_kill"),
        ("import os\nwhile True:\n    os.write(1, b'x' * 65536)", "sandbox_kill"),  # output cap
        # hostile or odd output is judged, never crashes the grader
        ("input()\nprint('sNaN')", "wrong_answer"),  # a signalling NaN cannot be compared
        ("import os\nos.write(3, b'[' * 100000 + b'\\n')\ninput()", "runtime_error"),  # too deep to decode
    ],
)  # fmt: skip
def test_stdin_semantics(code, outcome):
    assert grade.grade(code, STDIN).outcome == outcome


CALL = Cases(["[3,1,2]", "[5]"], ["[1, 3]", "[5, 5]"], "extremes")


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        ("class Solution:\n    def extremes(self, nums: List[int]) -> List[int]:\n        return [min(nums), max(nums)]", "passed"),
        ("class Solution:\n    def extremes(self, nums):\n        return min(nums), max(nums)", "passed"),  # tuple
        ("def extremes(nums):\n    return [min(nums), max(nums)]", "passed"),  # no class: module function
        ("class Solution:\n    def extremes(self, nums):\n        print('debug' * 1000)\n        return [min(nums), max(nums)]", "passed"),
        ("class Solution:\n    def extremes(self, nums):\n        return [[min(nums), max(nums)]]", "wrong_answer"),
        ("class Solution:\n    def extremes(self, nums):\n        return object()", "wrong_answer"),
        ("class Solution:\n    def extremes(self, nums):\n        import sys; sys.exit(0)", "runtime_error"),
        ("class Solution:\n    def other(self, nums):\n        return nums", "compile_error"),
        ("import sys\nsys.exit(1)", "compile_error"),
        ("class Solution:\n    def extremes(self, nums):\n        x = []\n        for _ in range(5000):\n            x = [x]\n        return x", "wrong_answer"),  # nested too deep for the host's decoder
        ("import os\nclass Solution:\n    def extremes(self, nums):\n        os.write(3, b'{\"ev\": \"test\", \"i\": 0, \"out\": 5}\\n')\n        return nums", "wrong_answer"),  # forged event
    ],
)  # fmt: skip
def test_functional_semantics(code, outcome):
    assert grade.grade(code, CALL).outcome == outcome


def test_refuses_without_network_isolation(monkeypatch):
    monkeypatch.setattr(sandbox, "_probed", {**sandbox.isolation(), "network": None})
    monkeypatch.setattr(grade, "_settings", grade.Settings(workers=1, timeout_s=1.0))
    with pytest.raises(sandbox.SandboxError, match="allow_unisolated"):
        grade.configure()
    with pytest.raises(sandbox.SandboxError):
        grade.grade_many([("print(1)", STDIN)])
    rec = grade.configure(workers=1, timeout_s=1.0, allow_unisolated=True)
    assert rec["allow_unisolated"] is True and rec["isolation"]["network"] is None


def test_lm_eval_hooks_round_trip(loaded):
    ds = lcb.custom_dataset(source="sample", n=2, seed=0, release="release_v6")["test"]
    doc = ds[0]
    sol = SOLUTIONS[doc["id"]]["reference"]
    assert lcb.process_results(doc, [fenced(sol)])["pass@1"] == 100.0
