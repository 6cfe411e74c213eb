"""Decode-time eviction (`h2o`, `snapkv_decode`): the kept sets equal an independent float64 reference over a
decode that evicts many times; a compiled step equals eager in one graph; a batch equals its rows alone; bad
settings are refused at config time.

The reference keeps every key the model ever produced (the prompt's and each decode step's, in float64) and a
kept mask per layer and KV head; each step it recomputes the method's scores from that full cache under the
mask, written here from the papers' and kvpress's definitions, independently of `evalkit.kv.evict`.
"""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from evalkit.config import ConfigError
from evalkit.engine import Engine
from evalkit.kv import H2O, SnapKVDecode, generate
from evalkit.kv import attention as kv_attention
from evalkit.kv.config import make_method
from evalkit.kv.pool import SlotPool
from evalkit.turns import ask
from tests.conftest import tiny_model
from tests.kv.test_batched import left_pad
from tests.kv.test_compile import Counting, fresh_dynamo, gen, prompts  # noqa: F401 (fixture)

NEW = 90  # decode tokens: h2o evicts at every step past the budget, snapkv_decode re-selects 5 times


# --- what the model produced: per layer, the prompt's Q/K and each decode step's query and new key ---------
@pytest.fixture
def spy(monkeypatch):
    seen = {"prompt": {}, "q": {}, "k": {}, "kept": {}, "scaling": {}}
    inner, write = kv_attention.evalkit_attention, SlotPool.write

    def recording(module, query, key, value, attention_mask, scaling=None, **kw):
        i = module.layer_idx
        seen["scaling"][i] = scaling
        if query.shape[2] > 1:
            seen["prompt"][i] = (query[0].double(), key[0].double())
        else:
            seen["q"].setdefault(i, []).append(query[0, :, 0].double())
        return inner(module, query, key, value, attention_mask, scaling=scaling, **kw)

    def writing(self, layer, k, v):
        out = write(self, layer, k, v)
        seen["k"].setdefault(layer.layer_idx, []).append(k[0, :, 0].double())
        valid = self.rows.valid[0]
        seen["kept"].setdefault(layer.layer_idx, []).append(
            [set(p[valid].tolist()) for p in layer.pos[0]]
        )  # per KV head, after this step's write
        return out

    monkeypatch.setitem(kv_attention.ALL_ATTENTION_FUNCTIONS._global_mapping, kv_attention.NAME, recording)
    monkeypatch.setattr(SlotPool, "write", writing)
    return seen


def probs(q, keys, allowed, scaling):
    """float64 softmax of q (H_q, n, D) over keys (H, T, D) where allowed (H, n, T); (H, g, n, T)."""
    h, t, d = keys.shape
    logits = q.view(h, -1, q.shape[1], d) @ keys.transpose(-1, -2)[:, None] * scaling
    return torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), dim=-1)


def top(scores, k):
    return set(torch.topk(scores, k).indices.tolist()) if k > 0 else set()


# --- H2O reference (FMInference/H2O utils_real_drop: accumulate hh_score, evict lowest non-recent) ------
def h2o_reference(spy, layer, method, length):
    q_prompt, k_prompt = spy["prompt"][layer]
    scaling = spy["scaling"][layer]
    keys = torch.cat([k_prompt, torch.stack(spy["k"][layer], 1)], 1)  # (H, T + steps, D), every position
    h, total = keys.shape[:2]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None].expand(h, -1, -1)
    acc = torch.zeros(h, total, dtype=torch.float64)
    acc[:, :length] = probs(q_prompt, k_prompt, causal, scaling).sum(2).mean(1)  # column sums, group mean
    kept = []
    for head in range(h):
        if length <= method.budget:
            kept.append(set(range(length)))
        else:
            rest = acc[head, : length - method.recent]
            kept.append(set(range(length - method.recent, length)) | top(rest, method.budget - method.recent))
    want = []
    for step, q in enumerate(spy["q"][layer]):
        p = length + step
        for head in range(h):
            if len(kept[head]) == method.budget:  # full: the lowest score older than the last `recent`
                old = [i for i in kept[head] if i < p - method.recent]
                kept[head].remove(min(old, key=lambda i: acc[head, i].item()))
            kept[head].add(p)
        want.append([set(s) for s in kept])
        mask = torch.zeros(h, 1, total, dtype=torch.bool)
        for head in range(h):
            mask[head, 0, list(kept[head])] = True
        acc += probs(q[:, None], keys, mask, scaling)[:, :, 0].mean(1)
    return want


