"""evalkit's attention function: plain sdpa, plus the hand-off that lets a cache layer see its queries.

Registered under the name "evalkit" in transformers' `AttentionInterface` (and, with sdpa's mask builder, in
`AttentionMaskInterface`: without it transformers silently builds no mask). Every transformers attention
module calls `cache.update(...)` and then the attention function, so the layer that was just updated is handed
over through a thread-local: at prefill the layer compresses with the post-RoPE queries (model-agnostic:
Llama, Qwen3 and DeepSeek-V3's MLA alike); at decode attention uses the layer's own slot mask. The hand-off is
plain attribute traffic that torch.compile traces (fullgraph), so a compiled decode step keeps it.
"""

from __future__ import annotations

import threading

import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "evalkit"
_handoff = threading.local()


def hand_off(layer) -> None:
    """Called by `KVLayer.update`: the next attention call of the same layer index belongs to this layer."""
    _handoff.layer = layer


def _take(module):
    layer = getattr(_handoff, "layer", None)
    _handoff.layer = None
    if layer is None or layer.layer_idx != getattr(module, "layer_idx", None):
        return None
    return layer


def evalkit_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """sdpa over what the cache returned; compress after prefill; evalkit's slot mask during decode."""
    layer = _take(module)
    if layer is None:  # no evalkit cache (e.g. a loglikelihood forward): plain sdpa
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if layer.pending is not None:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        layer.compress(
            query, key, attention_mask, scaling if scaling is not None else query.shape[-1] ** -0.5
        )
        return out
    if layer.cache.static:
        if kwargs.get("softcap") is not None or kwargs.get("dropout", 0.0):
            raise ValueError("evalkit's static decode attention supports neither softcap nor dropout")
        mask = layer.cache.decode_mask(layer)
        out = static_decode_sdpa(query, key, value, mask, scaling)
        if layer.cache.observing:  # the cache's evictor scores this step: its attention, or the query itself
            scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
            layer.cache.evictor.observe(layer.cache, layer, query, key, mask, scaling)
        return out
    mask = layer.cache.decode_mask(layer)
    if mask is not None and 1 < mask.shape[1] < query.shape[1]:  # per KV head: ride to its query heads
        mask = mask.repeat_interleave(query.shape[1] // mask.shape[1], dim=1)
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, is_causal=False, **kwargs)


def static_decode_sdpa(query, key, value, mask, scaling):
    """One decode query over every slot of a static cache, under its slot mask.

    query (B, H_q, 1, D), key/value (B, H_kv, S, D_k / D_v), mask (B, 1, 1, S) bool (per head under
    head-adaptive budgets: (B, H_kv, 1, S)) -> ((B, 1, H_q, D_v), None). The H_q / H_kv query heads of a GQA
    group ride as query rows of their KV head, so K/V are read once, never repeated per query head
    (transformers' sdpa does this only outside torch.compile, and repeats K/V inside it): the eager and the
    compiled step run the same attention.
    """
    b, h_q, _, d = query.shape
    h_kv = key.shape[1]
    packed = query.reshape(b, h_kv, h_q // h_kv, d)  # (B, H_kv, group, D)
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h_q, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> None:
    """Idempotent: an already registered "evalkit" entry (e.g. a test's spy around it) is left alone."""
    if NAME not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(NAME, evalkit_attention)
    if NAME not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def attach(model):
    """Make `model` run evalkit's attention (sdpa underneath); returns the model."""
    register()
    model.set_attn_implementation(NAME)
    return model
