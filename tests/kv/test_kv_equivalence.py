"""With a budget of at least prompt + generated tokens, every method reproduces the full cache exactly."""

import pytest
import torch

from evalkit.kv import Full, KVCache, SnapKV, SnapStream, StreamingLLM, generate
from tests.conftest import tiny_model

PROMPT, NEW = 60, 24


def methods(budget: int):
    """Every method with room for the prompt and all generated tokens.

    SnapStream twice: with the spec's fixed ring (`spare_slots="pad"`) nothing is evicted only while the
    prompt and generation fit in sink + ring (the unused top-K block stays masked padding); with
    `spare_slots="ring"` a budget of prompt + generated tokens is enough.
    """
    return [
        Full(),
        StreamingLLM(budget=budget, sink=4),
        SnapKV(budget=budget, window=8),
        SnapStream(budget=2 * budget, sink=4, recent=budget, window=8),
        SnapStream(budget=budget, sink=4, window=8, spare_slots="ring"),
    ]


def reference(model, ids):
    """transformers' own path: DynamicCache and plain sdpa."""
    return model.generate(
        ids,
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        min_new_tokens=NEW,
    )


def compressed(model, ids, method):
    out, stats = generate(
        model,
        ids,
        method,
        max_new_tokens=NEW,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        min_new_tokens=NEW,
    )
    return out, stats


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_tiny_models_match_full(arch):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    ref = reference(model, ids)
    for method in methods(PROMPT + NEW):
        out, stats = compressed(model, ids, method)
        assert torch.equal(out.sequences, ref.sequences), method.name
        diff = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits))
        assert diff <= 1e-5, (method.name, diff)
        assert stats["evicted"] == 0, method.name
        if method.ring:
            assert stats["slots"] == method.budget  # static: the padded slots are allocated and masked


def test_sampling_works_and_is_seeded():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        out, _ = generate(
            model, ids, SnapStream(budget=24, window=4, recent=8), max_new_tokens=30, do_sample=True
        )
        runs.append(out)
    greedy, _ = generate(model, ids, SnapStream(budget=24, window=4, recent=8), max_new_tokens=30)
    assert torch.equal(runs[0], runs[1]) and runs[0].shape[1] == 70  # same seed, same sample
    assert not torch.equal(runs[0], runs[2]) and not torch.equal(runs[0], greedy)  # really sampled


def test_full_cache_takes_a_multi_token_continuation():
    """`full` continues a prefilled prompt with several tokens in one forward (causal among themselves), the
    logits those of the whole sequence without a cache; two rows of one length decode together."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, PROMPT + 5), generator=torch.Generator().manual_seed(4))
    cache = KVCache.for_model(Full(), model)
    with torch.inference_mode():
        want = model(ids).logits[:, PROMPT:]
        model(ids[:, :PROMPT], cache=cache)
        got = model(ids[:, PROMPT : PROMPT + 3], cache=cache).logits
        got = torch.cat([got, model(ids[:, PROMPT + 3 :], cache=cache).logits], 1)
    assert (got - want).abs().max() <= 1e-5
    assert cache.positions(0)[:, :, -5:].tolist() == [[list(range(PROMPT, PROMPT + 5))] * 2] * 2
