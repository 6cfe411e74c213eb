"""Kept indices per (layer, KV head) equal an independent float64 implementation of the spec's scoring."""

import math

import pytest
import torch

from evalkit.kv import KVCache, SnapKV, SnapStream
from evalkit.kv import attention as kv_attention
from tests.conftest import tiny_model


def reference_keep(q, k, L, sink, tail, topk, window, kernel, cache_heads, scaling):
    """Positions kept for each cache head. q (Hq, L, D), k (Ha, L, D) post-RoPE, as attention saw them."""
    q, k = q.double(), k.double()
    hq, ha = q.shape[0], k.shape[0]
    mid = list(range(sink, L - tail))
    per_head = []
    for h in range(hq):
        kh = k[h // (hq // ha)]
        summed = [0.0] * len(mid)
        for i in range(L - window, L):  # observation window queries
            logits = [float(q[h, i] @ kh[j]) * scaling for j in mid]
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            z = sum(exps)
            summed = [s + e / z for s, e in zip(summed, exps)]
        pooled = [
            sum(summed[j] for j in range(c - kernel // 2, c + kernel // 2 + 1) if 0 <= j < len(mid)) / kernel
            for c in range(len(mid))
        ]
        per_head.append(pooled)
    keep = []
    group = hq // cache_heads  # query heads sharing one cached head (GQA group, or all heads for MLA)
    for c in range(cache_heads):
        heads = per_head[c * group : (c + 1) * group]
        mean = [sum(col) / len(heads) for col in zip(*heads)]
        order = sorted(range(len(mid)), key=lambda j: -mean[j])[:topk]
        keep.append(set(range(sink)) | {mid[j] for j in order} | set(range(L - tail, L)))
    return keep


@pytest.fixture
def spy(monkeypatch):
    """Record the (query, key, scaling) each layer's attention sees at prefill."""
    seen = {}
    inner = kv_attention.evalkit_attention

    def recording(module, query, key, value, attention_mask, scaling=None, **kw):
        if query.shape[2] > 1:
            seen[module.layer_idx] = (query[0].detach().clone(), key[0].detach().clone(), scaling)
        return inner(module, query, key, value, attention_mask, scaling=scaling, **kw)

    monkeypatch.setitem(kv_attention.ALL_ATTENTION_FUNCTIONS._global_mapping, kv_attention.NAME, recording)
    return seen


@pytest.mark.parametrize(
    "arch, method",
    [
        ("llama", SnapStream(budget=40, sink=4, recent=12, window=8, pool_kernel=7)),
        ("llama", SnapKV(budget=32, window=8, pool_kernel=5)),
        ("qwen3", SnapStream(budget=40, sink=2, recent=8, window=8, pool_kernel=3)),
        ("deepseek_v3", SnapStream(budget=40, sink=4, recent=12, window=8, pool_kernel=7)),
    ],
)
def test_kept_indices_match_float64_reference(arch, method, spy):
    model = tiny_model(arch, seed=3)
    L = 150
    ids = torch.randint(0, 256, (1, L), generator=torch.Generator().manual_seed(4))
    cache = KVCache.for_model(method, model)
    with torch.no_grad():
        model(ids, cache=cache)
    sink, tail, topk = method.blocks()
    for layer_idx, (q, k, scaling) in spy.items():
        held = cache.positions(layer_idx)[0]  # (H_cache, slots)
        expected = reference_keep(
            q, k, L, sink, tail, topk, method.window, method.pool_kernel, held.shape[0], scaling
        )
        for head in range(held.shape[0]):
            got = set(held[head].tolist())
            assert got == expected[head], (layer_idx, head, sorted(got ^ expected[head]))
            assert len(got) == method.budget  # no duplicates: every slot holds a distinct position
    assert len(spy) == model.config.num_hidden_layers
