"""Grading LiveCodeBench programs: upstream's extraction and comparison rules (`lcb_runner`, pinned in the
task docstring), the programs run by `driver.py` in `evalkit.sandbox`, expected outputs compared out here.

The sandbox settings live in this module, not in the task module, because lm-eval exec's the task module
from its path as a second copy: `configure()` and every `score()` meet here, in the one imported copy.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path

from evalkit import sandbox

OUTCOMES = ("passed", "wrong_answer", "timeout", "runtime_error", "compile_error", "no_code", "sandbox_kill")
DRIVER = (Path(__file__).parent / "driver.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Settings:
    workers: int | None = None  # parallel sandboxes; None = os.cpu_count()
    timeout_s: float = 6.0  # per test, and for the compile step (upstream's default)
    memory_mb: int = 4096  # RLIMIT_AS (upstream intends 4 GB but never applies it)
    allow_unisolated: bool = False  # run even where sandbox.missing_isolation() objects


@dataclass(frozen=True)
class Cases:
    inputs: list[str]
    outputs: list[str]
    fn_name: str | None  # None: a stdin program


@dataclass(frozen=True)
class Graded:
    outcome: str  # one of OUTCOMES


_settings = Settings()


def configure(workers=None, timeout_s=6.0, memory_mb=4096, allow_unisolated=False) -> dict:
    """Set the sandbox settings for all later grading and check the machine can honour them: without
    network isolation this raises unless `allow_unisolated`. Returns what the run should record (the
    settings plus the detected isolation), e.g. into metrics.json."""
    global _settings
    _settings = Settings(workers, float(timeout_s), int(memory_mb), bool(allow_unisolated))
    iso = sandbox.isolation()
    missing = sandbox.missing_isolation(iso)  # what run_program would refuse: refused here, before any run
    if missing and not _settings.allow_unisolated:
        raise sandbox.SandboxError(
            f"LiveCodeBench runs generated code and this machine gives {missing} ({iso}); "
            "set task.setup.allow_unisolated=true to run anyway (recorded in metrics.json)"
        )
    return {**asdict(_settings), "isolation": iso}


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


def call_equal(output_json: str | None, expected_json: str) -> bool:
    """Upstream's functional comparison `result == json.loads(expected)` (tuples already made lists); the
    driver sends the result as JSON, or None when JSON cannot carry it (then it never equals). The output
    comes from the sandbox (the candidate shares the driver's event pipe): anything undecodable is unequal."""
    try:
        return output_json is not None and json.loads(output_json) == json.loads(expected_json)
    except (TypeError, ValueError, RecursionError):
        return False


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for c correct out of n samples: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


# --- running the tests ------------------------------------------------------------------------------------


class _Judge:
    """The `on_event` of one run: checks each driver event as it arrives, stops the run at the first failure
    (upstream stops at the first failing test) or once every test passed."""

    def __init__(self, tests: Cases) -> None:
        self.tests, self.stage, self.next = tests, "start", 0
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
        i, t, out = self.next, self.tests, ev.get("out")
        if "error" in ev:
            return self._end("runtime_error")
        ok = call_equal(out, t.outputs[i]) if t.fn_name else stdio_equal(str(out), t.outputs[i])
        if not ok:
            return self._end("wrong_answer")
        self.next += 1
        return self._end("passed") if self.next == len(t.inputs) else True

    def _end(self, outcome: str) -> bool:
        self.outcome = outcome
        return False


# How a run that ended without a verdict from the judge is counted.
_UNJUDGED = {"timeout": "timeout", "output_limit": "sandbox_kill", "memory": "sandbox_kill",
             "killed": "sandbox_kill", "ok": "runtime_error", "runtime_error": "runtime_error"}  # fmt: skip


def grade(code: str, tests: Cases) -> Graded:
    """Run one extracted program on all tests of its problem (stopping at the first failure)."""
    if not code:
        return Graded("no_code")
    s = _settings
    judge = _Judge(tests)
    job = json.dumps({"code": code, "fn_name": tests.fn_name, "inputs": tests.inputs})
    res = sandbox.run_program(DRIVER, job, timeout_s=s.timeout_s, memory_mb=s.memory_mb,
                              cpu_s=s.timeout_s * (len(tests.inputs) + 2), on_event=judge,
                              allow_unisolated=s.allow_unisolated)  # fmt: skip
    if judge.outcome:
        return Graded(judge.outcome)
    if res.status == "sandbox_error" or judge.stage == "start":  # the candidate never ran: our failure
        raise sandbox.SandboxError(f"driver did not start ({res.status}): {res.error or res.stderr[-2000:]}")
    return Graded(_UNJUDGED[res.status])


def grade_many(jobs: list[tuple[str, Cases]]) -> list[Graded]:
    """`grade` over (code, tests) pairs on the configured number of parallel sandboxes, in input order.
    Where isolation is missing, `sandbox.run_program` refuses before anything runs."""
    return sandbox.map_parallel(lambda job: grade(*job), jobs, _settings.workers)
