"""The ring buffer: exact layout after N decode steps, static buffers, the paper's worked example, short
prompts."""

import torch

from evalkit.kv import Full, KVCache, SnapStream, StreamingLLM, generate
from tests.conftest import tiny_model


def decode(model, cache, ids, steps):
    """Prefill then `steps` greedy decode forwards; yields after each forward."""
    with torch.no_grad():
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        yield
        for _ in range(steps):
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
            yield


def test_paper_worked_example():
    """L = 26 (last prompt position), sink 1, recent 4: `[0 | 25 26 23 24 | top-K]`; position 27 replaces
    23."""
    model = tiny_model("llama")
    method = SnapStream(budget=8, sink=1, recent=4, window=4, pool_kernel=3)
    cache = KVCache.for_model(method, model)
    ids = torch.randint(0, 256, (1, 27), generator=torch.Generator().manual_seed(0))  # positions 0..26
    steps = decode(model, cache, ids, 1)
    next(steps)
    for layer in range(model.config.num_hidden_layers):
        held = cache.positions(layer)[0]
        assert held[:, :5].tolist() == [[0, 25, 26, 23, 24]] * held.shape[0]
        assert ((held[:, 5:] >= 1) & (held[:, 5:] <= 22)).all()  # top-K from the middle
    topk = cache.positions(0)[0, :, 5:].clone()
    next(steps)
    for layer in range(model.config.num_hidden_layers):
        assert cache.positions(layer)[0, :, :5].tolist() == [[0, 25, 26, 27, 24]] * 2
    assert torch.equal(cache.positions(0)[0, :, 5:], topk)  # the top-K block never changes


def test_after_n_steps_cache_holds_sinks_topk_and_last_recent():
    model = tiny_model("qwen3")
    method = SnapStream(budget=40, sink=4, recent=12, window=8)
    cache = KVCache.for_model(method, model)
    L, N = 120, 37
    ids = torch.randint(0, 256, (1, L), generator=torch.Generator().manual_seed(1))
    steps = decode(model, cache, ids, N)
    next(steps)
    layers = range(model.config.num_hidden_layers)
    topk = {i: cache.positions(i)[0, :, 16:].clone() for i in layers}
    buffers = {i: (cache.layers[i].keys.data_ptr(), cache.layers[i].values.data_ptr()) for i in layers}
    shapes = {i: (cache.layers[i].keys.shape, cache.layers[i].values.shape) for i in layers}
    for _ in steps:  # buffer shapes and storage never change during decode: no growth, no reallocation
        for i in layers:
            assert (cache.layers[i].keys.data_ptr(), cache.layers[i].values.data_ptr()) == buffers[i]
            assert (cache.layers[i].keys.shape, cache.layers[i].values.shape) == shapes[i]
    last = L + N  # positions 0..last-1 have been fed
    for i in layers:
        held = cache.positions(i)[0]
        for h in range(held.shape[0]):
            assert set(held[h, :4].tolist()) == {0, 1, 2, 3}
            assert set(held[h, 4:16].tolist()) == set(range(last - 12, last))
            assert torch.equal(held[h, 16:], topk[i][h])
    stats = cache.stats()
    assert stats["seen"] == last and stats["kept"] == 40 and stats["evicted"] == last - 40
    assert stats["evicted_generated"] == N - 12  # generated tokens that left the ring


def test_streamingllm_ring_keeps_sinks_and_recent():
    model = tiny_model("llama")
    cache = KVCache.for_model(StreamingLLM(budget=20, sink=4), model)
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(2))
    for _ in decode(model, cache, ids, 30):
        pass
    held = cache.positions(1)[0]
    for h in range(held.shape[0]):
        assert sorted(held[h].tolist()) == [0, 1, 2, 3, *range(80 - 16, 80)]


def test_short_prompts_pad_then_fill_then_wrap():
    """Prompt shorter than sink + recent (and the budget), the spec's layout: the cache is the prompt itself,
    the ring fills, then wraps; the top-K block stays masked padding."""
    model = tiny_model("llama")
    method = SnapStream(budget=16, sink=4, recent=4, window=4)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    cache = KVCache.for_model(method, model)
    steps = decode(model, cache, ids, 30)
    next(steps)
    held = cache.positions(0)[0]
    assert held[0].tolist() == [0, 1, 2, 3, 4] + [-1] * 11  # the prompt itself, then empty slots
    assert cache.stats()["kept"] == 5 and cache.stats()["slots"] == 16
    for _ in steps:
        pass
    held = cache.positions(0)[0, 0].tolist()
    assert held[:4] == [0, 1, 2, 3] and sorted(held[4:8]) == [31, 32, 33, 34] and held[8:] == [-1] * 8
    assert cache.stats()["kept"] == 8 and cache.stats()["slots"] == 16
    # while prompt + generated fit in sink + ring, the output equals the full cache's (4 tokens here)
    full, _ = generate(model, ids, Full(), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    short, _ = generate(model, ids, method, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert torch.equal(full, short)


def test_spare_slots_ring_keeps_short_prompts_whole():
    """evalkit's option: the ring grows into the top-K slots a short prompt leaves free."""
    model = tiny_model("llama")
    method = SnapStream(budget=16, sink=4, recent=4, window=4, spare_slots="ring")
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    cache = KVCache.for_model(method, model)
    for _ in decode(model, cache, ids, 30):
        pass
    assert sorted(cache.positions(0)[0, 0].tolist()) == [0, 1, 2, 3, *range(35 - 12, 35)]
    full, _ = generate(model, ids, Full(), max_new_tokens=11, do_sample=False, min_new_tokens=11)
    short, _ = generate(model, ids, method, max_new_tokens=11, do_sample=False, min_new_tokens=11)
    assert torch.equal(full, short)


def test_prompt_shorter_than_sinks():
    model = tiny_model("llama")
    cache = KVCache.for_model(SnapStream(budget=16, sink=4, recent=4, window=4), model)
    for _ in decode(model, cache, torch.tensor([[7, 9]]), 20):
        pass
    held = cache.positions(0)[0, 0].tolist()
    assert held[:4] == [0, 1, 2, 3] and sorted(held[4:8]) == [18, 19, 20, 21] and held[8:] == [-1] * 8


def test_middle_shorter_than_topk_is_kept_whole_and_rest_padded():
    """valid_topk = min(max(L - sink - recent, 0), K): 30 - 4 - 8 = 18 of K = 36 top-K slots hold the
    middle."""
    model = tiny_model("llama")
    cache = KVCache.for_model(SnapStream(budget=48, sink=4, recent=8, window=8), model)
    next(decode(model, cache, torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(4)), 0))
    held = cache.positions(0)[0]
    for h in range(held.shape[0]):
        assert held[h, 12:30].tolist() == list(range(4, 22)) and (held[h, 30:] == -1).all()
    assert cache.stats()["kept"] == 30 and cache.stats()["slots"] == 48
