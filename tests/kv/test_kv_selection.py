"""Kept indices per (batch row, layer, KV head) equal an independent float64 re-implementation of SnapKV's
published scoring: random tensors (GQA and MLA layouts, left-padded batches), tiny random models, and the
embedded SmolLM2's real queries and keys.

Upstream, quoted where followed:
- FasterDecoding/SnapKV `snapkv/monkeypatch/snapkv_utils.py`, `SnapKVCluster.update_kv`;
- FasterDecoding/SnapKV `snapkv/monkeypatch/mistral_hijack_4_37.py` (the KV heads are repeated before it);
- NVIDIA/kvpress 0.5.5 `kvpress/presses/snapkv_press.py`, `SnapKVPress.compute_window_attention` and `score`.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from evalkit.kv import KVCache, SnapKV, SnapStream
from evalkit.kv import attention as kv_attention
from evalkit.kv import select as kv_select
from evalkit.kv.prefill import PrefillRecord, populate
from tests.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def published_scores(q, k, kernel, scaling, cache_heads):
    """SnapKV's pooled scores of one unpadded prompt, float64, (H_cache, L - w).

    q (H_q, w, D): the observation window, the prompt's last w queries, post-RoPE; k (H_attn, L, D) post-RoPE.
    """
    q, k = q.double(), k.double()
    h_q, w, _ = q.shape
    h_attn, L, _ = k.shape
    # mistral_hijack_4_37.py: `key_states = repeat_kv(key_states, self.num_key_value_groups)`
    #     ahead of update_kv
    k = k.repeat_interleave(h_q // h_attn, dim=0)  # (H_q, L, D)
    # snapkv_utils.py: `attn_weights = torch.matmul(query_states[..., -self.window_size:, :],
    #     key_states.transpose(2, 3)) / math.sqrt(head_dim)`
    #     (evalkit: the model's scaling, the same for Llama)
    logits = q @ k.transpose(-1, -2) * scaling  # (H_q, w, L): every prompt key, not only the candidates
    # snapkv_utils.py: `mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)`;
    #     `attn_weights[:, :, -self.window_size:, -self.window_size:] += attention_mask`
    #     (causal in the window)
    later = torch.ones(w, w, dtype=torch.bool).triu(1)  # window key j is after window query i
    logits[:, :, L - w :] = logits[:, :, L - w :].masked_fill(later, float("-inf"))
    # snapkv_utils.py: `attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32)`
    probs = logits.softmax(dim=-1)
    # snapkv_utils.py:
    #     `attn_weights_sum = attn_weights[:, :, -self.window_size:, : -self.window_size].sum(dim = -2)`
    summed = probs[:, :, : L - w].sum(dim=1)  # (H_q, L - w)
    # snapkv_utils.py: `F.avg_pool1d(attn_weights_sum, kernel_size = self.kernel_size,
    #     padding=self.kernel_size//2, stride=1)`: zero padding, every window divided by the kernel
    r = kernel // 2
    pooled = F.pad(summed, (r, r)).unfold(-1, kernel, 1).sum(-1) / kernel  # (H_q, L - w)
    # kvpress snapkv_press.py: `scores = scores.view(bsz, num_key_value_heads, num_key_value_groups,
    #     k_len - self.window_size)`; `scores = scores.mean(2)` (one set per KV head; MLA: one latent head)
    return pooled.view(cache_heads, h_q // cache_heads, L - w).mean(dim=1)


def published_keep(scores, L, sink, tail, topk):
    """Positions kept per cache head: the layout's sink and tail, plus the top-K candidates by SnapKV score.

    Candidates are the middle `[sink, L - tail)` (spec: `[L_sink, L - L_recent)`); the choice is restricted to
    them only after scoring and pooling. Also returns the smallest relative gap between the K-th and the
    (K+1)-th candidate score, so a test can show its exact comparison is not decided by a near-tie.
    """
    middle = list(range(sink, L - tail))
    assert all(j < scores.shape[-1] for j in middle)  # the window's columns are never candidates
    fixed = set(range(L)) - set(middle)
    keep, gap = [], float("inf")
    for head in scores:
        ranked = sorted(middle, key=lambda j: -float(head[j]))
        keep.append(fixed | set(ranked[:topk]))
        if len(ranked) > topk:
            a, b = float(head[ranked[topk - 1]]), float(head[ranked[topk]])
            gap = min(gap, (a - b) / max(abs(a), 1e-300))
    return keep, gap


def expected_keep(q, k, L, method, scaling, cache_heads):
    """The kept sets SnapKV's published scoring gives one prompt under `method`'s layout."""
    sink, tail, topk = method.blocks()
    w = min(method.window, L)
    if L - tail <= sink:  # no middle to choose from: the layout keeps the whole prompt
        return [set(range(L))] * cache_heads, float("inf")
    scores = published_scores(q[:, -w:], k, method.pool_kernel, scaling, cache_heads)
    return published_keep(scores, L, sink, tail, topk)


def held_sets(cache, layer, row):
    held = cache.positions(layer)[row]  # (H_cache, slots), -1 = empty
    return [set(h[h >= 0].tolist()) for h in held]


# --- random tensors: evalkit's cache layer against the reference, per batch row -----------------------------


def compress_random(method, lengths, layout, seed, scaling=0.3):
    """Compress one left-padded batch of random Q/K/V through evalkit's cache layer (as a prefill would)."""
    g = torch.Generator().manual_seed(seed)
    b, t, h_q = len(lengths), max(lengths), 4
    if layout == "gqa":  # cached keys are what attention reads: 2 KV heads for 4 query heads
        attn_keys = torch.randn(b, 2, t, 16, generator=g)
        keys, values = attn_keys, torch.randn(b, 2, t, 16, generator=g)
    else:  # MLA: attention reads per-head keys rebuilt from one cached latent per token
        attn_keys = torch.randn(b, h_q, t, 16, generator=g)
        keys, values = torch.randn(b, 1, t, 24, generator=g), torch.randn(b, 1, t, 8, generator=g)
    query = torch.randn(b, h_q, t, 16, generator=g)
    real = torch.arange(t)[None, :] >= (t - torch.tensor(lengths))[:, None]  # (B, T) left padding
    # Large pad keys: unmasked, they would swallow much of some queries' softmax and reorder the ranking.
    attn_keys = torch.where(real[:, None, :, None], attn_keys, 10 * torch.randn(attn_keys.shape, generator=g))
    cache = KVCache(method, num_layers=1)
    layer = cache.layers[0]
    layer.lazy_initialization(keys, values)
    layer.pending = (keys, values)
    layer.compress(query, attn_keys, real[:, None, None, :], scaling)
    return cache, query, attn_keys, keys.shape[1]


