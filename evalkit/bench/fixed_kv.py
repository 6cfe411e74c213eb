"""Throughput at a fixed KV memory budget: the paper's claim (SnapStream Table 5), measured, not modelled.

For one KV budget in bytes and one long prompt: the largest batch each method's cache fits in it (full: prompt
plus decoded tokens per row; SnapStream: `budget` slots per row, whatever the length), the decode tokens/s it
reaches at that batch, and beside them what `evalkit.memory` predicts for the same setting (its bandwidth
model fed this run's measured copy bandwidth, weights counted from the config, no compute limit: the
prediction is the memory roofline).

The batch is evalkit.memory's max batch; the real caches' bytes after decoding are then read back
(`max_batch_measured` = KV budget // the bytes one real row holds), so the prediction is checked, not assumed.

One prefill serves every row and method: the prompt is prefilled once with a recording cache
(`evalkit.kv.prefill`), and each method's batch-B cache is populated from that record replicated B times
(views, no copies) by the same code path a real prefill takes, so the B rows are B identical requests (the
decode outputs equal `evalkit.kv.generate`'s, tests/test_bench.py).
"""

from __future__ import annotations

import math

import torch

from evalkit.bench.base import MIB, Context, Measurement
from evalkit.bench.roofline import Bandwidth, floor_columns, roofline_note, weight_bytes
from evalkit.bench.timing import (
    attention_timer,
    interleaved_steps,
    label,
    median_tok_s,
    prompt_ids,
    recorded_prefill,
)
from evalkit.kv import Full, KVCache, SnapStream
from evalkit.kv.prefill import PrefillRecord, populate


def replicated(record: PrefillRecord, batch: int) -> PrefillRecord:
    """The record of `batch` identical prompts: every tensor expanded along the batch (views, no copies)."""
    if not record.usable:
        raise ValueError("fixed-KV bench: the prefill record is not usable (an MLA model's); use a GQA model")
    out = PrefillRecord(window=record.window)
    for idx, (keys, values, queries, scaling) in record.layers.items():
        rows = [t.expand(batch, *t.shape[1:]) for t in (keys, values, queries)]  # (1, ...) -> (B, ...)
        out.layers[idx] = (*rows, scaling)
    out.mask = None if record.mask is None else record.mask.expand(batch, *record.mask.shape[1:])
    return out


def predictions(model, methods, prompt: int, decoded: int, kv_budget: int, bandwidth: float) -> list[dict]:
    """evalkit.memory's max batch and decode tok/s per method, for this model on a one-socket "machine" whose
    KV reservation is the budget and whose bandwidth is the measured one (efficiency 1, compute unbounded)."""
    from evalkit.memory import Deployment, Hardware, kv_entries, model_spec

    dtype = str(model.dtype)
    spec = model_spec("bench", model.config, dtype, dtype)
    hw = Hardware(
        "this machine",
        sockets=1,
        sram_bytes=0,
        hbm_bytes=spec.weight_bytes + kv_budget,
        ddr_bytes=0,
        hbm_bw=bandwidth,
        ddr_bw=0.0,
        flops=math.inf,
        efficiency=1.0,
    )
    dep = Deployment(spec, hw, tp=1)
    out = []
    for method in methods:
        entries = kv_entries(method.name, getattr(method, "budget", None), prompt, decoded, spec.kv.shape)
        batch = dep.max_batch(entries, reserve=kv_budget)
        out.append(
            {"entries": entries, "batch": batch, "tok_s": dep.step(batch, entries)["tok_s"] if batch else 0}
        )
    return out


