"""Compiled vs eager decode: tokens/s of one method's cache on a long prompt, beside the memory floor of a step.

Three ways to run the same decode from the same prefill: `eager` (the default cache, host bookkeeping), `static`
(the static cache, eager forward: what compilation starts from) and `compiled` (the static cache through
transformers' compiled forward, `evalkit.kv.generate.compile_config`). Steps run in interleaved rounds so machine
noise hits every configuration alike; medians are reported, with the greedy tokens each produced (they must
agree). The floor is the bytes one step must read (weights + the slots attention reads) over the machine's
bandwidth, measured in the same run (a large copy and a large read; the faster of the two).

    python scripts/compile_bench.py [--model smollm2_135m] [--tokens 4096] [--methods snapstream:512,full]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from evalkit.kv import Full, KVCache, SnapKV, SnapStream, StreamingLLM
from evalkit.kv.generate import compile_config
from evalkit.kv.prefill import PrefillRecord, populate

METHODS = {"full": Full, "snapstream": SnapStream, "streamingllm": StreamingLLM, "snapkv": SnapKV}
MODES = ("eager", "static", "compiled")


def parse_method(text: str):
    """`name[:budget]` -> a method (argparse type: a bad value is a usage error)."""
    name, _, budget = text.partition(":")
    if name not in METHODS:
        raise argparse.ArgumentTypeError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    try:
        return METHODS[name]() if not budget else METHODS[name](budget=int(budget))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth_of(device: torch.device, mib: int = 256, reps: int = 5) -> dict[str, float]:
    """Bytes per second of a large tensor copy (read + write counted) and of a large read (a sum), medians of
    `reps` (the first pass faults pages in). A decode step mostly reads, so the floor uses the faster one."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    times = {"copy": [], "read": []}
    for _ in range(reps + 1):
        for kind, op in (("copy", lambda: dst.copy_(src)), ("read", src.sum)):
            sync(device)
            start = time.perf_counter()
            op()
            sync(device)
            times[kind].append(time.perf_counter() - start)
    moved = {"copy": 2 * src.numel() * 4, "read": src.numel() * 4}
    return {kind: moved[kind] / statistics.median(ts[1:]) for kind, ts in times.items()}


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once


@torch.inference_mode()
def prefill_record(model, ids) -> tuple[PrefillRecord, torch.Tensor]:
    """One full prefill whose record fills every cache (same keys, same selection); its greedy first token."""
    record = PrefillRecord(window=32)
    logits = model(ids, cache=KVCache.for_model(Full(), model, record=record), logits_to_keep=1).logits
    return record, logits[:, -1:].argmax(-1)


@torch.inference_mode()
def filled(method, model, record, ids, static: bool, new_tokens: int) -> KVCache:
    cache = KVCache.for_model(method, model, static=static, max_new_tokens=new_tokens)
    if record.usable:
        populate(cache, record)
    else:  # MLA: the record keeps no expanded keys, so this cache prefills itself
        model(ids, cache=cache, logits_to_keep=1)
    return cache


@torch.inference_mode()
def timed_steps(forward, cache, token, steps: int) -> tuple[list[float], torch.Tensor, list[int]]:
    """Per-step wall times of `steps` greedy decode steps; the last token and every token produced."""
    times, tokens = [], []
    for _ in range(steps):
        sync(token.device)
        start = time.perf_counter()
        token = forward(input_ids=token, cache=cache).logits[:, -1:].argmax(-1)
        sync(token.device)
        times.append(time.perf_counter() - start)
        tokens.append(int(token[0, 0]))
    return times, token, tokens


