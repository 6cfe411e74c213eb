"""A compressed run equals a full-cache run whose attention masks out exactly the evicted positions.

Through prefill and 50 decode steps (the ring wraps several times), per layer and KV head: the compressed
cache's logits match a full cache (transformers' DynamicCache) whose attention sees only the positions the
compressed cache holds at that step, teacher-forced with the same tokens.
"""

import copy

import pytest
import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from evalkit.kv import TOVA, ExpectedAttention, KeyDiff, KNorm, KVCache, SnapKV, SnapStream, StreamingLLM
from tests.conftest import tiny_model

ALLOWED: dict[int, torch.Tensor] = {}  # layer -> (H_cache, kv_len) bool, positions the query may see


def masked_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Eager attention over a full cache with an extra per-head position mask (decode steps only)."""
    hq, hk = query.shape[1], key.shape[1]
    key = key.repeat_interleave(hq // hk, dim=1)
    value = value.repeat_interleave(hq // hk, dim=1)
    scores = (query @ key.transpose(-1, -2)) * scaling  # (B, Hq, q, kv)
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    allow = causal[None, None]
    if module.layer_idx in ALLOWED:
        heads = ALLOWED[module.layer_idx]  # (H_cache, kv_len)
        allow = allow & heads.repeat_interleave(hq // heads.shape[0], dim=0)[None, :, None, :]
    scores = scores.masked_fill(~allow, float("-inf"))
    out = torch.softmax(scores.float(), dim=-1).to(value.dtype) @ value
    return out.transpose(1, 2).contiguous(), None


ALL_ATTENTION_FUNCTIONS.register("masked_ref", masked_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("masked_ref", sdpa_mask)


def reference_model(model):
    ref = copy.deepcopy(model)  # deep copy: set_attn_implementation writes into the (shared) config
    ref.set_attn_implementation("masked_ref")
    return ref


@pytest.mark.parametrize(
    "arch, method, prompt_len",
    [
        ("llama", SnapStream(budget=32, sink=4, recent=8, window=8), 90),
        ("llama", StreamingLLM(budget=24, sink=4), 90),
        ("llama", SnapKV(budget=24, window=8), 90),
        ("llama", SnapStream(budget=16, sink=4, recent=4, window=4), 5),  # shorter than sink + recent
        ("llama", SnapStream(budget=16, sink=4, recent=4, window=4), 2),  # shorter than the sinks
        ("llama", SnapStream(budget=48, sink=4, recent=8, window=8), 30),  # middle shorter than top-K: padded
        ("llama", SnapStream(budget=16, sink=4, recent=4, window=4, spare_slots="ring"), 5),
        ("deepseek_v3", SnapStream(budget=32, sink=4, recent=8, window=8), 90),
        ("llama", KNorm(budget=24), 90),  # no sink, no tail: every kept prompt entry is top-K
        ("llama", TOVA(budget=24), 90),
        ("llama", ExpectedAttention(budget=24, future=32), 90),
        ("qwen3", KeyDiff(budget=24), 90),
    ],
)
def test_compressed_equals_masked_full(arch, method, prompt_len):
    model = tiny_model(arch, seed=5)
    ref = reference_model(model)
    ids = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(6))
    cache = KVCache.for_model(method, model)
    ALLOWED.clear()
    with torch.no_grad():
        got = model(ids, cache=cache).logits[:, -1]
        want = ref(ids, use_cache=True)
        ref_cache = want.past_key_values
        assert (got - want.logits[:, -1]).abs().max() <= 1e-4  # prefill attends to the whole prompt
        token = got.argmax(-1, keepdim=True)
        for step in range(50):
            got = model(token, cache=cache).logits[:, -1]
            p = prompt_len + step  # this token's position; the cache now holds what this step attended to
            for layer in range(model.config.num_hidden_layers):
                held = cache.positions(layer)[0]  # (H_cache, slots), -1 = empty
                allowed = torch.zeros(held.shape[0], p + 1, dtype=torch.bool)
                for h in range(held.shape[0]):
                    allowed[h, held[h][held[h] >= 0].long()] = True
                ALLOWED[layer] = allowed
            want = ref(token, past_key_values=ref_cache, use_cache=True)
            ref_cache = want.past_key_values
            assert (got - want.logits[:, -1]).abs().max() <= 1e-4, (
                step,
                (got - want.logits[:, -1]).abs().max(),
            )
            token = got.argmax(-1, keepdim=True)
    ALLOWED.clear()
    if method.ring:
        assert cache.stats()["evicted"] > 0 and cache.stats()["slots"] == method.budget
