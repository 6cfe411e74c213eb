"""The server under load on 127.0.0.1 (evalkit.bench.serving's generator, bounded in count and time): 32
concurrent clients, 200 mixed requests (completions and chat, prompt and output lengths mixed, some
streaming, some cancelled mid-stream, some sampled with a seed, some at their own budget). Every completed
answer equals the same request served alone, a cancelled one's text so far is a prefix of it, none is lost
or answered twice, the queue limit answers 429 (retried), and afterwards no row is held: on the fake backend
and on the real engine (tiny random model)."""

import pytest

from evalkit.bench.serving import Call, compare, mixed_calls, run_load
from evalkit.serve.live import engine_service
from tests.serve.conftest import fake_service, wait_for


def loaded(url: str, svc, calls: list[Call], clients: int) -> dict:
    alone, _ = run_load(url, [Call(c.id, c.path, c.body) for c in calls], clients=1, timeout_s=600)
    load, _ = run_load(url, calls, clients=clients, backoff_s=0.02, timeout_s=600)
    wait_for(lambda: svc.backend.stats()["running"] == 0, "every choice to end")
    return compare(calls, load, alone)


def check(result: dict, svc, calls: list[Call]) -> None:
    assert result["requests"] == len(calls) == result["completed"] + result["cancelled"]
    assert result["lost"] == result["answered_twice"] == result["failed"] == 0
    assert result["mismatches"] == 0 and result["cancelled_not_prefix"] == 0
    assert result["cancelled"] == sum(c.cancel_after is not None for c in calls) > 0
    assert result["rejected_429"] > 0  # 32 clients, 8 rows, 8 places in the queue
    stats = svc.backend.stats()
    assert stats["waiting"] == stats["running"] == 0 and stats["submitted"] == sum(stats["ended"].values())
    # a client may hang up after its last token was produced: then nothing is left to cancel
    assert 0 < stats["ended"]["cancelled"] <= result["cancelled"] and "error" not in stats["ended"]


def test_fake_backend_under_32_clients(serve, tokenizer):
    url, svc = serve(fake_service(tokenizer, context=4096, rows=8, queue_limit=8, step_s=0.001))
    calls = mixed_calls("fake", 200, seed=1, budgets=(None, 48, 96))
    check(loaded(url, svc, calls, clients=32), svc, calls)
    assert svc.backend.stats()["rows_held"] == 0


@pytest.mark.parametrize(
    "n, lengths",
    [
        (64, (3, 8, 16)),
        pytest.param(200, (4, 12, 24, 40), marks=pytest.mark.slow),
    ],  # slow: ~3 min on 2 busy cores
)
def test_real_engine_under_32_clients(serve, tiny_llama, one_thread, n, lengths):
    svc = engine_service(*tiny_llama, "tiny", "snapstream", rows=8, queue_limit=8, budget=128)
    url, _ = serve(svc)
    calls = mixed_calls("tiny", n, seed=2, budgets=(None, 64, 96), max_tokens=lengths)
    check(loaded(url, svc, calls, clients=32), svc, calls)
    engine = svc.backend.engine
    wait_for(lambda: engine.live == [None] * 8, "the engine to release the last rows")  # its thread's pace
    assert engine.pool.rows.valid.sum(1).tolist() == [1] * 8  # every row idle: one valid slot, nothing held


def test_the_bench_rows_compare_one_at_a_time_with_concurrent_clients(tokenizer):
    from evalkit.bench.serving import note, serve_and_load

    svc = fake_service(tokenizer, context=4096, rows=4, queue_limit=4, step_s=0.001)
    rows = serve_and_load(svc, mixed_calls("fake", 24, seed=3), clients=8)
    alone, load = rows
    assert (alone["mode"], load["mode"]) == ("one at a time", "8 clients")
    assert alone["requests"] == load["requests"] == 24 and load["mismatches"] == load["lost"] == 0
    assert load["rows_held_after"] == 0 and load["speedup"] == round(
        load["tokens_per_s"] / alone["tokens_per_s"], 2
    )
    assert alone["p50_s"] <= alone["p99_s"] and "0 answers differ from one at a time" in note(rows)