RANDOM_METHODS = [
    SnapStream(budget=48, sink=4, recent=12, window=8, pool_kernel=7),
    SnapStream(budget=40, sink=2, recent=8, window=8, pool_kernel=3),
    SnapKV(budget=40, window=8, pool_kernel=5),
]


@pytest.mark.parametrize("layout", ["gqa", "mla"])
@pytest.mark.parametrize("method", RANDOM_METHODS, ids=lambda m: f"{m.name}{m.budget}")
@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "per-head-chunks"])
def test_random_batch_matches_published_reference(layout, method, chunked, monkeypatch):
    """Rows longer and shorter than the budget (a middle short of K; no middle; shorter than the window),
    left-padded with adversarial pads; also with the head chunking that bounds memory at 128k."""
    if chunked:
        monkeypatch.setattr(kv_select, "_MAX_SCORE_ELEMENTS", 1)  # one attention head per chunk
    lengths = [300, 160, 57, 30, 5]
    cache, query, attn_keys, cache_heads = compress_random(method, lengths, layout, seed=7)
    t = max(lengths)
    for r, L in enumerate(lengths):
        want, gap = expected_keep(query[r, :, t - L :], attn_keys[r, :, t - L :], L, method, 0.3, cache_heads)
        assert gap > 1e-5, (r, gap)  # the comparison below is exact, not decided by a near-tie
        assert held_sets(cache, 0, r) == want, (r, L)


# --- crafted cases: what the published scoring changes ------------------------------------------------------


def crafted_cache(method, logits):
    """One head whose window attention logits are exactly `logits` (w, L): one-hot keys, queries = logits."""
    w, L = logits.shape
    keys = torch.eye(L)[None, None]  # (1, 1, L, L): key j is the unit vector e_j
    query = torch.zeros(1, 1, L, L)
    query[0, 0, L - w :] = logits  # q_i . k_j = logits[i, j]
    cache = KVCache(method, num_layers=1)
    layer = cache.layers[0]
    layer.lazy_initialization(keys, keys)
    layer.pending = (keys, keys)
    layer.compress(query, keys, None, 1.0)
    return held_sets(cache, 0, 0)[0]


