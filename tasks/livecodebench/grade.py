"""Grading LiveCodeBench programs: upstream's extraction and comparison rules (`lcb_runner`, pinned in the
task docstring), the programs run by `driver.py` in `evalkit.sandbox`. Expected outputs never enter the
program's sandbox: a stdin program's output and a functional call's JSON value are compared out here; a value
of another type (Fraction, Decimal, numpy) by upstream's `==` in a fresh sandboxed `compare.py`.

The sandbox settings live in this module, not in the task module, because lm-eval exec's the task module
from its path as a second copy: `configure()` and every `score()` meet here, in the one imported copy.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from decimal import Decimal
from numbers import Real
from pathlib import Path

from evalkit import sandbox

OUTCOMES = ("passed", "wrong_answer", "timeout", "runtime_error", "compile_error", "no_code", "sandbox_kill")
DRIVER = (Path(__file__).parent / "driver.py").read_text(encoding="utf-8")
COMPARE = (Path(__file__).parent / "compare.py").read_text(encoding="utf-8")
# Starting the interpreter and the driver is the harness's part, not the candidate's: it gets its own wall
# and CPU allowance, so even a tiny timeout_s grades the candidate (as a timeout) instead of failing here.
STARTUP_S, STARTUP_CPU_S = 60.0, 10.0


@dataclass(frozen=True)
class Settings:
    workers: int | None = None  # parallel sandboxes; None = os.cpu_count()
    timeout_s: float = 6.0  # per test, and for the compile step (upstream's default)
    memory_mb: int = 4096  # the whole program (upstream intends 4 GB but never applies it)
    allow_unisolated: bool = False  # run even where sandbox.missing_isolation() objects


@dataclass(frozen=True)
class Cases:
    inputs: list[str]
    outputs: list[str]
    fn_name: str | None  # None: a stdin program

    @functools.cached_property
    def encoded(self) -> list[bytes]:
        """The inputs as the driver reads them, encoded once and shared by every run on these tests (lone
        surrogates, which JSON allows, pass through and reach the driver as they were). Expected outputs
        are never sent."""
        return [text.encode("utf-8", "surrogatepass") for text in self.inputs]


@dataclass(frozen=True)
class Graded:
    outcome: str  # one of OUTCOMES


_settings = Settings()


def configure(workers=None, timeout_s=6.0, memory_mb=4096, allow_unisolated=False, **unknown) -> dict:
    """Check and set the sandbox settings for all later grading; the runner calls this before the model
    loads, so a bad setting fails before any generation. Raises ValueError for a bad value or when the
    grader cannot start under these limits, SandboxError where isolation is missing (unless
    `allow_unisolated`). Returns what the run records in metrics.json: the settings, the detected
    isolation, and what bounds the program's memory (`memory_limit`)."""
    global _settings
    settings = _checked(workers, timeout_s, memory_mb, allow_unisolated, unknown)
    iso = sandbox.isolation()
    missing = sandbox.missing_isolation(iso)  # what run_program would refuse: refused here, before any run
    if missing and not settings.allow_unisolated:
        raise sandbox.SandboxError(
            f"LiveCodeBench runs generated code and this machine gives {missing} ({iso}); "
            "set task.setup.allow_unisolated=true to run anyway (recorded in metrics.json)"
        )
    _check_start(settings)
    _settings = settings
    return {**asdict(settings), "isolation": iso, "memory_limit": MEMORY_LIMITS[iso["memory"]]}


MEMORY_LIMITS = {
    "cgroup": "memory_mb for the whole program (cgroup v2 memory.max, no swap)",
    "nofork": "memory_mb for the program's one process (RLIMIT_AS; fork refused by seccomp)",
    None: "memory_mb per process only (RLIMIT_AS; no bound on the total: allow_unisolated)",
}


