"""The one documented helper: generate with a fresh compressed cache and return its statistics."""

from __future__ import annotations

import torch

from evalkit.kv.cache import KVCache


@torch.inference_mode()
def generate(
    model, input_ids: torch.Tensor, method, attention_mask: torch.Tensor | None = None, **gen_kwargs
):
    """`model.generate` with a new `KVCache(method)`; returns (sequences (B, T + new), cache.stats()).

    Greedy or sampled, as `gen_kwargs` say. Batches must be left-padded (pass their attention_mask).
    """
    cache = KVCache.for_model(method, model)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    out = model.generate(input_ids, attention_mask=attention_mask, cache=cache, **gen_kwargs)
    return out, cache.stats()
