"""LiveCodeBench: prompt bytes (generic and DeepSeek-R1 styles), extraction and comparison tables, pass@k, the
loader on the upstream schema, and grading in the sandbox: the bundled reference and deliberately wrong
solutions, every way of reading stdin against upstream's outcome, settings, large inputs, pooled scoring."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter, OrderedDict, defaultdict
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from evalkit import sandbox
from evalkit.sample import render, render_sample
from tasks.livecodebench import compare, driver, grade
from tasks.livecodebench import livecodebench as lcb
from tasks.livecodebench import livecodebench_r1 as r1
from tasks.livecodebench.grade import Cases

SOLUTIONS = json.loads((Path(lcb.__file__).parent / "data" / "solutions.json").read_text())
FAST = dict(workers=2, timeout_s=1.0, memory_mb=1024)  # 1 s per test keeps deliberate timeouts short


@pytest.fixture(scope="module", autouse=True)
def fast_sandbox():
    """2 workers as on a small CI machine. Where isolation is missing the tests run unisolated, unless
    EVALKIT_REQUIRE_ISOLATION=1 (CI), where configure() must accept this machine as it is."""
    if sandbox.missing_isolation(sandbox.isolation()) and os.environ.get("EVALKIT_REQUIRE_ISOLATION") != "1":
        grade.configure(**FAST, allow_unisolated=True)
    else:
        grade.configure(**FAST)
    yield
    grade.configure()


@pytest.fixture(scope="module")
def loaded():
    return lcb.load()


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\nDone."


# --- prompt -------------------------------------------------------------------------------------------------


def test_prompt_stdin_problem_bytes(loaded):
    s = next(x for x in loaded.samples if x.id == "lcbs_001")
    row = json.loads(lcb.SAMPLE.read_text().splitlines()[0])
    assert s.system == (
        "You are an expert Python programmer. You will be given a question (problem specification) and will "
        "generate a correct Python program that matches the specification and passes all tests."
    )
    assert s.prompt == (
        "### Question:\n" + row["question_content"] + "\n\n"
        "### Format: Read the inputs from stdin solve the problem and write the answer to stdout (do not "
        "directly test on the sample inputs). Enclose your code within delimiters as follows. Ensure that "
        "when the python program runs, it reads the inputs, runs the algorithm and writes output to STDOUT.\n"
        "```python\n# YOUR CODE HERE\n```\n\n"
        "### Answer: (use the provided format with backticks)\n\n"
    )
    assert (s.answer_prefix, s.max_new_tokens, s.subset) == ("", 2000, "easy|atcoder")


def test_prompt_functional_problem_bytes():
    text = lcb.prompt("Return 1.", "class Solution:\n    def one(self) -> int:\n        ")
    assert text == (
        "### Question:\nReturn 1.\n\n"
        "### Format: You will use the following starter code to write the solution to the problem and "
        "enclose your code within delimiters.\n"
        "```python\nclass Solution:\n    def one(self) -> int:\n        \n```\n\n"
        "### Answer: (use the provided format with backticks)\n\n"
    )


# Bytes of upstream `format_prompt_generation(question, LMStyle.DeepSeekR1)` (LiveCodeBench@28fef95,
# lcb_runner/prompts/code_generation.py), produced by running it on these two questions:
#     if LanguageModelStyle == LMStyle.DeepSeekR1:
#         prompt = f"{PromptConstants.SYSTEM_MESSAGE_DEEPSEEK_R1}"
#         prompt += f"{get_deepseek_r1_question_template_answer(question)}"
R1_HEAD = (
    "<｜begin▁of▁sentence｜>A conversation between User and Assistant. The user asks a question, and the "
    "Assistant solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within <think> "
    "</think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>.<｜User｜>You will be given a question (problem specification) and will "
    "generate a correct Python program that matches the specification and passes all tests.\n\nQuestion: "
)
R1_STDIN = R1_HEAD + (
    "Print twice N.\n\nInput\n\nN\n\nRead the inputs from stdin solve the problem and write the answer to "
    "stdout (do not directly test on the sample inputs). Enclose your code within delimiters as follows. "
    "Ensure that when the python program runs, it reads the inputs, runs the algorithm and writes output to "
    "STDOUT.\n```python\n# YOUR CODE HERE\n```\n\n<｜Assistant｜>"
)
R1_STARTER = R1_HEAD + (
    "Return 1.\n\nYou will use the following starter code to write the solution to the problem and enclose "
    "your code within delimiters.\n```python\nclass Solution:\n    def one(self) -> int:\n        \n```\n\n"
    "<｜Assistant｜>"
)


def test_r1_prompt_bytes():
    assert r1.prompt("Print twice N.\n\nInput\n\nN", "") == R1_STDIN
    assert r1.prompt("Return 1.", "class Solution:\n    def one(self) -> int:\n        ") == R1_STARTER


class ChatTokenizer:
    """Any chat template would wrap the prompt: a raw protocol prompt must reach the model unwrapped."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, **_):
        return f"<wrapped>{messages}</wrapped>"


def test_r1_samples_are_rendered_as_is():
    s = next(x for x in r1.load().samples if x.meta["fn_name"] is None)
    row = next(json.loads(line) for line in lcb.SAMPLE.read_text().splitlines() if s.id in line)
    assert s.rendered and s.system is None and s.task == "livecodebench_r1" and s.answer_prefix == ""
    assert s.prompt == r1.prompt(row["question_content"], "") and s.prompt.endswith("<｜Assistant｜>")
    assert render_sample(ChatTokenizer(), s) == s.prompt
    generic = next(x for x in lcb.load().samples if x.id == s.id)
    assert not generic.rendered and render(ChatTokenizer(), generic.prompt).startswith("<wrapped>")
    assert type(s).from_doc(s.to_doc()) == s  # the flag survives lm-eval's dataset round trip