def _checked(workers, timeout_s, memory_mb, allow_unisolated, unknown: dict) -> Settings:
    def number(v):
        return isinstance(v, Real) and not isinstance(v, bool)

    if unknown:
        valid = sorted(Settings.__dataclass_fields__)
        raise ValueError(f"unknown setting(s) {sorted(unknown)}: the valid ones are {valid}")
    rules = (
        (
            "workers",
            workers,
            workers is None or isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1,
            "null (one per CPU) or a positive integer",
        ),
        (
            "timeout_s",
            timeout_s,
            number(timeout_s) and 0 < timeout_s < math.inf,
            "a positive number of seconds",
        ),
        (
            "memory_mb",
            memory_mb,
            isinstance(memory_mb, int) and not isinstance(memory_mb, bool) and memory_mb > 0,
            "a positive integer (MiB)",
        ),
        ("allow_unisolated", allow_unisolated, isinstance(allow_unisolated, bool), "true or false"),
    )
    for name, value, ok, rule in rules:
        if not ok:
            raise ValueError(f"{name} must be {rule}, got {value!r}")
    want, most = workers or os.cpu_count() or 1, sandbox.max_parallel()
    if want > most:  # else grading fails (too many open files, no free uid) after the whole generation
        shown = workers if workers is not None else f"null (one per CPU: {want})"
        raise ValueError(
            f"workers={shown} is more sandboxes than this process can run at once ({most}, from its "
            f"open-file limit and per-run uids); set task.setup.workers to at most {most}"
        )
    return Settings(workers, float(timeout_s), memory_mb, allow_unisolated)


def _check_start(s: Settings) -> None:
    """The driver must start under these limits (too little memory for the interpreter would otherwise fail
    every grading after the whole generation): one run of an empty program, no tests."""
    judge = _Judge(Cases([], [], None), s)
    res = _run_driver("pass", judge.tests, judge, s)
    if res.status == "sandbox_error":  # the sandbox itself failed: no memory setting would help
        raise sandbox.SandboxError(f"the sandbox cannot start the grader: {res.error or res.stderr[-300:]}")
    if judge.stage == "start":
        raise ValueError(
            f"the grader cannot start in the sandbox with memory_mb={s.memory_mb} ({res.status}: "
            f"{(res.error or res.stderr).strip()[-300:]}); raise task.setup.memory_mb"
        )


# --- extraction and comparison (upstream rules) -----------------------------------------------------------


def extract_code(output: str) -> str:
    """Upstream `extract_code`: the lines between the last two lines that contain ```; "" if fewer than 2."""
    lines = output.split("\n")
    fences = [i for i, line in enumerate(lines) if "```" in line]
    return "\n".join(lines[fences[-2] + 1 : fences[-1]]) if len(fences) >= 2 else ""


def _decimals(line: str) -> list[Decimal] | None:
    try:
        return [Decimal(tok) for tok in line.split()]
    except Exception:  # noqa: BLE001 - upstream: any failure means "not numbers"
        return None


def stdio_equal(output: str, expected: str) -> bool:
    """Upstream's stdin comparison: strip the whole text, split on \\n, strip each line; same line count; each
    line equal, or all its whitespace-separated tokens parse as Decimal and are equal."""
    got = [line.strip() for line in output.strip().split("\n")]
    want = [line.strip() for line in expected.strip().split("\n")]
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a == b:
            continue
        da, db = _decimals(a), _decimals(b)
        try:
            if da is None or db is None or da != db:
                return False
        except ArithmeticError:  # a signalling NaN printed by the program cannot be compared: not equal
            return False
    return True


# --- functional answers: upstream's `prediction == json.loads(expected)`, outside the program ---------------


def _big_int(text: str) -> int:
    """JSON integers as upstream decodes them: its grader raised the interpreter's digit limit to 50000
    (this process keeps the default 4300). Decimal converts without that limit."""
    if len(text.lstrip("-")) > 50000:
        raise ValueError(f"an integer of {len(text)} digits exceeds the limit of 50000")
    return int(text) if len(text) <= 4300 else int(Decimal(text))


def decode_json(text: str):
    """`json.loads` as in upstream's grading process (integers of up to 50000 digits), each NaN a float of
    its own: `json.loads` shares one, and inside a list `==` takes the same object as equal to itself, where
    upstream compares the program's own NaN with the expected one (unequal)."""
    return json.loads(text, parse_int=_big_int, parse_constant=float)


