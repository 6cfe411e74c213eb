"""Integer KV (KIVI) held in evalkit's slot caches (`evalkit.kv.storage.kivi_slots`): the engine's pool
decodes the tokens of the storage's own full cache (`StoredCache`, KIVI's reference path, itself equal to a
float64 KIVI) across residual blocks, compiled equals eager in one graph, a pool of rows of several lengths
and budgets equals each row alone, a ring row keeps its ring raw while its sinks and top-K are coded, and the
bytes a row reports equal `IntStorage.layer_bytes` (what evalkit.memory models)."""

import pytest
import torch

from evalkit.engine import Engine
from evalkit.kv import Full, SnapKV, SnapStream, StaticKVCache, StreamingLLM
from evalkit.kv.pool import BUCKETS, Buckets
from evalkit.kv.storage import IntStorage, NoStorage, StoredCache
from evalkit.memory.model import kv_geometry
from evalkit.turns import ask
from tests.conftest import TINY, tiny_model
from tests.kv.test_compile import Counting
from tests.kv.test_engine import Tok, prompts, settings

# tiny llama heads are 16 wide: groups of 8; residual 16 (int2: 32) so short decodes cross several blocks
INT = {
    "int8": IntStorage(bits=8, group=8, residual=16),
    "int4": IntStorage(bits=4, group=8, residual=16),
    "int2": IntStorage(bits=2, group=8, residual=32),
}
METHODS = {
    "full": Full(),
    "snapkv": SnapKV(budget=64, window=16),
    "snapstream": SnapStream(budget=64, recent=16, window=8),
    "streamingllm": StreamingLLM(budget=48),
}
SMALL = Buckets(floor=12, per_octave=4)  # 12, 16, 20, 24, 28, 32, 40, ...
LENGTHS = (5, 16, 17, 40, 90)  # shorter than the residual, a whole block, one past it, several blocks
NEW = 40


def ids(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def pooled(model, reqs, storage, rows, compile=False, new=NEW, buckets=BUCKETS):
    """{key: Done} of the engine decoding `reqs` [(ids, method)] in a pool of `rows` rows."""
    engine = Engine(model, Tok(), [0], rows, compile=compile, storage=storage, buckets=buckets)
    asks = [
        ask(str(i), x, new, m, settings(False, new), i, keep_logits=True) for i, (x, m) in enumerate(reqs)
    ]
    return {d.key: d for d in engine.run(asks)}, engine


@pytest.mark.parametrize("name", INT)
def test_int_pool_equals_the_kivi_full_cache(name):
    """Greedy decode in the pool (1 row; 3 rows attending over small buckets: visible slots that cut key
    groups) = transformers' generate over `StoredCache` with the same IntStorage, token for token, and every
    step's logits close, for prompts shorter and longer than the residual and 40 new tokens (several key
    blocks quantized while decoding)."""
    model, storage = tiny_model("llama", seed=3), INT[name]
    want, logits = {}, {}
    for i, x in enumerate(ids()):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([x]),
                cache=StoredCache.for_model(storage, model),
                generation_config=settings(False, NEW),
                return_dict_in_generate=True,
                output_logits=True,
            )
        want[str(i)] = out.sequences[0, len(x) :].tolist()
        logits[str(i)] = torch.stack([step[0] for step in out.logits])  # (NEW, V)
    for rows, buckets in ((1, BUCKETS), (3, SMALL)):
        done, engine = pooled(model, [(x, Full()) for x in ids()], storage, rows, buckets=buckets)
        assert {k: d.tokens for k, d in done.items()} == want, rows
        for k, d in done.items():
            got = torch.stack([x.float() for x in d.logits])
            assert torch.allclose(got, logits[k].float(), atol=1e-4), (rows, k)
    assert any(visible % 8 for _, _, visible in engine.shapes)  # a bucket that ends inside a key group


def test_int2_moves_the_logits():
    """The storage is applied, not ignored: int2 decodes other logits than the model dtype."""
    model = tiny_model("llama", seed=3)
    reqs = [(x, Full()) for x in ids()]
    int2, _ = pooled(model, reqs, INT["int2"], 2, new=8)
    plain, _ = pooled(model, reqs, NoStorage(), 2, new=8)
    gaps = [(torch.stack(int2[k].logits) - torch.stack(plain[k].logits)).abs().max() for k in plain]
    assert max(gaps) > 1e-3


@pytest.mark.parametrize("method", ["snapstream", "full"])
def test_int_compiled_equals_eager_in_one_graph(method):
    model, storage = tiny_model("llama", seed=3), INT["int4"]
    reqs = [(x, METHODS[method]) for x in ids()[1:4]]
    eager, _ = pooled(model, reqs, storage, 3)
    backend = Counting()
    compiled, _ = pooled(model, reqs, storage, 3, compile=backend)
    assert {k: d.tokens for k, d in compiled.items()} == {k: d.tokens for k, d in eager.items()}
    assert backend.compiled == 1