def test_r1_window_and_versions(tmp_path):
    """R1's "August 2024 - January 2025": 2024-08-01..2025-01-31, compared as upstream's loader does
    (`p_start_date <= e.contest_date`, `e.contest_date <= p_end_date`, both `datetime.strptime(d,
    "%Y-%m-%d")`)."""
    from omegaconf import OmegaConf

    conf = OmegaConf.load(Path(lcb.__file__).parents[2] / "conf" / "task" / "livecodebench_r1.yaml")
    window = {k: conf.load[k] for k in ("start_date", "end_date")}
    assert window == {"start_date": "2024-08-01", "end_date": "2025-01-31"}
    dates = ["2024-07-31T00:00:00", "2024-08-01T00:00:00", "2025-01-31T00:00:00", "2025-02-01T00:00:00"]
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(row(f"q{i}", contest_date=d)) + "\n" for i, d in enumerate(dates)))
    got = r1.load(str(path), **window)
    assert [s.id for s in got.samples] == ["q1", "q2"] and got.stats["outside_window"] == 2
    assert (r1.VERSION, lcb.VERSION, r1.SCORER_VERSION, lcb.SCORER_VERSION) == (2, 1, 5, 5)


# --- extraction, comparison, pass@k -------------------------------------------------------------------------


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
        ("YES \nNO", "YES\nNO", True),  # each line stripped, not only the whole text
        ("YES\n  NO\t\n", "YES\nNO", True),
        ("YES\n\nNO", "YES\nNO", False),  # an empty line inside counts
    ],
)
def test_stdio_equal(out, expected, equal):
    assert grade.stdio_equal(out, expected) is equal


# Upstream's functional verdict, testing_util.py `grade_call_based` (LiveCodeBench@28fef95), run in its
# grading process (evalkit: `compare.call_passed`, in the comparator's sandbox):
#     if isinstance(prediction, tuple):
#         prediction = list(prediction)
#     tmp_result = prediction == gt_out          # gt_out = json.loads(output)
#     ...
#     if not tmp_result: <-2, Wrong Answer>
#     except Exception as e: <-4, Runtime Error>
@pytest.mark.parametrize(
    ("prediction", "expected", "verdict"),
    [
        ([1, 2], "[1,2]", True),
        (2, "2.0", True),
        (True, "1", True),
        (object(), "[1]", False),
        ({"1": 2}, '{"1": 2}', True),
        ({1: 2}, '{"1": 2}', False),  # JSON keys are strings
        ([[1, 2]], "[[1, 2]]", True),
        (1.0000001, "1", False),
        ((1, 2), "[1, 2]", True),  # tuples become lists
        ([(1, 2)], "[[1, 2]]", False),  # only the outer one
        (Fraction(1, 2), "0.5", True),  # not JSON types: their own `==` decides, as upstream
        ([Fraction(3, 1), Decimal("0.25")], "[3, 0.25]", True),
        (Decimal("0.1"), "0.1", False),  # Decimal("0.1") != 0.1 (the float)
        (np.int64(7), "7", True),
        (np.array([5]), "[5]", True),  # one element: its truth value is that element's
        (np.array([1, 3]), "[1, 3]", ValueError),  # `not array` raises: upstream's runtime error
        (Decimal("sNaN"), "1", InvalidOperation),  # the comparison itself raises
    ],
)
def test_call_passed(prediction, expected, verdict):
    if isinstance(verdict, bool):
        assert compare.call_passed(prediction, json.loads(expected)) is verdict
    else:
        with pytest.raises(verdict):
            compare.call_passed(prediction, json.loads(expected))


@pytest.fixture
def upstream_int_limit():
    """Upstream's grading process (and evalkit's driver) allows integers of up to 50000 digits."""
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(50000)
    yield
    sys.set_int_max_str_digits(before)


def anything_equal():
    class Anything:  # a class of the program's own: its module cannot be loaded by the comparator
        def __eq__(self, other):
            return True

    return Anything()


# The same answers on evalkit's path: the driver reports the value (`driver.report_call`: JSON text when it is
# made of JSON types only, else its pickle), the host compares JSON values, the comparator the rest. Each
# verdict is upstream's (`call_passed` above, Python's `==` on the value itself), except a class of the
# program's own (deviations.md: graded wrong).
@pytest.mark.parametrize(
    ("prediction", "expected", "path", "outcome"),
    [
        ([1, 2], "[1,2]", "json", None),
        (2, "2.0", "json", None),
        (True, "1", "json", None),  # True == 1 in Python: not JSON-text equality
        (1, "true", "json", None),
        (False, "0.0", "json", None),
        (0.1 + 0.2, "0.30000000000000004", "json", None),  # floats round-trip by repr
        (0.1 + 0.2, "0.3", "json", "wrong_answer"),
        (-0.0, "0", "json", None),
        (float("inf"), "Infinity", "json", None),
        (float("nan"), "NaN", "json", "wrong_answer"),  # nan != nan
        ([float("nan")], "[NaN]", "json", "wrong_answer"),  # two objects: no identity shortcut upstream
        ({"1": 2}, '{"1": 2}', "json", None),
        ({1: 2}, '{"1": 2}', "pickle", "wrong_answer"),  # JSON keys are strings
        ("\ud800", '"\\ud800"', "json", None),  # a lone surrogate
        ([[1, 2]], "[[1, 2]]", "json", None),
        (1.0000001, "1", "json", "wrong_answer"),
        ((1, 2), "[1, 2]", "json", None),  # tuples become lists
        ([(1, 2)], "[[1, 2]]", "pickle", "wrong_answer"),  # only the outer one
        (10**5000, "1" + "0" * 5000, "json", None),  # beyond this process's 4300 digits
        (10**60000, "1", "pickle", "wrong_answer"),  # beyond 50000 digits: no JSON text
        (Fraction(1, 2), "0.5", "pickle", None),
        ([Fraction(3, 1), Decimal("0.25")], "[3, 0.25]", "pickle", None),
        (Decimal("0.1"), "0.1", "pickle", "wrong_answer"),
        (np.int64(7), "7", "pickle", None),
        (np.float64(0.5), "0.5", "pickle", None),
        (np.array([5]), "[5]", "pickle", None),
        (np.array([1, 3]), "[1, 3]", "pickle", "runtime_error"),  # `not array` raises
        (Decimal("sNaN"), "1", "pickle", "runtime_error"),
        (complex(2, 0), "2", "pickle", None),
        (Counter(a=1), '{"a": 1}', "pickle", None),
        (OrderedDict(a=1), '{"a": 1}', "pickle", None),
        (defaultdict(lambda: 0, a=1), '{"a": 1}', "pickle", None),  # its lambda plays no part in `==`
        (object(), "[1]", "pickle", "wrong_answer"),
        (anything_equal(), "[1]", "unpicklable", "wrong_answer"),  # upstream: passed (deviations.md)
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, int) else None,  # str() of 10**5000 raises
)
def test_functional_answer_paths(prediction, expected, path, outcome, upstream_int_limit):
    report = driver.report_call(prediction)
    assert list(report) == [path]
    assert grade.call_failure(report, expected, grade._settings) == outcome


