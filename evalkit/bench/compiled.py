"""Compiled vs eager decode: tokens/s of the full cache and SnapStream 512 after 2k-16k-token prompts, eager
(the default cache) against the static cache through transformers' compiled forward (`evalkit.kv.generate`'s
`compile=True` path: `StaticKVCache` + `compile_config`), with the roofline of each step.

Per prompt, one recorded prefill fills every cache (same keys, same selection). Per method:
- the compiled forward is compiled once on a throwaway cache of the same shape (`compile_s`). Dynamo is reset
  first, so it is this shape's first compilation in the process; inductor's on-disk cache may still serve it
  (`compile_cache_hit`), as it would in a second run of evalkit;
- decode steps run in interleaved rounds (each mode in turn, the first step of a round a warm-up) so machine
  noise hits every mode alike; medians are reported, and the greedy tokens each mode produced are compared
  (`tokens_equal`: every mode's tokens equal eager's over every step);
- flatness: the median step of the last quarter of the timed steps over the first quarter's (1 = flat);
- after the rounds, a few compiled steps run under torch.profiler (CPU): the shares of the compiled step spent
  in matmuls and in attention, the aten kernels a compiled step calls just as eager does, and `ceiling_x`, the
  speedup over eager of a compiled step made of those kernels alone: what compilation leaves as it is bounds
  what it can give.
`static` (the static cache, eager forward: what compilation starts from) is a third mode that
scripts/compile_bench.py and scripts/gpu_bench.py also measure.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from evalkit.bench.base import Context, Measurement
from evalkit.bench.roofline import Bandwidth, floor_columns, roofline_note, weight_bytes
from evalkit.bench.timing import label, prompt_ids, recorded_prefill, sync
from evalkit.kv import Full, KVCache, SnapStream, StaticKVCache
from evalkit.kv.generate import compile_config
from evalkit.kv.prefill import PrefillRecord, populate

MODES = ("eager", "compiled")  # the bench's; the scripts add "static"
ALL_MODES = ("eager", "static", "compiled")
MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
ATTENTION = "scaled_dot_product"  # in the name of every sdpa kernel (flash, math, efficient, cudnn)
PROFILED_STEPS = 3
# the target: compiled SnapStream-512 >= 1.5x eager tok/s at 4k, its step within 2x of the memory
# floor
TARGET = {"config": "snapstream_512", "prompt_tokens": 4096, "speedup": 1.5, "pct_of_floor": 200.0}


@dataclass
class Decode:
    """What one (method, prompt) measurement gives: per mode the step times (decode order, warm-ups dropped),
    the greedy tokens of every step and the KV bytes a step reads; the compilation; the compiled step's shares
    in matmuls and attention (None off CPU)."""

    times: dict[str, list[float]]
    tokens: dict[str, list[int]]
    kv_read: dict[str, float]
    compile_s: float
    cache_hit: bool
    graphs: int  # graphs dynamo compiled from the reset to the end of the rounds: 1 = no recompilation
    shares: dict[str, float] | None


@torch.inference_mode()
def mode_cache(mode: str, method, model, record: PrefillRecord, ids, new_tokens: int) -> KVCache:
    """A cache holding the prompt for `mode`: the default one for eager, the static one (append methods sized
    to prompt + `new_tokens`) otherwise; built from the record, or by its own prefill (MLA models)."""
    kind = KVCache if mode == "eager" else StaticKVCache
    cache = kind.for_model(method, model, max_new_tokens=new_tokens)
    if record.usable:
        populate(cache, record)
    else:
        model(ids, cache=cache, logits_to_keep=1)
    return cache


@torch.inference_mode()
def timed_steps(forward, cache, token, steps: int) -> tuple[list[float], torch.Tensor, list[int]]:
    """Per-step wall times of `steps` greedy decode forwards; token (1, 1); the last token and every token."""
    times, tokens = [], []
    for _ in range(steps):
        sync(token)
        start = time.perf_counter()
        token = forward(input_ids=token, cache=cache).logits[:, -1:].argmax(-1)
        sync(token)
        times.append(time.perf_counter() - start)
        tokens.append(int(token[0, 0]))
    return times, token, tokens


@torch.inference_mode()  # compiled for inference: the graph must be traced in the mode it runs in
def compile_once(model, cache, first, backend: str) -> tuple:
    """(the compiled forward, seconds its first call took, whether inductor's on-disk cache served it)."""
    torch._dynamo.reset()
    hits = counters["inductor"]["fxgraph_cache_hit"]
    compiled = model.get_compiled_call(compile_config(model, backend=backend))
    sync(first)
    start = time.perf_counter()
    compiled(input_ids=first, cache=cache)
    sync(first)
    return compiled, time.perf_counter() - start, counters["inductor"]["fxgraph_cache_hit"] > hits


def kernel_shares(forward, cache, token, steps: int) -> dict[str, float] | None:
    """Shares of the self CPU time of `steps` decode steps spent in matmuls and in attention. CPU only: on
    CUDA the profiler's CPU side would time kernel launches, not the kernels."""
    if token.is_cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_steps(forward, cache, token, steps)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)

    def share(pick) -> float:
        return sum(e.self_cpu_time_total for e in events if pick(e.key)) / total

    return {"matmul": share(MATMULS.__contains__), "attention": share(lambda name: ATTENTION in name)}