# --- SnapKV during decode (kvpress DecodingPress + SnapKVPress; SnapKV's pooling) ---------------------------
def snapkv_select(q, keys, positions, window_pos, kernel, keep):
    """Per KV head: the window (positions window_pos) plus the top `keep` of that head's older kept positions
    by the window queries' attention (q (H_q, w, D) already scaled), pooled in position order; float64."""
    h, g = keys.shape[0], q.shape[0] // keys.shape[0]
    kept = []
    for head in range(h):
        held = sorted(positions[head])
        older = [i for i in held if i < window_pos[0]]
        allowed = torch.zeros(1, len(window_pos), keys.shape[1], dtype=torch.bool)
        for j, wp in enumerate(window_pos):
            allowed[0, j, [i for i in held if i <= wp]] = True
        attn = probs(q.view(h, g, *q.shape[1:])[head], keys[head : head + 1], allowed, 1.0)  # (1, g, w, T)
        col = attn.sum(2)[0][:, older]  # (g, n_older), in position order
        pooled = F.avg_pool1d(col[:, None], kernel, 1, kernel // 2)[:, 0].mean(0)
        kept.append(set(window_pos) | {older[i] for i in top(pooled, keep)})
    return kept


def snapkv_decode_reference(spy, layer, method, length):
    q_prompt, k_prompt = spy["prompt"][layer]
    scale = spy["scaling"][layer]
    keys = torch.cat([k_prompt, torch.stack(spy["k"][layer], 1)], 1)
    h, w = keys.shape[0], method.window
    if length <= method.target:
        kept = [set(range(length)) for _ in range(h)]
    else:
        window = list(range(length - w, length))
        every = [range(length)] * h
        kept = snapkv_select(
            q_prompt[:, -w:] * scale, keys[:, :length], every, window, method.pool_kernel, method.target - w
        )
    want, queries, since = [], [], 0
    for step, q in enumerate(spy["q"][layer]):
        p = length + step
        for head in range(h):
            kept[head].add(p)
        want.append([set(s) for s in kept])
        queries.append(q)
        since += 1
        if since == method.interval:
            since = 0
            if len(kept[0]) > method.target:
                window = list(range(p - w + 1, p + 1))
                qw = torch.stack(queries[-w:], 1) * scale  # (H_q, w, D)
                kept = snapkv_select(qw, keys, kept, window, method.pool_kernel, method.target - w)
    return want


def sharp_model(arch: str, seed: int, gain: float = 3.0):
    """A tiny random model whose attention logits are `gain`² larger: random weights attend almost uniformly,
    so their scores tie within float32 rounding; sharper attention makes every choice a clear one."""
    model = tiny_model(arch, seed=seed)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for name in ("q_norm", "k_norm") if hasattr(attn, "q_norm") else ("q_proj", "k_proj"):
                getattr(attn, name).weight.mul_(gain)
    return model


def engine_decode(model, prompt, method, new=NEW):
    engine = Engine(model, None, [], 1)
    req = ask("0", prompt.tolist(), new, method, model.generation_config, 0, min_new=new)
    (done,) = engine.run([req])
    return done, engine


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "method, length",
    [
        (H2O(budget=40, recent=8), 120),
        (H2O(budget=48, recent=12), 30),  # prompt shorter than the budget: fills, then evicts
        (SnapKVDecode(budget=48, window=4, interval=16), 120),
        (SnapKVDecode(budget=48, window=8, interval=16, pool_kernel=3), 20),  # short prompt kept whole
    ],
    ids=["h2o", "h2o-short", "snapkv_decode", "snapkv_decode-short"],
)
def test_kept_sets_equal_float64_reference(arch, method, length, spy):
    model = sharp_model(arch, seed=5)
    prompt = prompts((length,), seed=6)[0]
    engine_decode(model, prompt, method)
    reference = h2o_reference if method.name == "h2o" else snapkv_decode_reference
    differ = False
    for layer in range(model.config.num_hidden_layers):
        want = reference(spy, layer, method, length)
        got = spy["kept"][layer]
        assert len(got) == len(want) == NEW - 1
        for step, (g, w) in enumerate(zip(got, want)):
            assert g == w, (layer, step, [sorted(a ^ b) for a, b in zip(g, w)])
        assert all(len(s) <= method.budget for s in got[-1])
        differ = differ or any(g[0] != g[1] for g in got)
    # the choice is per KV head: heads keep different entries (the tiny llama's heads attend alike: no check)
    assert differ or arch == "llama"
    evictions = NEW - 1 + length - method.budget
    assert evictions > 40  # the decode evicts many times