def test_deep_json_values_go_to_the_comparator():
    """Past JSON_DEPTH the host's recursion limit could differ from upstream's 50000: pickled instead."""
    value = [1]
    for _ in range(driver.JSON_DEPTH):
        value = [value]
    assert list(driver.report_call(value[0])) == ["json"] and list(driver.report_call(value)) == ["pickle"]
    assert grade.call_failure(driver.report_call(value), json.dumps(value), grade._settings) is None


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(eval),  # builtins.eval: a global outside ALLOWED
        b"cos\nsystem\n(S'true'\ntR.",  # os.system('true'), protocol 0
        pickle.dumps(Path("x")),
        b"not a pickle",
    ],
)
def test_comparator_admits_only_stdlib_and_numpy_types(payload):
    with pytest.raises(compare.Refused):
        compare.unpickle(payload)
    assert compare.unpickle(pickle.dumps([Fraction(1, 3), np.array([1.5]), Decimal(2)]))[0] == Fraction(1, 3)


@pytest.mark.parametrize(
    ("n", "c", "k", "value"),
    [
        (10, 0, 1, 0.0),
        (10, 10, 5, 1.0),
        (5, 2, 1, 0.4),
        (5, 2, 2, 0.7),
        (5, 4, 2, 1.0),
        (8, 1, 8, 1.0),
        (8, 1, 4, 0.5),
        (3, 1, 2, 2 / 3),
    ],
)
def test_pass_at_k(n, c, k, value):
    assert grade.pass_at_k(n, c, k) == pytest.approx(value)


def test_metrics_keys_and_percent():
    m = lcb.metrics(["passed", "wrong_answer", "no_code"], "hard")
    assert (m["pass@1"], m["pass@2"], m["pass@3"]) == (pytest.approx(100 / 3), pytest.approx(200 / 3), 100)
    assert m["pass@1/hard"] == m["pass@1"] and set(m) >= {f"outcome/{o}" for o in grade.OUTCOMES}
    assert m["outcome/no_code"] == pytest.approx(100 / 3) and m["outcome/timeout"] == 0


# --- loader -------------------------------------------------------------------------------------------------


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
    r = {
        "question_title": "Double",
        "question_content": "Print twice N.",
        "platform": "atcoder",
        "question_id": qid,
        "contest_id": "abc001",
        "contest_date": "2024-05-04T00:00:00",
        "starter_code": "",
        "difficulty": "easy",
        "public_test_cases": json.dumps([{"input": "1\n", "output": "2\n", "testtype": "stdin"}]),
        "private_test_cases": encoded,
        "metadata": "{}",
    }
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
    assert set(reasons) == {
        "c_bad_difficulty",
        "d_no_tests",
        "e_bad_payload",
        "f_functional_not_json",
        "g_missing",
        "a_json",
        "test.jsonl:9",
    }
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


# --- grading in the sandbox ---------------------------------------------------------------------------------


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


def test_timeout_ends_near_the_limit(loaded):
    """The 1 s limit ends an endless program; the bound scales with this machine's own grading time of a
    quick program (no absolute threshold: a busy machine slows both)."""
    sample = next(s for s in loaded.samples if s.id == "lcbs_105")
    tests = lcb.tests_of(sample.meta)
    t = time.monotonic()
    assert grade.grade(SOLUTIONS["lcbs_105"]["reference"], tests).outcome == "passed"
    baseline = time.monotonic() - t
    t = time.monotonic()
    assert grade.grade("while True:\n    pass", tests).outcome == "timeout"
    assert time.monotonic() - t < FAST["timeout_s"] + 5 * baseline


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
        (
            "def main():\n    print(sum(map(int, input().split())))\n\nif __name__ == '__main__':\n    main()",  # noqa: E501
            "passed",
        ),
        ("import sys\nprint(sum(map(int, input().split())))\nsys.exit(0)\nprint('unreachable')", "passed"),
        ("counter = []\ncounter.append(1)\nprint(sum(map(int, input().split())) * len(counter))", "passed"),
        ("print(sum(map(int, input().split())))\ninput()", "runtime_error"),  # EOFError
        ("import os\nos._exit(0)", "runtime_error"),  # gone before reporting
        (
            "import os\nos.kill(os.getpid(), 9)",
            "runtime_error",
        ),  # upstream's reliability_guard: os.kill is None
        ("import signal\nsignal.raise_signal(9)", "sandbox_kill"),
        (
            "import os\nwhile True:\n    os.write(1, b'x' * 65536)",
            "timeout",
        ),  # real stdout: not graded, not kept
        # hostile or odd output is judged, never crashes the grader
        ("input()\nprint('sNaN')", "wrong_answer"),  # a signalling NaN cannot be compared
        ("import os\nos.write(3, b'[' * 100000 + b'\\n')\ninput()", "runtime_error"),  # too deep to decode
        # a program that swallows the time limit: evalkit's watchdog is outside it (deviations.md, Timeouts)
        ("import time\ntry:\n    time.sleep(30)\nexcept BaseException:\n    pass\nprint(3)", "timeout"),
    ],
)
def test_stdin_semantics(code, outcome):
    assert grade.grade(code, STDIN).outcome == outcome


