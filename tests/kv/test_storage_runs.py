"""The KV storage wired into runs (issue 32.1): the slot caches and the engine's pool hold K/V as the storage
says (fp8 codes + frozen scales), attention reads them dequantized, the bytes a run measures equal
evalkit.memory's model, the pool equals the storage's own full cache (`StoredCache`) and batch 1, the compiled
step equals the eager one, and run identity and folders keep two storages apart."""

import pytest
import torch

from evalkit.engine import Engine
from evalkit.kv import H2O, Full, KVCache, SnapKV, SnapStream, StreamingLLM
from evalkit.kv.storage import Fp8Storage, NoStorage, StoredCache, make_storage
from evalkit.memory.model import kv_geometry
from evalkit.turns import ask
from tests.conftest import TINY, tiny_model
from tests.kv.test_compile import Counting
from tests.kv.test_engine import Tok, prompts, settings

NEW = 12
STORAGES = {
    "none": NoStorage(),
    "fp8_e4m3": make_storage("fp8_e4m3"),
    "fp8_e5m2": make_storage("fp8_e5m2"),
    "fp8_e4m3_tensor": Fp8Storage(scale="tensor"),
}
METHODS = {
    "full": Full(),
    "snapkv": SnapKV(budget=64, window=16),
    "snapstream": SnapStream(budget=64, recent=16, window=8),
    "streamingllm": StreamingLLM(budget=48),
    "h2o": H2O(budget=48),
}


def run(model, method, storage, rows=2, compile=False, n=3):
    ids = prompts()[:n]
    engine = Engine(model, Tok(), [0], rows, compile=compile, storage=storage)
    reqs = [ask(str(i), x, NEW, method, settings(False, NEW), i) for i, x in enumerate(ids)]
    return {d.key: d for d in engine.run(reqs)}, engine


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("method", METHODS)
def test_measured_bytes_equal_modelled(method, storage):
    """Each request's `kv_bytes` (every byte its row of the pool holds: codes and scales) = evalkit.memory's
    sequence bytes for its slots under the same storage."""
    model = tiny_model("llama", seed=3)
    done, _ = run(model, METHODS[method], STORAGES[storage])
    geometry = kv_geometry(TINY["llama"], "float32", storage=STORAGES[storage])
    for d in done.values():
        assert d.stats["kv_bytes"] == geometry.sequence_bytes(d.stats["kv_slots"]), d.key
    plain = kv_geometry(TINY["llama"], "float32")
    if storage != "none":  # codes really are held: a quarter of float32 plus the scales
        assert all(
            d.stats["kv_bytes"] < plain.sequence_bytes(d.stats["kv_slots"]) // 3 for d in done.values()
        )


def test_pool_holds_fp8_codes_and_none_the_model_dtype():
    model = tiny_model("llama", seed=3)
    for storage, dtype, scales in (
        (NoStorage(), torch.float32, 0),
        (make_storage("fp8_e4m3"), torch.uint8, 2),
    ):
        _, engine = run(model, METHODS["snapstream"], storage, n=1, rows=1)
        layer = engine.pool.layers[0]
        assert layer.keys.dtype == layer.values.dtype == dtype and len(layer.scales) == scales


@pytest.mark.parametrize("storage", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pool_equals_the_storages_full_cache_and_batch_one(storage):
    """A full cache in the pool (any row count) decodes the tokens of transformers' generate over the
    storage's own full cache (`StoredCache`, the path compared with transformers' QuantizedCache)."""
    model, s = tiny_model("llama", seed=3), STORAGES[storage]
    want = {}
    for i, x in enumerate(prompts()[:3]):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([x]),
                cache=StoredCache.for_model(s, model),
                generation_config=settings(False, NEW),
            )
        want[str(i)] = out[0, len(x) :].tolist()
    for rows in (1, 3):
        done, _ = run(model, Full(), s, rows=rows)
        assert {k: d.tokens for k, d in done.items()} == want, rows


def test_fp8_changes_the_tokens_somewhere():
    """The storage is applied, not ignored: fp8_e5m2 (2 mantissa bits) moves some logit."""
    model = tiny_model("llama", seed=3)
    ids = torch.tensor([prompts()[0]])
    logits = []
    for s in (NoStorage(), STORAGES["fp8_e5m2"]):
        cache = KVCache.for_model(Full(), model, storage=s)
        with torch.inference_mode():
            model(input_ids=ids, cache=cache, use_cache=True)
            out = model(input_ids=ids[:, -1:], cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
    assert not torch.equal(*logits)
    assert (logits[0] - logits[1]).abs().max() < 0.5  # ... within fp8's precision


@pytest.mark.parametrize("method", ["snapstream", "snapkv"])
def test_fp8_compiled_equals_eager(method):
    """The compiled decode step (one graph) with fp8 codes decodes the eager step's tokens."""
    model = tiny_model("llama", seed=3)
    eager, _ = run(model, METHODS[method], STORAGES["fp8_e4m3"])
    backend = Counting()
    compiled, _ = run(model, METHODS[method], STORAGES["fp8_e4m3"], compile=backend)
    assert {k: d.tokens for k, d in compiled.items()} == {k: d.tokens for k, d in eager.items()}
    assert backend.compiled == 1


def test_the_quantized_bench_holds_the_modelled_bytes():
    """`make bench`'s quantized rows time a cache that holds what evalkit.memory models (its memory floor is
    the storage's bytes), and its fp8 step attends to about what the model dtype's does."""
    from evalkit.bench import quantized as bench

    shape, out = bench.SHAPE, {}
    for name in bench.STORAGES:
        storage = make_storage(name)
        cache = bench.layers(storage, 256, torch.bfloat16)
        want = storage.layer_bytes(256, 0, shape["kv_heads"], shape["head_dim"], shape["head_dim"], 16)
        assert bench.held_bytes(cache) == shape["layers"] * want, name
        g = torch.Generator().manual_seed(1)
        q = torch.randn(1, shape["q_heads"], 1, shape["head_dim"], generator=g).to(torch.bfloat16)
        k, v = (torch.randn(1, shape["kv_heads"], 1, shape["head_dim"], generator=g).bfloat16() for _ in "kv")
        out[name] = bench.step(storage, cache, q, k, v, 3).float()
    assert (out["fp8_e4m3"] - out["none"]).abs().max() < 0.1 and not torch.equal(out["fp8_e4m3"], out["none"])
