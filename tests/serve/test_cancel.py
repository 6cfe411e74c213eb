"""A client that goes away frees its row at the engine's next step: a stream closed mid-way, or a connection
closed while a non-streamed answer is being generated; the next request takes the row. On the fake backend,
and on the real engine, whose slot-pool rows are then all idle again."""

import http.client
import json
from urllib.parse import urlsplit

from evalkit.serve.live import engine_service
from tests.serve.conftest import fake_service, post, stream_then_hang_up, wait_for

BODY = {"model": "fake", "prompt": "The lamp by the window", "temperature": 0}


def test_a_stream_closed_midway_frees_its_row_for_the_next_request(serve, tokenizer):
    url, svc = serve(fake_service(tokenizer, context=100_000, rows=1, queue_limit=4, step_s=0.01))
    got = stream_then_hang_up(url, "/v1/completions", {**BODY, "max_tokens": 90_000}, 3)
    assert len(got) == 3
    # the one row was held by a request of 90,000 tokens: the next one is answered because it was released
    after = post(url, "/v1/completions", {**BODY, "max_tokens": 4})
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
    stats = svc.backend.stats()
    assert stats["ended"] == {"cancelled": 1, "length": 1} and stats["running"] == stats["rows_held"] == 0


def test_a_connection_closed_while_waiting_for_its_answer_cancels_it(serve, tokenizer):
    url, svc = serve(fake_service(tokenizer, context=100_000, rows=1, queue_limit=4, step_s=0.01))
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**BODY, "max_tokens": 90_000}))
    wait_for(lambda: svc.backend.stats()["running"] == 1, "the request to take the row")
    conn.close()
    wait_for(lambda: svc.backend.stats()["ended"].get("cancelled") == 1, "the cancellation")
    assert post(url, "/v1/completions", {**BODY, "max_tokens": 2}).status_code == 200
    assert svc.backend.stats()["rows_held"] == 0


def test_the_real_engine_releases_a_cancelled_row_and_its_pool_is_idle_after(serve, tiny_llama, one_thread):
    svc = engine_service(*tiny_llama, "tiny", "snapstream", rows=2, queue_limit=4, budget=64)
    url, _ = serve(svc)
    body = {"model": "tiny", "prompt": "The lamp by the window", "temperature": 0}
    alone = post(url, "/v1/completions", {**body, "max_tokens": 6}).json()["choices"][0]["text"]
    got = stream_then_hang_up(url, "/v1/completions", {**body, "max_tokens": 4000}, 2)
    assert alone.startswith("".join(c["choices"][0]["text"] for c in got))
    both = [post(url, "/v1/completions", {**body, "max_tokens": 6}) for _ in range(2)]
    assert [b.json()["choices"][0]["text"] for b in both] == [alone, alone]
    wait_for(lambda: svc.backend.stats()["ended"].get("cancelled") == 1, "the cancellation")
    engine = svc.backend.engine
    wait_for(lambda: engine.live == [None, None], "the rows to be released")
    assert engine.pool.rows.valid.sum(1).tolist() == [1, 1]  # SlotPool.idle_row: one valid slot, nothing held
    assert svc.backend.stats()["ended"] == {"length": 3, "cancelled": 1}
