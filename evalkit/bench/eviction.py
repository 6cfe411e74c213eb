"""Decode-time eviction: decode tokens/s of `h2o` and `snapkv_decode` beside `snapstream` at one budget after
4k-token prompts (`--only eviction_16k`: 16k, not in the default run), and what their scoring costs per step.

Per prompt, one recorded prefill (every query kept: h2o's prefill scores with all of them) fills each method's
cache, which goes into a one-row slot pool, the engine's decode path (eager forward). Steps run in interleaved
rounds, each config in turn, so machine noise hits all alike. Each decode-time method runs twice from the same
state: as it is, and with its scoring off (`evictor.scoring = False`: h2o adds no attention to its sums,
snapkv_decode stores no query and never re-selects), so `scoring_ms` = mean step with scoring - mean step
without: the per-step cost of the score update, snapkv_decode's re-selections amortised in (`refit_ms`: one
re-selection, timed directly). tok/s are from mean step times (re-selection steps included).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from evalkit.bench.base import Context, Measurement
from evalkit.bench.timing import filled_cache, label, prompt_ids, sync
from evalkit.kv import H2O, Full, KVCache, Ringed, SnapKVDecode, SnapStream, TOVADecode
from evalkit.kv.evict import RefitEvictor
from evalkit.kv.methods import RunFacts
from evalkit.kv.pool import SlotPool
from evalkit.kv.prefill import PrefillRecord
from evalkit.kv.scorers import ExpectedAttentionScore

ALL_QUERIES = 1 << 30  # a record window that keeps every prompt query (h2o's prefill score)


def methods(model, budget: int) -> list:
    """snapstream, h2o, snapkv_decode, tova_decode and expected_attention_ring at `budget`, less those the
    model refuses (snapkv_decode re-scores cached keys: not on MLA)."""
    mla = hasattr(model.config.get_text_config(), "kv_lora_rank")
    facts = RunFacts(model_name=model.config.name_or_path, mla=mla, followup=False, compile=False, tp=1)
    # the conf's window (32) where the budget allows it; small smoke budgets scale it down to fit
    every = [
        SnapStream(budget=budget),
        H2O(budget=budget),
        SnapKVDecode(budget=budget, window=min(32, budget // 8)),
        TOVADecode(budget=budget),
        Ringed(budget=budget, scorer=ExpectedAttentionScore()),  # snapstream's step: its cost is at prefill
    ]
    return [m for m in every if m.refusal(facts) is None]


@torch.inference_mode()
def pools(method, model, record: PrefillRecord, ids) -> list[SlotPool]:
    """One-row pools holding `method`'s compressed prompt: [as it is] plus, for a method whose evictor scores
    while decoding, [scoring off] from the same state."""
    cache = filled_cache(method, model, record, ids)
    out = []
    for scoring in (True, False):
        pool = SlotPool.shaped_like(cache, 1, method.budget)
        pool.load_row(0, cache)
        pool.evictor.scoring = scoring
        out.append(pool)
        if not pool.observing:  # nothing to switch off
            break
    return out


@torch.inference_mode()
def pool_steps(model, pool: SlotPool, token, steps: int) -> tuple[list[float], torch.Tensor]:
    """Wall time of each of `steps` greedy decode steps on a one-row pool (re-selections included)."""
    times = []
    for _ in range(steps):
        sync(token)
        start = time.perf_counter()
        position = pool.rows.next_pos.clone()[:, None]
        token = model(input_ids=token, position_ids=position, cache=pool).logits[:, -1:].argmax(-1)
        pool.decoded([0])
        sync(token)
        times.append(time.perf_counter() - start)
    return times, token


def eviction_speed(model, ids, budget: int, steps: int, rounds: int = 4) -> list[dict]:
    """Rows per method: decode tok/s with and without the score update, its cost per step, the
    re-selections."""
    with torch.inference_mode():  # one prefill; its record (every query kept) fills each method's cache
        record = PrefillRecord(window=ALL_QUERIES)
        cache = KVCache.for_model(Full(), model, record=record)
        first = model(ids, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        del cache
    runs = []  # [method, scoring, pool, token]
    for method in methods(model, budget):
        runs += [[method, p.evictor.scoring, p, first] for p in pools(method, model, record, ids)]
    del record
    times = {(label(m), s): [] for m, s, _, _ in runs}
    refit = RefitTimer()
    for _ in range(rounds):
        for run in runs:
            method, scoring, pool, token = run
            with refit.timing(label(method) if scoring else None):
                ts, run[3] = pool_steps(model, pool, token, max(2, steps // rounds) + 1)
            times[(label(method), scoring)] += ts[1:]  # the first step of a round warms up
    return [_row(ids.shape[1], m, times, refit) for m, scoring, _, _ in runs if scoring]


class RefitTimer:
    """Wall time and count of snapkv_decode's re-selections (`evalkit.kv.evict.RefitEvictor.refit`) per
    config."""

    def __init__(self):
        self.spent: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextlib.contextmanager
    def timing(self, name: str | None):
        inner = RefitEvictor.refit

        def timed(evictor, pool, r):
            sync(pool.rows.valid)
            start = time.perf_counter()
            inner(evictor, pool, r)
            sync(pool.rows.valid)
            if name is not None:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1

        RefitEvictor.refit = timed
        try:
            yield
        finally:
            RefitEvictor.refit = inner


def _row(prompt: int, method, times: dict, refit: RefitTimer) -> dict:
    key = label(method)
    on = statistics.mean(times[(key, True)])
    off = statistics.mean(times.get((key, False)) or times[(key, True)])
    spent, calls = refit.spent.get(key, 0.0), refit.calls.get(key, 0)
    row = {
        "prompt_tokens": prompt,
        "config": label(method),
        "decode_tok_s": round(1 / on, 2),
        "no_scoring_tok_s": round(1 / off, 2),
        "step_ms": round(on * 1e3, 3),
        "scoring_ms": round((on - off) * 1e3, 3),
        "scoring_pct": round(100 * (on - off) / off, 2),
        "refits": calls,
        "refit_ms": round(spent / calls * 1e3, 3) if calls else 0.0,
        "steps": len(times[(key, True)]),
    }
    print(f"eviction {prompt} {row['config']}: {row['decode_tok_s']} tok/s, scoring {row['scoring_ms']} ms")
    return row


def run_at(lengths_quick: list[int], lengths: list[int]):
    def run(ctx: Context) -> list[dict]:
        budget = ctx.size(128, 512)
        steps = ctx.size(48, 320)  # > 2 intervals of snapkv_decode (budget // 4): re-selections included
        return [
            row
            for n in ctx.size(lengths_quick, lengths)
            for row in eviction_speed(ctx.model, prompt_ids(ctx.tokenizer, n), budget, steps)
        ]

    return run


def note(rows: list[dict]) -> str:
    return (
        "Decode-time eviction beside SnapStream's ring at the same budget (eager, one row). `scoring_ms`: "
        "the mean step with the method's scoring minus without it (h2o: one more pass of the query over the "
        "budget's keys each step; snapkv_decode: its query stored each step and a re-selection every "
        "`interval` steps, `refit_ms` each; tova_decode: the step's attention over the slots, averaged over "
        "all heads, for the next eviction; expected_attention_ring decodes as snapstream, its scoring is at "
        "prefill); `decode_tok_s` counts every step, re-selections included. A cost below the machine's "
        "noise (a few % of a step on a shared CPU) can come out negative."
    )


MEASUREMENT = Measurement(
    "eviction", "eviction_speed.csv", "Decode-time eviction", run_at([1024], [4096]), note
)
MEASUREMENT_16K = Measurement(
    "eviction_16k", "eviction_speed_16k.csv", "Decode-time eviction at 16k", run_at([2048], [16384]), note
)
