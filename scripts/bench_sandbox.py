"""Sandbox cost: start-up overhead per program, programs graded per second, and LiveCodeBench grading of the
bundled sample one problem at a time (lm-eval's order) versus pooled across problems (`score_many`).

    .venv/bin/python scripts/bench_sandbox.py [--n 100] [--workers 2] [--k 4]

Overhead is the wall time of a sandboxed empty program minus that of the same interpreter started plainly
(`python -I -c pass`); throughput runs trivial programs, and trivial LiveCodeBench gradings (driver, one
stdin test), on `--workers` parallel sandboxes. The per-problem vs pooled grading is `evalkit.bench.grading`
(`make bench ARGS="--only grading"`), run here at `--k` and `--workers`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from evalkit import sandbox
from evalkit.bench.grading import grading_bench
from tasks.livecodebench import grade


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    print(f"cpus={os.cpu_count()} isolation={sandbox.isolation()}")

    plain = timed(lambda: subprocess.run([sys.executable, "-I", "-c", "pass"], check=True), args.n // 2)
    boxed = timed(lambda: sandbox.run_program("pass", timeout_s=10, memory_mb=512), args.n // 2)
    p, b = statistics.median(plain), statistics.median(boxed)
    print(f"plain interpreter {p * 1e3:.1f} ms, sandboxed {b * 1e3:.1f} ms: overhead {(b - p) * 1e3:.1f} ms")

    t = time.perf_counter()
    runs = sandbox.map_parallel(
        lambda i: sandbox.run_program(f"print({i})", timeout_s=10, memory_mb=512), range(args.n), args.workers
    )
    dt = time.perf_counter() - t
    assert all(r.status == "ok" for r in runs)
    print(f"trivial programs: {args.n / dt:.1f}/s on {args.workers} workers")

    grade.configure(workers=args.workers, timeout_s=6, memory_mb=4096)
    cases = grade.Cases(["1 2\n"], ["3\n"], None)
    code = "a, b = map(int, input().split())\nprint(a + b)"
    t = time.perf_counter()
    graded = grade.grade_many([(code, cases)] * args.n)
    dt = time.perf_counter() - t
    assert all(g.outcome == "passed" for g in graded)
    print(f"LiveCodeBench gradings (driver + 1 test): {args.n / dt:.1f}/s on {args.workers} workers")
    print(f"bundled sample, per problem vs pooled: {grading_bench(args.k, args.workers)}")


if __name__ == "__main__":
    main()
