"""Timing helpers shared by the measurements: prompts, device sync, timed calls, decode loops, caches filled
from one recorded prefill, interleaved rounds and peak RSS."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

import psutil
import torch

from evalkit.kv import Full, KVCache
from evalkit.kv.prefill import PrefillRecord, populate


def prompt_ids(tokenizer, length: int, seed: int = 0) -> torch.Tensor:
    """(1, length) token ids of a needle-in-a-haystack prompt, the question at the end."""
    from evalkit.demo import needle_sample

    text, _ = needle_sample(tokenizer, length + 200, seed)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    return ids[:, -length:]  # exactly `length` tokens


def sync(t: torch.Tensor) -> None:
    """Wait for queued GPU work, so wall times measure it (a no-op on CPU)."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


@torch.inference_mode()
def prefill_time(model, ids, cache) -> float:
    sync(ids)
    start = time.perf_counter()
    model(ids, cache=cache, logits_to_keep=1)
    sync(ids)
    return time.perf_counter() - start


class CallTimer:
    """Accumulates the wall time spent in `owner.attr` while the block runs (patched in, restored on exit).

    Used to time one part of a forward directly where end-to-end ratios carry +-5% machine noise."""

    def __init__(self, owner, attr: str):
        self.owner, self.attr, self.inner, self.total = owner, attr, getattr(owner, attr), 0.0

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = self.inner(*args, **kwargs)
            self.total += time.perf_counter() - start
            return out

        setattr(self.owner, self.attr, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.owner, self.attr, self.inner)


def compress_timer() -> CallTimer:
    """Compression at prefill (scoring the window, top-K, gathering into the static buffers)."""
    from evalkit.kv.cache import KVLayer

    return CallTimer(KVLayer, "compress")


def attention_timer() -> CallTimer:
    """Attention over the cache (sdpa): the part of a decode step that the cache size drives."""
    from evalkit.kv import attention

    return CallTimer(attention, "sdpa_attention_forward")


@torch.inference_mode()
def decode_steps(model, cache, first_token, steps: int) -> list[float]:
    """Per-step wall times of `steps` greedy decode forwards on a filled cache; first_token (B, 1)."""
    token, times = first_token, []
    for _ in range(steps):
        sync(token)
        start = time.perf_counter()
        token = model(token, cache=cache).logits[:, -1:].argmax(-1)
        sync(token)
        times.append(time.perf_counter() - start)
    return times


def interleaved_steps(
    model, caches: list, firsts: list, steps: int, rounds: int, part=None
) -> tuple[list, list]:
    """Decode step times per cache, measured in interleaved rounds (each cache in turn, repeated) so that
    machine noise and drift hit every configuration alike; the first step of each round is a warm-up.

    Returns (step times per cache, mean seconds per step spent in `part` per cache): `part` makes a CallTimer
    (e.g. `attention_timer`; CPU only: on CUDA it would time kernel launches), None leaves those at 0."""
    times: list[list[float]] = [[] for _ in caches]
    spent, forwards = [0.0] * len(caches), [0] * len(caches)
    for _ in range(rounds):
        for i, (cache, first) in enumerate(zip(caches, firsts)):
            timer = part() if part else None
            with timer or contextlib.nullcontext():
                ts = decode_steps(model, cache, first, max(2, steps // rounds))
            times[i] += ts[1:]
            spent[i] += timer.total if timer else 0.0
            forwards[i] += len(ts)
    return times, [s / n for s, n in zip(spent, forwards)]


@torch.inference_mode()
def recorded_prefill(model, ids) -> tuple[PrefillRecord, torch.Tensor]:
    """One prefill whose record builds every method's cache (same keys, same selection); its first token."""
    record = PrefillRecord(window=32)
    cache = KVCache.for_model(Full(), model, record=record)
    logits = model(ids, cache=cache, logits_to_keep=1).logits
    return record, logits[:, -1:].argmax(-1)


@torch.inference_mode()
def filled_cache(method, model, record: PrefillRecord, ids) -> KVCache:
    """A `method` cache holding the prompt: built from the record, or by its own prefill where the record is
    not usable (MLA models, see PrefillRecord)."""
    cache = KVCache.for_model(method, model)
    if record.usable:
        populate(cache, record)
    else:
        model(ids, cache=cache, logits_to_keep=1)
    return cache


def label(method) -> str:
    name = method.describe()["name"]  # a ring's is its scorer's (expected_attention_ring)
    return name if name == "full" else f"{name}_{method.budget}"


def median_tok_s(step_times: list[float], batch: int = 1) -> float:
    """Decode tokens/s from the median step time: each step emits one token per batch row."""
    return batch / statistics.median(step_times)


class PeakRSS:
    """Peak resident memory of this process while the block runs (sampled every 5 ms)."""

    def __enter__(self):
        self.proc, self.peak, self.running = psutil.Process(), 0, True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