def test_output_over_the_cap_is_a_sandbox_kill():
    """A 40 MB output exceeds the sandbox's 32 MB cap (upstream has none: a deviation). A generous limit, so
    that producing it on a busy machine cannot turn into a timeout first."""
    s = grade.Settings(
        workers=1, timeout_s=60, memory_mb=1024, allow_unisolated=grade._settings.allow_unisolated
    )
    assert grade.grade("print('x' * (40 << 20))", STDIN, s).outcome == "sandbox_kill"


# --- every way of reading stdin, as upstream grades it ------------------------------------------------------
# LiveCodeBench/LiveCodeBench@28fef95, lcb_runner/evaluation/testing_util.py, `call_method`:
#     inputs_line_iterator = iter(inputs.split("\n"))
#     mock_stdin = MockStdinWithBuffer(inputs)
#     @patch("builtins.open", mock_open(read_data=inputs))
#     @patch("sys.stdin", mock_stdin)  # Use our custom mock instead of StringIO
#     @patch("sys.stdin.readline", lambda *args: next(inputs_line_iterator))
#     @patch("sys.stdin.readlines", lambda *args: inputs.split("\n"))
#     @patch("sys.stdin.read", lambda *args: inputs)
# The last three patch the real stdin object (entered first, before it is swapped), which a program bound
# through `from sys import stdin` or the prelude's `from sys import *`. The real stdin is /dev/null (the
# grader is a multiprocessing child), `reliability_guard()` has nulled os.kill, os.getcwd, quit, ... and
# blocked `resource`, and argv is the runner's command line. Outcome = upstream's result (-2 wrong answer, -4
# error) from `evaluate_generations` on these programs and the bundled tests of lcbs_002 (Codeforces, Bracket
# Repair); `test_stdin_forms_side_by_side_with_upstream` reproduces the column from an upstream checkout.

