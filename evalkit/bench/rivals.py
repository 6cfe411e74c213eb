"""Every method beside SnapStream at one budget after a 4k-token prompt (issue 33): what its prefill costs and
how fast it then decodes.

Per method, its own prefill as a run does it (`KVMethod.prefill` under `shared_prefill`: the forward, which
compresses as attention hands each layer its queries, plus KVzip's reconstruction passes), timed end to end
(`prefill_s`, beside the full cache's own prefill of the same prompt run just before it,
`full_prefill_s`, and `prefill_pct`: the method's over that one) and its
compression timed directly (`compress_ms`: scoring + top-K + gather, every layer). The prefilled one-row
cache then goes into a one-row slot pool, the engine's decode path (eager forward), and decodes greedily in
interleaved rounds with every other method, so machine noise hits all alike (`decode_tok_s` from the mean
step, a decode-time method's scoring and re-selections included; `vs_snapstream`: its tok/s over
SnapStream's).
An append method (snapkv and the prefill scorers) holds its budget plus the tokens it decodes; a ring method
and a decode-time evictor hold the budget.
"""

from __future__ import annotations

import statistics
import time

import torch

from evalkit.bench.base import Context, Measurement
from evalkit.bench.eviction import pool_steps
from evalkit.bench.timing import compress_timer, label, prompt_ids, sync
from evalkit.kv import (
    H2O,
    TOVA,
    AdaKV,
    ExpectedAttention,
    Full,
    KeyDiff,
    KNorm,
    KVCache,
    KVzip,
    PyramidKV,
    Ringed,
    SnapKV,
    SnapKVDecode,
    SnapStream,
    StreamingLLM,
    TOVADecode,
)
from evalkit.kv.methods import RunFacts
from evalkit.kv.pool import SlotPool
from evalkit.kv.prefill import shared_prefill
from evalkit.kv.scorers import ExpectedAttentionScore, ReconstructionScore


def methods(model, budget: int) -> list:
    """Every method of conf/method at `budget` (SnapStream first), less those the model refuses."""
    mla = hasattr(model.config.get_text_config(), "kv_lora_rank")
    facts = RunFacts(model_name=model.config.name_or_path, mla=mla, followup=False, compile=False, tp=1)
    window = min(32, budget // 8)  # the confs' window where the budget allows it (small smoke budgets)
    every = [
        SnapStream(budget=budget),
        StreamingLLM(budget=budget),
        SnapKV(budget=budget, window=window),
        KNorm(budget=budget),
        KeyDiff(budget=budget),
        TOVA(budget=budget),
        ExpectedAttention(budget=budget),
        KVzip(budget=budget),
        Ringed(budget=budget, scorer=ExpectedAttentionScore()),
        Ringed(budget=budget, scorer=ReconstructionScore(4, 2048)),
        AdaKV(budget=budget, inner=SnapKV(window=window)),
        AdaKV(budget=budget, inner=ExpectedAttention()),
        PyramidKV(budget=budget, inner=SnapKV(window=window)),
        H2O(budget=budget),
        SnapKVDecode(budget=budget, window=window),
        TOVADecode(budget=budget),
    ]
    return [m for m in every if m.refusal(facts) is None]


@torch.inference_mode()
def prefilled(method, model, tokenizer, ids, max_new: int) -> tuple[KVCache, torch.Tensor, float, float]:
    """`method`'s one-row cache after its own prefill, the first token, the prefill's wall time and the
    compression's (both seconds)."""
    cache = KVCache.for_model(method, model, max_new_tokens=max_new)
    sync(ids)
    with compress_timer() as timer, shared_prefill(model, tokenizer):
        start = time.perf_counter()
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, logits_to_keep=1)
        sync(out.logits)
        spent = time.perf_counter() - start
    return cache, out.logits[:, -1:].argmax(-1), spent, timer.total


def rivals_speed(model, tokenizer, ids, budget: int, steps: int, rounds: int = 4) -> list[dict]:
    """One row per method: prefill and compression time, decode tok/s from one-row pools (interleaved)."""
    per_round = max(2, steps // rounds)
    prefilled(Full(), model, tokenizer, ids, 1)  # warms up: a first forward pays one-off costs
    runs = []  # [method, pool, token, prefill_s, compress_s, full_s]
    for method in methods(model, budget):
        full_s = prefilled(Full(), model, tokenizer, ids, 1)[2]  # paired: the load drifts on a shared CPU
        cache, first, prefill_s, compress_s = prefilled(method, model, tokenizer, ids, steps + rounds)
        pool = SlotPool.shaped_like(cache, 1, cache.rows.n + (0 if method.ring else steps + rounds))
        pool.load_row(0, cache)
        runs.append([method, pool, first, prefill_s, compress_s, full_s])
        del cache
    times = {label(r[0]): [] for r in runs}
    for _ in range(rounds):
        for run in runs:
            ts, run[2] = pool_steps(model, run[1], run[2], per_round + 1)
            times[label(run[0])] += ts[1:]  # the first step of a round warms up
    snap = statistics.mean(times[label(runs[0][0])])
    return [_row(ids.shape[1], m, times[label(m)], snap, p, c, f) for m, _, _, p, c, f in runs]


def _row(prompt: int, method, times: list, snap: float, prefill_s: float, compress_s: float, full_s: float):
    step = statistics.mean(times)
    row = {
        "prompt_tokens": prompt,
        "config": label(method),
        "kind": _kind(method),
        "prefill_s": round(prefill_s, 3),
        "full_prefill_s": round(full_s, 3),
        "prefill_pct": round(100 * prefill_s / full_s, 1),
        "compress_ms": round(1e3 * compress_s, 1),
        "decode_tok_s": round(1 / step, 2),
        "step_ms": round(1e3 * step, 3),
        "vs_snapstream": round(snap / step, 3),
        "steps": len(times),
    }
    print(
        f"rivals {prompt} {row['config']}: prefill {row['prefill_s']} s ({row['prefill_pct']}% of full), "
        f"compress {row['compress_ms']} ms, decode {row['decode_tok_s']} tok/s",
        flush=True,
    )
    return row


def _kind(method) -> str:
    """What its cost is: a fixed ring, a decode-time evictor, or an appending prefill selection."""
    if method.evictor.observes or method.evictor.chooses_slots:
        return "decode-time"
    return "ring" if method.ring else "prefill"


def run(ctx: Context) -> list[dict]:
    n, budget, steps = ctx.size(1024, 4096), ctx.size(128, 512), ctx.size(16, 64)
    return rivals_speed(ctx.model, ctx.tokenizer, prompt_ids(ctx.tokenizer, n), budget, steps)


def note(rows: list[dict]) -> str:
    return " ".join(
        [
            "Every method beside SnapStream at one budget (eager, one row).",
            "`prefill_s`: the method's own prefill end to end (KVzip's reconstruction passes included);",
            "`prefill_pct`: that over the full cache's prefill of the same prompt run just before it",
            "(`full_prefill_s`: paired, as the load drifts on a shared CPU);",
            "`compress_ms`: scoring + top-K + gather over every layer, timed directly;",
            "`decode_tok_s`: the mean step over interleaved rounds in a one-row slot pool (a decode-time",
            "method's scoring and re-selections included); `vs_snapstream`: its speed over SnapStream's.",
            "Append methods (kind `prefill`) grow by one slot per token; ring and decode-time methods hold",
            "the budget.",
        ]
    )


MEASUREMENT = Measurement(
    "rivals", "rivals_speed.csv", "Every method at 4k: prefill cost and decode", run, note
)
