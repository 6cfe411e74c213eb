"""Batched generation (left padding, per-row selection and ring positions) equals batch size 1, token for token."""

import pytest
import torch

from evalkit.kv import Full, KVCache, SnapKV, SnapStream, StreamingLLM
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


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.name}-{getattr(m, 'spare_slots', '')}")
def test_batch_equals_single_rows(arch, method):
    model = tiny_model(arch, seed=1)
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(0, 256, (n,), generator=g) for n in (150, 97, 40, 123)
    ]  # 40 < budget: padded ring
    ids, mask, width = left_pad(prompts)
    batch_cache = KVCache.for_model(method, model)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, cache=batch_cache, max_new_tokens=30, min_new_tokens=30, do_sample=False
        )
    alone_rows = []
    for r, p in enumerate(prompts):
        alone_cache = KVCache.for_model(method, model)
        with torch.no_grad():
            alone = model.generate(
                p[None], cache=alone_cache, max_new_tokens=30, min_new_tokens=30, do_sample=False
            )
        assert torch.equal(alone[0, len(p) :], out[r, width:]), (method.name, r)
        for layer in range(model.config.num_hidden_layers):  # the same positions, per head, in each row
            got = batch_cache.positions(layer)[r]
            want = alone_cache.positions(layer)[0]
            for h in range(got.shape[0]):
                assert set(got[h][got[h] >= 0].tolist()) == set(want[h][want[h] >= 0].tolist()), (layer, h)
        alone_rows.append(alone_cache.row_stats()[0])
    assert batch_cache.row_stats() == alone_rows  # per-row KV statistics equal a run of that row alone
