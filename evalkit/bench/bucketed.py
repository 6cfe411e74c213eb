"""The bucketed full cache (issue 35): the full cache decoding in the engine's slot pool, its step attending
over the filled slots rounded up to a bucket (`evalkit.kv.pool.Buckets`), eager and compiled, against the
dynamic cache's eager decode and the pool attending over its whole capacity (the engine before buckets).

Per prompt length, one recorded prefill fills every cache. The pool is sized as the engine sizes it for a
request allowed `max_new` new tokens (prompt + max_new slots), so what buckets save is the slots reserved for
the answer that no step has reached yet. Modes:
- `eager`: transformers' decode with evalkit's dynamic full cache (it grows a slot per step);
- `whole`: the pool, compiled, attending over every slot (capacity) under the valid-slot mask;
- `bucketed_eager` / `bucketed`: the pool with the engine's buckets, eager / compiled.
Steps run in interleaved rounds (the first step of a round a warm-up), medians reported; the greedy tokens of
every mode are compared with eager's. The floor of a step is the same for every mode: the weights plus the
K/V of the filled slots (what any decode must read) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch._dynamo.utils import counters

from evalkit.bench.base import Context, Measurement
from evalkit.bench.roofline import Bandwidth, roofline_note, weight_bytes
from evalkit.bench.timing import filled_cache, prompt_ids, recorded_prefill, sync
from evalkit.kv import Full, StaticKVCache
from evalkit.kv.pool import BUCKETS, WHOLE, Buckets, SlotPool
from evalkit.kv.prefill import populate
from evalkit.kv.static import compile_config

MODES = ("eager", "whole", "bucketed_eager", "bucketed")
COMPILED = {"whole", "bucketed"}
# the target: compiled (bucketed) faster than eager at 16k on CPU, its step within 1.5x of the floor
TARGET = {"prompt_tokens": 16384, "pct_of_floor": 150.0}


@torch.inference_mode()
def full_pool(model, record, ids, max_new: int, buckets: Buckets) -> SlotPool:
    """A one-row pool holding the prompt ids (1, T) in a full cache, sized for `max_new` new tokens: filled
    from the record, or by its own prefill (MLA models)."""
    cache = StaticKVCache.for_model(Full(), model, max_new_tokens=max_new)
    if record.usable:
        populate(cache, record)
    else:
        model(ids, cache=cache, logits_to_keep=1)
    pool = SlotPool.shaped_like(cache, 1, cache.rows.n + max_new, buckets)
    pool.load_row(0, cache)
    return pool


@torch.inference_mode()
def steps(forward, cache, token, n: int, pooled: bool) -> tuple[list[float], torch.Tensor, list[int]]:
    """Wall times of `n` greedy decode steps (a pool's positions passed, `decoded` after each)."""
    times, tokens = [], []
    for _ in range(n):
        sync(token)
        start = time.perf_counter()
        kw = {"position_ids": cache.rows.next_pos.clone()[:, None]} if pooled else {}
        token = forward(input_ids=token, cache=cache, logits_to_keep=1, **kw).logits[:, -1:].argmax(-1)
        if pooled:
            cache.decoded([0])
        sync(token)
        times.append(time.perf_counter() - start)
        tokens.append(int(token[0, 0]))
    return times, token, tokens


def kv_bytes(pool: SlotPool, slots: int) -> int:
    """K and V bytes of `slots` slots of every layer of a one-row pool."""
    return sum(layer.entry_bytes() * slots for layer in pool.layers)


@torch.inference_mode()
def bucketed_full(
    model, ids, max_new: int, n_steps: int = 64, rounds: int = 4, backend="inductor", buckets=BUCKETS
) -> dict:
    """One row: every mode's decode of the full cache after the prompt ids (1, T)."""
    record, first = recorded_prefill(model, ids)
    bandwidth = Bandwidth(ids.device, 2**28 if ids.shape[1] < 4096 else 2**30, reps=3)
    bandwidth.sample()
    caches = {
        "eager": filled_cache(Full(), model, record, ids),
        "whole": full_pool(model, record, ids, max_new, WHOLE),
        "bucketed_eager": full_pool(model, record, ids, max_new, buckets),
        "bucketed": full_pool(model, record, ids, max_new, buckets),
    }
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = model.get_compiled_call(compile_config(model, backend=backend))
    graphs, compile_s = counters["stats"]["unique_graphs"], {}
    for mode in COMPILED:  # first call of each shape on a throwaway pool of the same shape and bucket
        warm = full_pool(model, record, ids, max_new, caches[mode].buckets)
        start = time.perf_counter()
        steps(compiled, warm, first, 1, True)
        compile_s[mode] = time.perf_counter() - start
        del warm
    del record
    forwards = {m: compiled if m in COMPILED else model.__call__ for m in MODES}
    times, tokens, token = {m: [] for m in MODES}, {m: [] for m in MODES}, dict.fromkeys(MODES, first)
    per_round = max(2, n_steps // rounds)
    for _ in range(rounds):
        for mode in MODES:
            cache = caches[mode]
            ts, token[mode], toks = steps(forwards[mode], cache, token[mode], per_round, cache.pooled)
            times[mode] += ts[1:]
            tokens[mode] += toks
    graphs = counters["stats"]["unique_graphs"] - graphs
    bandwidth.sample()
    pool = caches["bucketed"]
    filled = ids.shape[1] + rounds * per_round / 2  # mean slots held over the measured steps
    floor_s = (weight_bytes(model) + kv_bytes(pool, filled)) / bandwidth.median
    row = {
        "prompt_tokens": ids.shape[1],
        "max_new": max_new,
        "capacity": pool.capacity,
        "visible": pool.visible,
        "buckets": f"floor {buckets.floor}, {buckets.per_octave}/octave",
        "graphs": graphs,
        "bucket_count": buckets.count(pool.capacity),
        "compile_s": round(compile_s["bucketed"], 2),
        "tokens_equal": all(tokens[m] == tokens["eager"] for m in MODES),
        "steps": len(times["bucketed"]),
        "bandwidth_gb_s": round(bandwidth.median / 1e9, 2),
        "floor_ms": round(1e3 * floor_s, 3),
    }
    for mode in MODES:
        step = statistics.median(times[mode])
        row[f"{mode}_tok_s"] = round(1 / step, 2)
        row[f"{mode}_pct_of_floor"] = round(100 * step / floor_s, 1)
    row["speedup"] = round(row["bucketed_tok_s"] / row["eager_tok_s"], 3)
    row["vs_whole"] = round(row["bucketed_tok_s"] / row["whole_tok_s"], 3)
    print(
        f"bucketed full {row['prompt_tokens']}: eager {row['eager_tok_s']}, whole {row['whole_tok_s']}, "
        f"bucketed eager {row['bucketed_eager_tok_s']}, bucketed {row['bucketed_tok_s']} tok/s "
        f"({row['bucketed_pct_of_floor']}% of floor, {graphs} graphs, tokens equal: {row['tokens_equal']})",
        flush=True,
    )
    return row


def run(ctx: Context) -> list[dict]:
    lengths = ctx.size([1024], [2048, 4096, 8192, 16384])
    max_new, n_steps, rounds = ctx.size(1024, 8192), ctx.size(12, 64), ctx.size(2, 4)
    return [bucketed_full(ctx.model, prompt_ids(ctx.tokenizer, n), max_new, n_steps, rounds) for n in lengths]


# --- summary.md -------------------------------------------------------------------------------------------
def target_line(rows: list[dict]) -> str:
    row = next((r for r in rows if r["prompt_tokens"] == TARGET["prompt_tokens"]), None)
    want = (
        f"compiled bucketed full cache faster than eager at {TARGET['prompt_tokens']} prompt tokens, its "
        f"step within {TARGET['pct_of_floor'] / 100:g}x of the floor"
    )
    if row is None:
        return f"Target ({want}): not measured by this run (--quick measures 1024 tokens only)."
    fast = row["bucketed_tok_s"] > row["eager_tok_s"]
    near = row["bucketed_pct_of_floor"] <= TARGET["pct_of_floor"]
    return (
        f"Target ({want}): {row['bucketed_tok_s']} vs {row['eager_tok_s']} tok/s "
        f"({'reached' if fast else 'NOT reached'}); the step is at {row['bucketed_pct_of_floor']}% of the "
        f"floor ({'reached' if near else 'NOT reached'})."
    )


def note(rows: list[dict]) -> str:
    return " ".join(
        [
            "The full cache in the engine's slot pool, sized for `max_new` new tokens (prompt + max_new "
            "slots). `eager`: the dynamic full cache, eager; `whole`: the pool compiled, attending over "
            "all `capacity` slots; `bucketed_eager` / `bucketed`: the pool attending over the filled slots "
            "rounded up to a bucket (`visible`), eager / compiled (inductor). `graphs`: graphs compiled for "
            "the row (both compiled modes; `bucket_count`: buckets the pool has). `pct_of_floor`: the median "
            "step as a % of one floor for all modes, (weights + K/V of the filled slots) / the measured copy "
            "bandwidth.",
            target_line(rows),
            "Tokens: every mode equals eager in every row."
            if all(r["tokens_equal"] for r in rows)
            else "Tokens DIFFER from eager in some rows (`tokens_equal`).",
            roofline_note(),
        ]
    )


TABLE = [
    "prompt_tokens",
    "max_new",
    "capacity",
    "visible",
    "eager_tok_s",
    "whole_tok_s",
    "bucketed_eager_tok_s",
    "bucketed_tok_s",
    "speedup",
    "vs_whole",
    "eager_pct_of_floor",
    "whole_pct_of_floor",
    "bucketed_pct_of_floor",
    "floor_ms",
    "graphs",
    "bucket_count",
    "compile_s",
    "tokens_equal",
]


def table(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in TABLE} for r in rows]


MEASUREMENT = Measurement(
    "bucketed", "bucketed_full.csv", "The bucketed full cache (engine pool)", run, note, table
)


def kept_rows(out, lengths: set[int], command: str) -> tuple[list[dict], str]:
    """The rows of other prompt lengths already in `out`'s CSV (a run of some lengths updates those rows
    only), and the provenance command saying which rows came from where."""
    import json

    import pandas as pd

    from evalkit.bench.summary import PROVENANCE

    path = out / MEASUREMENT.csv
    if not path.exists():
        return [], command
    rows = [r for r in pd.read_csv(path).to_dict("records") if int(r["prompt_tokens"]) not in lengths]
    if not rows:
        return [], command
    prov = out / PROVENANCE
    before = json.loads(prov.read_text()).get(MEASUREMENT.name, {}) if prov.exists() else {}
    others = ", ".join(str(r["prompt_tokens"]) for r in rows)
    was = f"`{before.get('command', '?')}` ({before.get('finished', '?')}, git {before.get('git', '?')})"
    return rows, f"{command} ({', '.join(map(str, sorted(lengths)))}); {others} kept from {was}"


def main(argv=None) -> None:
    """`python -m evalkit.bench.bucketed --lengths 16384 8192`: the full-size rows of some lengths, longest
    first, the CSV and summary.md rewritten after each row (a loaded machine may not finish them all)."""
    import argparse
    import sys
    from pathlib import Path

    from evalkit.bench.__main__ import measurement, names
    from evalkit.bench.base import write_csv
    from evalkit.bench.summary import record_provenance, write_summary

    ap = argparse.ArgumentParser(prog="python -m evalkit.bench.bucketed")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 8192, 4096, 2048])
    ap.add_argument("--max-new", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ctx, rows = Context(quick=False, out=Path(args.out)), []
    command = " ".join(["python -m evalkit.bench.bucketed", *(sys.argv[1:] if argv is None else argv)])
    kept, command = kept_rows(ctx.out, set(args.lengths), command)
    for n in args.lengths:
        rows.append(bucketed_full(ctx.model, prompt_ids(ctx.tokenizer, n), args.max_new, 64, 4))
        write_csv(ctx.out / MEASUREMENT.csv, sorted(kept + rows, key=lambda r: r["prompt_tokens"]))
        record_provenance(ctx.out, MEASUREMENT.name, command, False)
        write_summary(ctx.out, [measurement(m) for m in names()], {MEASUREMENT.name}, command)


if __name__ == "__main__":
    main()
