"""GPU checks (`make test-gpu` / scripts/gpu_check.sh): bf16 + sdpa on CUDA, random weights of real
architectures.

Skipped without CUDA. On a GPU, sdpa dispatches to flash / memory-efficient kernels; evalkit's caches must
still reproduce the full cache when the budget holds everything, and keep the ring exact past wrap-around.
"""

import pytest
import torch

from evalkit.kv import KVCache, SnapStream, generate
from tests.conftest import tiny_model
from tests.kv.test_kv_equivalence import methods

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_bf16_equivalence_on_cuda(arch):
    model = tiny_model(arch).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ref = model.generate(ids, **kw)
    for method in methods(400):  # each with room for the prompt and all 32 generated tokens
        out, stats = generate(model, ids, method, **kw)
        assert stats["evicted"] == 0, method
        assert torch.equal(out.sequences, ref.sequences), method.name
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(out.logits, ref.logits))
        assert diff <= 2e-2, (method.name, diff)


def test_ring_static_and_exact_on_cuda():
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    method = SnapStream(budget=64, recent=16, window=8)
    cache = KVCache.for_model(method, model)
    ids = torch.randint(0, 256, (1, 500), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        token = model(ids, cache=cache).logits[:, -1:].argmax(-1)
        ptr = cache.layers[0].keys.data_ptr()
        for _ in range(100):
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
    assert cache.layers[0].keys.data_ptr() == ptr and cache.layers[0].keys.shape[2] == 64
    held = cache.positions(1)[0, 0]
    assert set(held[4:20].tolist()) == set(range(600 - 16, 600))