@torch.inference_mode()
def fixed_kv(model, ids, kv_budget: int, budgets, steps: int, rounds: int, copy_bytes: int) -> list[dict]:
    """Full vs SnapStream `budgets` after the prompt `ids` (1, T), each at the largest batch whose KV fits
    `kv_budget` bytes; decode steps in interleaved rounds, median step time."""
    methods = [Full()] + [SnapStream(budget=b) for b in budgets]
    decoded = rounds * max(2, steps // rounds)  # forwards per cache (interleaved_steps), warm-ups included
    plan = predictions(model, methods, ids.shape[1], decoded, kv_budget, bandwidth=1.0)
    for method, p in zip(methods, plan):
        if p["batch"] < 1:
            raise ValueError(
                f"fixed-KV bench: a {label(method)} cache of {p['entries']} slots per row does not fit a KV "
                f"budget of {kv_budget / MIB:.0f} MiB even at batch 1; raise the budget or shorten the prompt"
            )
    record, first = recorded_prefill(model, ids)
    caches = []
    for method, p in zip(methods, plan):
        caches.append(KVCache.for_model(method, model))
        populate(caches[-1], replicated(record, p["batch"]))
    del record
    bandwidth = Bandwidth(ids.device, copy_bytes, reps=3)
    bandwidth.sample()
    before = [cache.stats()["bytes"] for cache in caches]
    firsts = [first.repeat(p["batch"], 1) for p in plan]  # (B, 1)
    # the attention part of each step: where a batch of compressed rows spends what the full cache spends
    times, attention = interleaved_steps(model, caches, firsts, steps, rounds, part=attention_timer)
    bandwidth.sample()
    stats = [cache.stats() for cache in caches]
    predicted = predictions(model, methods, ids.shape[1], decoded, kv_budget, bandwidth.median)
    measured = {"stats": stats, "kv_before": before, "times": times, "attention": attention}
    return rows_for(
        ids.shape[1], kv_budget, methods, predicted, measured, weight_bytes(model), bandwidth.median
    )


def rows_for(prompt, kv_budget, methods, predicted, measured, weights, bandwidth) -> list[dict]:
    """One row per method: batch (predicted, and measured from the real caches' bytes), tok/s and gain
    (measured, predicted), KV bytes, attention time, roofline."""
    rows = []
    per_method = zip(methods, predicted, *(measured[k] for k in ("stats", "kv_before", "times", "attention")))
    for method, p, st, kv0, ts, attn in per_method:
        row_bytes = st["rows"][0]["bytes"]  # one row's slots after decoding, all layers, K and V
        tps = median_tok_s(ts, p["batch"])
        rows.append(
            {
                "prompt_tokens": prompt,
                "kv_budget_mib": round(kv_budget / MIB, 1),
                "config": label(method),
                "batch": p["batch"],
                "max_batch_measured": kv_budget // row_bytes,
                "kv_slots_per_row": st["slots"],
                "kv_bytes_per_row": row_bytes,
                "kv_bytes_batch": st["bytes"],
                "kv_reserved_bytes": st["reserved_bytes"],
                "decode_tok_s": round(tps, 2),
                "predicted_tok_s": round(p["tok_s"], 2),
                "steps": len(ts),
                "attn_ms": round(1e3 * attn, 4),
                **floor_columns(p["batch"] / tps, weights, (kv0 + st["bytes"]) / 2, bandwidth),
            }
        )
        print(
            f"fixed KV {kv_budget / MIB:.0f} MiB, {prompt} tokens, {label(method)} x{p['batch']}: "
            f"{tps:.2f} tok/s (predicted {p['tok_s']:.2f})",
            flush=True,
        )
    for r in rows:
        r["gain_vs_full"] = round(r["decode_tok_s"] / rows[0]["decode_tok_s"], 2)
        r["predicted_gain"] = round(r["predicted_tok_s"] / rows[0]["predicted_tok_s"], 2)
    return rows


def run(ctx: Context) -> list[dict]:
    # 4x compression, the paper's ratio (128k -> 32k), and 16x; the full bench's 1 GiB holds one full 16k row
    length, kv_budget = ctx.size(2048, 16384), ctx.size(128 * MIB, 1024 * MIB)
    budgets = [length // 4, length // 16]
    ids = prompt_ids(ctx.tokenizer, length)
    return fixed_kv(
        ctx.model, ids, kv_budget, budgets, ctx.size(12, 48), ctx.size(4, 6), ctx.size(2**28, 2**30)
    )


def note(rows: list[dict]) -> str:
    full = rows[0]
    lines = [
        f"KV budget {full['kv_budget_mib']:g} MiB, {full['prompt_tokens']}-token prompt. `batch`: the "
        "largest batch whose KV (slots after decoding x bytes per slot, all layers) fits, from "
        "evalkit.memory; `max_batch_measured`: the budget // one real row's bytes after decoding (they must "
        "agree). `kv_reserved_bytes` is the allocation (the full cache grows geometrically: spare slots). "
        "`attn_ms`: mean time per step in attention (sdpa over the cache, all layers), the part the KV size "
        "drives. Target: SnapStream tok/s >= 4x the full cache's (paper: up to 4.3x at 4x compression).",
    ]
    for r in rows[1:]:
        lines.append(
            f"{r['config']} x{r['batch']} vs full x{full['batch']}: measured {r['gain_vs_full']}x, predicted "
            f"{r['predicted_gain']}x (evalkit.memory at the measured bandwidth); step at "
            f"{r['step_pct_of_floor']}% of its roofline floor, full at {full['step_pct_of_floor']}%; "
            f"attention {r['attn_ms']:.1f} of {r['step_ms']:.1f} ms per step (full: {full['attn_ms']:.1f} of "
            f"{full['step_ms']:.1f})."
        )
    return " ".join(lines) + " " + roofline_note()


MEASUREMENT = Measurement("fixed_kv", "fixed_kv.csv", "Throughput at a fixed KV memory budget", run, note)