SOLVE = (
    "def solve(s):\n    open_ = need = 0\n    for ch in s:\n        if ch == '(':\n            open_ += 1\n"
    "        elif open_:\n            open_ -= 1\n        else:\n            need += 1\n    return need + open_\n"  # noqa: E501
)
LOOP = "for _ in range(t):\n    print(solve({}.strip()))"
FORMS = [  # (name, program after SOLVE, upstream's result, evalkit's outcome)
    ("input()", "t = int(input())\n" + LOOP.format("input()"), True, "passed"),
    ("sys.stdin.read", "import sys\nd = sys.stdin.read().split()\nfor s in d[1:]:\n    print(solve(s))", True, "passed"),  # noqa: E501
    ("sys.stdin.readline", "import sys\nt = int(sys.stdin.readline())\n" + LOOP.format("sys.stdin.readline()"), True, "passed"),  # noqa: E501
    ("sys.stdin.readlines", "import sys\nls = sys.stdin.readlines()\nfor s in ls[1:1 + int(ls[0])]:\n    print(solve(s.strip()))", True, "passed"),  # noqa: E501
    ("sys.stdin.read().splitlines", "import sys\nls = sys.stdin.read().splitlines()\nfor s in ls[1:]:\n    print(solve(s))", True, "passed"),  # noqa: E501
    ("sys.stdin.buffer.read", "import sys\nd = sys.stdin.buffer.read().split()\nfor s in d[1:]:\n    print(solve(s.decode()))", True, "passed"),  # noqa: E501
    ("sys.stdin.buffer.readline", "import sys\nt = int(sys.stdin.buffer.readline())\n" + LOOP.format("sys.stdin.buffer.readline().decode()"), -2, "wrong_answer"),  # MockBuffer: always line 1  # noqa: E501
    ("input = sys.stdin.readline", "import sys\ninput = sys.stdin.readline\nt = int(input())\n" + LOOP.format("input()"), True, "passed"),  # noqa: E501
    ("from sys import stdin; readline", "from sys import stdin\nt = int(stdin.readline())\n" + LOOP.format("stdin.readline()"), True, "passed"),  # noqa: E501
    ("from sys import stdin; read", "from sys import stdin\nd = stdin.read().split()\nfor s in d[1:]:\n    print(solve(s))", True, "passed"),  # noqa: E501
    ("from sys import stdin; readlines", "from sys import stdin\nls = stdin.readlines()\nfor s in ls[1:1 + int(ls[0])]:\n    print(solve(s.strip()))", True, "passed"),  # noqa: E501
    ("from sys import stdin as f", "from sys import stdin as f\nt = int(f.readline())\n" + LOOP.format("f.readline()"), True, "passed"),  # noqa: E501
    ("input = stdin.readline", "from sys import stdin\ninput = stdin.readline\nt = int(input())\n" + LOOP.format("input()"), True, "passed"),  # noqa: E501
    ("bare stdin (the prelude's)", "t = int(stdin.readline())\n" + LOOP.format("stdin.readline()"), True, "passed"),  # noqa: E501
    ("bound stdin inside a def", "from sys import stdin\ndef main():\n    t = int(stdin.readline())\n    for _ in range(t):\n        print(solve(stdin.readline().strip()))\nmain()", True, "passed"),  # noqa: E501
    ("import inside a def", "def main():\n    from sys import stdin\n    t = int(stdin.readline())\n    for _ in range(t):\n        print(solve(stdin.readline().strip()))\nmain()", True, "passed"),  # noqa: E501
    ("iter(stdin.readline, '')", "from sys import stdin\nt = int(stdin.readline())\nfor s in iter(stdin.readline, ''):\n    if s.strip():\n        print(solve(s.strip()))", True, "passed"),  # noqa: E501
    ("bound readline past the end", "from sys import stdin\nt = int(stdin.readline())\n" + LOOP.format("stdin.readline()") + "\nstdin.readline()\nstdin.readline()", -4, "runtime_error"),  # StopIteration  # noqa: E501
    ("input() past the end", "t = int(input())\n" + LOOP.format("input()") + "\ninput()", -4, "runtime_error"),  # EOFError  # noqa: E501
    ("sys.stdin.seek", "import sys\nsys.stdin.readline()\nsys.stdin.seek(0)\nt = int(sys.stdin.readline())\n" + LOOP.format("sys.stdin.readline()"), True, "passed"),  # noqa: E501
    ("for line in sys.stdin", "import sys\nit = iter(sys.stdin)\nnext(it)\nfor s in it:\n    print(solve(s.strip()))", -4, "runtime_error"),  # not iterable  # noqa: E501
    ("for line in bound stdin", "from sys import stdin\nls = [s for s in stdin]\nfor s in ls[1:]:\n    print(solve(s.strip()))", -2, "wrong_answer"),  # /dev/null  # noqa: E501
    ("open(0)", "d = open(0).read().split()\nfor s in d[1:1 + int(d[0])]:\n    print(solve(s))", -4, "runtime_error"),  # the real open  # noqa: E501
    ("builtins.open(0)", "import builtins\nd = builtins.open(0).read().split()\nfor s in d[1:]:\n    print(solve(s))", True, "passed"),  # mock_open  # noqa: E501
    ("os.read(0)", "import os\nd = os.read(0, 1 << 20).split()\nfor s in d[1:1 + int(d[0])]:\n    print(solve(s.decode()))", -4, "runtime_error"),  # noqa: E501
    ("BytesIO(os.read(0)) fast io", "import io, os\ninput = io.BytesIO(os.read(0, os.fstat(0).st_size)).readline\nt = int(input())\n" + LOOP.format("input().decode()"), -4, "runtime_error"),  # noqa: E501
    ("fileinput.input()", "import fileinput\nls = [l for l in fileinput.input()]\nfor s in ls[1:]:\n    print(solve(s.strip()))", -2, "wrong_answer"),  # one mocked file per argv entry  # noqa: E501
    ("exit() after the output", "t = int(input())\n" + LOOP.format("input()") + "\nexit()\nprint('unreachable')", True, "passed"),  # noqa: E501
    ("sys.exit(0) after the output", "import sys\nt = int(input())\n" + LOOP.format("input()") + "\nsys.exit(0)", True, "passed"),  # noqa: E501
    ("quit() after the output", "t = int(input())\n" + LOOP.format("input()") + "\nquit()", -4, "runtime_error"),  # guard: quit is None  # noqa: E501
    ("debug print to stderr", "import sys\nt = int(input())\nfor _ in range(t):\n    s = input().strip()\n    print('debug', s, file=sys.stderr)\n    print(solve(s))", True, "passed"),  # noqa: E501
    ("sys.stdout.write", "import sys\nt = int(input())\nsys.stdout.write(''.join(str(solve(input().strip())) + '\\n' for _ in range(t)))", True, "passed"),  # noqa: E501
    ("bound stdout.write", "from sys import stdout\nt = int(input())\nstdout.write(''.join(str(solve(input().strip())) + '\\n' for _ in range(t)))", -2, "wrong_answer"),  # the real stdout  # noqa: E501
    ("sys.stdout.buffer.write", "import sys\nt = int(input())\nsys.stdout.buffer.write(''.join(str(solve(input().strip())) + '\\n' for _ in range(t)).encode())", -4, "runtime_error"),  # StringIO  # noqa: E501
    ("os.write(1)", "import os\nt = int(input())\nos.write(1, ''.join(str(solve(input().strip())) + '\\n' for _ in range(t)).encode())", -2, "wrong_answer"),  # noqa: E501
    ("threading main", "import sys, threading\ndef main():\n    t = int(sys.stdin.readline())\n    for _ in range(t):\n        print(solve(sys.stdin.readline().strip()))\nthreading.stack_size(1 << 26)\nth = threading.Thread(target=main)\nth.start()\nth.join()", True, "passed"),  # noqa: E501
    ("import resource", "import resource\nt = int(input())\n" + LOOP.format("input()"), -4, "compile_error"),  # guard  # noqa: E501
    ("os.getcwd()", "import os\nos.getcwd()\nt = int(input())\n" + LOOP.format("input()"), -4, "runtime_error"),  # guard  # noqa: E501
    ("import multiprocessing", "import multiprocessing\nt = int(input())\n" + LOOP.format("input()"), True, "passed"),  # loaded before the guard  # noqa: E501
    ("os.fork is None", "import os\nassert os.fork is None and os.system is None\nt = int(input())\n" + LOOP.format("input()"), True, "passed"),  # noqa: E501
    ("__main__ guard", "def main():\n    t = int(input())\n    for _ in range(t):\n        print(solve(input().strip()))\n\nif __name__ == '__main__':\n    main()", True, "passed"),  # noqa: E501
    ("sys.argv", "import sys\nassert sys.argv[1:3] == ['--model', 'deepseek-ai/DeepSeek-R1']\nt = int(input())\n" + LOOP.format("input()"), True, "passed"),  # noqa: E501
]  # fmt: skip


@pytest.fixture(scope="module")
def bracket_tests(loaded):
    sample = next(s for s in loaded.samples if s.id == "lcbs_002")
    assert sample.meta["platform"] == "codeforces"
    return lcb.tests_of(sample.meta)


def test_stdin_forms_as_upstream(bracket_tests):
    """Every way of reading (and writing) that upstream passes passes here; every one it fails fails here,
    with the same kind of failure (-2: wrong_answer, -4: a runtime or compile error)."""
    graded = grade.grade_many([(SOLVE + code, bracket_tests) for _, code, _, _ in FORMS])
    got = {name: g.outcome for (name, *_), g in zip(FORMS, graded)}
    assert got == {name: outcome for name, _, _, outcome in FORMS}
    kinds = {True: {"passed"}, -2: {"wrong_answer"}, -4: {"runtime_error", "compile_error"}}
    assert all(outcome in kinds[upstream] for _, _, upstream, outcome in FORMS)


UPSTREAM_ENV = "EVALKIT_LCB_UPSTREAM"  # a LiveCodeBench checkout at 28fef95 (never part of evalkit)


