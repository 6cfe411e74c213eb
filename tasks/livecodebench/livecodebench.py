"""LiveCodeBench code generation (https://arxiv.org/abs/2403.07974), graded in an OS sandbox.

Dataset `livecodebench/code_generation_lite`, split `test`: its raw JSONL shards (`test.jsonl`, `test2.jsonl`
... `test6.jsonl`) at the pinned `REVISION`, read directly (the hub loader script is never run). `release`
picks shards as upstream's `version_tag` does (`release_vN` = shards 1..N, `vN` one shard, `vA_vB` shards
A..B, `release_latest` all); `start_date <= contest_date <= end_date` then filters (the shards overlap at
their edges). Prompt (generic chat style: system message + user text), extraction and grading follow
LiveCodeBench/LiveCodeBench@28fef95 (`lcb_runner/prompts/code_generation.py`, `utils/extraction_utils.py`,
`evaluation/testing_util.py`); see `grade.py`, `driver.py` and `compare.py`. The DeepSeek-R1 protocol (its
own raw prompt style and date window) is `livecodebench_r1.py`, a module of its own so that each protocol
has its VERSION.

Generated programs run in `evalkit.sandbox`. The runner applies the `setup` settings of
conf/task/livecodebench*.yaml with `configure(**setup)` before the model loads and records the dict it
returns (the settings, the detected isolation, what bounds memory) in metrics.json; without enough isolation
it refuses unless `allow_unisolated`. `score_many` grades every prediction of many problems on one pool of
sandboxes; outcomes are memoized per process, so scoring a prediction again runs nothing.
Deviations from upstream: docs/deviations.md#livecodebench.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import pickle
import re
import zlib
from datetime import datetime
from pathlib import Path

from evalkit.sample import Sample, Skipped
from evalkit.task import Loaded, data_file, keep_all, lm_eval_hooks, subsample, unique
from tasks.livecodebench.grade import OUTCOMES, Cases, configure, extract_code, grade_problems, pass_at_k

TASK = "livecodebench"
# query_aware=false is refused (the runner names this reason): it needs a context before the question
NO_QUESTION_SPLIT = (
    "the problem statement (with its examples and starter code) is the question itself: there is no "
    "separable context"
)
VERSION = 1  # what is generated: bump when this task's prompt or data handling changes
SCORER_VERSION = 5  # how it is graded (2: upstream's stdin patches, guard and argv; whole-program memory cap;
# 3: functional answers judged by upstream's `==`; 4: that `==` outside the program's process, so answers of
# the program's own classes are wrong; 5: `no_answer`, the standard key, = outcome/no_code)
REPO = "livecodebench/code_generation_lite"
# Not checked against the hub from here (unreachable): the dataset revision public LiveCodeBench pins record
# (e.g. beside lcb_runner@28fef95 and test6.jsonl, 175 problems).
REVISION = "0fe84c3912ea0c4d4a78037083943e8f0c4dd505"
N_SHARDS = 6
SAMPLE = Path(__file__).parent / "data" / "sample.jsonl"
MAX_DECODED = 1 << 30  # bytes: a private-test payload larger than this is refused (a zlib bomb, not tests)
DIFFICULTIES = ("easy", "medium", "hard")

SYSTEM = (
    "You are an expert Python programmer. You will be given a question (problem specification) and will "
    "generate a correct Python program that matches the specification and passes all tests."
)
FORMAT_STARTER = (
    "You will use the following starter code to write the solution to the problem and enclose your code "
    "within delimiters."
)
FORMAT_STDIN = (
    "Read the inputs from stdin solve the problem and write the answer to stdout (do not directly test on "
    "the sample inputs). Enclose your code within delimiters as follows. Ensure that when the python program "
    "runs, it reads the inputs, runs the algorithm and writes output to STDOUT."
)


def prompt(question_content: str, starter_code: str) -> str:
    """Upstream `get_generic_question_template_answer`: the user message (the system message is SYSTEM)."""
    text = f"### Question:\n{question_content}\n\n"
    if starter_code:
        text += f"### Format: {FORMAT_STARTER}\n```python\n{starter_code}\n```\n\n"
    else:
        text += f"### Format: {FORMAT_STDIN}\n```python\n# YOUR CODE HERE\n```\n\n"
    return text + "### Answer: (use the provided format with backticks)\n\n"


# --- data ---------------------------------------------------------------------------------------------


def shards(release: str) -> list[str]:
    """Shard files of a `version_tag`: release_vN, release_latest, vN or vA_vB."""
    if release == "release_latest":
        first, last = 1, N_SHARDS
    elif m := re.fullmatch(r"release_v(\d+)", release):
        first, last = 1, int(m[1])
    elif m := re.fullmatch(r"v(\d+)(?:_v(\d+))?", release):
        first, last = int(m[1]), int(m[2] or m[1])
    else:
        raise ValueError(f"unknown release {release!r}: release_vN, release_latest, vN or vA_vB")
    if not 1 <= first <= last <= N_SHARDS:
        raise ValueError(f"release {release!r} names shards outside 1..{N_SHARDS}")
    return ["test.jsonl" if i == 1 else f"test{i}.jsonl" for i in range(first, last + 1)]


class _StrOnly(pickle.Unpickler):
    """The only legitimate payload is a pickled `str`: any class or callable lookup is refused, so a
    malicious shard cannot run code on load."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: test payloads are plain strings")


