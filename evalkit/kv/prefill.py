"""One prefill for many budgets: record what a prefill hands the cache, then build other methods' caches from it.

A budget sweep of one method runs the same prompts B times, and the prefill (full attention over the whole
prompt) is identical in every run: only the compression after it and the decode differ. So the first run
records, per layer, the full K/V, the last `window` post-RoPE queries and the keys attention saw, plus the
prefill's last-position logits; the other budgets' caches are compressed from that record by the same code
path (`KVLayer.compress`) while the model's prefill forward is skipped. Decoding then proceeds as usual, so
results are identical to separate runs by construction (tests/test_shared_prefill.py checks it).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast


@dataclass
class PrefillRecord:
    window: int  # queries kept per layer: the largest observation window of the methods that will replay
    layers: dict[int, tuple] = field(
        default_factory=dict
    )  # idx -> (keys, values, queries, attn_keys, scaling)
    mask: torch.Tensor | None = None  # the prefill attention mask (None: no padding)
    logits: torch.Tensor | None = None  # (B, 1, V) last-position logits of the prefill forward

    def add(self, layer_idx, keys, values, query, attn_keys, attention_mask, scaling) -> None:
        q = query[:, :, -self.window :].clone()
        self.layers[layer_idx] = (keys, values, q, None if attn_keys is keys else attn_keys, scaling)
        self.mask = attention_mask


def populate(cache, record: PrefillRecord) -> None:
    """Fill an empty KVCache from a record, exactly as its own prefill would have."""
    for idx, layer in enumerate(cache.layers):
        keys, values, queries, attn_keys, scaling = record.layers[idx]
        layer.lazy_initialization(keys, values)
        layer.pending = (keys, values)
        layer.compress(queries, keys if attn_keys is None else attn_keys, record.mask, scaling)


@contextmanager
def shared_prefill(model):
    """Within this block, a KVCache with `record` keeps its prefill's logits, and one with `replay` skips the
    prefill forward: its cache is populated from the record and the recorded logits are returned."""
    original = model.forward

    @functools.wraps(original)
    def forward(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        replay = getattr(cache, "replay", None)
        if replay is not None and cache.rows is None:
            populate(cache, replay)
            return CausalLMOutputWithPast(logits=replay.logits, past_key_values=cache)
        out = original(*args, **kwargs)
        record = getattr(cache, "record", None)
        if record is not None and record.logits is None:
            record.logits = out.logits[:, -1:].clone()
        return out

    model.forward = forward
    try:
        yield
    finally:
        del model.forward  # back to the class's forward