def upstream_results(tests: Cases, codes: list[str], tmp_path) -> list[list]:
    """Upstream's `evaluate_generations` on `codes` (as the published runs did: a worker pool, one process
    per program, the documented argv, stdin from /dev/null): each program's per-test results."""
    checkout = os.environ.get(UPSTREAM_ENV)
    if not checkout:
        pytest.skip(f"set {UPSTREAM_ENV} to a LiveCodeBench checkout at 28fef95")
    job = {"inputs": tests.inputs, "outputs": tests.outputs, "fn_name": tests.fn_name, "codes": codes}
    (tmp_path / "job.json").write_text(json.dumps(job))
    script = (
        "import json, sys\nsys.path.insert(0, sys.argv[1])\n"
        "from lcb_runner.evaluation.compute_code_generation_metrics import evaluate_generations\n"
        "job = json.load(open(sys.argv[2]))\n"
        "sample = {'input_output': json.dumps({k: job[k] for k in ('inputs', 'outputs', 'fn_name')})}\n"
        f"sys.argv = {driver.ARGV!r}\n"
        "res, _ = evaluate_generations([sample], [job['codes']], num_process_evaluate=2, timeout=6)\n"
        "print(json.dumps(res[0]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, checkout, str(tmp_path / "job.json")],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=True,
        cwd=checkout,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_stdin_forms_side_by_side_with_upstream(bracket_tests, tmp_path):
    """Upstream's own `evaluate_generations` on FORMS checks the upstream column."""
    results = upstream_results(bracket_tests, [SOLVE + c for _, c, _, _ in FORMS], tmp_path)
    assert [True if all(x is True for x in r) else r[-1] for r in results] == [u for _, _, u, _ in FORMS]


CALL = Cases(["[3,1,2]", "[5]"], ["[1, 3]", "[5, 5]"], "extremes")


@pytest.mark.parametrize(
    ("code", "outcome"),
    [
        (
            "class Solution:\n    def extremes(self, nums: List[int]) -> List[int]:\n        return [min(nums), max(nums)]",  # noqa: E501
            "passed",
        ),
        (
            "class Solution:\n    def extremes(self, nums):\n        return min(nums), max(nums)",
            "passed",
        ),  # tuple
        ("def extremes(nums):\n    return [min(nums), max(nums)]", "passed"),  # no class: module function
        (
            "class Solution:\n    def extremes(self, nums):\n        print('debug' * 1000)\n        return [min(nums), max(nums)]",  # noqa: E501
            "passed",
        ),
        (
            "import numpy as np\nclass Solution:\n    def extremes(self, nums):\n        return [np.int64(min(nums)), np.int64(max(nums))]",  # noqa: E501
            "passed",
        ),  # numpy loaded before the guard, as upstream
        (
            "class Solution:\n    def extremes(self, nums):\n        return [[min(nums), max(nums)]]",
            "wrong_answer",
        ),
        ("class Solution:\n    def extremes(self, nums):\n        return object()", "wrong_answer"),
        ("class Solution:\n    def extremes(self, nums):\n        import sys; sys.exit(0)", "runtime_error"),
        (
            "class Solution:\n    def extremes(self, nums):\n        quit()",
            "runtime_error",
        ),  # guard: quit is None
        (
            "import resource\nclass Solution:\n    def extremes(self, nums):\n        return [min(nums), max(nums)]",  # noqa: E501
            "compile_error",
        ),  # guard
        ("class Solution:\n    def other(self, nums):\n        return nums", "compile_error"),
        ("import sys\nsys.exit(1)", "compile_error"),
        (
            "class Solution:\n    def extremes(self, nums):\n        x = []\n        for _ in range(5000):\n            x = [x]\n        return x",  # noqa: E501
            "wrong_answer",
        ),  # nested 5000 deep: `[x] == [1, 3]` is False, as upstream
        (
            'import os\nclass Solution:\n    def extremes(self, nums):\n        os.write(3, b\'{"ev": "test", "i": 0, "out": 5}\\n\')\n        return nums',  # noqa: E501
            "wrong_answer",
        ),  # forged event
    ],
)
def test_functional_semantics(code, outcome):
    assert grade.grade(code, CALL).outcome == outcome


# Hostile functional programs: each would pass were expected outputs or verdicts inside the program's process
# (the first two did, when the driver judged `==` there; the last two pass upstream, which trusts the
# answer's `__eq__`). None may pass: generated code is untrusted.
HOSTILE = [
    (
        "forged verdicts on the event pipe",
        "import os\nclass Solution:\n    def extremes(self, nums):\n"
        '        os.write(3, b\'{"ev": "test", "i": 0, "passed": true}\\n\'\n'
        '                    b\'{"ev": "test", "i": 1, "passed": true}\\n\')',
        "wrong_answer",
    ),
    (  # finds the driver's stream and header in its frames, reads ahead and hands the driver back its bytes
        "expected outputs read from the driver's stream",
        "import io, json, sys\nclass Solution:\n    def extremes(self, nums):\n"
        "        f = sys._getframe(1)\n        while 'job' not in f.f_locals:\n            f = f.f_back\n"
        "        job, header, i = f.f_locals['job'], f.f_locals['header'], f.f_locals['i']\n"
        "        main = sys.modules['__main__']\n        if i == 0:\n"
        "            main.stolen = io.BytesIO(job.read())\n            real = main.read_input\n"
        "            main.read_input = lambda _job, size: real(main.stolen, size)\n"
        "        pos = main.stolen.tell()\n"
        "        value = json.loads(main.stolen.read(header.get('expected_sizes', header['sizes'])[i]))\n"
        "        main.stolen.seek(pos)\n        return value",
        "wrong_answer",  # all it finds is the next input, [5]
    ),
    (
        "an answer whose __eq__ always holds",
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "class Solution:\n    def extremes(self, nums):\n        return Anything()",
        "wrong_answer",  # its class cannot be pickled (upstream: passed)
    ),
    (
        "a pickle that builds such an answer in the comparator",
        "class Sneaky:\n    def __reduce__(self):\n"
        "        return eval, (\"type('A', (), {'__eq__': lambda s, o: True})()\",)\n"
        "class Solution:\n    def extremes(self, nums):\n        return Sneaky()",
        "wrong_answer",  # builtins.eval is refused
    ),
    (
        "a JSON answer forged on the event pipe",
        "import os\nclass Solution:\n    def extremes(self, nums):\n"
        '        os.write(3, b\'{"ev": "test", "i": 0, "json": "[1, 3]"}\\n\')\n        return nums',
        "runtime_error",  # only as good as returning [1, 3]; the driver's own event is then unexpected
    ),
]


@pytest.mark.parametrize(("name", "code", "outcome"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_functional_programs_never_pass(name, code, outcome):
    assert grade.grade(code, CALL).outcome == outcome


def test_json_answers_need_no_comparator(monkeypatch):
    """The extra sandboxed process runs only for answers that are not JSON values."""
    monkeypatch.setattr(grade, "compare_pickled", lambda *a: pytest.fail("comparator ran"))
    code = "class Solution:\n    def extremes(self, nums):\n        return min(nums), max(nums)"
    assert grade.grade(code, CALL).outcome == "passed"


# Answers that are not JSON types: upstream judges `prediction == json.loads(expected)` in its grading
# process, evalkit in the comparator's sandbox (`compare.call_passed`). (name, program, upstream's result from
# `evaluate_generations`, evalkit's outcome); `test_non_json_answers_side_by_side_with_upstream` reproduces
# the upstream column (measured: Fraction and Decimal [True, True]; the numpy array [True, -4], its `==` an
# array whose truth value raises ValueError; complex [True, True]; the computed NaN [False]).
NON_JSON = [
    ("Fraction", "from fractions import Fraction\nclass Solution:\n    def extremes(self, nums):\n        return [Fraction(min(nums)), Fraction(max(nums), 1)]", True, "passed"),  # noqa: E501
    ("Decimal tuple", "from decimal import Decimal\nclass Solution:\n    def extremes(self, nums):\n        return (Decimal(min(nums)), Decimal(max(nums)))", True, "passed"),  # noqa: E501
    ("numpy array", "import numpy as np\nclass Solution:\n    def extremes(self, nums):\n        return np.array([min(nums), max(nums)])", -4, "runtime_error"),  # noqa: E501
    ("float off by 1e-9", "class Solution:\n    def extremes(self, nums):\n        return [min(nums), max(nums) + 1e-9]", False, "wrong_answer"),  # noqa: E501
    ("object()", "class Solution:\n    def extremes(self, nums):\n        return object()", False, "wrong_answer"),  # noqa: E501
    ("complex", "class Solution:\n    def extremes(self, nums):\n        return [complex(min(nums), 0), max(nums)]", True, "passed"),  # noqa: E501
    ("computed NaN", "class Solution:\n    def extremes(self, nums):\n        return [float('nan'), max(nums)]", False, "wrong_answer"),  # noqa: E501
]  # fmt: skip


def test_non_json_answers_as_upstream():
    graded = grade.grade_many([(code, CALL) for _, code, _, _ in NON_JSON])
    assert {name: g.outcome for (name, *_), g in zip(NON_JSON, graded)} == {n: o for n, _, _, o in NON_JSON}
    kinds = {True: {"passed"}, False: {"wrong_answer"}, -4: {"runtime_error"}}
    assert all(outcome in kinds[upstream] for _, _, upstream, outcome in NON_JSON)


@pytest.mark.slow
def test_non_json_answers_side_by_side_with_upstream(tmp_path):
    """Upstream's own `evaluate_generations` on NON_JSON: its verdict per program (True when every test
    passed, else the last test's code: -2 wrong, -4 error; a plain wrong answer records False)."""
    results = upstream_results(CALL, [code for _, code, _, _ in NON_JSON], tmp_path)
    assert [True if all(x is True for x in r) else r[-1] for r in results] == [u for _, _, u, _ in NON_JSON]


def test_refuses_without_isolation(monkeypatch):
    for lacking in ({"network": None}, {"memory": None}):
        monkeypatch.setattr(sandbox, "_probed", {**sandbox.isolation(), **lacking})
        monkeypatch.setattr(grade, "_settings", grade.Settings(workers=1, timeout_s=1.0))
        with pytest.raises(sandbox.SandboxError, match="allow_unisolated"):
            grade.configure()
        with pytest.raises(sandbox.SandboxError):
            grade.grade_many([("print(1)", STDIN)])
    rec = grade.configure(workers=1, timeout_s=1.0, allow_unisolated=True)
    assert rec["allow_unisolated"] is True and rec["isolation"]["memory"] is None
    assert "no bound" in rec["memory_limit"]


# --- settings (checked before the model loads) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"memory_mb": 0}, "memory_mb must be a positive integer"),
        ({"memory_mb": -5}, "memory_mb"),
        ({"memory_mb": 512.5}, "memory_mb"),
        ({"memory_mb": True}, "memory_mb"),
        ({"memory_mb": "4096"}, "memory_mb"),
        ({"timeout_s": 0}, "timeout_s must be a positive number"),
        ({"timeout_s": -1.0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
        ({"workers": -1}, "workers must be null"),
        ({"workers": 0}, "workers"),
        ({"workers": 2.0}, "workers"),
        ({"allow_unisolated": "yes"}, "allow_unisolated must be true or false"),
        ({"memroy_mb": 512}, r"unknown setting\(s\) \['memroy_mb'\]"),
        ({"memory_mb": 4}, "cannot start in the sandbox with memory_mb=4"),  # far too little for Python
    ],
)
def test_configure_rejects_bad_settings(setting, message):
    before = grade._settings
    with pytest.raises(ValueError, match=message):
        grade.configure(**{**FAST, **setting})
    assert grade._settings is before  # nothing half-applied


def test_configure_records_the_memory_bound():
    iso = sandbox.isolation()
    rec = grade.configure(**FAST, allow_unisolated=bool(sandbox.missing_isolation(iso)))
    assert rec["memory_limit"] == grade.MEMORY_LIMITS[iso["memory"]] and rec["isolation"] == iso
    assert {k: rec[k] for k in FAST} == {**FAST, "timeout_s": 1.0}


def test_tiny_timeout_scores_timeout_never_raises(bracket_tests):
    """Even a limit no program can meet grades the candidate (timeout): start-up is not the candidate's."""
    s = grade.Settings(
        workers=1, timeout_s=1e-6, memory_mb=1024, allow_unisolated=grade._settings.allow_unisolated
    )
    code = SOLVE + FORMS[0][1]
    assert grade.grade(code, bracket_tests, s).outcome == "timeout"
    assert grade.grade(code, bracket_tests).outcome == "passed"  # the same program under FAST


# --- large inputs -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nd = sys.stdin.read()\nprint(d.count('\\n') - 1)",
        "import sys\nd = sys.stdin.buffer.read()\nprint(d.count(b'\\n') - 1)",
        "import sys\ninput = sys.stdin.readline\nn = int(input())\nfor _ in range(n):\n    input()\nprint(n)",
    ],
    ids=["read", "buffer", "readline"],
)
def test_150_mb_input_fits_in_the_memory_limit(code):
    """A 150 MB test under memory_mb=1024: the input reaches the program once as bytes and once as text
    (the driver streamed it: before, it held the whole job as JSON, parsed, and copied again, MemoryError)."""
    n = 1_500_000
    text = f"{n}\n" + ("(" * 99 + "\n") * n
    assert len(text) > 150_000_000
    s = grade.Settings(
        workers=1, timeout_s=120, memory_mb=1024, allow_unisolated=grade._settings.allow_unisolated
    )
    assert grade.grade(code, Cases([text], [str(n)], None), s).outcome == "passed"


# --- many problems at once ----------------------------------------------------------------------------------


@pytest.fixture
def counted_runs(monkeypatch):
    """Every sandboxed grading run, and the most that ran at once."""
    runs, live, peak, lock = [], [0], [0], threading.Lock()
    real = grade.grade

    def counting(code, tests, settings=None):
        with lock:
            runs.append(code)
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        try:
            return real(code, tests, settings)
        finally:
            with lock:
                live[0] -= 1

    monkeypatch.setattr(grade, "grade", counting)
    monkeypatch.setattr(grade, "_memo", {})
    return runs, peak


def test_score_many_pools_problems_and_memoizes(loaded, counted_runs):
    """One pool across problems (at most `workers` at once), results equal to scoring each problem alone,
    and the runner's second pass over single predictions (per-repeat scores) runs nothing again."""
    runs, peak = counted_runs
    items = []
    for s in loaded.samples:
        sol = SOLUTIONS[s.id]
        items.append(
            ([fenced(sol["reference"])] + [fenced(c) for c in sol["wrong"].values()] + ["no code"], s)
        )
    pooled = lcb.score_many(items)
    assert peak[0] == FAST["workers"] and len(runs) == sum(len(p) - 1 for p, _ in items)
    alone = [lcb.score(p, s) for p, s in items]  # memoized: the same outcomes, nothing re-run
    per_repeat = lcb.score_many([([p], s) for preds, s in items for p in preds])
    assert alone == pooled and len(runs) == sum(len(p) - 1 for p, _ in items)
    for (_, s), m in zip(items, pooled):
        outcomes = ["passed", *SOLUTIONS[s.id]["wrong"], "no_code"]
        assert m == lcb.metrics(outcomes, s.meta["difficulty"])
    assert [m["pass@1"] for m in per_repeat] == [
        100.0 * (o == "passed") for p, s in items for o in ["passed", *SOLUTIONS[s.id]["wrong"], "no_code"]
    ]


def test_pool_decodes_each_problem_once_and_when_due(monkeypatch):
    """One worker: the second problem's tests are decoded only after the first problem's first program ran
    (at most workers + 1 problems held); a problem listed twice (the runner's per-repeat call) is decoded
    once, a repeated program runs once, an empty one never."""
    events = []

    def loader(name):
        def load():
            events.append(("load", name))
            return Cases(["1\n"], ["1\n"], None)

        return load

    monkeypatch.setattr(grade, "_memo", {})
    monkeypatch.setattr(grade, "_settings", grade.Settings(workers=1))
    monkeypatch.setattr(
        grade, "grade", lambda code, tests, s=None: events.append(("run", code)) or grade.Graded("passed")
    )
    out = grade.grade_problems(
        [("a", loader("a"), ["x", "y"]), ("b", loader("b"), ["z", ""]), ("a", loader("a2"), ["x"])]
    )
    assert [[g.outcome for g in r] for r in out] == [["passed", "passed"], ["passed", "no_code"], ["passed"]]
    # b is decoded once a's last program is submitted (here: after x ran), while that one runs
    assert events[:2] == [("load", "a"), ("run", "x")] and events[-1] == ("run", "z")
    assert sorted(events[2:4]) == [("load", "b"), ("run", "y")] and len(events) == 5


def test_memo_is_keyed_by_settings_and_tests(loaded, counted_runs):
    runs, _ = counted_runs
    s = next(x for x in loaded.samples if x.id == "lcbs_001")
    pred = fenced(SOLUTIONS["lcbs_001"]["reference"])
    lcb.score_many([([pred, pred], s)])  # the same program twice: run once
    assert len(runs) == 1
    grade.configure(**{**FAST, "timeout_s": 2.0}, allow_unisolated=grade._settings.allow_unisolated)
    try:
        lcb.score_many([([pred], s)])
    finally:
        grade.configure(**FAST, allow_unisolated=grade._settings.allow_unisolated)
    other = type(s)(**{**s.__dict__, "meta": {**s.meta, "public_test_cases": "[]"}})  # other tests, same id
    assert lcb.score_many([([pred], other)])[0]["pass@1"] == 100.0 and len(runs) == 3


def test_lm_eval_hooks_round_trip(loaded):
    ds = lcb.custom_dataset(source="sample", n=2, seed=0, release="release_v6")["test"]
    doc = ds[0]
    sol = SOLUTIONS[doc["id"]]["reference"]
    assert lcb.process_results(doc, [fenced(sol)])["pass@1"] == 100.0
