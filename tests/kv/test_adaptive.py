"""Head- and layer-adaptive budgets (`evalkit.kv.adaptive`): AdaKV and PyramidKV keep, per layer and KV head,
exactly what an independent float64 re-implementation of kvpress 0.5.5's allocation keeps (tiny random
models), at the uniform budget's total entries; they decode through the engine's slot pool (batch = single,
compiled = eager), and the per-head slot mask gives the attention of a cache that physically dropped each
head's unkept entries.

Upstream, quoted where followed (NVIDIA/kvpress 0.5.5, `kvpress/presses/`): `adakv_press.py`,
`pyramidkv_press.py`, `snapkv_press.py`, `knorm_press.py`.
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from evalkit.kv import AdaKV, KNorm, KVCache, PyramidKV, SnapKV, SnapStream, generate
from evalkit.kv import attention as kv_attention
from evalkit.kv.adaptive import pyramid_budget
from evalkit.kv.layout import SHARED
from evalkit.kv.methods import RunFacts
from tests.conftest import TINY, tiny_model
from tests.kv.test_compile import Counting, assert_same_generation, gen
from tests.kv.test_rivals import L, StubTokenizer, assert_batch_equals_single, held_sets, prompt, spy  # noqa: F401

W, KERNEL = 8, 3  # SnapKV's window and pooling kernel here (small, so the top-K block is most of a budget)


def deep_llama(layers: int, seed: int):
    """The tiny llama with more layers (a pyramid's schedule needs more than two to show its slope)."""
    from evalkit.kv import attach
    from evalkit.loading import random_model
    from evalkit.models import ModelSpec

    spec = ModelSpec(name="tiny_llama", random={**TINY["llama"], "num_hidden_layers": layers}, seed=seed)
    return attach(random_model(spec).eval())


# --- the references: float64 scores from the spied post-RoPE Q/K, kvpress's allocation ---------------------
def snapkv64(q, k, scaling):
    """snapkv_press.py: the last W queries' softmax over the keys (causal in the window), the window's
    columns dropped, mean over the window, avg_pool1d(kernel, stride 1, padding kernel // 2), mean over the
    group (T - W,) per KV head."""
    h_q, t, _ = q.shape
    g = h_q // k.shape[0]
    keys = k.double().repeat_interleave(g, 0)
    logits = torch.einsum("hwd,htd->hwt", q[:, -W:].double(), keys) * scaling
    later = torch.arange(t)[None, :] > torch.arange(t - W, t)[:, None]  # (W, T)
    probs = logits.masked_fill(later, float("-inf")).softmax(-1)[..., : t - W].mean(1)  # (H_q, T - W)
    padded = F.pad(probs, (KERNEL // 2, KERNEL // 2))
    pooled = torch.stack([padded[:, i : i + t - W] for i in range(KERNEL)]).mean(0)  # count_include_pad
    return pooled.view(k.shape[0], g, -1).mean(1)  # (H, T - W)


def knorm64(q, k, scaling):
    return -k.double().norm(dim=-1)  # knorm_press.py: (H, T), nothing always kept


def adakv_sets(scores, fixed: set, budget: int, alpha: float):
    """adakv_press.py: `n_safe = int(n_kept * alpha)` (at least 1), each head's top-n_safe raised to the
    maximum, then one bottom-k prune over all heads: each head keeps `fixed` (scored above all by its press)
    and its top-(n_safe - |fixed|), then the layer's remaining H x (budget - |fixed|) - H x floor entries go
    to the highest scores of any head. Returns the kept sets and the smallest relative gap at the cut."""
    h, n = scores.shape
    floor = max(max(1, int(budget * alpha)) - len(fixed), 0)
    keep = [set(fixed) for _ in range(h)]
    rest = []
    for i in range(h):
        ranked = sorted((j for j in range(n) if j not in fixed), key=lambda j: -float(scores[i, j]))
        keep[i] |= set(ranked[:floor])
        rest += [(float(scores[i, j]), i, j) for j in ranked[floor:]]
    rest.sort(reverse=True)
    take = h * (budget - len(fixed)) - h * floor
    for _, i, j in rest[:take]:
        keep[i].add(j)
    a, b = rest[take - 1][0], rest[take][0]
    return keep, (a - b) / max(abs(a), 1e-300)


def pyramid64(budget, window, beta, layer, layers, q_len):
    """pyramidkv_press.py `get_layer_budget` in floats, at the ratio keeping `budget` (n_kept = q_len x (1 -
    ratio) = budget)."""
    max_capacity_prompt = window + budget
    min_num = (max_capacity_prompt - window) / beta
    max_num = (max_capacity_prompt - window) * 2 - min_num
    if max_num >= q_len - window:
        max_num = q_len - window
        min_num = (max_capacity_prompt - window) * 2 - max_num
    if not (q_len >= max_num >= min_num >= window):
        return budget
    return round(max_num - layer * (max_num - min_num) / (layers - 1))


def top_sets(scores, fixed, k):
    keep, gap = [], float("inf")
    for head in scores:
        ranked = sorted(range(len(head)), key=lambda j: -float(head[j]))
        keep.append(set(fixed) | set(ranked[:k]))
        a, b = float(head[ranked[k - 1]]), float(head[ranked[k]])
        gap = min(gap, (a - b) / max(abs(a), 1e-300))
    return keep, gap


ADA = [
    AdaKV(budget=40, alpha=0.2, inner=SnapKV(window=W, pool_kernel=KERNEL)),
    AdaKV(budget=40, alpha=0.5, inner=SnapKV(window=W, pool_kernel=KERNEL)),  # a floor above the window
    AdaKV(budget=40, alpha=0.2, inner=KNorm()),
]
ADA_IDS = ["snapkv-0.2", "snapkv-0.5", "knorm-0.2"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("method", ADA, ids=ADA_IDS)
def test_adakv_selection_matches_float64_reference(arch, method, spy):  # noqa: F811
    if arch == "qwen3" and isinstance(method.inner, KNorm):
        pytest.skip("Qwen3's k_norm gives every key nearly one norm: no exact ranking to compare")
    model = tiny_model(arch, seed=5 if isinstance(method.inner, KNorm) else 4)
    cache = KVCache.for_model(method, model)
    with torch.no_grad():
        model(prompt(), cache=cache)
    counts = set()
    for layer, [(q, k, _, scaling)] in spy["attn"].items():
        if isinstance(method.inner, SnapKV):
            scores = torch.cat([snapkv64(q, k, scaling), torch.full((k.shape[0], W), float("inf"))], 1)
            fixed = set(range(L - W, L))
        else:
            scores, fixed = knorm64(q, k, scaling), set()
        want, gap = adakv_sets(scores, fixed, method.budget, method.alpha)
        assert gap > 1e-6, (layer, gap)
        held = held_sets(cache, layer)
        assert held == want, (layer, [sorted(a ^ b) for a, b in zip(held, want)])
        assert sum(map(len, held)) == k.shape[0] * method.budget  # the uniform budget's total per layer
        counts |= {len(h) for h in held}
    assert len(counts) > 1  # spread unevenly somewhere (else the test shows nothing)


@pytest.mark.parametrize("beta", [2, 20])  # 20 (kvpress's default) falls back to the uniform budget here
def test_pyramidkv_selection_matches_float64_reference(beta, spy):  # noqa: F811
    model = deep_llama(5, seed=3)
    method = PyramidKV(budget=40, beta=beta, inner=SnapKV(window=W, pool_kernel=KERNEL))
    cache = KVCache.for_model(method, model)
    with torch.no_grad():
        model(prompt(), cache=cache)
    kept = []
    for layer, [(q, k, _, scaling)] in spy["attn"].items():
        n = pyramid64(method.budget, W, beta, layer, 5, L) - W
        want, gap = top_sets(snapkv64(q, k, scaling), set(range(L - W, L)), n)
        assert gap > 1e-6, (layer, gap)
        held = held_sets(cache, layer)
        assert held == want, (layer, [sorted(a ^ b) for a, b in zip(held, want)])
        kept.append(len(held[0]))
    assert sum(kept) == 5 * method.budget  # the uniform budget's total over layers
    assert kept == ([60, 50, 40, 30, 20] if beta == 2 else [40] * 5), (
        kept
    )  # min = budget / beta, max = 2b - min


@pytest.mark.parametrize("budget, beta", [(40, 2), (64, 3), (256, 20), (1000, 7), (333, 4), (50, 1)])
@pytest.mark.parametrize("layers", [2, 3, 5, 24, 30])
@pytest.mark.parametrize("length", [60, 300, 4096])
def test_pyramid_total_is_the_uniform_total_and_equals_kvpress(budget, beta, layers, length):
    """Every layer's budget is kvpress's (float arithmetic, as there) and the layers keep L x budget in all,
    whatever rounds (the schedule is symmetric about the budget and rounds half to even)."""
    window = 8
    got = [pyramid_budget(budget, window, beta, i, layers, length) for i in range(layers)]
    assert got == [pyramid64(budget, window, beta, i, layers, length) for i in range(layers)]
    assert sum(got) == layers * budget


def test_ragged_bytes_count_what_each_head_holds():
    """The buffers hold the largest head's slots in every head (`bytes`); `ragged_bytes` count each head's
    own entries: less for AdaKV, equal for the uniform SnapKV at the same budget."""
    model = tiny_model("llama", seed=3)
    ada, uniform = ADA[0], SnapKV(budget=40, window=W, pool_kernel=KERNEL)
    got = {}
    for method in (ada, uniform):
        cache = KVCache.for_model(method, model)
        with torch.no_grad():
            model(prompt(), cache=cache)
        got[method.name] = cache.stats()
    entry = 2 * 16 * 4  # K and V, head_dim 16 (hidden 64 / 4 heads), float32: per head and slot
    layers, heads = 2, 2
    assert got["snapkv"]["ragged_bytes"] == got["snapkv"]["bytes"] == layers * heads * 40 * entry
    assert got["adakv"]["ragged_bytes"] == layers * heads * 40 * entry  # the uniform total
    assert (
        got["adakv"]["bytes"] == layers * heads * got["adakv"]["slots"] * entry > got["adakv"]["ragged_bytes"]
    )


METHODS = [ADA[0], ADA[2], PyramidKV(budget=40, beta=2, inner=SnapKV(window=W, pool_kernel=KERNEL))]
IDS = ["adakv_snapkv", "adakv_knorm", "pyramidkv"]


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_batch_equals_single(method):
    """A left-padded batch of three prompts through the engine's slot pool gives each row the tokens that
    prompt gives alone."""
    assert_batch_equals_single(method, max_new_tokens=12, min_new_tokens=12)


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_compiled_step_is_one_graph_equal_to_eager(method):
    model = tiny_model("llama", seed=1)
    ids = torch.stack([prompt(seed=3, n=150)[0], prompt(seed=4, n=150)[0]])
    counting = Counting("eager")
    assert_same_generation(gen(model, ids, method, backend=counting), gen(model, ids, method), 0)
    assert (counting.compiled, counting.runs) == (1, 29)


@pytest.mark.slow  # inductor compiles on CPU (~1 min each)
@pytest.mark.parametrize("method", METHODS[::2], ids=IDS[::2])
def test_inductor_step_equals_eager_over_rows_of_different_lengths(method):
    from tests.kv.test_batched import left_pad

    model = tiny_model("llama", seed=1)
    ids, mask, _ = left_pad([prompt(seed=3, n=n)[0] for n in (150, 97)])
    counting = Counting("inductor")
    assert_same_generation(
        gen(model, ids, method, mask, backend=counting), gen(model, ids, method, mask), 1e-4
    )
    assert (counting.compiled, counting.runs) == (1, 29)


def test_engine_equals_dynamic_cache():
    """The dynamic cache (per-head mask, transformers' sdpa over query heads) and the engine's slot pool
    (per-KV-head mask in the packed decode attention) give the same tokens."""
    model = tiny_model("llama", seed=5)
    ids = prompt(seed=7)
    for method in METHODS:
        cache = KVCache.for_model(method, model)
        with torch.no_grad():
            want = model.generate(ids, cache=cache, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        got, _ = generate(model, ids, method, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert got[0, L:].tolist() == want[0, L:].tolist(), method.describe()["name"]


# --- the per-head mask equals attention over each head's kept entries only ---------------------------------
def dropped_attention(query, layer, scaling):
    """float64 reference: per row and KV head, the K/V of the slots that head holds (position >= 0) gathered
    out, the group's queries' softmax attention over them alone. query (B, H_q, 1, D) -> (B, 1, H_q, D_v)."""
    b, h_q, _, _ = query.shape
    h = layer.keys.shape[1]
    keys, values = layer.cache.storage.load(layer, layer.keys, layer.values)
    out = torch.zeros(b, h_q, values.shape[-1], dtype=torch.float64)
    for r in range(b):
        for i in range(h):
            held = layer.pos[r, i] >= 0
            k, v = keys[r, i, held].double(), values[r, i, held].double()
            for j in range(i * h_q // h, (i + 1) * h_q // h):
                probs = (k @ query[r, j, 0].double() * scaling).softmax(-1)
                out[r, j] = probs @ v
    return out[:, None]


@pytest.fixture
def attention_spy(monkeypatch):
    """Each decode step's attention output beside the physically-dropped reference (max abs difference)."""
    diffs, inner = [], kv_attention.static_decode_sdpa
    current = {}
    take = kv_attention._take

    def taking(module):
        current["layer"] = take(module)
        return current["layer"]

    def checked(query, key, value, mask, scaling):
        out, w = inner(query, key, value, mask, scaling)
        ref = dropped_attention(query, current["layer"], scaling)
        diffs.append((out.double() - ref).abs().max().item())
        return out, w

    monkeypatch.setattr(kv_attention, "_take", taking)
    monkeypatch.setattr(kv_attention, "static_decode_sdpa", checked)
    return diffs


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_per_head_mask_equals_physically_dropped_entries(method, attention_spy, monkeypatch):
    """Every decode step of every layer in the engine's pool: the masked attention over the fixed-shape
    buffers equals, per head, attention over only the entries that head keeps. Without the per-head mask
    (each row's one mask, as a uniform method reads) it does not: the test can fail."""
    model = tiny_model("llama", seed=5)
    ids = torch.stack([prompt(seed=8, n=150)[0], prompt(seed=9, n=150)[0]])
    generate(model, ids, method, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert len(attention_spy) == 5 * 2 and max(attention_spy) < 1e-5, max(attention_spy)
    attention_spy.clear()
    monkeypatch.setattr(type(method), "slot_mask", SHARED)
    generate(model, ids, method, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert max(attention_spy) > 1e-3


def test_uniform_methods_read_one_mask_per_row():
    """A uniform method's decode mask is its rows' (B, 1, 1, S), the same object the cache built."""
    model = tiny_model("llama", seed=5)
    for method in (SnapKV(budget=40, window=W), SnapStream(budget=48, recent=16, window=8)):
        cache = KVCache.for_model(method, model)
        assert cache.slot_mask is SHARED
        cache.step_mask = object()
        assert cache.decode_mask(cache.layers[0]) is cache.step_mask


def test_a_pool_read_through_one_mask_per_row_refuses_a_per_head_row():
    """A pool shaped like a uniform row would read an adaptive row's empty head slots as zero keys: it refuses
    the row; a pool shaped like the adaptive row takes both kinds (a uniform row's slots are its heads')."""
    from evalkit.kv.pool import SlotPool

    model = tiny_model("llama", seed=5)
    ids = prompt()

    def prefilled(method):
        cache = KVCache.for_model(method, model, max_new_tokens=4)
        with torch.no_grad():
            model(ids, cache=cache)
        return cache

    uniform, adaptive = (
        prefilled(SnapKV(budget=40, window=W)),
        prefilled(AdaKV(budget=40, inner=SnapKV(window=W))),
    )
    shared = SlotPool.shaped_like(uniform, 2, 400)
    with pytest.raises(ValueError, match="keeps other slots per KV head"):
        shared.load_row(0, adaptive)
    own = SlotPool.shaped_like(adaptive, 2, 400)
    own.load_row(0, adaptive)
    own.load_row(1, uniform)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(inner={"_target_": "evalkit.kv.SnapStream"}), "inner must be a prefill method whose decode"),
        (dict(inner={"_target_": "evalkit.kv.H2O"}), "inner must be a prefill method whose decode"),
        (dict(alpha=1.5), "alpha must be in [0, 1]"),
        (dict(budget=0), "budget must be > 0"),
        (
            dict(budget=16, inner={"_target_": "evalkit.kv.SnapKV", "window": 32}),
            "window must be in [1, budget]",
        ),
    ],
)
def test_invalid_settings_fail_at_construction(settings, message):
    from omegaconf import OmegaConf

    from evalkit.config import ConfigError
    from evalkit.kv.config import make_method

    conf = {"_target_": "evalkit.kv.AdaKV", "budget": 64, "inner": {"_target_": "evalkit.kv.SnapKV"}}
    with pytest.raises(ConfigError) as err:
        make_method(OmegaConf.create({**conf, **settings}))
    assert message in str(err.value)


@pytest.mark.parametrize("name", ["adakv_snapkv", "adakv_expected_attention", "pyramidkv_snapkv"])
def test_confs_make_the_methods_and_refuse_what_their_inner_method_refuses(name):
    """Tensor parallelism runs them (each rank reads every rank's scores: tests/parallel/test_tp.py); an
    inner method's own refusal (kvzip's second pass over an MLA latent) is theirs."""
    from evalkit.kv.config import make_method

    method = make_method(name, budget=128)
    assert method.describe()["name"] == name and method.inner.budget == 128
    facts = RunFacts(model_name="m", mla=False, followup=False, compile=False, tp=2)
    assert method.refusal(facts) is None
    assert method.refusal(RunFacts(model_name="m", mla=False, followup=False, compile=False, tp=1)) is None
    from evalkit.kv import KVzip

    over_kvzip = replace(method, inner=KVzip(budget=128))
    assert over_kvzip.refusal(facts) is None
    mla = RunFacts(model_name="m", mla=True, followup=False, compile=False, tp=1)
    assert "caches MLA's latent" in over_kvzip.refusal(mla)


def test_a_run_records_both_byte_figures_and_the_memory_report_models_the_buffers(tmp_path):
    """`python -m evalkit method=adakv_snapkv` on the tiny model: metrics.json holds the buffers' bytes
    (`peak_bytes`, the largest head's slots in every head) and the ragged figure beside them (less), its
    kept entries per head are the budget's plus the decoded tokens, and evalkit.memory's prediction from
    lengths (the method's slots for the model's heads) equals the measured bytes and entries."""
    from evalkit import metrics as metrics_record
    from evalkit.memory.report import measured_rows
    from tests.conftest import fresh_run, the_run

    run = ["model=tiny_llama", "model.max_new_tokens=6", "task.load.n=1", "task.load.lengths=[1024]"]
    fresh_run(*run, "method=adakv_snapkv", "method.budget=64", results=tmp_path)
    kv = metrics_record.load(the_run(tmp_path, "adakv_snapkv", "64") / "metrics.json", strict=False).kv
    assert kv["peak_ragged_bytes"] < kv["peak_bytes"]
    # 64 per head + the decoded tokens (6, the last one never written), out of 96 slots + those tokens
    assert kv["mean_kept_entries"] == 64 + 5 and kv["peak_entries"] == 96 + 5
    rows, notes = measured_rows(tmp_path)
    assert not notes and [r["match"] for r in rows] == [True], rows


def test_the_memory_report_sizes_a_run_with_its_own_settings(tmp_path):
    """An AdaKV run at a non-default floor (alpha 0.9 at budget 128: 141 slots per head, the conf's 0.2 224):
    the memory report's prediction uses the settings the run ran with, and equals its measured bytes (it
    rebuilt the method from the conf's defaults before)."""
    from evalkit.memory.report import measured_rows
    from tests.conftest import fresh_run

    run = ["model=tiny_llama", "model.max_new_tokens=6", "task.load.n=1", "task.load.lengths=[1024]"]
    fresh_run(*run, "method=adakv_snapkv", "method.budget=128", "method.alpha=0.9", results=tmp_path)
    rows, notes = measured_rows(tmp_path)
    assert not notes and [r["match"] for r in rows] == [True], rows


@pytest.mark.parametrize(
    "method",
    [AdaKV(budget=64, inner=SnapKV(window=16)), PyramidKV(budget=64, beta=2, inner=SnapKV(window=16))],
    ids=lambda m: m.name,
)
def test_the_static_cache_decodes_what_the_dynamic_one_does(method):
    """`StaticKVCache` (every slot read under the per-head mask) generates the dynamic cache's greedy tokens:
    it read a zero-width mask and crashed at the first decode step before (`visible` was never set)."""
    from evalkit.kv import StaticKVCache

    model = tiny_model("llama", seed=3)
    ids = torch.randint(3, 256, (1, 90), generator=torch.Generator().manual_seed(5))
    outs = []
    for cache in (KVCache.for_model(method, model), StaticKVCache.for_model(method, model, max_new_tokens=8)):
        with torch.inference_mode():
            outs.append(model.generate(ids, cache=cache, max_new_tokens=8, min_new_tokens=8, do_sample=False))
    assert torch.equal(outs[0], outs[1])
