"""LiveCodeBench grading wall time on the bundled sample: one problem at a time vs pooled across problems.

Per problem is how lm-eval grades: `score` one document at a time, that problem's k predictions in parallel on
`workers` sandboxes, the next problem once the last of them ends. Pooled is `score_many`: every prediction of
every problem on one pool of `workers` sandboxes. Both start from an empty grading memo (outcomes are memoized
per process, so a second pass would re-run nothing), grade the same programs, and must agree on every
program's outcome and every score (`outcomes_identical`).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

from evalkit.bench.base import Context, Measurement
from tasks.livecodebench import grade
from tasks.livecodebench import livecodebench as lcb

MODES = ("per_problem", "pooled")


def sample_predictions(k: int) -> list[tuple[list[str], lcb.Sample]]:
    """k distinct predictions per bundled problem: its reference and wrong solutions (timeouts included),
    cycled, each copy made distinct by a comment so that the grading memo cannot merge them."""
    if k < 1:
        raise ValueError(f"grading bench: k must be a positive integer, got {k!r}")
    sols = json.loads((lcb.SAMPLE.parent / "solutions.json").read_text())
    items = []
    for s in lcb.load().samples:
        codes = [sols[s.id]["reference"], *sols[s.id]["wrong"].values()]
        items.append(([f"```python\n{codes[i % len(codes)]}\n# copy {i}\n```" for i in range(k)], s))
    return items


def graded(mode: str, items) -> tuple[float, list[dict], dict]:
    """(wall seconds, scores per problem, outcome per graded program) of one mode, from an empty memo."""
    grade._memo.clear()  # else the memo would serve the second mode without running it
    start = time.perf_counter()
    scores = [lcb.score(p, s) for p, s in items] if mode == "per_problem" else lcb.score_many(items)
    wall = time.perf_counter() - start
    return wall, scores, {key: g.outcome for key, g in grade._memo.items()}


def grading_row(k: int, workers: int, timeout_s: float, per: tuple, pooled: tuple) -> dict:
    """One row from the two modes' `graded` results."""
    (per_s, per_scores, per_out), (pool_s, pool_scores, pool_out) = per, pooled
    counts = Counter(per_out.values())
    return {
        "problems": len(per_scores),
        "k": k,
        "workers": workers,
        "timeout_s": timeout_s,
        "programs": len(per_out),
        "per_problem_s": round(per_s, 2),
        "pooled_s": round(pool_s, 2),
        "speedup": round(per_s / pool_s, 2),
        "outcomes_identical": per_out == pool_out and per_scores == pool_scores,
        "outcomes": ", ".join(f"{o} {counts[o]}" for o in grade.OUTCOMES if counts[o]),
    }


def grading_bench(
    k: int = 4,
    workers: int | None = None,
    timeout_s: float = 6.0,
    memory_mb: int = 4096,
    allow_unisolated: bool = False,
) -> dict:
    """Wall seconds to grade the bundled sample (10 problems x k predictions) per problem and pooled, under
    these sandbox settings (checked by `grade.configure`, which refuses a machine without isolation unless
    `allow_unisolated`); the previous settings are restored afterwards."""
    previous = (
        grade._settings
    )  # put back as it was: re-configuring would re-check isolation and start a program
    grade.configure(
        workers=workers, timeout_s=timeout_s, memory_mb=memory_mb, allow_unisolated=allow_unisolated
    )
    try:
        items = sample_predictions(k)
        per, pooled = (graded(mode, items) for mode in MODES)
    finally:
        grade._memo.clear()
        grade._settings = previous
    row = grading_row(k, workers or os.cpu_count() or 1, timeout_s, per, pooled)
    print(
        f"grading k={k} workers={row['workers']}: per problem {row['per_problem_s']} s, pooled "
        f"{row['pooled_s']} s ({row['speedup']}x), outcomes identical: {row['outcomes_identical']}",
        flush=True,
    )
    return row


def run(ctx: Context) -> list[dict]:
    cores = os.cpu_count() or 1
    # workers=1 is the control (both modes grade one program at a time); upstream's 6 s per test in the full
    # bench
    cases = ctx.size([(1, cores), (2, cores)], sorted({(1, 1), (1, cores), (4, cores), (8, cores)}))
    return [grading_bench(k, w, timeout_s=ctx.size(1.0, 6.0)) for k, w in cases]


def note(rows: list[dict]) -> str:
    return (
        "The bundled sample (10 problems), k predictions each cycling the problem's reference and its "
        "deliberately wrong solutions (3 problems have one that times out: it costs `timeout_s` per copy). "
        "Per problem: lm-eval's order, `score` one problem at a time (its k predictions on `workers` "
        "sandboxes); pooled: `score_many`, all problems on one pool. Both from an empty grading memo; "
        "`programs`: distinct programs graded; `outcomes_identical`: every program's outcome and every score "
        "equal in both modes. workers=1 is the control (both serial: ~1x). --quick: 1 s per test."
    )


MEASUREMENT = Measurement("grading", "grading.csv", "LiveCodeBench grading: per problem vs pooled", run, note)