def test_softmax_runs_over_all_prompt_keys():
    """Two window queries. One looks at a sink (mass 0.9) and a little at candidate 10; the other spreads over
    candidate 10 (0.1) and candidate 20 (0.5). Over all keys, 20 (0.5) beats 10 (0.2); softmaxed over the
    candidates only, the first query's 0.1 becomes 1.0 and 10 (1.17) beats 20 (0.83)."""
    method = SnapStream(budget=8, sink=4, recent=3, window=2, pool_kernel=1)  # top-K = 1
    L = 40
    probs = torch.full((2, L), 1e-9)  # window queries at positions L - 2 and L - 1
    probs[0, 2], probs[0, 10] = 0.9, 0.1  # the sink, a candidate
    probs[1, 10], probs[1, 20], probs[1, L - 1] = 0.1, 0.5, 0.4  # two candidates, itself
    assert crafted_cache(method, probs.log()) == set(range(4)) | {20} | set(range(L - 3, L))


def test_pooling_sees_the_sinks_before_the_choice_is_restricted():
    """A token next to a sink ranks with the sink's attention in its pooling window (SnapKV pools the real
    attention of every non-window position); masking the sinks before pooling would pick position 20
    instead."""
    method = SnapStream(budget=8, sink=4, recent=3, window=1, pool_kernel=5)  # top-K = 1
    L = 40
    logits = torch.zeros(1, L)
    logits[0, 2], logits[0, 3] = 3.0, 6.0  # the sinks take most of the window's attention
    logits[0, 20] = 2.0  # the best candidate on its own
    logits[0, 19] = logits[0, 21] = 1.0
    assert crafted_cache(method, logits) == set(range(4)) | {4} | set(range(L - 3, L))


# --- real queries and keys: tiny random models and the embedded SmolLM2 -------------------------------------


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


def prefill(model, ids, method, record=None):
    cache = KVCache.for_model(method, model, record=record)
    with torch.no_grad():
        model(ids, cache=cache)
    return cache


def assert_matches_reference(cache, method, spy, L, min_gap):
    """Every layer and cache head of a prefilled `cache` holds what the reference keeps from the spied Q/K."""
    assert len(spy) == len(cache.layers)
    for layer_idx, (q, k, scaling) in spy.items():
        held = held_sets(cache, layer_idx, 0)
        want, gap = expected_keep(q, k, L, method, scaling, len(held))
        assert gap > min_gap, (layer_idx, gap)
        assert held == want, (layer_idx, [sorted(a ^ b) for a, b in zip(held, want)])
        assert all(len(h) == method.budget for h in held)  # no duplicates: distinct positions per slot


@pytest.mark.parametrize(
    "arch, method",
    [
        ("llama", SnapStream(budget=40, sink=4, recent=12, window=8, pool_kernel=7)),
        ("llama", SnapKV(budget=32, window=8, pool_kernel=5)),
        ("qwen3", SnapStream(budget=40, sink=2, recent=8, window=8, pool_kernel=3)),
        ("deepseek_v3", SnapStream(budget=40, sink=4, recent=12, window=8, pool_kernel=7)),  # MLA
    ],
)
def test_tiny_models_match_published_reference(arch, method, spy):
    model = tiny_model(arch, seed=3)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(4))
    assert_matches_reference(prefill(model, ids, method), method, spy, ids.shape[1], min_gap=1e-5)


def smollm2_prompts(tok):
    """Two ~1k-token prompts: a RULER needle haystack and natural text (a bundled LongBench-v2 document)."""
    from evalkit.demo import needle_sample

    needle, _ = needle_sample(tok, 1000, seed=0)
    doc = json.loads((ROOT / "tasks/longbench_v2/data/sample.json").read_text())[0]["context"]
    return {"ruler": needle, "natural": doc}


@pytest.mark.parametrize("kind", ["ruler", "natural"])
def test_smollm2_matches_published_reference(smollm2, kind, spy):
    """Budgets 128/256/512 (window 32, kernel 7): one prefill, the other budgets replayed from its record, as
    a budget sweep runs them (`evalkit.kv.prefill`)."""
    model, tok = smollm2
    text = smollm2_prompts(tok)[kind]
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert 800 <= ids.shape[1] <= 1300
    methods = [SnapStream(budget=b, window=32, pool_kernel=7) for b in (128, 256, 512)]  # sink 4, recent B/8
    record = PrefillRecord(window=32)
    caches = [prefill(model, ids, methods[0], record=record)]
    for method in methods[1:]:
        caches.append(KVCache.for_model(method, model, replay=record))
        populate(caches[-1], record)
    for cache, method in zip(caches, methods):
        assert_matches_reference(cache, method, spy, ids.shape[1], min_gap=1e-6)
