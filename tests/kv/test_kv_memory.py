"""Reported bytes equal the KV-memory formulas: GQA 2·layers·kv_heads·head_dim·bytes, MLA latent widths."""

import pytest
import torch

from evalkit.kv import Full, SnapKV, SnapStream, StreamingLLM, generate
from tests.conftest import TINY, tiny_model


@pytest.mark.parametrize(
    "method", [Full(), StreamingLLM(budget=48), SnapKV(budget=48, window=8), SnapStream(budget=48)]
)
def test_gqa_bytes(method):
    model = tiny_model("llama")
    cfg = TINY["llama"]
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(0))
    _, stats = generate(model, ids, method, max_new_tokens=10, do_sample=False, min_new_tokens=10)
    entries = stats["slots"]
    expected_slots = {"full": 109, "streamingllm": 48, "snapkv": 48 + 9, "snapstream": 48}[method.name]
    assert entries == expected_slots
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert (
        stats["bytes"] == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4 * entries
    )
    assert all(d["bytes"] == stats["bytes"] // cfg["num_hidden_layers"] for d in stats["per_layer"])


def test_mla_latent_bytes():
    model = tiny_model("deepseek_v3")
    cfg = TINY["deepseek_v3"]
    ids = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(0))
    _, stats = generate(
        model, ids, SnapStream(budget=40, recent=8, window=8), max_new_tokens=5, do_sample=False
    )
    per_entry = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4  # fp32
    assert stats["slots"] == 40 and stats["bytes"] == per_entry * 40


@pytest.mark.parametrize("method", [Full(), SnapKV(budget=48, window=8), SnapStream(budget=48)])
def test_a_padded_batchs_layers_hold_what_its_rows_hold(method):
    """`KVCache.stats`: per layer, the bytes every row holds of it, adding up to the rows' bytes (a
    left-padded row holds fewer slots than the batch is wide: counting the width for every row was more)."""
    from evalkit.kv import KVCache
    from tests.kv.test_batched import left_pad

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(0)
    ids, mask, _ = left_pad([torch.randint(3, 256, (n,), generator=g) for n in (100, 61)])
    cache = KVCache.for_model(method, model)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    stats = cache.stats()
    per_layer = [d["bytes"] for d in stats["per_layer"]]
    assert len(per_layer) == TINY["llama"]["num_hidden_layers"]
    assert sum(per_layer) == stats["bytes"] == sum(r["bytes"] for r in stats["rows"])
