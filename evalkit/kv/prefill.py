"""One prefill for many budgets: record what a prefill hands the cache, then build other methods' caches from
it.

A budget sweep of one method runs the same prompts B times, and the prefill (full attention over the whole
prompt) is identical in every run: only the compression after it and the decode differ. So the first run
records, per layer, the full K/V and the last `window` post-RoPE queries (a method whose score is
budget-free and reads every query, h2o, records that score per entry instead), plus the prefill's
last-position logits; the other budgets' caches are compressed from that record by the same code
path (`KVLayer.compress`) while the model's prefill forward is skipped. Decoding then proceeds as usual, so
results are identical to separate runs by construction (tests/kv/test_shared_prefill.py checks it).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast


@dataclass
class PrefillRecord:
    """Holds one full-cache copy of the prompt's K/V per layer (plus `window` queries) until the batch ends.

    Models whose attention reads keys expanded from the cache (MLA: DeepSeek-V3's per-head keys are rebuilt
    from the latent) are not recorded, because keeping the expanded keys would cost more than re-running the
    prefill (~390 GB for R1 at 128k); those budgets then prefill separately (`usable` is False)."""

    window: int  # queries kept per layer: the largest observation window of the methods that will replay
    layers: dict[int, tuple] = field(default_factory=dict)  # idx -> (keys, values, queries, scaling)
    mask: torch.Tensor | None = None  # the prefill attention mask (None: no padding)
    logits: torch.Tensor | None = None  # (B, 1, V) last-position logits of the prefill forward
    usable: bool = True
    # idx -> (B, H, T) budget-free scores per prompt entry: a pass before compression computed them (KVzip's
    # reconstruction), or the recording prefill's own (h2o's attention sums, `KVMethod.records_score`)
    hints: dict[int, torch.Tensor] = field(default_factory=dict)
    hinted_by: str | None = None  # `KVMethod.score_key` of the method whose scores `hints` are

    def keep_scores(self, method, hints: dict[int, torch.Tensor]) -> None:
        """Keep `method`'s budget-free scores per layer, for the methods that score alike to replay; another
        method's scores held before are dropped (a record holds one method's scores, never a mix)."""
        key = method.score_key()
        if key != self.hinted_by:
            self.hints, self.hinted_by = {}, key
        self.hints.update(hints)

    def hints_for(self, method) -> dict[int, torch.Tensor]:
        """The recorded scores `method` may replay: only those of a method that scores as it does (another
        method's, e.g. KVzip's reconstruction scores replayed by expected_attention, would be its choice)."""
        return self.hints if self.hinted_by == method.score_key() else {}

    def nbytes(self) -> int:
        """Bytes the record holds (K/V, kept queries, hints, logits): what a budget list keeps per prompt."""
        tensors = [t for keys, values, queries, _ in self.layers.values() for t in (keys, values, queries)]
        tensors += [*self.hints.values(), *([self.logits] if self.logits is not None else [])]
        return sum(t.numel() * t.element_size() for t in tensors)

    def add(self, layer_idx, keys, values, query, attn_keys, attention_mask, scaling) -> None:
        if attn_keys is not keys or not self.usable:
            self.usable, self.layers = False, {}
            return
        self.layers[layer_idx] = (keys, values, query[:, :, -self.window :].clone(), scaling)
        self.mask = attention_mask


def populate(cache, record: PrefillRecord) -> None:
    """Fill an empty KVCache from a record, exactly as its own prefill would have."""
    if not record.usable:
        raise ValueError("this prefill record is not usable (an MLA model's): prefill the cache itself")
    window = getattr(cache.method, "window", 0)  # the queries this method scores the prompt with
    if window > record.window:
        raise ValueError(
            f"{cache.method.name}: window={window} scores the prompt with its last {window} queries, but "
            f"this prefill record holds {record.window}: record with PrefillRecord(window=...) at least the "
            "largest window of the methods that replay it"
        )
    hints = record.hints_for(cache.method)
    for idx, layer in enumerate(cache.layers):
        keys, values, queries, scaling = record.layers[idx]
        if cache.method.records_score and idx not in hints and queries.shape[2] < keys.shape[2]:
            raise ValueError(
                f"{cache.method.name} scores the prompt with every query: replay a record of its own prefill "
                "(which keeps that score) or one that kept every query"
            )
        layer.lazy_initialization(keys, values)
        layer.pending = (keys, values)
        layer.compress(queries, keys, record.mask, scaling, hint=hints.get(idx))


@contextmanager
def shared_prefill(model, tokenizer=None):
    """Within this block, a KVCache with `record` keeps its prefill's logits, and one with `replay` skips the
    prefill forward: its cache is populated from the record and the recorded logits are returned. Otherwise
    the cache's method runs the prefill (`KVMethod.prefill`: the forward itself, or KVzip's passes, which
    need the `tokenizer`)."""
    original = model.forward
    own = model.__dict__.get("forward")  # an instance-level forward (accelerate's device hooks) to restore

    @functools.wraps(original)
    def forward(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        replay = getattr(cache, "replay", None)
        if replay is not None and cache.rows is None:
            populate(cache, replay)
            return CausalLMOutputWithPast(logits=replay.logits, cache=cache)
        method = getattr(cache, "method", None)
        if method is None or args or cache.rows is not None:  # not an evalkit prefill: the plain forward
            out = original(*args, **kwargs)
        else:
            out = method.prefill(original, cache, tokenizer, kwargs)
        record = getattr(cache, "record", None)
        if record is not None and record.logits is None:
            record.logits = out.logits[:, -1:].clone()
        return out

    model.forward = forward
    try:
        yield
    finally:
        if own is None:
            del model.forward  # back to the class's forward
        else:
            model.forward = own