def call_failure(ev: dict, expected: str, s: Settings) -> str | None:
    """How a functional test failed (an outcome), or None when it passed. A JSON value (exactly JSON types,
    str keys: `driver.plain`) is compared here: the decoded values' `==` is upstream's `==` on the value
    itself (its JSON text round-trips: floats by repr, NaN and infinities included, so `True == 1`,
    `2 == 2.0` and `nan != nan` hold as there). A pickled value goes to `compare_pickled`; one the driver
    could not pickle (a class of the program's own) is a wrong answer. Anything else on the event is the
    candidate's writing on the driver's pipe: wrong."""
    if isinstance(ev.get("json"), str):
        try:
            return None if decode_json(ev["json"]) == decode_json(expected) else "wrong_answer"
        except (ValueError, RecursionError):  # not the driver's text: the candidate wrote this event
            return "wrong_answer"
    if isinstance(ev.get("pickle"), str):
        try:
            data = base64.b64decode(ev["pickle"], validate=True)
        except ValueError:
            return "wrong_answer"
        return compare_pickled(data, expected, s)
    return "wrong_answer"


# How the comparator's verdict, or its run's end without one, counts.
_COMPARED = {"timeout": "timeout", "memory": "sandbox_kill", "output_limit": "sandbox_kill"}


def compare_pickled(data: bytes, expected: str, s: Settings) -> str | None:
    """Upstream's `==` on a pickled answer, in a fresh sandbox under the same limits with no program code
    loaded (`compare.py`): None when it holds; `wrong_answer` when it does not or the pickle is refused
    (not a stdlib or numpy type); `runtime_error` when it raises (upstream's -4)."""
    verdict: dict = {}

    def on_event(ev: dict) -> bool:
        verdict.update(ev)
        return ev.get("ev") == "ready"

    body = expected.encode("utf-8", "surrogatepass")
    header = json.dumps({"sizes": [len(data), len(body)]}).encode() + b"\n"
    res = sandbox.run_program(
        COMPARE,
        [header, data, body],
        timeout_s=s.timeout_s,
        first_event_s=STARTUP_S,
        memory_mb=s.memory_mb,
        cpu_s=STARTUP_CPU_S + s.timeout_s,
        on_event=on_event,
        allow_unisolated=s.allow_unisolated,
    )
    if "passed" in verdict:
        return None if verdict["passed"] is True else "wrong_answer"
    if "refused" in verdict:
        return "wrong_answer"
    if "error" in verdict:
        return "runtime_error"
    if res.status == "sandbox_error" or "ev" not in verdict:  # never ready: our failure, not the answer's
        raise sandbox.SandboxError(
            f"comparator did not start ({res.status}): {res.error or res.stderr[-2000:]}"
        )
    return _COMPARED.get(res.status, "runtime_error")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for c correct out of n samples: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


# --- running the tests ------------------------------------------------------------------------------------


class _Judge:
    """The `on_event` of one run: checks each driver event as it arrives, stops the run at the first failure
    (upstream stops at the first failing test) or once every test passed."""

    def __init__(self, tests: Cases, settings: Settings) -> None:
        self.tests, self.settings, self.stage, self.next = tests, settings, "start", 0
        self.outcome: str | None = None

    def __call__(self, ev: dict) -> bool:
        kind = ev.get("ev")
        if self.stage == "start" and kind == "ready":
            self.stage = "compile"
            return True
        if self.stage == "compile" and kind == "compile_error":
            return self._end("compile_error")
        if self.stage == "compile" and kind == "compiled":
            self.stage = "test"
            return self._end("passed") if not self.tests.inputs else True
        if self.stage == "test" and kind == "test" and ev.get("i") == self.next:
            return self._test(ev)
        return self._end("runtime_error")  # an unexpected event: the candidate wrote to the driver's pipe

    def _test(self, ev: dict) -> bool:
        i, t = self.next, self.tests
        if "error" in ev:
            return self._end("runtime_error")
        failed = call_failure(ev, t.outputs[i], self.settings) if t.fn_name else None
        if failed or not t.fn_name and not stdio_equal(str(ev.get("out")), t.outputs[i]):
            return self._end(failed or "wrong_answer")
        self.next += 1
        return self._end("passed") if self.next == len(t.inputs) else True

    def _end(self, outcome: str) -> bool:
        self.outcome = outcome
        return False


# How a run that ended without a verdict from the judge is counted.
_UNJUDGED = {
    "timeout": "timeout",
    "output_limit": "sandbox_kill",
    "memory": "sandbox_kill",
    "killed": "sandbox_kill",
    "ok": "runtime_error",
    "runtime_error": "runtime_error",
}


