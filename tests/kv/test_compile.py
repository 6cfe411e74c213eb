"""A decode step that compiles: the static cache equals the default one, and torch.compile captures its decode
step as one graph (no graph break), compiled once per (batch, slots) shape, with outputs identical to eager.

Compilation is counted by a backend of our own (`Counting`): it sees every graph dynamo hands over (a graph
break makes two, a recompilation one more) and every time a compiled graph runs, so a decode that silently
fell back to eager (dynamo's recompile limit) shows up as missing runs.
"""

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

from evalkit.kv import Full, KVCache, SnapKV, SnapStream, StaticKVCache, generate
from evalkit.kv.generate import compile_config
from evalkit.kv.prefill import PrefillRecord, shared_prefill
from tests.conftest import tiny_model
from tests.kv.test_batched import METHODS, left_pad  # every method, ring layouts both

IDS = [f"{m.name}-{getattr(m, 'spare_slots', '')}" for m in METHODS]


class Counting:
    """A torch.compile backend that counts the graphs it compiles and how often they run (wraps `inner`)."""

    def __init__(self, inner: str = "eager"):
        self.inner, self.compiled, self.runs = lookup_backend(inner), 0, 0

    def __call__(self, gm, example_inputs):
        self.compiled += 1
        compiled = self.inner(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run

    def __deepcopy__(self, memo):  # transformers deep-copies the compile config: keep counting here
        return self


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch (dynamo's caches are per code object, shared across models)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def gen(model, ids, method, mask=None, backend=None, new=30, **kw):
    """Greedy (unless kw says otherwise) generation of exactly `new` tokens; `backend`: compiled with it."""
    settings = dict(
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    settings.update(kw)
    if backend is not None:
        settings.update(compile=True, compile_config=compile_config(model, backend=backend))
    return generate(model, ids, method, attention_mask=mask, **settings)


def assert_same_generation(got, want, logits_atol: float):
    (out, stats), (ref, ref_stats) = got, want
    assert torch.equal(out.sequences, ref.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits))
    assert diff <= logits_atol, diff
    # a static append cache reserves exactly prompt + max_new_tokens: only `reserved_bytes` may differ
    drop = ("reserved_bytes",)
    assert {k: v for k, v in stats.items() if k not in drop} == {
        k: v for k, v in ref_stats.items() if k not in drop
    }


# --- the static cache, eager: the bookkeeping on the device equals the host's -------------------------------
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_static_cache_equals_default_cache(arch, method):
    """Left-padded batch with prompts shorter than the budget (40: padded top-K; 12: shorter than sink +
    recent, so the ring fills slot by slot) and rings that wrap: each row of the static batch equals that row
    decoded alone with the default (dynamic) cache."""
    model = tiny_model(arch, seed=1)
    rows = prompts((150, 97, 40, 12))
    ids, mask, width = left_pad(rows)
    static = StaticKVCache.for_model(method, model, max_new_tokens=30)
    kw = dict(
        max_new_tokens=30,
        min_new_tokens=30,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, cache=static, disable_compile=True, **kw)
    for r, p in enumerate(rows):
        default = KVCache.for_model(method, model)
        with torch.inference_mode():
            ref = model.generate(p[None], cache=default, **kw)
        assert torch.equal(out.sequences[r, width:], ref.sequences[0, len(p) :]), (method.name, r)
        diff = max((a[r] - b[0]).abs().max().item() for a, b in zip(out.logits, ref.logits))
        assert diff <= 1e-5, diff
        assert static.row_stats()[r] == default.row_stats()[0]
        for layer in range(model.config.num_hidden_layers):  # the same positions in every head
            got, want = static.positions(layer)[r], default.positions(layer)[0]
            for h in range(got.shape[0]):
                assert set(got[h][got[h] >= 0].tolist()) == set(want[h][want[h] >= 0].tolist())


def test_static_buffers_never_move():
    """Append methods too: prompt + max_new_tokens slots allocated at prefill, written in place."""
    model = tiny_model("llama")
    for method in (Full(), SnapStream(budget=32, recent=8, window=8)):
        cache = StaticKVCache.for_model(method, model, max_new_tokens=40)
        with torch.inference_mode():
            token = model(prompts((100,))[0][None], cache=cache).logits[:, -1:].argmax(-1)
            ptrs = [(lay.keys.data_ptr(), lay.values.data_ptr(), lay.pos.data_ptr()) for lay in cache.layers]
            shape = cache.layers[0].keys.shape
            for _ in range(39):
                token = model(token, cache=cache).logits[:, -1:].argmax(-1)
        assert [
            (lay.keys.data_ptr(), lay.values.data_ptr(), lay.pos.data_ptr()) for lay in cache.layers
        ] == ptrs
        assert cache.layers[0].keys.shape == shape == (1, 2, 140 if method.name == "full" else 32, 16)
        assert cache.stats()["seen"] == 139  # 100 prompt tokens, 39 decoded


def test_static_cache_refuses_what_it_cannot_do():
    model = tiny_model("llama")
    for bad in (None, 0, True, 2.5):
        with pytest.raises(ValueError, match="needs max_new_tokens"):
            StaticKVCache.for_model(Full(), model, max_new_tokens=bad)
    StaticKVCache.for_model(SnapStream(budget=64), model)  # a ring needs no decode budget
    cache = StaticKVCache.for_model(Full(), model, max_new_tokens=8)
    with torch.inference_mode():
        model(prompts((20,))[0][None], cache=cache)
        with pytest.raises(ValueError, match="one token per forward"):
            model(prompts((3,))[0][None], cache=cache)
    with pytest.raises(ValueError, match="chunked prefill"):
        generate(model, prompts((20,))[0][None], Full(), compile=True, max_new_tokens=4, prefill_chunk_size=8)


# --- compiled: one graph, once per shape, every step through it ------------------------------------------
@pytest.mark.parametrize(
    "arch, new",
    [("llama", 520), ("deepseek_v3", 64), pytest.param("deepseek_v3", 520, marks=pytest.mark.slow)],
)
def test_one_graph_no_recompile_over_a_ring_that_wraps(arch, new):
    """`new` decode steps through a 16-slot ring (520: it wraps 32 times): one graph, compiled once, run at
    every step, tokens equal to eager; then once per (batch, slots) shape, whatever the prompt length."""
    model = tiny_model(arch)
    counting = Counting()
    method = SnapStream(budget=64, recent=16, window=8)
    ids = prompts((100,))[0][None]
    out, _ = gen(model, ids, method, backend=counting, new=new)
    steps = new - 1  # the first token comes from the eager prefill
    assert (counting.compiled, counting.runs) == (1, steps)
    assert not counters["graph_break"]
    ref, _ = gen(model, ids, method, new=new)
    assert torch.equal(out.sequences, ref.sequences)
    # another request of the same (batch, slots) shape, a new cache, another prompt length: no compilation
    gen(model, prompts((150,))[0][None], method, backend=counting, new=8)
    assert (counting.compiled, counting.runs) == (1, steps + 7)
    # another batch size is another shape: compiled once more
    ids, mask, _ = left_pad(prompts((150, 40)))
    gen(model, ids, method, mask, backend=counting, new=8)
    assert (counting.compiled, counting.runs) == (2, steps + 14)


def test_shared_prefill_replay_compiles_once():
    """lm.py runs every request inside `shared_prefill` (a new forward wrapper each time) and replays recorded
    prefills into other budgets' caches: still one compilation per shape."""
    model = tiny_model("llama", seed=8)
    counting = Counting()
    ids = prompts((150,))[0][None]
    first, other = SnapStream(budget=48, recent=8, window=8), SnapStream(budget=64, recent=16, window=8)
    outs = []
    for _ in range(2):  # two requests
        record = PrefillRecord(window=32)
        for method, rec, replay in ((first, record, None), (other, None, record)):
            cache = StaticKVCache.for_model(method, model, record=rec, replay=replay)
            with torch.inference_mode(), shared_prefill(model):
                outs.append(
                    model.generate(
                        ids,
                        cache=cache,
                        max_new_tokens=12,
                        min_new_tokens=12,
                        do_sample=False,
                        compile_config=compile_config(model, backend=counting),
                    )
                )
    assert (counting.compiled, counting.runs) == (2, 44)  # two budgets (two shapes), 11 steps x 4 generations
    for method, out in zip((first, other), outs[:2]):
        assert torch.equal(out, gen(model, ids, method, new=12)[0].sequences)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def test_explain_reports_no_graph_break():
    """`torch._dynamo.explain` on one decode step: one graph, zero graph breaks (the MLA model as well)."""
    for arch in ("llama", "deepseek_v3"):
        model = tiny_model(arch)
        cache = StaticKVCache.for_model(SnapStream(budget=32, recent=8, window=8), model)
        with torch.inference_mode():
            token = model(prompts((60,))[0][None], cache=cache).logits[:, -1:].argmax(-1)
            explained = torch._dynamo.explain(model.__call__)(input_ids=token, cache=cache)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


# --- inductor: the code that really runs compiled, equal to eager ----------------------------------------
def test_inductor_batch_equals_eager():
    """Left-padded batch (a short row on the padded ring, rings that wrap), greedy and sampled: inductor's
    compiled step gives the eager tokens."""
    model = tiny_model("llama", seed=1)
    ids, mask, _ = left_pad(prompts((150, 97, 40)))
    method = SnapStream(budget=64, recent=16, window=8)
    counting = Counting("inductor")
    assert_same_generation(
        gen(model, ids, method, mask, backend=counting), gen(model, ids, method, mask), 1e-4
    )
    torch.manual_seed(5)
    sampled = gen(model, ids, method, mask, backend=counting, do_sample=True, top_k=0)
    torch.manual_seed(5)
    assert_same_generation(sampled, gen(model, ids, method, mask, do_sample=True, top_k=0), 1e-4)
    assert (counting.compiled, counting.runs) == (1, 58)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("method", METHODS, ids=IDS)
@pytest.mark.parametrize("lengths", [(150,), (150, 97, 40, 123)], ids=["batch1", "batch4"])
def test_inductor_equals_eager_all_methods(arch, method, lengths):
    model = tiny_model(arch, seed=1)
    ids, mask, _ = left_pad(prompts(lengths))
    counting = Counting("inductor")
    assert_same_generation(
        gen(model, ids, method, mask, backend=counting), gen(model, ids, method, mask), 1e-4
    )
    assert (counting.compiled, counting.runs) == (1, 29)


@pytest.mark.slow
def test_smollm2_512_steps_one_graph(smollm2):
    model, tok = smollm2
    ids = tok("The history of the river Rhine", return_tensors="pt")["input_ids"]
    method = SnapStream(budget=128, recent=32, window=16)
    counting = Counting()
    out = gen(model, ids, method, backend=counting, new=520)
    assert (counting.compiled, counting.runs) == (1, 519)
    assert_same_generation(out, gen(model, ids, method, new=520), 1e-4)


# --- CUDA: inductor with CUDA graphs (mode="reduce-overhead"), scripts/gpu_check.sh ------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "arch",
    [
        "llama",
        pytest.param(
            "deepseek_v3",
            marks=pytest.mark.xfail(
                raises=RuntimeError,
                strict=True,
                reason="transformers 5.24's fp32 MoE experts (its grouped-mm fallback) copy expert offsets "
                "to the host (offs.tolist()) inside the captured step: 'Cannot copy between CPU and CUDA "
                "tensors during CUDA graph capture' (seen on an H200, 2026-12-04); not evalkit's cache",
            ),
        ),
    ],
)
def test_cuda_graphs_equal_eager(arch, monkeypatch):
    """fp32 on CUDA: CUDA-graph replays give the eager tokens; a skipped CUDA graph is an error here (the
    static buffers must be pinned, no data-dependent op in the step); one graph per shape across requests."""
    monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", True)
    model = tiny_model(arch).cuda()
    ids, mask, _ = left_pad(prompts((150, 97, 40)))
    ids, mask = ids.cuda(), mask.cuda()
    for method in (SnapStream(budget=64, recent=16, window=8), Full(), SnapKV(budget=64, window=8)):
        graphs = counters["stats"]["unique_graphs"]
        for _ in range(2):  # a second request: new cache buffers, CUDA graphs re-recorded, nothing recompiled
            assert_same_generation(
                gen(model, ids, method, mask, backend="inductor"), gen(model, ids, method, mask), 1e-4
            )
        assert counters["stats"]["unique_graphs"] - graphs == 1, method.name
    assert not counters["inductor"]["cudagraph_skips"]
