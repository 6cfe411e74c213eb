"""The rival prefill methods (knorm, keydiff, tova, expected_attention, kvzip) keep, per layer and KV head,
exactly what an independent float64 re-implementation of their kvpress 0.5.5 press keeps (tiny random models),
and a left-padded batch keeps per row what each prompt keeps alone.

Upstream, quoted where followed (NVIDIA/kvpress 0.5.5, `kvpress/presses/`): `knorm_press.py`,
`keydiff_press.py`, `tova_press.py`, `expected_attention_press.py`, `kvzip_press.py`, and `scorer_press.py`
(`indices = scores.topk(n_kept, dim=-1).indices`: each KV head keeps its own top entries).
"""

import pytest
import torch

from evalkit.kv import TOVA, ExpectedAttention, KeyDiff, KNorm, KVCache, KVzip, generate
from evalkit.kv import attention as kv_attention
from evalkit.kv.prefill import shared_prefill
from evalkit.kv.reconstruct import FIRST, NEXT, OVERLAP
from tests.conftest import tiny_model

L = 150  # prompt tokens (tiny models: 2 or 3 layers, GQA 4 query heads on 2 KV heads for llama)


class StubTokenizer:
    """No chat template (kvpress then reconstructs from the first token, suffix "\\n"); one id per char."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 250 for c in text]


@pytest.fixture
def spy(monkeypatch):
    """Every multi-token forward's (query, key, value, scaling) per layer, and each layer's hidden states."""
    seen = {"attn": {}, "hidden": {}}
    inner = kv_attention.evalkit_attention

    def recording(module, query, key, value, attention_mask, scaling=None, **kw):
        if query.shape[2] > 1:
            got = (query[0].detach().clone(), key[0].detach().clone(), value[0].detach().clone(), scaling)
            seen["attn"].setdefault(module.layer_idx, []).append(got)
        return inner(module, query, key, value, attention_mask, scaling=scaling, **kw)

    monkeypatch.setitem(kv_attention.ALL_ATTENTION_FUNCTIONS._global_mapping, kv_attention.NAME, recording)
    return seen


def hidden_states(model, ids) -> dict[int, torch.Tensor]:
    """Each layer's attention input (T, hidden) for the prompt, float64 (kvpress reads it in its hook)."""
    got, hooks = {}, []
    for layer in model.get_decoder().layers:
        attn = layer.self_attn

        def hook(module, args, kwargs):
            got[module.layer_idx] = kwargs["hidden_states"][0].detach().double()

        hooks.append(attn.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return got


def held_sets(cache, layer):
    held = cache.positions(layer)[0]  # (H_kv, slots), -1 = empty
    return [set(h[h >= 0].tolist()) for h in held]


def top_sets(scores, fixed, budget):
    """Per head: the fixed positions plus the top (budget - |fixed|) others; and the smallest relative gap
    at the cut, so an exact comparison is not decided by a near-tie."""
    keep, gap = [], float("inf")
    n = budget - len(fixed)
    for head in scores:
        ranked = sorted((j for j in range(len(head)) if j not in fixed), key=lambda j: -float(head[j]))
        keep.append(set(fixed) | set(ranked[:n]))
        a, b = float(head[ranked[n - 1]]), float(head[ranked[n]])
        gap = min(gap, (a - b) / max(abs(a), 1e-300))
    return keep, gap


# --- the references: float64, from the spied post-RoPE Q/K/V (expected attention: the hidden states) ---


def knorm_ref(q, k, v, scaling, method, model, hidden):
    # knorm_press.py: `return -torch.linalg.vector_norm(keys, dim=-1, dtype=score_dtype)`
    return top_sets(-k.double().norm(dim=-1), set(), method.budget)


def keydiff_ref(q, k, v, scaling, method, model, hidden):
    # keydiff_press.py: `anchor = F.normalize(keys, p=2, dim=-1).mean(dim=2, keepdim=True)`;
    #     `return -F.cosine_similarity(keys, anchor, dim=-1)`
    k = k.double()
    unit = k / k.norm(dim=-1, keepdim=True)
    anchor = unit.mean(dim=1, keepdim=True)
    cos = (k * anchor).sum(-1) / (k.norm(dim=-1) * anchor.norm(dim=-1))
    return top_sets(-cos, set(), method.budget)


def tova_ref(q, k, v, scaling, method, model, hidden):
    # tova_press.py: `attn_weights = attentions[..., -1:, :-1]` (softmax over every key, itself included);
    #     `scores = attn_weights.mean(1)` (all heads); `scores.repeat(1, keys.shape[1], 1)`;
    #     `F.pad(scores, (0, 1), value=scores.max().item() + 1)` (the last token kept)
    keys = k.double().repeat_interleave(q.shape[0] // k.shape[0], 0)  # (H_q, L, D)
    probs = (torch.einsum("hd,hld->hl", q[:, -1].double(), keys) * scaling).softmax(-1)  # (H_q, L)
    return top_sets(probs.mean(0)[None].expand(k.shape[0], -1), {L - 1}, method.budget)


def rope64(positions, d, theta):
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    return torch.cat([-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]], dim=-1)


def expected_attention_ref(q, k, v, scaling, method, model, hidden):
    # expected_attention_press.py, get_query_statistics: `h = hidden_states[:, self.n_sink :]`;
    #     `query_states = get_prerope_query_states(module, h)` (q_proj, before RoPE); `mu = mean`;
    #     `cov = einsum("bnsi,bnsj->bnij", centered, centered) / h.shape[1]`
    cfg = model.config
    d, h_q, s = cfg.head_dim, cfg.num_attention_heads, method.sink
    w = model.get_decoder().layers[hidden[0]].self_attn.q_proj.weight.double()
    pre = (hidden[1][s:] @ w.T).view(-1, h_q, d).transpose(0, 1)  # (H_q, L - s, D)
    mu = pre.mean(dim=1)
    centred = pre - mu[:, None]
    cov = centred.transpose(1, 2) @ centred / pre.shape[1]
    # apply_avg_rope: `position_ids = torch.arange(q_len, q_len + self.n_future_positions)`;
    #     `R = cos.unsqueeze(1) * Id + sin.unsqueeze(1) * P`; `R = R.mean(dim=0)`; mu @ R.T; R cov R^T
    cos, sin = rope64(torch.arange(L, L + method.future), d, cfg.rope_parameters["rope_theta"])
    eye = torch.eye(d, dtype=torch.float64)
    rot = torch.stack([torch.diag(c) + torch.diag(sn) @ rotate_half(eye.T).T for c, sn in zip(cos, sin)])
    rot = rot.mean(0)
    mu, cov = mu @ rot.T, rot @ cov @ rot.T
    # score: `scores = matmul(mean_query, keys) / sqrt(d)`; `+= einsum(keys, cov, keys) / d / 2`;
    #     softmax over the non-sink keys; mean per group; `(scores + epsilon) * values.norm(dim=-1)`
    g = h_q // k.shape[0]
    keys = k.double()[:, s:].repeat_interleave(g, 0)  # (H_q, L - s, D)
    logits = (keys @ mu[:, :, None])[..., 0] * scaling
    logits = logits + torch.einsum("hti,hij,htj->ht", keys, cov, keys) * scaling**2 / 2
    probs = logits.softmax(-1).view(k.shape[0], g, -1).mean(1)
    scores = (probs + method.epsilon) * v.double()[:, s:].norm(dim=-1)
    scores = torch.cat([torch.full((k.shape[0], s), float("inf"), dtype=torch.float64), scores], dim=1)
    return top_sets(scores, set(range(s)), method.budget)


def kvzip_ref(passes, method):
    """kvzip_press.py: per chunk [start, end) of the prompt, the repeat input's queries attend (softmax) to
    the sinks `keys[:, :, :sink]`, the chunk and the input itself (causal); `attn_weights[..., sink : sink +
    ctx_len].amax(dim=(-3, -2))` (max over the group's heads and the queries); compress_post: sinks kept."""
    scaling = passes[0][3]
    h_kv = passes[0][1].shape[0]
    scores = torch.zeros(h_kv, L, dtype=torch.float64)
    for i, (q, k, _, _) in enumerate(passes[1:]):
        start, end = i * method.chunk, min((i + 1) * method.chunk, L)
        s = min(method.sink, start)
        n = q.shape[1]
        sub = torch.cat([k[:, :s], k[:, start:end], k[:, -n:]], dim=1).double()
        g = q.shape[0] // h_kv
        logits = q.double().view(h_kv, g, n, -1) @ sub[:, None].transpose(-1, -2) * scaling  # (H, g, n, m)
        later = torch.ones(n, n, dtype=torch.bool).triu(1)
        logits[..., -n:] = logits[..., -n:].masked_fill(later, float("-inf"))
        scores[:, start:end] = logits.softmax(-1)[..., s : s + end - start].amax(dim=(1, 2))
    return top_sets(scores, set(range(method.sink)), method.budget)


REFERENCES = {
    "knorm": knorm_ref,
    "keydiff": keydiff_ref,
    "tova": tova_ref,
    "expected_attention": expected_attention_ref,
}
METHODS = [KNorm(budget=40), KeyDiff(budget=40), TOVA(budget=40), ExpectedAttention(budget=40, future=64)]


def prompt(seed=4, n=L):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_selection_matches_float64_reference(arch, method, spy):
    if arch == "qwen3" and method.name == "expected_attention":
        pytest.skip("the reference computes pre-RoPE queries as Llama does (Qwen3 adds q_norm)")
    if arch == "qwen3" and method.name == "knorm":
        pytest.skip(
            "Qwen3's k_norm gives every key nearly one norm (gaps ~1e-8): no exact ranking to compare"
        )
    model = tiny_model(arch, seed=3)
    ids = prompt()
    hidden = hidden_states(model, ids)
    spy["attn"].clear()
    cache = KVCache.for_model(method, model)
    with torch.no_grad():
        model(ids, cache=cache)
    for layer, [(q, k, v, scaling)] in spy["attn"].items():
        want, gap = REFERENCES[method.name](q, k, v, scaling, method, model, (layer, hidden.get(layer)))
        assert gap > 1e-6, (layer, gap)
        held = held_sets(cache, layer)
        assert held == want, (layer, [sorted(a ^ b) for a, b in zip(held, want)])
        assert all(len(h) == method.budget for h in held)


def test_kvzip_matches_float64_reference(spy):
    """Three reconstruction chunks (64, 64, 22 tokens) in the engine's prefill (`shared_prefill`): the spied
    forwards are the prompt's, then one per chunk whose input is kvpress's repeat prompt; the kept sets are
    the reference's from those queries and keys."""
    model, method, tok = tiny_model("llama", seed=3), KVzip(budget=40, chunk=64), StubTokenizer()
    ids = prompt()
    cache = KVCache.for_model(method, model)
    with torch.no_grad(), shared_prefill(model, tok):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True)
    first, later = len(tok.encode(FIRST)) + 1, len(tok.encode(NEXT)) + OVERLAP + 1  # + the "\n" suffix
    for layer, passes in spy["attn"].items():
        assert [p[0].shape[1] for p in passes] == [L, first + 64, later + 64, later + 22]
        want, gap = kvzip_ref(passes, method)
        assert gap > 1e-6, (layer, gap)
        assert held_sets(cache, layer) == want, layer