@torch.inference_mode()
def measure(model, ids, record, first, method, steps: int, rounds: int, backend: str, modes) -> Decode:
    """Every mode of `method` decoding from the recorded prefill `record` of `ids` (1, T), first token (1,
    1)."""
    per_round = max(2, steps // rounds)
    new_tokens = (
        1 + rounds * per_round + PROFILED_STEPS
    )  # every forward a cache sees (a static append is sized to it)
    caches = {mode: mode_cache(mode, method, model, record, ids, new_tokens) for mode in modes}
    warm = mode_cache("compiled", method, model, record, ids, new_tokens)  # throwaway: same shape
    graphs = counters["stats"]["unique_graphs"]  # dynamo's reset keeps its counters: count the difference
    compiled, compile_s, hit = compile_once(model, warm, first, backend)
    del warm
    forwards = {"eager": model.__call__, "static": model.__call__, "compiled": compiled}
    before = caches["eager"].stats()["bytes"]
    times, tokens, token = {m: [] for m in modes}, {m: [] for m in modes}, dict.fromkeys(modes, first)
    for _ in range(rounds):
        for mode in modes:
            ts, token[mode], toks = timed_steps(forwards[mode], caches[mode], token[mode], per_round)
            times[mode] += ts[1:]  # the first step of a round warms the caches back up
            tokens[mode] += toks
    graphs = counters["stats"]["unique_graphs"] - graphs
    # the default full cache grows a slot per step (read: the mean of its sizes); a static cache reads all its
    # slots
    eager = (before + caches["eager"].stats()["bytes"]) / 2
    kv_read = {m: eager if m == "eager" else caches[m].stats()["reserved_bytes"] for m in modes}
    shares = kernel_shares(compiled, caches["compiled"], token["compiled"], PROFILED_STEPS)
    return Decode(times, tokens, kv_read, compile_s, hit, graphs, shares)


def quarters(times: list[float]) -> tuple[float, float]:
    """Median step time of the first and of the last quarter of `times` (at least one step each)."""
    q = max(1, len(times) // 4)
    return statistics.median(times[:q]), statistics.median(times[-q:])


def mode_columns(mode: str, times: list[float], weights: int, kv_read: float, bandwidth: float) -> dict:
    """One mode's columns: tok/s (median step), its roofline, its flatness (last quarter / first quarter)."""
    step = statistics.median(times)
    roof = floor_columns(step, weights, kv_read, bandwidth)
    first, last = quarters(times)
    return {
        f"{mode}_tok_s": round(1 / step, 2),
        f"{mode}_step_ms": roof["step_ms"],
        f"{mode}_kv_read_bytes": roof["kv_read_bytes"],
        f"{mode}_floor_ms": roof["floor_ms"],
        f"{mode}_pct_of_floor": roof["step_pct_of_floor"],
        f"{mode}_first_q_ms": round(1e3 * first, 3),
        f"{mode}_last_q_ms": round(1e3 * last, 3),
        f"{mode}_flatness": round(last / first, 3),
    }


def row_for(prompt: int, method, res: Decode, weights: int, bandwidth: float) -> dict:
    """One row: every mode's columns, compiled over eager, the compilation, token agreement, the kernels'
    ceiling."""
    eager, compiled = (statistics.median(res.times[m]) for m in ("eager", "compiled"))
    shares = res.shares or {}
    kept = sum(shares.values())  # of the compiled step: what compilation leaves as it is
    row = {
        "prompt_tokens": prompt,
        "config": label(method),
        "speedup": round(eager / compiled, 3),
        "tokens_equal": all(res.tokens[m] == res.tokens["eager"] for m in res.tokens),
        "compile_s": round(res.compile_s, 2),
        "compile_cache_hit": res.cache_hit,
        "graphs": res.graphs,
        "steps": len(res.times["compiled"]),
        "weight_bytes": weights,
        "bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "compiled_matmul_pct": round(100 * shares["matmul"], 1) if shares else None,
        "compiled_attention_pct": round(100 * shares["attention"], 1) if shares else None,
        "ceiling_x": round(eager / (kept * compiled), 2) if kept else None,
    }
    for mode, times in res.times.items():
        row |= mode_columns(mode, times, weights, res.kv_read[mode], bandwidth)
    return row


def compiled_decode(
    model,
    ids,
    methods,
    steps: int = 64,
    rounds: int = 4,
    backend: str = "inductor",
    copy_bytes: int = 2**30,
    modes=MODES,
) -> list[dict]:
    """One row per method: `modes` of its decode after the prompt `ids` (1, T), from one shared prefill; the
    copy bandwidth is sampled before and after, so the roofline is this run's machine state."""
    if steps < 1 or rounds < 1:
        raise ValueError(f"compiled decode needs steps >= 1 and rounds >= 1, got {steps}, {rounds}")
    if not {"eager", "compiled"} <= set(modes) <= set(ALL_MODES):
        raise ValueError(f"modes must include eager and compiled, from {ALL_MODES}; got {modes}")
    record, first = recorded_prefill(model, ids)
    bandwidth = Bandwidth(ids.device, copy_bytes, reps=3)
    bandwidth.sample()
    results = [measure(model, ids, record, first, m, steps, rounds, backend, modes) for m in methods]
    del record
    bandwidth.sample()
    rows = [
        row_for(ids.shape[1], m, res, weight_bytes(model), bandwidth.median)
        for m, res in zip(methods, results)
    ]
    for r in rows:
        print(
            f"compiled {r['prompt_tokens']} {r['config']}: eager {r['eager_tok_s']} tok/s, compiled "
            f"{r['compiled_tok_s']} tok/s ({r['speedup']}x, compile {r['compile_s']} s, tokens equal: "
            f"{r['tokens_equal']})",
            flush=True,
        )
    return rows


def run(ctx: Context) -> list[dict]:
    lengths = ctx.size([1024], [2048, 4096, 8192, 16384])
    methods = [SnapStream(budget=512), Full()]
    steps, rounds, copy_bytes = ctx.size(12, 96), ctx.size(2, 6), ctx.size(2**28, 2**30)
    return [
        row
        for n in lengths
        for row in compiled_decode(
            ctx.model, prompt_ids(ctx.tokenizer, n), methods, steps, rounds, copy_bytes=copy_bytes
        )
    ]


# --- summary.md -------------------------------------------------------------------------------------------


def target_line(rows: list[dict]) -> str:
    """The target, read off this run's rows: reached or not, with the measured figures and why."""
    want = (
        f"compiled {TARGET['config']} decode >= {TARGET['speedup']}x eager tok/s at "
        f"{TARGET['prompt_tokens']} prompt tokens, its step within {TARGET['pct_of_floor'] / 100:g}x of the "
        "memory floor"
    )
    row = next(
        (
            r
            for r in rows
            if r["config"] == TARGET["config"] and r["prompt_tokens"] == TARGET["prompt_tokens"]
        ),
        None,
    )
    if row is None:
        return f"Target ({want}): not measured by this run (no such row; --quick measures 1024 tokens only)."
    fast = row["speedup"] >= TARGET["speedup"]
    near = row["compiled_pct_of_floor"] <= TARGET["pct_of_floor"]
    text = (
        f"Target ({want}): measured {row['speedup']}x ({'reached' if fast else 'NOT reached'}); the compiled "
        f"step is at {row['compiled_pct_of_floor']}% of the floor ({'reached' if near else 'NOT reached'})."
    )
    if not fast and row["compiled_matmul_pct"] is not None:
        mm, attn = row["compiled_matmul_pct"], row["compiled_attention_pct"]
        text += (
            f" Why: the eager step is already at {row['eager_pct_of_floor']}% of the floor. In the compiled "
            f"step, matmuls (the weights, streamed once per step) take {mm}% and attention {attn}% "
            "(torch.profiler, this run): kernels a compiled step calls just as eager does. Compilation can "
            f"only shrink the other {round(100 - mm - attn, 1)}% (norms, RoPE, masks, dispatch, fused into "
            "fewer kernels), so even a compiled step of matmuls and attention alone would be "
            f"{row['ceiling_x']}x eager."
        )
    return text


def note(rows: list[dict]) -> str:
    differ = [f"{r['config']} at {r['prompt_tokens']}" for r in rows if not r["tokens_equal"]]
    return " ".join(
        [
            "Eager: the default cache, eager forward. Compiled: the static cache through transformers' "
            "compiled forward (`evalkit.kv.generate(compile=True)`; inductor, one graph per (batch, slots) "
            "shape). Steps in interleaved rounds, medians. `compile_s`: the first compiled call (dynamo "
            "reset before each row; `compile_cache_hit`: inductor's on-disk cache served it); `graphs`: "
            "graphs compiled for the row (1 = no recompilation while timed). `*_flatness`: median step of "
            "the last quarter of the steps / the first quarter's. `compiled_matmul_pct`, "
            "`compiled_attention_pct`: shares of the compiled step (torch.profiler, self CPU time); "
            "`ceiling_x`: eager step / the compiled step's time in those two. On a shared machine use "
            "--threads 1: inductor's OpenMP kernels stall when another process takes a core.",
            target_line(rows),
            "Tokens: compiled equals eager in every row."
            if not differ
            else f"Tokens DIFFER from eager in: {', '.join(differ)}.",
            roofline_note() + " A static cache reads all its slots every step (masked ones included).",
        ]
    )


TABLE = [
    "config",
    "prompt_tokens",
    "eager_tok_s",
    "compiled_tok_s",
    "speedup",
    "compile_s",
    "tokens_equal",
    "graphs",
    "eager_pct_of_floor",
    "compiled_pct_of_floor",
    "compiled_floor_ms",
    "eager_flatness",
    "compiled_flatness",
    "compiled_matmul_pct",
    "compiled_attention_pct",
    "ceiling_x",
]


def table(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in TABLE} for r in rows]


MEASUREMENT = Measurement("compiled", "compiled_decode.csv", "Compiled vs eager decode", run, note, table)