def _run_driver(code: str, tests: Cases, judge: _Judge, s: Settings) -> sandbox.RunResult:
    """One sandboxed driver run: a JSON header line, then the raw inputs streamed, never joined."""
    sizes = [len(b) for b in tests.encoded]
    header = json.dumps({"code": code, "fn_name": tests.fn_name, "sizes": sizes}).encode() + b"\n"
    return sandbox.run_program(
        DRIVER,
        [header, *tests.encoded],
        timeout_s=s.timeout_s,
        first_event_s=STARTUP_S,
        memory_mb=s.memory_mb,
        cpu_s=STARTUP_CPU_S + s.timeout_s * (len(sizes) + 1),
        on_event=judge,
        allow_unisolated=s.allow_unisolated,
    )


def grade(code: str, tests: Cases, settings: Settings | None = None) -> Graded:
    """Run one extracted program on all tests of its problem (stopping at the first failure)."""
    if not code:
        return Graded("no_code")
    s = settings or _settings
    judge = _Judge(tests, s)
    res = _run_driver(code, tests, judge, s)
    if judge.outcome:
        return Graded(judge.outcome)
    if res.status == "sandbox_error" or judge.stage == "start":  # the candidate never ran: our failure
        raise sandbox.SandboxError(f"driver did not start ({res.status}): {res.error or res.stderr[-2000:]}")
    return Graded(_UNJUDGED[res.status])


def grade_many(jobs: list[tuple[str, Cases]]) -> list[Graded]:
    """`grade` over (code, tests) pairs on the configured number of parallel sandboxes, in input order.
    Where isolation is missing, `sandbox.run_program` refuses before anything runs."""
    return sandbox.map_parallel(lambda job: grade(*job), jobs, _settings.workers)


# --- many problems at once ----------------------------------------------------------------------------------
# A problem is (key, load, codes): `key` names its tests (a digest), `load()` decodes them (hub tests reach
# hundreds of MB: decoded once per call, when its first program is due, and dropped when its last is done).
# Outcomes are memoized per process by (tests, code, timeout, memory), so the runner's second pass over
# single predictions (per-repeat scores) re-runs nothing and always agrees with the first.

Problem = tuple[str, Callable[[], Cases], list[str]]
_memo: dict[tuple, Graded] = {}
_memo_lock = threading.Lock()


def grade_problems(problems: list[Problem]) -> list[list[Graded]]:
    """Every code of every problem on one pool of `workers` sandboxes; results in input order."""
    s = _settings
    out: list[list[Graded | None]] = [[None] * len(codes) for _, _, codes in problems]
    due: dict[str, tuple[Callable[[], Cases], dict[tuple, list[tuple[int, int]]]]] = {}
    for i, (key, load, codes) in enumerate(problems):
        for j, code in enumerate(codes):
            digest = hashlib.sha256(code.encode("utf-8", "surrogatepass")).hexdigest()
            mk = (key, digest, s.timeout_s, s.memory_mb)
            with _memo_lock:
                known = Graded("no_code") if not code else _memo.get(mk)
            if known is not None:
                out[i][j] = known
            else:  # the same program twice (greedy repeats) runs once
                due.setdefault(key, (load, {}))[1].setdefault((mk, code), []).append((i, j))
    for (mk, code), graded in _pool(due.values(), s):
        with _memo_lock:
            _memo[mk] = graded
        for i, j in due[mk[0]][1][mk, code]:
            out[i][j] = graded
    return out  # type: ignore[return-value]


def _pool(problems, s: Settings) -> list[tuple[tuple, Graded]]:
    """Grade the due programs, at most `workers` at a time; a problem's tests are decoded just before its
    first program is submitted, so at most about `workers` problems' tests are held at once."""
    workers = s.workers or os.cpu_count() or 1
    free, failed, futures = threading.Semaphore(workers), threading.Event(), []

    def done(fut) -> None:
        if fut.exception() is not None:
            failed.set()
        free.release()

    with ThreadPoolExecutor(workers, thread_name_prefix="lcb-grade") as pool:
        for load, jobs in problems:
            if failed.is_set():
                break
            tests = load()
            _ = tests.encoded  # encoded here, once, before the pool's threads share it
            for job in jobs:
                free.acquire()
                fut = pool.submit(grade, job[1], tests, s)
                fut.add_done_callback(done)
                futures.append((job, fut))
            del tests
    return [(job, fut.result()) for job, fut in futures]
