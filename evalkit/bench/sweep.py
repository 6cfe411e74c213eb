"""One prefill for many budgets: a 4-budget RULER sweep as separate runs vs one run with shared prefills."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from evalkit.bench.base import Context, Measurement

FULL = [
    "task.load.n=2",
    "task.load.lengths=[2048]",
    "task.load.tasks=[niah_single_1,niah_multikey_2,niah_multikey_3]",
]
QUICK = ["task.load.n=1", "task.load.lengths=[1024]", "task.load.tasks=[niah_single_1]"]


def bench_sweep(tmp: Path, budgets, task: list[str]) -> list[dict]:
    """Both modes in this process (the runner loads the model once); fresh results folders for each.
    `task`: the RULER overrides (samples, lengths, tasks)."""
    from evalkit.config import compose
    from evalkit.run import run

    base = [*task, "method=snapstream"]
    jobs = {
        "separate": [[f"method.budget={b}"] for b in budgets],
        "shared": [[f"method.budget=[{','.join(map(str, budgets))}]"]],
    }
    rows = []
    for mode, overrides in jobs.items():
        start = time.perf_counter()
        for extra in overrides:
            run(compose(overrides=[*base, *extra, f"results_dir={tmp / mode}"]))
        rows.append({"mode": mode, "budgets": len(budgets), "wall_s": round(time.perf_counter() - start, 1)})
    rows[1]["speedup"] = round(rows[0]["wall_s"] / rows[1]["wall_s"], 2)
    return rows


def run(ctx: Context) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        return bench_sweep(Path(tmp), [128, 256, 512, 1024], ctx.size(QUICK, FULL))


def note(rows: list[dict]) -> str:
    return (
        "Same results as separate runs (tests/test_shared_prefill.py); one model load in both modes. Full "
        "bench: 2 samples of 3 niah tasks at 2k tokens (--quick: 1 sample of niah_single_1 at 1k)."
    )


MEASUREMENT = Measurement(
    "sweep", "sweep_prefill.csv", "One prefill for many budgets (4-budget RULER sweep)", run, note
)