def test_h2o_on_mla_keeps_one_set_per_layer():
    """MLA (DeepSeek-V3) caches one latent head: the query heads' attention is averaged into it, and a full
    cache stays `budget` slots, written in place."""
    model = tiny_model("deepseek_v3", seed=2)
    done, engine = engine_decode(model, prompts((100,))[0], H2O(budget=32, recent=4))
    assert engine.pool.capacity == 32 and done.stats["kv_kept"] == 32
    for layer in engine.pool.layers:
        assert layer.pos.shape[1] == 1 and len(set(layer.pos[0, 0].tolist())) == 32


@pytest.mark.parametrize(
    "method", [H2O(budget=40, recent=8), SnapKVDecode(budget=48, window=4, interval=16)], ids=lambda m: m.name
)
def test_compiled_step_equals_eager_one_graph(method):
    """Many evictions / re-selections through a compiled step: one graph, compiled once, run every step, the
    same tokens as eager."""
    model = tiny_model("llama", seed=1)
    counting = Counting()
    ids = prompts((100,))[0][None]
    out, stats = gen(model, ids, method, backend=counting, new=NEW)
    assert (counting.compiled, counting.runs) == (1, NEW - 1)
    assert not counters["graph_break"]
    ref, ref_stats = gen(model, ids, method, new=NEW)
    assert torch.equal(out.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) <= 1e-5
    assert stats["kept"] == ref_stats["kept"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "method", [H2O(budget=40, recent=8), SnapKVDecode(budget=48, window=4, interval=16)], ids=lambda m: m.name
)
def test_inductor_step_equals_eager(method):
    """The same through inductor (what `compile: true` runs): one graph, every step, the same tokens."""
    model = tiny_model("llama", seed=1)
    counting = Counting("inductor")
    ids = prompts((100,))[0][None]
    out, stats = gen(model, ids, method, backend=counting, new=60)
    assert (counting.compiled, counting.runs) == (1, 59)
    ref, ref_stats = gen(model, ids, method, new=60)
    assert torch.equal(out.sequences, ref.sequences) and stats["kept"] == ref_stats["kept"]
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) <= 1e-5


@pytest.mark.parametrize(
    "method", [H2O(budget=40, recent=8), SnapKVDecode(budget=48, window=4, interval=16)], ids=lambda m: m.name
)
def test_batch_equals_single_rows(method):
    """A left-padded batch (rows of different lengths, so different phases of eviction and re-selection)
    equals each row decoded alone, token for token, with the same kept sets."""
    model = tiny_model("qwen3", seed=1)
    rows = prompts((150, 97, 40, 23))
    ids, mask, width = left_pad(rows)
    kw = dict(max_new_tokens=50, min_new_tokens=50, do_sample=False)
    out, stats = generate(model, ids, method, attention_mask=mask, **kw)
    for r, p in enumerate(rows):
        one, one_stats = generate(model, p[None], method, **kw)
        assert torch.equal(out[r, width:], one[0, len(p) :]), r
        assert stats["rows"][r] == one_stats["rows"][0]


def test_dynamic_cache_refuses_decode_eviction():
    from evalkit.kv import KVCache

    model = tiny_model("llama")
    cache = KVCache.for_model(H2O(budget=32), model)
    with torch.inference_mode(), pytest.raises(ValueError, match="decode through evalkit.kv.generate"):
        model.generate(prompts((50,))[0][None], cache=cache, max_new_tokens=3, do_sample=False)


def test_snapkv_decode_refuses_mla():
    model = tiny_model("deepseek_v3")
    with pytest.raises(ValueError, match="MLA"):
        generate(model, prompts((50,))[0][None], SnapKVDecode(budget=48, window=4), max_new_tokens=3)


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("h2o", {"recent": 0}, "h2o: recent must be in [1, budget - 1]"),
        ("h2o", {"budget": 16, "recent": 16}, "h2o: recent must be in [1, budget - 1]"),
        ("h2o", {"budget": 0}, "h2o: budget must be > 0"),
        # the setting given, not its derived recent=0 (issue 31, item 12)
        ("h2o", {"budget": 1}, "h2o: budget must be >= 2 (at least one recent entry and one to evict)"),
        ("snapkv_decode", {"interval": 32, "window": 32}, "snapkv_decode: interval must be > window"),
        (
            "snapkv_decode",
            {"budget": 64, "interval": 48, "window": 32},
            "snapkv_decode: budget - interval (entries kept at each re-selection) must be >= window",
        ),
        ("snapkv_decode", {"budget": 40}, "budget - interval (entries kept at each re-selection)"),
        ("snapkv_decode", {"pool_kernel": 4}, "pool_kernel must be odd"),
        ("snapkv_decode", {"interval": "x"}, "interval must be int or null"),
    ],
)
def test_bad_settings_refused_at_config_time(name, overrides, message):
    with pytest.raises(ConfigError) as e:
        make_method(name, **overrides)
    assert message in str(e.value)


