"""Any prefill scorer in SnapStream's fixed-size layout (`Ringed`, issue 33 item 2): with SnapKV's scorer it
is `snapstream` (kept sets and tokens), with another it keeps the sinks, the last `recent` prompt tokens and
the scorer's top of the middle (float64 references of KnormPress and TOVAPress restricted to the middle), and
it decodes fixed-size through the engine: batch = single, compiled (one graph) = eager."""

import pytest
import torch

from evalkit.kv import KVCache, Ringed, SnapStream, generate
from evalkit.kv import scorers as sc
from evalkit.kv.config import make_method
from evalkit.kv.prefill import shared_prefill
from tests.conftest import tiny_model
from tests.kv.test_batched import left_pad
from tests.kv.test_compile import Counting, assert_same_generation, gen
from tests.kv.test_rivals import L, StubTokenizer, held_sets, prompt
from tests.kv.test_rivals import spy as spy  # noqa: F401 (the fixture)

RINGS = [
    Ringed(budget=48, recent=12, scorer=sc.KeyNormScore()),
    Ringed(budget=48, recent=12, scorer=sc.LastQueryScore()),
    Ringed(budget=48, recent=12, scorer=sc.ExpectedAttentionScore(future=64)),
    Ringed(budget=48, recent=12, scorer=sc.ReconstructionScore(chunk=64)),
]
IDS = [m.describe()["name"] for m in RINGS]
SEED = 5  # a prompt whose kept sets are no near-tie at the cut (gap > 1e-6)


def test_with_snapkvs_scorer_it_is_snapstream():
    """Same kept sets per layer and KV head after prefill, same tokens through a ring that wraps, both spare
    slot settings (a 30-token prompt pads the top-K block or grows the ring)."""
    model = tiny_model("llama", seed=3)
    for spare in ("pad", "ring"):
        snap = SnapStream(budget=40, recent=8, window=8, spare_slots=spare)
        ring = Ringed(budget=40, recent=8, spare_slots=spare, scorer=sc.SnapKVScore(window=8))
        for n in (L, 30):
            ids = prompt(seed=7, n=n)
            caches = [KVCache.for_model(m, model) for m in (snap, ring)]
            with torch.no_grad():
                for c in caches:
                    model(ids, cache=c)
            for layer in range(len(caches[0].layers)):
                assert held_sets(caches[0], layer) == held_sets(caches[1], layer), (spare, n, layer)
            a, _ = generate(model, ids, snap, max_new_tokens=20, do_sample=False)
            b, _ = generate(model, ids, ring, max_new_tokens=20, do_sample=False)
            assert torch.equal(a, b), (spare, n)


def _ring_ref(scores, sink, recent, budget):
    """Per head: the sinks, the last `recent` positions, and the top of the middle [sink, L - recent)."""
    n = budget - sink - recent
    fixed = set(range(sink)) | set(range(L - recent, L))
    keep, gap = [], float("inf")
    for head in scores:
        ranked = sorted(range(sink, L - recent), key=lambda j: -float(head[j]))
        keep.append(fixed | set(ranked[:n]))
        a, b = float(head[ranked[n - 1]]), float(head[ranked[n]])
        gap = min(gap, (a - b) / max(abs(a), 1e-300))
    return keep, gap


@pytest.mark.parametrize("method", RINGS[:2], ids=IDS[:2])
def test_keeps_sinks_ring_and_the_scorers_top_of_the_middle(method, spy):  # noqa: F811
    model = tiny_model("llama", seed=3)
    cache = KVCache.for_model(method, model)
    with torch.no_grad():
        model(prompt(seed=SEED), cache=cache)
    for layer, [(q, k, _, scaling)] in spy["attn"].items():
        if method.scorer.name == "knorm":  # knorm_press.py: minus the key's L2 norm
            scores = -k.double().norm(dim=-1)
        else:  # tova_press.py: the last query's softmax over every key, averaged over all query heads
            keys = k.double().repeat_interleave(q.shape[0] // k.shape[0], 0)
            probs = (torch.einsum("hd,hld->hl", q[:, -1].double(), keys) * scaling).softmax(-1)
            scores = probs.mean(0)[None].expand(k.shape[0], -1)
        want, gap = _ring_ref(scores, method.sink, method.recent, method.budget)
        assert gap > 1e-6, (layer, gap)
        assert held_sets(cache, layer) == want, layer


@pytest.mark.parametrize("method", RINGS, ids=IDS)
def test_batch_equals_single_through_a_wrapping_ring(method):
    """A left-padded batch through the engine gives each row its tokens alone; 20 new tokens wrap the
    12-slot ring; the cache stays `budget` slots."""
    model = tiny_model("llama", seed=5)
    rows = [prompt(seed=10 + i, n=n)[0] for i, n in enumerate([150, 97, 61])]
    ids, mask, t = left_pad(rows)
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, tokenizer=StubTokenizer())
    batch, stats = generate(model, ids, method, attention_mask=mask, **kw)
    for r, row in enumerate(rows):
        alone, _ = generate(model, row[None], method, **kw)
        assert batch[r, t:].tolist() == alone[0, len(row) :].tolist(), r


