"""A new decode-time method is one dataclass and one `Evictor` subclass, both defined here and nowhere else:
`OldestOut` evicts, per KV head, the oldest entry past the sinks once a row is full, which is what
StreamingLLM's ring does. Through the engine's slot pool (continuous batching, rows of several lengths) its
kept sets equal StreamingLLM's at every decode step, and a compiled step equals eager in one graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch._dynamo.utils import counters

from evalkit.engine import Engine
from evalkit.kv import StreamingLLM
from evalkit.kv.evict import Evictor, SlotEvictor, kept
from evalkit.kv.methods import RunFacts
from evalkit.kv.pool import SlotPool
from evalkit.turns import ask
from tests.conftest import tiny_model
from tests.kv.test_compile import Counting, fresh_dynamo, gen, prompts  # noqa: F401 (fixture)


class OldestOutEvictor(SlotEvictor):
    """A full row overwrites, per KV head, its oldest entry past the row's sinks."""

    def write_index(self, cache, layer) -> tuple:
        row, head, slot = super().write_index(cache, layer)
        pos = layer.pos  # (B, H, cap), -1 where never written
        sink = (pos >= 0) & (pos < cache.state.sink[:, None, None])
        candidate = cache.rows.valid[:, None, :] & ~sink  # (B, H, cap)
        oldest = kept(cache, -pos.float().masked_fill(~candidate, float("inf")), 1)[..., 0]  # (B, H)
        return row, head, torch.where(self.full[:, None], oldest, slot)


@dataclass
class OldestOut(StreamingLLM):
    """StreamingLLM's prefill (sinks + the last tokens), then decode-time eviction of the oldest non-sink."""

    name: ClassVar[str] = "oldest_out"
    evictor: ClassVar[type[Evictor]] = OldestOutEvictor


@pytest.fixture
def kept_sets(monkeypatch):
    """[(step, layer, row) -> per-KV-head kept positions], after every write of the engine's slot pool."""
    seen = []
    write = SlotPool.write

    def writing(self, layer, k, v):
        out = write(self, layer, k, v)
        valid = self.rows.valid
        for r in range(layer.pos.shape[0]):
            seen.append((layer.layer_idx, r, [frozenset(p[valid[r]].tolist()) for p in layer.pos[r]]))
        return out

    monkeypatch.setattr(SlotPool, "write", writing)
    return seen


def decode_all(model, method, lengths, new=40, rows=2):
    """Requests of `lengths` through one engine of `rows` rows (continuous batching), `new` tokens each."""
    engine = Engine(model, None, [], rows)
    reqs = [
        ask(str(i), p.tolist(), new, method, model.generation_config, 0, min_new=new)
        for i, p in enumerate(prompts(lengths, seed=8))
    ]
    return sorted(engine.run(reqs), key=lambda d: d.key)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_test_only_evictor_keeps_streamingllms_sets_at_every_step(arch, kept_sets):
    model = tiny_model(arch, seed=3)
    lengths = (100, 20, 57)  # longer than the budget, shorter (fills, then evicts), and a refill
    want = decode_all(model, StreamingLLM(budget=32, sink=4), lengths)
    ring = list(kept_sets)
    kept_sets.clear()
    got = decode_all(model, OldestOut(budget=32, sink=4), lengths)
    assert len(kept_sets) == len(ring) > 3 * 40 * 2
    for step, (a, b) in enumerate(zip(kept_sets, ring)):
        assert a == b, step
    assert [d.stats["kv_kept"] for d in got] == [d.stats["kv_kept"] for d in want] == [32, 32, 32]
    # it runs as any decode-time method: refused where a slot pool cannot hold its rows
    facts = RunFacts(model_name="m", mla=False, followup=True, compile=False, tp=1, task="t")
    assert "slot pool cannot hold" in OldestOut(budget=32).refusal(facts)
    assert StreamingLLM(budget=32).refusal(facts) is None


def test_a_test_only_evictor_compiles_to_one_graph_equal_to_eager():
    model = tiny_model("llama", seed=1)
    ids = prompts((100,))[0][None]
    method, counting = OldestOut(budget=32, sink=4), Counting()
    out, stats = gen(model, ids, method, backend=counting, new=50)
    assert (counting.compiled, counting.runs) == (1, 49)
    assert not counters["graph_break"]
    ref, ref_stats = gen(model, ids, method, new=50)
    assert torch.equal(out.sequences, ref.sequences) and stats["kept"] == ref_stats["kept"]
    assert max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits)) <= 1e-5
    ring, _ = gen(model, ids, StreamingLLM(budget=32, sink=4), new=50)  # the same sets: the same tokens
    assert torch.equal(ring.sequences, ref.sequences)


def test_a_grown_h2o_pool_decodes_as_one_made_that_large():
    """A pool that grows mid-decode (a longer request arrived) grows its evictor's state with it: the row
    decodes the same tokens and keeps the same entries as in a pool allocated at that size."""
    from evalkit.kv import H2O, KVCache
    from tests.kv.test_decode_eviction import sharp_model

    model = sharp_model("llama", seed=5)
    ids = prompts((60,), seed=6)[0][None]
    cache = KVCache.for_model(H2O(budget=24, recent=4), model)
    with torch.inference_mode():
        first = model(ids, cache=cache).logits[:, -1:].argmax(-1)

    def decode(pool, token, steps):
        out = []
        with torch.inference_mode():
            for _ in range(steps):
                position = pool.rows.next_pos.clone()[:, None]
                token = model(input_ids=token, position_ids=position, cache=pool).logits[:, -1:].argmax(-1)
                pool.decoded([0])
                out.append(int(token))
        return out, token

    def held(pool):
        return [[set(p[pool.rows.valid[0]].tolist()) for p in layer.pos[0]] for layer in pool.layers]

    pools = [SlotPool.shaped_like(cache, 1, n) for n in (24, 40)]
    for pool in pools:
        pool.load_row(0, cache)
    grown, large = pools
    before, token = decode(grown, first, 10)
    grown.grow(40)
    after, _ = decode(grown, token, 30)
    assert before + after == decode(large, first, 40)[0]
    assert held(grown) == held(large) and grown.capacity == large.capacity == 40