def test_int_batch_equals_single_across_lengths_and_budgets():
    """A pool of rows of different prompt lengths and SnapStream budgets (rings of different widths: the
    pool's raw windows grow to the widest as its rows arrive) decodes what each row does alone, and each row
    reports the bytes it holds alone."""
    model, storage = tiny_model("llama", seed=3), INT["int4"]
    budgets = ((64, 16), (128, 32), (96, 24), (64, 16), (128, 32))
    reqs = [(x, SnapStream(budget=b, recent=r, window=8)) for x, (b, r) in zip(prompts(), budgets)]
    alone, _ = pooled(model, reqs, storage, 1, new=24)
    together, engine = pooled(model, reqs, storage, 3, new=24)
    assert {k: d.tokens for k, d in together.items()} == {k: d.tokens for k, d in alone.items()}
    assert engine.pool.layers[0].scales[0].shape[2] == 32  # the widest ring's raw window (first row: 16)
    geometry = kv_geometry(TINY["llama"], "float32", storage=storage)
    for (k, d), (_, m) in zip(sorted(together.items(), key=lambda kd: int(kd[0])), reqs):
        assert d.stats["kv_bytes"] == alone[k].stats["kv_bytes"], k
        assert d.stats["kv_bytes"] == geometry.sequence_bytes(d.stats["kv_slots"], m.blocks()[1]), k


def _static(model, method, storage, prompt, fed):
    """A one-row static cache after prefill and a decode of the tokens `fed`."""
    cache = StaticKVCache.for_model(method, model, max_new_tokens=len(fed), storage=storage)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
        for t in fed:
            model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
    return cache


def test_a_ring_stays_raw_while_sinks_and_topk_are_quantized():
    """SnapStream with int4: layer 0's K/V as attention reads them equal the model dtype's exactly in the
    ring (20 decode steps wrap the 16-slot ring), and differ, within int4's error, in the sinks and top-K."""
    model, method = tiny_model("llama", seed=3), METHODS["snapstream"]
    prompt, fed = prompts()[0], list(range(40, 60))  # 150 tokens into 64 slots: sinks 4, top-K 44, ring 16
    plain = _static(model, method, NoStorage(), prompt, fed)
    coded = _static(model, method, INT["int4"], prompt, fed)
    assert torch.equal(plain.layers[0].pos, coded.layers[0].pos)  # the same entries kept (scored raw)
    ring = slice(4, 4 + 16)
    for want, got in zip(plain.layers[0].held(), coded.layers[0].held()):
        assert torch.equal(got[:, :, ring], want[:, :, ring])
        kept = torch.cat([got[:, :, :4] - want[:, :, :4], got[:, :, 20:] - want[:, :, 20:]], 2)
        assert 0 < kept.abs().max() < 0.25 * want.abs().max()
    assert coded.layers[0].keys.dtype == torch.uint8 and coded.layers[0].scales[0].shape[2] == 16


@pytest.mark.parametrize("name", INT)
def test_int_measured_bytes_equal_modelled(name):
    """Each request's `kv_bytes` (its row's slot bytes and its raw windows) = evalkit.memory's sequence
    bytes for its slots (and ring) under the same storage, for full, snapkv, snapstream and streamingllm rows
    of one pool; below the model dtype's unless the ring is nearly the whole budget (streamingllm: every ring
    slot holds its unused codes beside its raw entry)."""
    model, storage = tiny_model("llama", seed=3), INT[name]
    reqs = [(x, m) for m in METHODS.values() for x in prompts()[:2]]
    done, _ = pooled(model, reqs, storage, 2, new=12)
    geometry = kv_geometry(TINY["llama"], "float32", storage=storage)
    plain = kv_geometry(TINY["llama"], "float32")
    for i, (_, m) in enumerate(reqs):
        slots, held = done[str(i)].stats["kv_slots"], done[str(i)].stats["kv_bytes"]
        assert held == geometry.sequence_bytes(slots, m.blocks()[1] if m.ring else 0), (m.name, i)
        if m.name != "streamingllm":
            assert held < plain.sequence_bytes(slots), (m.name, i)


def test_generate_reserves_the_pools_codes_and_windows():
    """`generate`'s `reserved_bytes` is the engine pool's whole allocation in its storage: every slot's codes
    and the raw windows beside them (`SlotPool.allocated_bytes`), so never below the bytes its rows hold (it
    counted the codes alone: less than a full row's codes + windows)."""
    from evalkit.kv import generate

    model = tiny_model("llama", seed=3)
    x = torch.tensor([ids((90,))[0]])
    _, stats = generate(model, x, Full(), storage=INT["int4"], max_new_tokens=8, min_new_tokens=8)
    _, plain = generate(model, x, Full(), max_new_tokens=8, min_new_tokens=8)
    assert stats["bytes"] <= stats["reserved_bytes"] < plain["reserved_bytes"]


@pytest.mark.parametrize("storage", ["int4", "fp8"])
def test_generate_counts_each_layers_codes_and_windows(storage):
    """`generate`'s per-layer bytes are each row's slots of that layer and the storage's tensors beside them
    (int's raw windows, fp8's scales): they add up to the rows' bytes (they counted the codes alone)."""
    from evalkit.kv import generate
    from evalkit.kv.storage import make_storage

    store = INT["int4"] if storage == "int4" else make_storage("fp8_e4m3")
    model = tiny_model("llama", seed=3)
    x = torch.tensor([ids((90,))[0]])
    _, stats = generate(model, x, SnapStream(budget=64, window=8), storage=store, max_new_tokens=8)
    per_layer = [d["bytes"] for d in stats["per_layer"]]
    assert len(per_layer) == TINY["llama"]["num_hidden_layers"]
    assert sum(per_layer) == stats["bytes"] == sum(r["bytes"] for r in stats["rows"])
    assert len(set(per_layer)) == 1  # every layer alike here
