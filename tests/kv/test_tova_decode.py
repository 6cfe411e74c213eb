"""tova_decode's logits and kept sets equal an independent float64 TOVA over a full cache, evicting at every
step (issue 33 item 1), and it decodes in the engine's slot pool as one compiled graph equal to eager, a batch
as each row alone.

The reference is TOVA (schwartz-lab-NLP/TOVA `TOVACache.reduce`) as an attention function over transformers'
own full cache, in float64: the prompt attends causally and keeps the top `cache_size` positions by its last
query's attention averaged over all query heads (the last token competing); each decode step attends over the
kept entries and the new one, then drops the one of least head-averaged attention. `cache_size = budget - 1`
(the module docstring of evalkit/kv/tova.py says why). Nothing of evalkit's cache runs in it.
"""

from __future__ import annotations

import pytest
import torch

from evalkit.engine import Engine
from evalkit.kv import TOVADecode, generate
from evalkit.turns import ask
from tests.kv.test_batched import left_pad
from tests.kv.test_compile import Counting, assert_same_generation, gen, prompts
from tests.kv.test_decode_eviction import sharp_model
from tests.kv.test_h2o_reference import logits_through

NEW = 90


class TOVAReference:
    """An attention function (transformers' signature) that is TOVA over the full cache, float64."""

    def __init__(self, cache_size: int):
        self.size = cache_size
        self.kept: dict[int, torch.Tensor] = {}  # layer -> (T,) bool after the last reduce
        self.attended: dict[int, torch.Tensor] = {}  # layer -> (T,) bool the last step attended over

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        i = module.layer_idx
        q, k, v = query[0].double(), key[0].double(), value[0].double()  # (H_q, n, D), (H, T, D), (H, T, Dv)
        h, t = k.shape[:2]
        n, g = q.shape[1], q.shape[0] // h
        cols = torch.arange(t)
        if n > 1:  # the prompt: causal attention
            allowed = cols[None, :] <= cols[:, None]  # (n, T)
            keep = torch.ones(t, dtype=torch.bool)
        else:  # the new token joins the kept entries
            keep = torch.cat([self.kept[i], torch.ones(1, dtype=torch.bool)])
            allowed = keep[None, :]
        logits = q.view(h, g, n, -1) @ k.transpose(-1, -2)[:, None] * (scaling or q.shape[-1] ** -0.5)
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)  # (H, g, n, T)
        self.attended[i] = keep.clone()
        if int(keep.sum()) > self.size:  # reduce: the top cache_size by the last query, mean over all heads
            mean = probs[:, :, -1].mean(dim=(0, 1)).masked_fill(~keep, float("-inf"))  # (T,)
            keep = torch.zeros(t, dtype=torch.bool)
            keep[mean.topk(self.size).indices] = True
        self.kept[i] = keep
        out = (probs @ v[:, None]).reshape(h * g, n, -1)  # (H_q, n, Dv)
        return out.transpose(0, 1)[None].to(query.dtype), None


def reference_logits(model, prompt, tokens, cache_size, monkeypatch) -> tuple[list, TOVAReference]:
    ref = TOVAReference(cache_size)
    return logits_through(ref, model, prompt, tokens, monkeypatch), ref


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("budget, length", [(40, 120), (48, 30)], ids=["evicting", "short-prompt"])
def test_tova_decode_logits_equal_a_float64_reference(arch, budget, length, monkeypatch):
    model = sharp_model(arch, seed=5).double()
    method = TOVADecode(budget=budget)
    prompt = prompts((length,), seed=6)[0]
    engine = Engine(model, None, [], 1)
    request = ask(
        "0", prompt.tolist(), NEW, method, model.generation_config, 0, min_new=NEW, keep_logits=True
    )
    (done,) = engine.run([request])
    want, ref = reference_logits(model, prompt, done.tokens, budget - 1, monkeypatch)
    assert len(done.logits) == len(want) == NEW
    for step, (got, w) in enumerate(zip(done.logits, want)):
        assert (got.double() - w).abs().max().item() <= 1e-6, step  # evalkit's logits are float32
    assert max((w - want[0]).abs().max().item() for w in want) > 0.1  # the steps differ
    for i, layer in enumerate(engine.pool.layers):  # the last step attended over the same entries
        held = [set(p[p >= 0].tolist()) for p in layer.pos[0]]
        assert held == [set(torch.nonzero(ref.attended[i]).flatten().tolist())] * len(held), i
    assert NEW - 1 + length - budget > 40  # the decode evicts many times


def test_batch_equals_single_and_compiled_equals_eager():
    """A left-padded batch (one prompt shorter than the budget) gives each row its tokens alone; the compiled
    step is one graph with the eager tokens and logits."""
    model = sharp_model("llama", seed=1)
    method = TOVADecode(budget=40)
    rows = prompts((150, 97, 30))
    ids, mask, t = left_pad(rows)
    kw = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False)
    batch, _ = generate(model, ids, method, attention_mask=mask, **kw)
    for r, row in enumerate(rows):
        alone, _ = generate(model, row[None], method, **kw)
        assert batch[r, t:].tolist() == alone[0, len(row) :].tolist(), r
    counting = Counting("eager")
    assert_same_generation(gen(model, ids, method, mask, backend=counting), gen(model, ids, method, mask), 0)
    assert (counting.compiled, counting.runs) == (1, 29)


def test_tova_decode_runs_compiled_under_tensor_parallelism_and_refuses_budget_one():
    from evalkit.kv.methods import RunFacts

    facts = RunFacts("m", mla=False, followup=False, compile=True, tp=2)
    # tests/parallel/test_tp.py: compiled TP=2 decodes one process's tokens
    assert TOVADecode(budget=8).refusal(facts) is None
    assert TOVADecode(budget=8).refusal(RunFacts("m", False, False, False, 1)) is None
    with pytest.raises(ValueError, match="budget must be >= 2"):
        TOVADecode(budget=1)


def test_prefill_tova_and_its_ring_run_under_tensor_parallelism():
    """The prefill scorer's mean over all heads reads every TP rank's heads (gathered at prefill: kept sets
    and tokens equal one process's, tests/parallel/test_tp.py); tova_decode gathers every step, compiled or
    not."""
    from evalkit.kv import TOVA, Ringed
    from evalkit.kv.methods import RunFacts
    from evalkit.kv.scorers import LastQueryScore

    tp2 = RunFacts("m", mla=False, followup=False, compile=False, tp=2)
    for method in (TOVA(budget=8), Ringed(budget=64, scorer=LastQueryScore())):
        assert method.refusal(tp2) is None
        assert method.refusal(RunFacts("m", False, False, False, 1)) is None
    assert TOVADecode(budget=8).refusal(tp2) is None  # eager: each step gathers the layer's heads
    compiled = RunFacts("m", mla=False, followup=False, compile=True, tp=2)
    assert TOVADecode(budget=8).refusal(compiled) is None  # the step's all-gather is traced (one graph)
