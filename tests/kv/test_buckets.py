"""The bucketed full cache (issue 35): the engine's pool attends over its filled slots rounded up to a bucket,
not its whole capacity. Outputs equal the dynamic full cache (greedy and sampled, one row or several), and a
compiled step compiles once per bucket it reaches, never more than the buckets there are."""

import pytest
import torch
from torch._dynamo.utils import counters

from evalkit.kv import Full, SnapStream
from evalkit.kv.pool import WHOLE, Buckets
from evalkit.kv.static import compile_config
from evalkit.turns import ask
from tests.conftest import tiny_model
from tests.kv.test_compile import Counting
from tests.kv.test_engine import alone, engine_run, prompts, settings

SMALL = Buckets(floor=16, per_octave=2)  # tiny prompts cross several buckets: 16, 24, 32, 48, 64, 96, ...
NEW = 40


def test_the_ladder_of_buckets():
    assert Buckets() == Buckets(floor=256, per_octave=4) and Buckets().of(257, 10_000) == 320
    b = Buckets(per_octave=2)
    assert [b.of(n, 10_000) for n in (1, 256, 257, 384, 385, 512, 513, 1000, 1025)] == [
        256, 256, 384, 384, 512, 512, 768, 1024, 1536
    ]  # fmt: skip
    assert b.of(5000, 4200) == 4200 and b.of(300, 300) == 300  # never past the capacity
    assert WHOLE.of(3, 900) == 900
    assert SMALL.count(100) == len({SMALL.of(n, 100) for n in range(1, 101)}) == 7  # 16 .. 96, 100
    assert Buckets(per_octave=1).count(32768) == 8  # 256, 512, ..., 32768
    with pytest.raises(ValueError, match="buckets need"):
        Buckets(floor=0)


@pytest.mark.parametrize("sample", [False, True])
@pytest.mark.parametrize("arch", ["llama", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_bucketed_full_cache_equals_the_dynamic_full_cache(arch, sample):
    """Rows that cross several buckets while they decode (prompts 20..200, 40 new tokens), one row at a time
    and three at once with refills: every request's tokens are `model.generate`'s with the dynamic full cache,
    and the steps really attended over fewer slots than the pool holds."""
    model = tiny_model(arch, seed=3)
    ids = prompts()
    want = [alone(model, x, Full(), sample, 100 + i, new=NEW) for i, x in enumerate(ids)]
    for rows in (1, 3):
        reqs = [ask(str(i), x, NEW, Full(), settings(sample, NEW), 100 + i) for i, x in enumerate(ids)]
        got, engine = engine_run(model, reqs, rows, buckets=SMALL)
        assert [got[str(i)].tokens for i in range(len(ids))] == want, rows
        visible = {v for _, _, v in engine.shapes}
        assert len(visible) > 1 and min(visible) < engine.pool.capacity, engine.shapes


def test_a_budget_list_beside_the_full_cache_decodes_as_each_alone():
    """Full cache and SnapStream rows in one bucketed pool (the ring rows reach their budget, the full rows
    grow): each request as it decodes alone."""
    model = tiny_model("llama", seed=3)
    ids = prompts()[:3]
    methods = [Full(), SnapStream(budget=48, recent=16, window=8)]
    reqs = [
        ask(f"{m.name}{i}", x, NEW, m, settings(False, NEW), i) for i, x in enumerate(ids) for m in methods
    ]
    got, engine = engine_run(model, reqs, 4, buckets=SMALL)
    for i, x in enumerate(ids):
        for m in methods:
            assert got[f"{m.name}{i}"].tokens == alone(model, x, m, False, i, new=NEW), (m.name, i)
    assert len({v for _, _, v in engine.shapes}) > 1


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("sample", [False, True])
def test_compiled_bucketed_full_cache_one_graph_per_bucket(fresh_dynamo, sample):
    """Compiled: the dynamic full cache's tokens, every step through a compiled graph (no fallback to eager at
    dynamo's recompile limit), and no more graphs than the pool has buckets (one per bucket reached)."""
    model = tiny_model("llama", seed=3)
    ids = prompts()[:3]  # 150, 40, 90 tokens
    counting = Counting()
    reqs = [ask(str(i), x, NEW, Full(), settings(sample, NEW), 100 + i) for i, x in enumerate(ids)]
    got, engine = engine_run(model, reqs, 1, buckets=SMALL, compile=compile_config(model, backend=counting))
    assert [got[str(i)].tokens for i in range(len(ids))] == [
        alone(model, x, Full(), sample, 100 + i, new=NEW) for i, x in enumerate(ids)
    ]
    assert counting.runs == engine.steps  # every step ran compiled
    assert counting.compiled == len(engine.shapes) <= SMALL.count(engine.pool.capacity)
    assert counting.compiled > 2 and not counters["graph_break"]
