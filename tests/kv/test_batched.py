"""Batched generation (left padding, per-row selection and ring positions) equals batch size 1, token for
token: a left-padded batch decodes through the engine (`evalkit.kv.generate`, each row in its own slot of one
pool), each row alone through transformers' decode loop with the dynamic cache; the dynamic cache refuses such
a batch."""

import pytest
import torch

from evalkit.engine import Engine
from evalkit.kv import Full, KVCache, SnapKV, SnapStream, StreamingLLM, generate
from evalkit.kv.pool import SlotPool
from evalkit.turns import ask
from tests.conftest import tiny_model

METHODS = [
    Full(),
    StreamingLLM(budget=48),
    SnapKV(budget=64, window=8),
    SnapStream(budget=64, recent=16, window=8),
    SnapStream(budget=64, recent=16, window=8, spare_slots="ring"),
]


def left_pad(prompts: list[torch.Tensor], pad: int = 0):
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    return ids, mask, width


def decoded_pool(model, prompts, method, new: int) -> SlotPool:
    """The engine's pool after decoding each prompt in its own row (row r = prompt r: all end together)."""
    config = model.generation_config
    engine = Engine(model, None, [], len(prompts))
    reqs = [ask(str(r), p.tolist(), new, method, config, 0) for r, p in enumerate(prompts)]
    list(engine.run(reqs))
    return engine.pool


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.name}-{getattr(m, 'spare_slots', '')}")
def test_batch_equals_single_rows(arch, method):
    model = tiny_model(arch, seed=1)
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(0, 256, (n,), generator=g) for n in (150, 97, 40, 123)
    ]  # 40 < budget: padded ring
    ids, mask, width = left_pad(prompts)
    kw = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False)
    out, stats = generate(model, ids, method, attention_mask=mask, **kw)
    pool = decoded_pool(model, prompts, method, 30)
    alone_rows = []
    for r, p in enumerate(prompts):
        alone_cache = KVCache.for_model(method, model)
        with torch.no_grad():
            alone = model.generate(p[None], cache=alone_cache, **kw)
        assert torch.equal(alone[0, len(p) :], out[r, width:]), (method.name, r)
        for layer in range(model.config.num_hidden_layers):  # the same positions, per head, in each row
            got = pool.positions(layer)[r]
            want = alone_cache.positions(layer)[0]
            for h in range(got.shape[0]):
                assert set(got[h][got[h] >= 0].tolist()) == set(want[h][want[h] >= 0].tolist()), (layer, h)
        alone_rows.append(alone_cache.row_stats()[0])
    assert stats["rows"] == alone_rows  # per-row KV statistics equal a run of that row alone


def test_dynamic_cache_refuses_a_left_padded_batch():
    """Rows of different lengths decode only through the engine; rows of one length still decode together."""
    model = tiny_model("llama", seed=1)
    g = torch.Generator().manual_seed(3)
    ids, mask, _ = left_pad([torch.randint(0, 256, (n,), generator=g) for n in (50, 40)])
    with torch.no_grad(), pytest.raises(ValueError, match="use evalkit.kv.generate or evalkit.engine.Engine"):
        model.generate(ids, attention_mask=mask, cache=KVCache.for_model(Full(), model), max_new_tokens=3)
    same = torch.randint(0, 256, (1, 50), generator=g).repeat(2, 1)
    with torch.no_grad():
        out = model.generate(
            same, cache=KVCache.for_model(SnapStream(budget=32, recent=8, window=8), model), max_new_tokens=5
        )
    assert torch.equal(out[0], out[1])
