"""h2o's logits, not only its kept sets, equal an independent float64 H2O over a decode that evicts at every
step (issue 31, item 15).

The reference is H2O (FMInference/H2O `H2OKVCache_LayerWise`, under the schedule docs/deviations.md lists)
written as an attention function over transformers' own full cache, in float64: the prompt attends causally
and its column sums pick the heavy hitters beside the last `recent` tokens; each decode step first evicts, per
KV head, the lowest sum older than the last `recent` tokens of a full cache, then attends over the kept
entries only and adds its probabilities to their sums. Nothing of evalkit's cache runs in it. The model runs
in float64 on both sides and the reference is fed evalkit's tokens, so every step compares the same question.
"""

from __future__ import annotations

import pytest
import torch

from evalkit.engine import Engine
from evalkit.kv import H2O
from evalkit.kv import attention as kv_attention
from evalkit.turns import ask
from tests.kv.test_compile import prompts
from tests.kv.test_decode_eviction import sharp_model

NEW = 90


class H2OReference:
    """An attention function (transformers' signature) that is H2O over the full cache, float64."""

    def __init__(self, method: H2O):
        self.method = method
        self.acc: dict[int, torch.Tensor] = {}  # layer -> (H, T) accumulated attention per position
        self.kept: dict[int, torch.Tensor] = {}  # layer -> (H, T) bool

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        i, (budget, recent) = module.layer_idx, (self.method.budget, self.method.recent)
        q, k, v = query[0].double(), key[0].double(), value[0].double()  # (H_q, n, D), (H, T, D), (H, T, Dv)
        h, t = k.shape[:2]
        n, g = q.shape[1], q.shape[0] // h
        cols = torch.arange(t)
        if n > 1:  # the prompt: causal attention, then its heavy hitters and the last `recent`
            allowed = (cols[None, :] <= cols[:, None])[None].expand(h, n, t)
        else:  # one new token at position t - 1: evict first if full, then attend over the kept
            acc = torch.cat([self.acc[i], torch.zeros(h, 1, dtype=torch.float64)], 1)
            kept = torch.cat([self.kept[i], torch.zeros(h, 1, dtype=torch.bool)], 1)
            old = kept & (cols < t - 1 - recent)[None]
            victim = acc.masked_fill(~old, float("inf")).argmin(-1)  # (H,)
            full = kept.sum(-1) >= budget
            kept[full, victim[full]] = False
            kept[:, t - 1] = True
            allowed, self.acc[i], self.kept[i] = kept[:, None, :], acc, kept
        logits = q.view(h, g, n, -1) @ k.transpose(-1, -2)[:, None] * (scaling or q.shape[-1] ** -0.5)
        probs = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), dim=-1)  # (H, g, n, T)
        if n > 1:
            self.acc[i] = probs.sum(2).mean(1)
            keep = torch.ones(h, t, dtype=torch.bool)
            if t > budget:
                heavy = self.acc[i][:, : t - recent].topk(budget - recent, dim=-1).indices
                keep = (cols >= t - recent)[None].expand(h, t).clone().scatter_(1, heavy, True)
            self.kept[i] = keep
        else:
            self.acc[i] += probs.sum(2).mean(1)
        out = (probs @ v[:, None]).reshape(h * g, n, -1)  # (H_q, n, Dv)
        return out.transpose(0, 1)[None].to(query.dtype), None


def reference_logits(model, prompt, tokens, method, monkeypatch) -> tuple[list, H2OReference]:
    """The reference's float64 logits before each of `tokens` (fed in turn), over transformers' full cache."""
    ref = H2OReference(method)
    return logits_through(ref, model, prompt, tokens, monkeypatch), ref


def logits_through(ref, model, prompt, tokens, monkeypatch) -> list:
    """The logits before each of `tokens` (fed in turn, greedy), every attention of the model running `ref`
    (an attention function with transformers' signature) over transformers' own full cache."""
    monkeypatch.setitem(kv_attention.ALL_ATTENTION_FUNCTIONS._global_mapping, kv_attention.NAME, ref)
    with torch.inference_mode():
        out = model(input_ids=prompt[None], use_cache=True)
        logits = [out.logits[0, -1]]
        for token in tokens[:-1]:
            out = model(input_ids=torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
            logits.append(out.logits[0, -1])
    monkeypatch.undo()
    return logits


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "method, length",
    [(H2O(budget=40, recent=8), 120), (H2O(budget=48, recent=12), 30)],
    ids=["evicting", "short-prompt"],
)
def test_h2o_logits_equal_a_float64_reference(arch, method, length, monkeypatch):
    model = sharp_model(arch, seed=5).double()
    prompt = prompts((length,), seed=6)[0]
    engine = Engine(model, None, [], 1)
    request = ask(
        "0", prompt.tolist(), NEW, method, model.generation_config, 0, min_new=NEW, keep_logits=True
    )
    (done,) = engine.run([request])
    want, ref = reference_logits(model, prompt, done.tokens, method, monkeypatch)
    assert len(done.logits) == len(want) == NEW
    for step, (got, w) in enumerate(zip(done.logits, want)):
        assert (got.double() - w).abs().max().item() <= 1e-6, step  # evalkit's logits are float32
    assert max((w - want[0]).abs().max().item() for w in want) > 0.1  # the steps differ: no trivial equality
    for i, layer in enumerate(engine.pool.layers):  # and the last step kept the same entries per KV head
        held = [set(p.tolist()) for p in layer.pos[0]]
        assert held == [set(torch.nonzero(k).flatten().tolist()) for k in ref.kept[i]], i
    assert NEW - 1 + length - method.budget > 40  # the decode evicts many times
