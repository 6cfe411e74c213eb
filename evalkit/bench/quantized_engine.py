"""Every KV storage in the engine's decode path (issue 32.5): SmolLM2-135M's whole decode step (weights
included) over a full cache held by each storage in a one-row slot pool, at 4k and 16k prompt tokens, and the
bytes each holds (its memory floor).

One prefill records the prompt's K/V (`PrefillRecord`); each storage's full cache is compressed from that
record (`populate`: the storage's `seal`, as a run's prefill does), copied into a one-row pool (what the
engine decodes in: KIVI's moving residual, fp8's frozen scales) and decoded greedily, eager, in interleaved
rounds so machine noise hits every storage alike. `step_ms` is the mean step; `vs_none` the step over the
model dtype's and `dequant_ms` the difference (the storage's coding and read-back: on CPU an elementwise pass
over the cache each step); `kv_bytes` the row's bytes as held (codes, scales, residual windows), which equal
the memory model's (tests/kv/test_storage_slots.py), and `floor_ms` weights plus those bytes at the measured
copy bandwidth.
"""

from __future__ import annotations

import statistics

import torch

from evalkit.bench.base import Context, Measurement
from evalkit.bench.eviction import pool_steps
from evalkit.bench.quantized import copy_bandwidth
from evalkit.bench.roofline import weight_bytes
from evalkit.bench.timing import prompt_ids
from evalkit.kv import Full, KVCache
from evalkit.kv.pool import SlotPool
from evalkit.kv.prefill import PrefillRecord, populate
from evalkit.kv.storage import make_storage

STORAGES = ("none", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "int2")


@torch.inference_mode()
def storage_pools(model, ids, storages: dict, room: int) -> tuple[dict, torch.Tensor]:
    """A one-row pool per storage (name -> `KVStorage`) holding the prompt's full cache (room for `room` new
    tokens), and the first token."""
    record = PrefillRecord(window=32)
    first = model(ids, cache=KVCache.for_model(Full(), model, record=record), logits_to_keep=1)
    pools = {}
    for name, storage in storages.items():
        cache = KVCache.for_model(Full(), model, max_new_tokens=room, storage=storage)
        populate(cache, record)
        pool = SlotPool.shaped_like(cache, 1, cache.rows.n + room)
        pool.load_row(0, cache)
        pools[name] = pool
    return pools, first.logits[:, -1:].argmax(-1)


def storage_decode(model, ids, steps: int, rounds: int = 4, storages: dict | None = None) -> list[dict]:
    """One row per storage (name -> `KVStorage`, the first the model dtype's; default: every conf/kv at its
    conf settings): mean decode step in its pool, bytes held, tokens equal to the first's."""
    storages = storages or {name: make_storage(name) for name in STORAGES}
    names, per_round = list(storages), max(2, steps // rounds)
    pools, first = storage_pools(model, ids, storages, rounds * (per_round + 1) + 1)
    times = {name: [] for name in names}
    tokens, token = {name: [] for name in names}, dict.fromkeys(names, first)
    for _ in range(rounds):
        for name in names:
            ts, token[name] = pool_steps(model, pools[name], token[name], per_round + 1)
            times[name] += ts[1:]  # the first step of a round warms up
            tokens[name].append(int(token[name]))
    bandwidth, weights = copy_bandwidth(), weight_bytes(model)
    base = statistics.mean(times[names[0]])
    rows = []
    for name in names:
        step = statistics.mean(times[name])
        held = pools[name].row_stats()[0]["bytes"]
        rows.append(
            {
                "prompt_tokens": ids.shape[1],
                "storage": name,
                "step_ms": round(1e3 * step, 3),
                "vs_none": round(step / base, 2),
                "dequant_ms": round(1e3 * (step - base), 3),
                "kv_bytes": held,
                "kv_vs_none": round(held / pools[names[0]].row_stats()[0]["bytes"], 3),
                "floor_ms": round(1e3 * (weights + held) / bandwidth, 3),
                "bandwidth_gb_s": round(bandwidth / 1e9, 2),
                "same_tokens_as_none": tokens[name] == tokens[names[0]],
                "steps": len(times[name]),
            }
        )
        print(f"quantized engine {ids.shape[1]} {name}: {rows[-1]['step_ms']} ms/step", flush=True)
    return rows


def run(ctx: Context) -> list[dict]:
    lengths, steps = ctx.size((512,), (4096, 16384)), ctx.size(8, 24)
    return [row for n in lengths for row in storage_decode(ctx.model, prompt_ids(ctx.tokenizer, n), steps)]


def note(rows: list[dict]) -> str:
    return " ".join(
        [
            "SmolLM2-135M's whole decode step (float32 weights, eager) over its full cache held by each",
            "storage in a one-row slot pool, the engine's decode path. `vs_none` is the step over the model",
            "dtype's, `dequant_ms` the difference; `kv_bytes` the row's bytes as held (codes, scales and",
            "KIVI's raw residual windows: int's slot layout) and `kv_vs_none` over the model dtype's;",
            "`floor_ms` weights plus those bytes at the measured copy bandwidth;",
            "`same_tokens_as_none`: each round's last greedy token equals the model dtype's.",
            "On CPU the read-back is an elementwise pass over the whole cache every step (int: unpack,",
            "scale, overlay the residual), so a storage costs time while it saves bytes; a fused kernel",
            "(vLLM's fp8, KIVI's CUDA kernels) reads codes inside attention instead.",
        ]
    )


MEASUREMENT = Measurement(
    "quantized_engine",
    "quantized_engine.csv",
    "Every KV storage in the engine's decode step",
    run,
    note,
)
