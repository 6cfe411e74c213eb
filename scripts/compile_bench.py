"""Compiled vs eager decode of any model conf: `evalkit.bench.compiled` (which `make bench --only compiled`
runs on the embedded model at 2k-16k) on one prompt length, with the static mode too, rows written as JSON.

Three ways to run the same decode from the same prefill: `eager` (the default cache), `static` (the static
cache, eager forward: what compilation starts from) and `compiled` (the static cache through transformers'
compiled forward); tokens/s, token agreement, compile time and the memory floor of each (see
evalkit/bench/compiled.py).

    python scripts/compile_bench.py [--model smollm2_135m] [--tokens 4096] [--methods snapstream:512,full]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from evalkit.bench.compiled import ALL_MODES, compiled_decode
from evalkit.bench.roofline import weight_bytes
from evalkit.kv import Full, SnapKV, SnapStream, StreamingLLM

METHODS = {"full": Full, "snapstream": SnapStream, "streamingllm": StreamingLLM, "snapkv": SnapKV}


def parse_method(text: str):
    """`name[:budget]` -> a method (argparse type: a bad value is a usage error)."""
    name, _, budget = text.partition(":")
    if name not in METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    try:
        return METHODS[name]() if not budget else METHODS[name](budget=int(budget))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m", help="a conf/model name")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument(
        "--methods",
        type=lambda s: [parse_method(x) for x in s.split(",")],
        default=[SnapStream(budget=512)],
        help="name[:budget],... (default snapstream:512)",
    )
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per mode")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="results/bench/compile_decode.json")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.tokens < 65 or args.steps < 2 * args.rounds or args.rounds < 1:
        ap.error("--tokens must be > 64, --rounds at least 1 and --steps at least 2 per round")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be a positive integer, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from evalkit.config import model_spec
    from evalkit.loading import load_model

    model, _ = load_model(model_spec(args.model))
    ids = torch.randint(
        0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(next(model.parameters()).device)
    rows = compiled_decode(model, ids, args.methods, args.steps, args.rounds, args.backend, modes=ALL_MODES)
    report = {
        "model": args.model,
        "weight_bytes": weight_bytes(model),
        "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
