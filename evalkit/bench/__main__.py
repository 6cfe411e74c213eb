"""`python -m evalkit.bench [--quick] [--only NAME[,NAME]] [--out DIR]`: the measurements below, one CSV each,
then summary.md assembled from every CSV in the output folder. A new measurement is one module with a
`MEASUREMENT` record, added to the list here."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# --only name -> its module under evalkit.bench, in the order they run (and summary.md shows them). Modules
# are imported when needed, so `--help` and a bad argument answer at once, without torch.
MEASUREMENTS = {
    "prefill": "prefill",
    "decode": "decode",
    "fixed_kv": "fixed_kv",
    "memory": "rss",  # peak RSS per configuration (the simulated memory report is evalkit.memory)
    "steps": "steps",
    "profile": "profile_step",
    "batch": "batch",
    "continuous": "continuous",
    "sweep": "sweep",
    "compiled": "compiled",
    "bucketed": "bucketed",  # the full cache in the engine's pool, attending over buckets (issue 35)
    "grading": "grading",
    "eviction": "eviction",
    "rivals": "rivals",  # every method beside SnapStream at 4k: prefill cost and decode tok/s (issue 33)
    "serving": "serving",  # `make serve`'s engine under concurrent HTTP clients on 127.0.0.1
    "quantized": "quantized",  # KV storage: fp8's dequantization per decode step beside bf16, 4k and 16k
    "eviction_16k": "eviction_16k",  # opt-in (--only): a 16k prefill per method takes minutes on CPU
}
OPT_IN = {"eviction_16k"}  # left out of the default run


def names() -> list[str]:
    return list(MEASUREMENTS)


def measurement(name: str):
    """The `MEASUREMENT` record of a registered name (imports its module)."""
    return importlib.import_module(f"evalkit.bench.{MEASUREMENTS[name]}").MEASUREMENT


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m evalkit.bench",
        description="Speed and memory of the KV methods on the embedded model (make bench).",
        epilog="measurements, in the order they run: " + ", ".join(names()),
    )
    ap.add_argument("--out", help="output folder (default: results/bench; with --quick: results/bench_quick)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run of a few minutes")
    ap.add_argument(
        "--only", metavar="NAME[,NAME]", help=f"run only these (default: all of {','.join(names())})"
    )
    ap.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's, one per core). On a shared machine use 1: a batched "
        "matmul whose threads wait on each other at every barrier slows down many times over when another "
        "process takes a core, which distorts batch-size comparisons",
    )
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)  # LENGTH:BUDGET, run by the memory measurement
    return ap


def selected(ap: argparse.ArgumentParser, only: str | None) -> list[str]:
    """The measurement names --only asks for, validated before anything loads."""
    known = names()
    if only is None:
        return [n for n in known if n not in OPT_IN]
    asked = [n.strip() for n in only.split(",")]
    unknown = [n for n in asked if n not in known]
    if unknown:
        ap.error(
            f"--only: unknown measurement(s) {', '.join(map(repr, unknown))}; choose from: {', '.join(known)}"
        )
    if len(set(asked)) < len(asked):
        ap.error(f"--only: a measurement is named twice in {only!r}")
    return asked


def output_folder(ap: argparse.ArgumentParser, args) -> Path:
    out = Path(args.out or ("results/bench_quick" if args.quick else "results/bench"))
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        ap.error(f"--out: cannot create the folder {str(out)!r} ({e.strerror or e})")
    return out


def memory_child(ap: argparse.ArgumentParser, spec: str) -> None:
    import json

    try:
        length, budget = (int(x) for x in spec.split(":"))
    except ValueError:
        ap.error(f"--memory-child: expected LENGTH:BUDGET (integers), got {spec!r}")
    from evalkit.bench.rss import memory_child as child

    print(json.dumps(child(length, budget)))


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    args = ap.parse_args(argv)
    if args.memory_child:
        return memory_child(ap, args.memory_child)
    asked = selected(ap, args.only)
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be a positive integer, got {args.threads}")
    from evalkit.bench.base import Context, write_csv  # torch: only once the arguments are known good
    from evalkit.bench.summary import record_provenance, write_summary
    from evalkit.errors import EvalkitError, exit_with

    ctx = Context(quick=args.quick, out=output_folder(ap, args))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    command = " ".join(["python -m evalkit.bench", *(sys.argv[1:] if argv is None else argv)])
    registered = [measurement(name) for name in names()]
    try:
        for m in registered:
            if m.name in asked:
                write_csv(ctx.out / m.csv, m.run(ctx))
                record_provenance(ctx.out, m.name, command, args.quick)
    except EvalkitError as e:  # a model that cannot load, a bad setting: the message says what to do
        exit_with("python -m evalkit.bench", e)
    print(write_summary(ctx.out, registered, set(asked), command))


if __name__ == "__main__":
    main()