@pytest.mark.parametrize("method", [*METHODS, KVzip(budget=40, chunk=64)], ids=lambda m: m.name)
def test_batch_equals_single(method):
    """A left-padded batch of three prompts through the engine (`evalkit.kv.generate`) gives each row the
    tokens that prompt gives alone."""
    assert_batch_equals_single(method, max_new_tokens=8)


def assert_batch_equals_single(method, **generation):
    """Three prompts (150, 97, 61 tokens) left-padded into one batch: each row's new tokens are those the
    prompt gives alone (`generation`: generate's settings)."""
    model = tiny_model("llama", seed=5)
    lengths = [150, 97, 61]
    rows = [prompt(seed=10 + i, n=n)[0] for i, n in enumerate(lengths)]
    t = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(t - len(r), dtype=torch.long), r]) for r in rows])
    mask = (torch.arange(t)[None, :] >= (t - torch.tensor(lengths))[:, None]).long()
    kw = dict(do_sample=False, tokenizer=StubTokenizer(), **generation)
    batch, _ = generate(model, ids, method, attention_mask=mask, **kw)
    for r, row in enumerate(rows):
        alone, _ = generate(model, row[None], method, **kw)
        assert batch[r, t:].tolist() == alone[0, len(row) :].tolist(), r


def test_padded_prefill_keeps_what_each_row_keeps_alone():
    """The dynamic cache's left-padded prefill (positions from the mask, as `model.generate` passes them):
    each row's kept sets equal that prompt's alone, pads never kept (expected attention reads RoPE positions
    and undoes them per row)."""
    model = tiny_model("llama", seed=6)
    lengths = [150, 90]
    rows = [prompt(seed=20 + i, n=n)[0] for i, n in enumerate(lengths)]
    t = max(lengths)
    ids = torch.stack([torch.cat([torch.zeros(t - len(r), dtype=torch.long), r]) for r in rows])
    mask = (torch.arange(t)[None, :] >= (t - torch.tensor(lengths))[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for method in METHODS:
        batch = KVCache.for_model(method, model)
        with torch.no_grad():
            model(ids, attention_mask=mask, position_ids=positions, cache=batch)
        for r, row in enumerate(rows):
            alone = KVCache.for_model(method, model)
            with torch.no_grad():
                model(row[None], cache=alone)
            for layer in range(len(batch.layers)):
                held = cache_row(batch, layer, r)
                assert held == held_sets(alone, layer), (method.name, r, layer)


def cache_row(cache, layer, r):
    held = cache.positions(layer)[r]
    return [set(h[h >= 0].tolist()) for h in held]


@pytest.mark.parametrize(
    "name, settings, message",
    [
        ("knorm", dict(budget=0), "budget must be > 0"),
        ("tova", dict(budget=1), "budget must exceed the entries always kept (sink 0 + last 1)"),
        (
            "expected_attention",
            dict(budget=4),
            "budget must exceed the entries always kept (sink 4 + last 0)",
        ),
        ("kvzip", dict(budget=64, sink=-1), "sink must be >= 0"),
        ("expected_attention", dict(budget=64, future=0), "future must be >= 1"),
        ("kvzip", dict(budget=64, chunk=0), "chunk must be >= 1"),
    ],
)
def test_invalid_settings_fail_at_construction(name, settings, message):
    from evalkit.config import ConfigError
    from evalkit.kv.config import make_method

    with pytest.raises(ConfigError) as err:
        make_method(name, **settings)
    assert message in str(err.value) and name in str(err.value)
