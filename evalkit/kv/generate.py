"""The one documented helper: generate with a fresh compressed cache and return its statistics.

`compile=True` decodes through transformers' own compiled-forward path: the cache is static (fixed shapes, device
bookkeeping, see `evalkit.kv.cache`), so `generate` compiles the model forward once per (batch, slots) shape and
runs every decode step through it; the prefill (and SnapKV's compression) stays eager.
"""

from __future__ import annotations

import torch
from transformers import CompileConfig

from evalkit.kv.cache import KVCache
from evalkit.kv.static import StaticKVCache


def compile_config(model, backend="inductor", mode: str | None = None) -> CompileConfig:
    """How `generate` compiles the decode forward: one graph (fullgraph: a graph break is an error, not a slow
    path), specialised to its shapes (dynamic=False: a static cache has one shape per batch and slot count).

    Inductor with CUDA graphs (`reduce-overhead`) on CUDA, plain inductor elsewhere; `backend` may be any
    torch.compile backend (tests count compilations with their own)."""
    cuda = model.device.type == "cuda"
    if mode is None and backend == "inductor":
        mode = "reduce-overhead" if cuda else "default"
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=mode)
    config._compile_all_devices = not cuda  # transformers compiles on accelerators only unless told
    return config


def max_new_tokens_of(model, gen_kwargs: dict) -> int | None:
    """The generation budget `model.generate` will use for these kwargs (a static append cache sizes to it)."""
    if gen_kwargs.get("max_new_tokens") is not None:
        return gen_kwargs["max_new_tokens"]
    config = gen_kwargs.get("generation_config") or model.generation_config
    return config.max_new_tokens


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    method,
    attention_mask: torch.Tensor | None = None,
    compile: bool = False,
    **gen_kwargs,
):
    """`model.generate` with a new `KVCache(method)`; returns (sequences (B, T + new), cache.stats()).

    Greedy or sampled, as `gen_kwargs` say. Batches must be left-padded (pass their attention_mask).
    `compile=True`: a static cache and a compiled decode step (`compile_config` unless `gen_kwargs` has one).
    """
    if compile:
        if gen_kwargs.get("prefill_chunk_size") is not None:
            raise ValueError(
                "compile: chunked prefill is not supported (the prefill compresses in one forward)"
            )
        gen_kwargs.setdefault("compile_config", compile_config(model))
        cache = StaticKVCache.for_model(method, model, max_new_tokens=max_new_tokens_of(model, gen_kwargs))
    else:
        cache = KVCache.for_model(method, model)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    out = model.generate(input_ids, attention_mask=attention_mask, cache=cache, **gen_kwargs)
    return out, cache.stats()