def decode_tests(field: str) -> list:
    """`private_test_cases`: JSON, else base64 -> zlib -> pickle (of a JSON string) -> JSON, as upstream."""
    try:
        return json.loads(field)
    except json.JSONDecodeError:
        pass
    inflater = zlib.decompressobj()
    raw = inflater.decompress(base64.b64decode(field, validate=True), MAX_DECODED + 1)
    if len(raw) > MAX_DECODED or inflater.unconsumed_tail:
        raise ValueError(f"decoded test payload exceeds {MAX_DECODED} bytes")
    try:
        payload = _StrOnly(io.BytesIO(raw)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # truncated or corrupt pickles raise EOFError, struct.error, IndexError, ...
        raise ValueError(f"unreadable test payload: {e!r}") from e
    if not isinstance(payload, str):
        raise ValueError(f"decoded test payload is a {type(payload).__name__}, not a str")
    return json.loads(payload)


def tests_of(meta: dict) -> Cases:
    """Public then private tests (upstream's order) of a sample, checked: every case has string input and
    output, and a functional problem's input lines and outputs are JSON."""
    cases = json.loads(meta["public_test_cases"]) + decode_tests(meta["private_test_cases"])
    if not cases:
        raise ValueError("no test cases")
    if not all(
        isinstance(c, dict) and isinstance(c.get("input"), str) and isinstance(c.get("output"), str)
        for c in cases
    ):
        raise ValueError("a test case lacks a string input or output")
    fn_name = meta["fn_name"]
    for c in cases if fn_name else []:
        for line in c["input"].split("\n"):
            json.loads(line)
        json.loads(c["output"])
    return Cases([c["input"] for c in cases], [c["output"] for c in cases], fn_name)


def generic_sample(qid: str, row: dict, meta: dict, max_new_tokens: int) -> Sample:
    """The generic chat style: SYSTEM as the system message, `prompt` as the user turn."""
    user = prompt(row["question_content"], row["starter_code"])
    subset = f"{row['difficulty']}|{row['platform']}"
    return Sample(qid, TASK, user, [], max_new_tokens, system=SYSTEM, subset=subset, meta=meta)


def _parse(row: dict, i: int, date: datetime, max_new_tokens: int, make=generic_sample) -> Sample | Skipped:
    """A row that `_rows` read (a JSON object with a contest date) -> Sample (built by `make`), or Skipped
    with the reason."""
    qid = str(row.get("question_id") or f"row {i}")
    try:
        if row["difficulty"] not in DIFFICULTIES:
            raise ValueError(f"difficulty {row['difficulty']!r}")
        if not isinstance(row["question_content"], str) or not isinstance(row["starter_code"], str):
            raise ValueError("question_content/starter_code is not a string")
        metadata = json.loads(row["metadata"] or "{}")
        meta = {
            "platform": row["platform"],
            "contest_id": row.get("contest_id"),
            "contest_date": date.isoformat(),
            "difficulty": row["difficulty"],
            "title": row.get("question_title", ""),
            "fn_name": metadata.get("func_name"),
            "public_test_cases": row["public_test_cases"],
            "private_test_cases": row["private_test_cases"],
        }
        tests_of(meta)  # malformed or unsafe tests are found here, at load, not mid-run
    except (KeyError, TypeError, ValueError, pickle.UnpicklingError, zlib.error) as e:
        return Skipped(qid, f"{type(e).__name__}: {e}")
    return make(qid, row, meta, max_new_tokens)


def _files(source: str, release: str) -> tuple[list[Path], str]:
    """The shard files to read: the release's hub shards, a local directory's, or one file read whole."""
    if source == "hub":
        got = [data_file(source, SAMPLE, REPO, f, REVISION) for f in shards(release)]
        return [path for path, _ in got], got[0][1]
    path, tag = data_file(source, SAMPLE, REPO, "", REVISION)  # the bundled sample or a local path
    return ([path] if path.is_file() else [path / f for f in shards(release)]), tag


def _day(value) -> datetime | None:
    return None if value in (None, "") else datetime.strptime(str(value), "%Y-%m-%d")


def _rows(paths, start, end, max_new_tokens: int, digest, counts: dict, make):
    """Parsed rows (Sample or Skipped) of the shard files inside the date window; the others are counted.
    The window compares datetimes as upstream does: `start <= contest_date <= end`, both days at midnight."""
    for path in paths:
        with open(path, "rb") as f:  # shards reach 1.25 GB: one row at a time
            for i, line in enumerate(f):
                digest.update(line)
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    date = datetime.fromisoformat(row["contest_date"])  # a non-object row fails here too
                except (ValueError, KeyError, TypeError) as e:
                    yield Skipped(f"{path.name}:{i + 1}", f"unreadable row: {type(e).__name__}: {e}")
                    continue
                if (start and date < start) or (end and date > end):
                    counts["outside_window"] += 1
                    continue
                yield _parse(row, i, date, max_new_tokens, make)


def load(
    source="sample",
    n=None,
    seed=0,
    release="release_v6",
    start_date=None,
    end_date=None,
    max_new_tokens=2000,
    *,
    make=generic_sample,
    **_,
) -> Loaded:
    """Problems sorted by question_id (upstream's order). `release` selects hub shards or the shard files of
    a local directory (the bundled sample and a local file are read whole); the date window applies to all.
    With n, a seeded random subset is kept in that order. `make` builds each Sample (the prompt style)."""
    paths, tag = _files(source, release)
    digest, counts = hashlib.sha256(), {"outside_window": 0}
    rows = _rows(paths, _day(start_date), _day(end_date), max_new_tokens, digest, counts, make)
    samples, skipped = unique(rows, "question_id")
    samples = subsample(sorted(samples, key=lambda s: s.id), n, seed)
    stats = {
        "release": release if source != "sample" else None,
        "start_date": start_date,
        "end_date": end_date,
        **counts,
    }
    return Loaded(samples, tag, digest.hexdigest(), skipped, stats)


# --- scoring ------------------------------------------------------------------------------------------


def metrics(outcomes: list[str], difficulty: str) -> dict[str, float]:
    """Percent: unbiased pass@k for k in 1, 2, 5, 10, 20, 50, 100 and n (k <= n), pass@1/<difficulty>, and the
    share of the n predictions with each outcome (`outcome/<name>`, all names present so means stay fair), and
    `no_answer` (the standard key every task reports: here no code block to run)."""
    n, c = len(outcomes), outcomes.count("passed")
    ks = sorted({k for k in (1, 2, 5, 10, 20, 50, 100) if k <= n} | {n})
    out = {f"pass@{k}": 100 * pass_at_k(n, c, k) for k in ks}
    out[f"pass@1/{difficulty}"] = out["pass@1"]
    out.update({f"outcome/{name}": 100 * outcomes.count(name) / n for name in OUTCOMES})
    out["no_answer"] = out["outcome/no_code"]  # the standard key: nothing to run
    return out


def problem_key(sample: Sample) -> str:
    """Names a problem's tests for the grading memo: a digest of the fields they are decoded from."""
    h = hashlib.sha256()
    for part in (
        sample.id,
        str(sample.meta["fn_name"]),
        sample.meta["public_test_cases"],
        sample.meta["private_test_cases"],
    ):
        h.update(part.encode("utf-8", "surrogatepass") + b"\0")
    return h.hexdigest()


def score_many(items: list[tuple[list[str], Sample]]) -> list[dict[str, float]]:
    """`score` for many samples at once: every prediction of every sample shares one pool of sandboxes
    (`workers` at a time), each problem's tests decoded once, outcomes memoized per process."""
    if empty := [s.id for preds, s in items if not preds]:
        raise ValueError(f"no predictions to score for {empty[:5]}")
    problems = [
        (problem_key(s), functools.partial(tests_of, s.meta), [extract_code(p) for p in preds])
        for preds, s in items
    ]
    graded = grade_problems(problems)
    return [metrics([g.outcome for g in gs], s.meta["difficulty"]) for gs, (_, s) in zip(graded, items)]


def score(predictions: list[str], sample: Sample) -> dict[str, float]:
    """Grade the k predictions of one problem (in parallel sandboxes); see `metrics` for the keys."""
    return score_many([(predictions, sample)])[0]


def score_keys(repeats: int) -> set[str]:
    """The metrics `score` returns for `repeats` predictions a problem: `metrics`' own keys (pass@k for each
    k it reports, `outcome`), without their breakdowns."""
    return {key.partition("/")[0] for key in metrics(["passed"] * repeats, "easy")}


custom_dataset, process_results = lm_eval_hooks(TASK, load, score, no_split=NO_QUESTION_SPLIT)
__all__ = ["load", "score", "score_many", "configure", "custom_dataset", "process_results", "keep_all"]
