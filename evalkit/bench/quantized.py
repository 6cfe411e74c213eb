"""Quantized KV decode (issue 32.5): what a storage's dequantization costs per decode step, beside the model
dtype, at 4k and 16k cached entries on SmolLM2-135M's cache shape, and the bytes it holds (its memory floor).

A step is what the slot caches run per layer (`evalkit.kv.cache` / `static`): code the new token into its
slot (`storage.store`), read every slot back in the model dtype (`storage.load`) and attend over it with the
static decode attention, for every layer of the model. The model's weights are left out on purpose: this
isolates the cache's share of a step, the part a storage changes. `kv_bytes` is one sequence's cache as
held (codes and scales), `floor_ms` the time to read it once at the machine's measured copy bandwidth.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from evalkit.bench.base import Context, Measurement
from evalkit.kv.attention import static_decode_sdpa
from evalkit.kv.storage import make_storage

# SmolLM2-135M's cache: 30 layers, 3 KV heads of 64 channels, 9 query heads; bf16 as deployed
SHAPE = {"layers": 30, "kv_heads": 3, "q_heads": 9, "head_dim": 64}
STORAGES = ("none", "fp8_e4m3", "fp8_e5m2")


def layers(storage, entries: int, dtype: torch.dtype, seed: int = 0) -> list[SimpleNamespace]:
    """One sequence's cache of `entries` slots per layer, held by `storage` (what a prefill leaves)."""
    g = torch.Generator().manual_seed(seed)
    h, d = SHAPE["kv_heads"], SHAPE["head_dim"]
    out = []
    for _ in range(SHAPE["layers"]):
        k, v = (torch.randn(1, h, entries, d, generator=g).to(dtype) for _ in range(2))
        layer = SimpleNamespace(keys=k.clone(), values=v.clone(), scales=(), dtype=dtype)
        storage.seal(layer, k, v, torch.ones(1, entries, dtype=torch.bool))
        out.append(layer)
    return out


def step(storage, cache, query, k, v, slot: int) -> torch.Tensor:
    """One decode step over every layer: write the token into `slot`, dequantize, attend."""
    mask = torch.ones(1, 1, 1, cache[0].keys.shape[2], dtype=torch.bool)
    out = query
    for layer in cache:
        ck, cv = storage.store(layer, k, v)
        layer.keys[:, :, slot] = ck[:, :, 0]
        layer.values[:, :, slot] = cv[:, :, 0]
        keys, values = storage.load(layer, layer.keys, layer.values)
        out = static_decode_sdpa(query, keys, values, mask, None)[0]
    return out


def held_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for lay in cache for t in (lay.keys, lay.values, *lay.scales))


def copy_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes/s of a plain tensor copy (read + write) on this machine, best of three."""
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def run(ctx: Context) -> list[dict]:
    lengths = ctx.size((1024, 4096), (4096, 16384))
    steps = ctx.size(5, 20)
    dtype = torch.bfloat16
    bandwidth = copy_bandwidth()
    rows = []
    for entries in lengths:
        caches = {name: layers(make_storage(name), entries, dtype) for name in STORAGES}
        query = torch.randn(1, SHAPE["q_heads"], 1, SHAPE["head_dim"]).to(dtype)
        k, v = (torch.randn(1, SHAPE["kv_heads"], 1, SHAPE["head_dim"]).to(dtype) for _ in range(2))
        times: dict[str, list[float]] = {name: [] for name in STORAGES}
        with torch.inference_mode():
            for i in range(steps + 1):  # interleaved, so machine noise hits every storage alike
                for name in STORAGES:
                    t = time.perf_counter()
                    step(make_storage(name), caches[name], query, k, v, i % entries)
                    if i:  # the first round warms up
                        times[name].append(time.perf_counter() - t)
        base = statistics.median(times["none"])
        for name in STORAGES:
            ms = statistics.median(times[name]) * 1e3
            nbytes = held_bytes(caches[name])
            rows.append(
                {
                    "entries": entries,
                    "storage": name,
                    "step_ms": round(ms, 3),
                    "vs_bf16": round(ms / (base * 1e3), 2),
                    "dequant_ms": round(ms - base * 1e3, 3),
                    "kv_bytes": nbytes,
                    "floor_ms": round(nbytes / bandwidth * 1e3, 3),
                    "bandwidth_gb_s": round(bandwidth / 1e9, 2),
                    "steps": steps,
                }
            )
    return rows


def note(rows: list[dict]) -> str:
    return (
        "The cache's share of one decode step (every layer: write the token, dequantize every slot, attend; "
        "weights left out) on SmolLM2-135M's cache shape in bf16, per storage. `vs_bf16` is the step over "
        "the model dtype's; `dequant_ms` the difference; `kv_bytes` one sequence's cache as held (codes + "
        "scales) and `floor_ms` reading it once at the measured copy bandwidth. On CPU the fp8 read-back is "
        "an elementwise pass over the whole cache each step, so it costs time while it halves the bytes; a "
        "fused kernel (vLLM's) reads fp8 inside attention instead."
    )


MEASUREMENT = Measurement(
    "quantized", "quantized_decode.csv", "Quantized KV: dequantization per step", run, note
)
