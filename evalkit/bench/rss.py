"""Peak and live RSS per configuration, each measured in a fresh process (`--memory-child LENGTH:BUDGET`).

A fresh process per configuration, because a process's peak RSS never goes down: measured in one process,
every configuration would report the largest one's peak.
"""

from __future__ import annotations

import ctypes
import json
import resource
import subprocess
import sys

import psutil
import torch

from evalkit.bench.base import MIB, Context, Measurement
from evalkit.bench.timing import PeakRSS, decode_steps, label, prompt_ids
from evalkit.kv import Full, KVCache, SnapStream


@torch.inference_mode()
def memory_child(length: int, budget: int) -> dict:
    """In this (fresh) process: load, prefill `length` tokens into one method's cache (budget 0 = full),
    decode 16 steps; resident memory at each stage."""
    from evalkit.config import model_spec
    from evalkit.loading import load_model

    model, tok = load_model(model_spec("smollm2_135m"))
    proc = psutil.Process()
    trim = ctypes.CDLL("libc.so.6").malloc_trim  # hands freed heap back to the OS: RSS then counts live data
    model(torch.ones(1, 8, dtype=torch.long))  # touch every weight page (safetensors loads lazily)
    trim(0)
    loaded = proc.memory_info().rss
    method = Full() if budget == 0 else SnapStream(budget=budget)
    cache = KVCache.for_model(method, model)
    ids = prompt_ids(tok, length)
    with PeakRSS() as pre:
        first = model(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    trim(0)  # the prefill's activations are freed: what stays is weights + cache
    settled = proc.memory_info().rss
    with PeakRSS() as dec:
        decode_steps(model, cache, first, 16)
    stats = cache.stats()
    return {
        "prompt_tokens": length,
        "config": label(method),
        "rss_model_warm_mib": round(loaded / MIB, 1),
        "peak_rss_prefill_mib": round(pre.peak / MIB, 1),
        "rss_live_after_prefill_mib": round(settled / MIB, 1),
        "peak_rss_decode_mib": round(dec.peak / MIB, 1),
        "peak_rss_process_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "cache_bytes": stats["bytes"],
        "cache_reserved_bytes": stats["reserved_bytes"],
        "cache_slots": stats["slots"],
        "live_minus_model_mib": round((settled - loaded) / MIB, 1),
    }


def bench_memory(lengths, budgets) -> list[dict]:
    """`memory_child` for every length x (full, budgets), each in its own process."""
    rows = []
    for n in lengths:
        for b in [0, *budgets]:
            cmd = [sys.executable, "-m", "evalkit.bench", "--memory-child", f"{n}:{b}"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"memory run {n}:{b} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(
                f"memory {n} {r['config']}: prefill peak {r['peak_rss_prefill_mib']} MiB, "
                f"decode peak {r['peak_rss_decode_mib']} MiB, cache {r['cache_bytes'] / MIB:.1f} MiB",
                flush=True,
            )
    return rows


def run(ctx: Context) -> list[dict]:
    return bench_memory(ctx.size([1024], [2048, 4096, 8192, 16384]), [256, 512, 1024])


def note(rows: list[dict]) -> str:
    return (
        "Each configuration in its own process (model loaded, one prefill, 16 decode steps). Resident "
        "memory: the model after one tiny forward (all weight pages touched), the peak during prefill (with "
        "the activations of one full-length forward), live after prefill (freed activations handed back with "
        "malloc_trim: weights + cache), the peak during decode. `live_minus_model_mib` is what the cache "
        "costs in RSS; compare it with `cache_reserved_bytes`."
    )


MEASUREMENT = Measurement("memory", "memory.csv", "Peak RSS and cache bytes", run, note)