@torch.inference_mode()  # compiled for inference: the graph must be traced in the mode it runs in
def measure(model, ids, method, steps: int, rounds: int, backend: str) -> dict:
    """Eager, static and compiled decode of `method` after `ids`: median step times and the tokens each made."""
    record, first = prefill_record(model, ids)
    caches = {mode: filled(method, model, record, ids, mode != "eager", steps + 1) for mode in MODES}
    warm = filled(method, model, record, ids, True, steps + 1)  # a throwaway cache of the same shape
    del record
    compiled = model.get_compiled_call(compile_config(model, backend=backend))
    forwards = {"eager": model.__call__, "static": model.__call__, "compiled": compiled}
    start = time.perf_counter()
    compiled(input_ids=first, cache=warm)  # compiles once for this (batch, slots) shape
    compile_s = time.perf_counter() - start
    del warm
    times = {mode: [] for mode in MODES}
    tokens = {mode: [] for mode in MODES}
    token = dict.fromkeys(MODES, first)
    per_round = max(2, steps // rounds)
    for _ in range(rounds):
        for mode in MODES:
            ts, token[mode], toks = timed_steps(forwards[mode], caches[mode], token[mode], per_round)
            times[mode] += ts[1:]  # the first step of a round warms caches back up
            tokens[mode] += toks
    return {"times": times, "tokens": tokens, "compile_s": compile_s, "kv_bytes": kv_read_bytes(caches)}


def kv_read_bytes(caches: dict) -> dict:
    """Bytes of K/V attention reads per step: the slots in use (eager) or the whole static buffer."""
    eager = caches["eager"].stats()["bytes"]
    static = sum(lay.entry_bytes() * lay.keys.shape[2] for lay in caches["static"].layers)
    return {"eager": eager, "static": static, "compiled": static}


def compiled_decode(
    model, ids, method, steps: int = 64, rounds: int = 4, backend: str = "inductor"
) -> list[dict]:
    """Rows (one per mode) of tokens/s, speedup over eager, the floor and whether the tokens agree."""
    bandwidth = bandwidth_of(next(model.parameters()).device)
    graphs = counters["stats"]["unique_graphs"]
    res = measure(model, ids, method, steps, rounds, backend)
    res["graphs"] = counters["stats"]["unique_graphs"] - graphs
    rows = rows_for(model, ids, method, res, bandwidth)
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def rows_for(model, ids, method, res: dict, bandwidth: dict) -> list[dict]:
    weights, best = weight_bytes(model), max(bandwidth.values())
    base = statistics.median(res["times"]["eager"])
    rows = []
    for mode in MODES:
        step = statistics.median(res["times"][mode])
        floor = (weights + res["kv_bytes"][mode]) / best
        rows.append({"prompt_tokens": ids.shape[1], "method": method.name, "budget": getattr(method, "budget", None),
                     "mode": mode, "decode_tok_s": round(1 / step, 2), "median_step_ms": round(1e3 * step, 2),
                     "speedup_vs_eager": round(base / step, 3), "steps": len(res["times"][mode]),
                     "floor_ms": round(1e3 * floor, 2), "step_over_floor": round(step / floor, 2),
                     "tokens_equal_eager": res["tokens"][mode] == res["tokens"]["eager"],
                     "copy_gb_s": round(bandwidth["copy"] / 1e9, 2), "read_gb_s": round(bandwidth["read"] / 1e9, 2),
                     "threads": torch.get_num_threads(),
                     "compile_s": round(res["compile_s"], 1) if mode == "compiled" else None,
                     "graphs_compiled": res["graphs"] if mode == "compiled" else None})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m", help="a conf/model name")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--methods", type=lambda s: [parse_method(x) for x in s.split(",")],
                    default=[SnapStream(budget=512)], help="name[:budget],... (default snapstream:512)")  # fmt: skip
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per mode")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default="results/bench/compile_decode.json")
    args = ap.parse_args()
    if args.tokens < 65 or args.steps < 2 * args.rounds:
        ap.error("--tokens must be > 64 and --steps at least 2 per round")
    if args.threads:
        torch.set_num_threads(args.threads)
    from evalkit.config import model_spec
    from evalkit.models import load_model

    model, _ = load_model(model_spec(args.model))
    ids = torch.randint(
        0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(next(model.parameters()).device)
    report = {
        "model": args.model,
        "weight_bytes": weight_bytes(model),
        "command": " ".join(sys.argv),
        "rows": [],
    }
    for method in args.methods:
        report["rows"] += compiled_decode(model, ids, method, args.steps, args.rounds, args.backend)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
