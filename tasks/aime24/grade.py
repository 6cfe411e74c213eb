"""Judging one AIME box with math-verify (huggingface/Math-Verify, pinned 0.9.0), as lighteval's AIME metric
does.

lighteval's `pass_at_k_math` (the metric of its `aime24` task) parses the gold and the prediction with the
extraction targets `[ExprExtractionConfig(), LatexExtractionConfig()]` and compares them with math-verify's
`verify(gold, prediction)`. evalkit extracts the last box itself (`aime24.last_boxed`) and hands math-verify
`\\boxed{<content>}`, so math-verify's own boxed extraction reads exactly what the model boxed. The gold goes
first: `verify` is not symmetric, and with an integer gold it accepts a chain that ends in it (`n = 809`).

Timeouts. sympy can run for ever on a short box (`9^{9^{9^{9}}}` does). math-verify stops it with SIGALRM,
which only works in a process's main thread (anywhere else it raises ValueError), and a timeout it catches
reads as a wrong answer. evalkit turns math-verify's timers off and arms its own around the same two steps
with math-verify's default budgets (parse 5 s, verify 5 s), so a timeout is reported as its own outcome.
Called from another thread, the judging runs in a one-process pool, in that process's main thread.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import signal
import threading
import time
from contextlib import contextmanager

PARSE_S = 5.0  # math-verify's default `parsing_timeout`
VERIFY_S = 5.0  # math-verify's default `timeout_seconds`
POOL_GRACE_S = 30.0  # on top of the two budgets, for the worker's own overhead (IPC, a busy machine)


class JudgeTimeout(BaseException):
    """A BaseException, like math-verify's own TimeoutException: its `except Exception` must not swallow
    it."""


@contextmanager
def deadline(seconds: float):
    """Raise JudgeTimeout in the main thread after `seconds`; a timer set by someone else is re-armed
    after."""

    def expire(signum, frame):
        raise JudgeTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


class _TimersOff(logging.Filter):
    """math-verify warns once that its timers are off and that the caller must stop runaway work: evalkit does
    (`deadline`), so that one line is dropped; every other math-verify message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_TimersOff())


def judge_here(text: str, gold: str, parse_s: float = PARSE_S, verify_s: float = VERIFY_S):
    """(correct, vote) for the text math-verify reads (`\\boxed{<box>}`, or a whole response) in this
    process's main thread, or None when a step ran out of time.

    `vote` is what a wrong answer votes for in cons@k: the string of math-verify's reading of the text (its
    first extraction), None when nothing could be read."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    targets = [ExprExtractionConfig(), LatexExtractionConfig()]  # lighteval pass_at_k_math, gold and pred
    try:
        with deadline(parse_s):
            gold_parsed = parse(gold, targets, parsing_timeout=None)
            pred = parse(text, targets, parsing_timeout=None)
        if not gold_parsed:
            raise ValueError(f"math-verify cannot read the gold answer {gold!r}")
        with deadline(verify_s):
            correct = verify(gold_parsed, pred, timeout_seconds=None)
            return correct, (str(pred[0]) if pred else None)
    except JudgeTimeout:
        return None


_POOL = None
_POOL_LOCK = threading.Lock()


def _warm() -> None:
    import math_verify  # noqa: F401  (sympy + antlr load once, outside any time budget)


def _close_pool() -> None:
    """End the worker at exit (or after a stuck call): left to the garbage collector, it errs at shutdown."""
    global _POOL
    if _POOL is not None:
        _POOL.terminate()
        _POOL.join()
        _POOL = None


def judge_box(box: str, gold: str):
    """One box's content, read by math-verify's own boxed extraction as `\\boxed{<box>}` (the headline)."""
    return _judge("\\boxed{" + box + "}", gold)


def judge_text(text: str, gold: str):
    """lighteval's reading of a whole response (`pass_at_k_math`: PassAtK(strip_strings=True) over
    MultilingualExtractiveMatchMetric with the same targets, precision 6, first_match fallback, any_match
    extraction: math-verify's `parse`/`verify` defaults): whatever its extraction finds anywhere in the
    stripped text, thinking included, i.e. lighteval run with its reasoning tags kept
    (`remove_reasoning_tags=False`; its current default cuts `<think>...</think>` first). Reported beside
    the headline, never in it."""
    return _judge(text.strip(), gold)


def _judge(text: str, gold: str):
    """`judge_here` from any thread: directly in the main thread, else in a one-process pool (spawned once)
    where it runs in that process's main thread; a worker that outlives its budgets is killed."""
    parse_s, verify_s = PARSE_S, VERIFY_S  # read at call time (tests shorten them)
    if threading.current_thread() is threading.main_thread():
        return judge_here(text, gold, parse_s, verify_s)
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = multiprocessing.get_context("spawn").Pool(1)
            atexit.register(_close_pool)
            _POOL.apply(_warm)
        pending = _POOL.apply_async(judge_here, (text, gold, parse_s, verify_s))
        try:
            return pending.get(parse_s + verify_s + POOL_GRACE_S)
        except multiprocessing.TimeoutError:  # stuck where SIGALRM cannot reach (inside one C call)
            _close_pool()
            return None