@pytest.mark.parametrize("method", RINGS[1:3], ids=IDS[1:3])
def test_compiled_step_is_one_graph_equal_to_eager(method):
    model = tiny_model("llama", seed=1)
    ids, mask, _ = left_pad([prompt(seed=3, n=n)[0] for n in (150, 97, 40)])
    counting = Counting("eager")
    assert_same_generation(gen(model, ids, method, mask, backend=counting), gen(model, ids, method, mask), 0)
    assert (counting.compiled, counting.runs) == (1, 29)


def test_confs_make_the_rings_and_name_them_by_scorer():
    ea, kvzip = make_method("expected_attention_ring"), make_method("kvzip_ring", budget=128)
    assert isinstance(ea.scorer, sc.ExpectedAttentionScore) and ea.blocks() == (4, 32, 220)
    assert (ea.describe()["name"], kvzip.describe()["name"]) == ("expected_attention_ring", "kvzip_ring")
    # a shared prefill keeps expected attention's score per entry, not every prompt query (it kept them all
    # before: tests/kv/test_shared_prefill.py, the record's bytes); KVzip's pass needs the last query only
    assert (ea.window, ea.records_score, kvzip.window, kvzip.records_score) == (0, True, 1, False)


def test_kvzip_ring_runs_its_reconstruction_pass():
    """The scorer's pass comes with it: the ring's top-K equals KVzip's ranking of the middle."""
    model, tok = tiny_model("llama", seed=3), StubTokenizer()
    method = RINGS[3]
    ids = prompt()
    cache = KVCache.for_model(method, model)
    with torch.no_grad(), shared_prefill(model, tok):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True)
    assert cache.record is None or cache.record.hints  # the hint reached the scorer (else it raises)
    held = held_sets(cache, 0)
    assert all(set(range(4)) | set(range(L - 12, L)) <= h and len(h) == 48 for h in held)


def test_a_ring_runs_folder_names_its_conf_and_changed_scorer_settings(tmp_path):
    from tests.conftest import planned_folder

    out = planned_folder(
        tmp_path,
        "model=tiny_llama",
        "method=kvzip_ring",
        "method.budget=64",
        "method.scorer.chunk=512",
        "method.recent=16",
    )
    assert out.parts[-2:] == ("kvzip_ring", "64-recent16-scorer.chunk512")
    out = planned_folder(tmp_path, "model=tiny_llama", "method=expected_attention_ring", "method.budget=64")
    assert out.parts[-2:] == ("expected_attention_ring", "64")


def test_the_report_reads_a_scorer_rings_recent_block_from_its_run(tmp_path):
    """The report rebuilds a run's method to read its ring (the entries a quantized storage keeps in the model
    dtype): for expected_attention_ring it merged the recorded scorer description (its `name` among its
    settings) into the conf and failed; it builds from the run's saved config, or, for a metrics.json
    without one, from the conf and the plain settings recorded."""
    import dataclasses

    from evalkit import metrics as metrics_record
    from evalkit.report.budget import ring_of
    from evalkit.report.runs import Run
    from tests.conftest import fresh_run, the_run

    run = ["model=tiny_llama", "model.max_new_tokens=4", "task.load.n=1", "task.load.lengths=[1024]"]
    ring = ["method=expected_attention_ring", "method.budget=64", "method.recent=40"]
    fresh_run(*run, *ring, results=tmp_path)
    folder = the_run(tmp_path, "expected_attention_ring", "64-recent40")
    m = metrics_record.load(folder / "metrics.json", strict=False)
    assert ring_of(Run(folder, "r", m)) == 40
    older = dataclasses.replace(m, provenance={k: v for k, v in m.provenance.items() if k != "config"})
    assert ring_of(Run(folder, "r", older)) == 40