def test_defaults():
    assert make_method("h2o", budget=256).recent == 128
    m = make_method("snapkv_decode", budget=256)
    assert (m.window, m.interval, m.target, m.blocks()) == (32, 64, 192, (0, 32, 160))
    assert make_method("snapkv_decode", budget=128).interval == 33  # at least window + 1


def test_h2o_budgets_share_one_prefill():
    """A budget sweep records one prefill (h2o's summed attention per entry, not its queries) and replays it
    into the other budgets' caches: the same kept entries and accumulated scores as a prefill of their own."""
    from evalkit.kv import KVCache
    from evalkit.kv.prefill import PrefillRecord, populate

    model = sharp_model("qwen3", seed=4)
    ids = prompts((120,))[0][None]
    small, large = H2O(budget=40), H2O(budget=64, recent=16)
    record = PrefillRecord(window=max(32, small.window, large.window))  # lm.py's rule
    with torch.inference_mode():
        model(ids, cache=KVCache.for_model(small, model, record=record))
        replayed = KVCache.for_model(large, model, replay=record)
        populate(replayed, record)
        alone = KVCache.for_model(large, model)
        model(ids, cache=alone)
    for got, want in zip(replayed.layers, alone.layers):
        assert torch.equal(got.pos, want.pos)
    for got, want in zip(replayed.evictor.acc, alone.evictor.acc, strict=True):  # the evictor keeps the sums
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def test_an_h2o_record_keeps_the_summed_attention_not_the_queries():
    """A budget list's record for h2o holds its prefill score per entry (B, H_kv, T) float32 and the default
    32 queries, not every prompt query: its bytes per prompt token are the K/V's plus 4 per KV head and
    layer (issue 35.3). A record of another method that kept too few queries cannot replay h2o."""
    from evalkit.kv import KVCache
    from evalkit.kv.methods import Full
    from evalkit.kv.prefill import PrefillRecord, populate

    model = sharp_model("llama", seed=4)
    t = 120
    ids = prompts((t,))[0][None]
    record = PrefillRecord(window=max(32, H2O.window))  # conversation.py's rule
    with torch.inference_mode():
        model(ids, cache=KVCache.for_model(H2O(budget=40), model, record=record))
    cfg = model.config
    layers, h_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = cfg.hidden_size // cfg.num_attention_heads
    for i in range(layers):
        keys, values, queries, _ = record.layers[i]
        assert queries.shape[2] == 32 and record.hints[i].shape == (1, h_kv, t)
        assert record.hints[i].dtype == torch.float32
    kv = layers * h_kv * d * 2 * 4  # K and V, float32, per prompt token
    queries = layers * cfg.num_attention_heads * d * 4
    per_token = (record.nbytes() - 32 * queries) / t
    print(f"h2o record: {per_token:.0f} B per prompt token (K/V {kv}, every query {queries}, now kept: 32)")
    assert per_token == kv + layers * h_kv * 4  # was kv + queries per token
    short = PrefillRecord(window=32)
    with torch.inference_mode():
        model(ids, cache=KVCache.for_model(Full(), model, record=short))
        with pytest.raises(ValueError, match="h2o scores the prompt with every query"):
            populate(KVCache.for_model(H2O(budget=40), model, replay=short), short)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "method", [H2O(budget=40, recent=8), SnapKVDecode(budget=48, window=4, interval=16)], ids=lambda m: m.name
)
def test_cuda_graphs_equal_eager(method, monkeypatch):
    """fp32 on CUDA: CUDA-graph replays give the eager tokens and kept sets, snapkv_decode's re-selections
    writing the graph's pinned buffers between replays included; a skipped CUDA graph is an error here."""
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", True)
    model = tiny_model("llama", seed=1).cuda()
    ids = prompts((100,))[0][None].cuda()
    out, stats = gen(model, ids, method, backend="inductor", new=60)
    ref, ref_stats = gen(model, ids, method, new=60)
    assert torch.equal(out.sequences, ref.sequences) and stats["kept"] == ref_stats["kept"]
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) <= 1e-4
    assert not counters["inductor"]["cudagraph_skips"]
