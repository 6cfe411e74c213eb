"""KV storages against upstream's: fp8 is token-equal (and logit-equal) to transformers'
`QuantizedCache(backend="fp8")` on the embedded SmolLM2 through a greedy decode; KIVI's group quantizer equals
optimum-quanto's (what transformers' quanto-backed `QuantizedCache` runs) where the two coincide."""

import pytest
import torch
from transformers.cache_utils import QuantizedCache

from evalkit.kv.storage import IntStorage, NoStorage, StoredCache, make_storage
from evalkit.kv.storage.kivi import unpack

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def greedy(model, ids, cache, new=24):
    out = model.generate(
        ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    return out.sequences[0, ids.shape[1] :], torch.stack(out.scores)


def test_fp8_token_equal_to_transformers_quantized_cache(smollm2):
    """Full cache, fp8 e4m3 with transformers' per-tensor scale: the prompt calibrates, decode tokens are
    coded with the frozen scale, attention reads everything dequantized (the current token included)."""
    model, tok = smollm2
    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    layers = model.config.num_hidden_layers
    theirs, their_scores = greedy(model, ids, QuantizedCache(backend="fp8", config=model.config))
    ours, our_scores = greedy(model, ids, StoredCache(make_storage("fp8_e4m3", scale="tensor"), layers))
    assert torch.equal(ours, theirs)
    assert torch.equal(our_scores, their_scores)  # not only the argmax: every logit
    # the comparison can fail: fp8 moves the logits away from the model-dtype cache's
    _, plain_scores = greedy(model, ids, StoredCache(NoStorage(), layers))
    assert not torch.allclose(plain_scores, their_scores, rtol=0, atol=1e-3)


@pytest.mark.parametrize("bits", [4, 2])
def test_int_group_quantizer_equals_quanto(bits):
    """transformers' quanto backend with axis_key=-1 groups keys per channel along tokens and axis_value=0
    values per token along channels: KIVI's groups. Codes and read-back values equal optimum-quanto's."""
    from optimum import quanto  # pinned in requirements.txt: the reference always runs

    g = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 3, 64, 64, generator=g) * torch.linspace(0.5, 8, 64)
    storage = IntStorage(bits=bits, group=32, residual=64)
    qtype = quanto.qint4 if bits == 4 else quanto.qint2
    for axis, quantize, dequantize in (
        (-1, storage.quantize_keys, storage.dequantize_keys),
        (0, storage.quantize_values, storage.dequantize_values),
    ):
        scale, shift = quanto.MaxOptimizer()(x, qtype, axis, 32)
        theirs = quanto.quantize_weight(x, qtype, axis, scale, shift, 32)
        ours = quantize(x)
        their_codes = theirs._data.unpack() if hasattr(theirs._data, "unpack") else theirs._data
        our_codes = unpack(ours.codes, bits)
        if axis == -1:  # quanto's groups: (G, D * T / G) columns; ours (..., T, D)
            our_codes = our_codes.reshape(-1, 32, 64).permute(1, 2, 0).reshape(32, -1)
        else:
            our_codes = our_codes.reshape(-1, 32)
        assert torch.equal(our_codes.to(their_codes.dtype), their_codes.reshape(our_codes.shape))
        assert torch.allclose(dequantize(ours, x.dtype), theirs.dequantize(), rtol=0, atol=1e-5)
