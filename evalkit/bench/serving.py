"""The server under load (`make bench`, measurement `serving`), and the load generator its tests use.

A load is a list of `Call`s (completions and chat, mixed prompt and output lengths, some streaming, some
cancelled by their client mid-stream, some at their own budget, some sampled with a seed) sent by `clients`
concurrent clients to a server on 127.0.0.1; a 429 is retried after a back-off. The same calls are then
served one at a time: every completed answer must equal its one-at-a-time answer (a cancelled one's text so
far must be a prefix of it), none lost or answered twice. The measurement records tokens per second of both
passes and the latency percentiles (p50, p99) of the concurrent one.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field

from evalkit.bench.base import Context, Measurement

LOOPBACK = "127.0.0.1"  # traffic goes nowhere else
WORDS = ("river", "stone", "lamp", "quiet", "orange", "window", "seven", "paper", "garden", "cloud", "silver")


class Background:
    """An ASGI app served by uvicorn in a thread on 127.0.0.1 (a free port), for as long as the block runs."""

    def __init__(self, app, shutdown_s: float = 5.0):
        import uvicorn

        config = uvicorn.Config(
            app,
            host=LOOPBACK,
            port=0,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=shutdown_s,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def __enter__(self) -> Background:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{LOOPBACK}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=60)


@dataclass
class Call:
    """One request of a load."""

    id: int
    path: str  # /v1/completions or /v1/chat/completions
    body: dict
    cancel_after: int | None = None  # a streaming client goes away after this many chunks

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


@dataclass
class Outcome:
    id: int
    status: int
    text: str = ""
    finish: str | None = None
    latency_s: float = 0.0  # from the accepted attempt's start to its last byte
    rejected: int = 0  # 429 answers before it was taken
    cancelled: bool = False  # its client went away on purpose
    tokens: int = 0  # completion tokens (usage), when it completed
    ids: set[str] = field(default_factory=set)  # the response ids it saw


def mixed_calls(model: str, n: int, seed: int = 0, budgets=(None,), max_tokens=(4, 12, 24, 40)) -> list[Call]:
    """`n` calls of mixed lengths: a quarter chat, a third streaming (a third of those cancelled after two
    chunks), a fifth sampled with a seed, budgets drawn from `budgets`."""
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        words = rng.choice((6, 30, 90, 200))
        text = f"Note {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        body = {"model": model, "max_tokens": rng.choice(max_tokens), "temperature": 0.0}
        if rng.random() < 0.2:
            body.update(temperature=0.8, top_p=0.9, seed=rng.randrange(2**31))
        if (budget := rng.choice(budgets)) is not None:
            body["budget"] = budget
        chat = rng.random() < 0.25
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
        cancel = None
        if rng.random() < 0.33:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            cancel = 2 if rng.random() < 0.33 and body["max_tokens"] >= 8 else None
        calls.append(Call(i, path, body, cancel))
    return calls


async def _send(session, url: str, call: Call, backoff_s: float | None) -> Outcome:
    out = Outcome(call.id, 0)
    while True:
        start = time.perf_counter()
        async with session.post(url + call.path, json=call.body) as r:
            if r.status == 429:
                out.rejected += 1
                await asyncio.sleep(float(r.headers["Retry-After"]) if backoff_s is None else backoff_s)
                continue
            out.status = r.status
            if r.status != 200:
                out.text = await r.text()
            elif call.stream:
                await _read_stream(r, call, out)
            else:
                _read_answer(await r.json(), out)
            out.latency_s = time.perf_counter() - start
            return out


def _read_answer(body: dict, out: Outcome) -> None:
    choice = body["choices"][0]
    out.text = choice["text"] if "text" in choice else choice["message"]["content"]
    out.finish, out.tokens = choice["finish_reason"], body["usage"]["completion_tokens"]
    out.ids.add(body["id"])


async def _read_stream(r, call: Call, out: Outcome) -> None:
    chunks = 0
    async for line in r.content:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        out.ids.add(event["id"])
        if event.get("usage"):
            out.tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            out.text += choice.get("text", choice.get("delta", {}).get("content", ""))
            out.finish = choice["finish_reason"] or out.finish
        chunks += 1
        if call.cancel_after is not None and chunks >= call.cancel_after:
            out.cancelled = True
            r.close()  # the connection goes: the server cancels the choice
            return


def run_load(url: str, calls: list[Call], clients: int, backoff_s: float | None = None, timeout_s=600):
    """(outcomes in call order, wall seconds): `clients` clients, each sending its next call when its last
    one is answered."""
    import aiohttp

    async def main():
        todo = list(calls)
        out: list[Outcome] = []
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients)) as s:

            async def client():
                while todo:
                    out.append(await _send(s, url, todo.pop(0), backoff_s))

            await asyncio.wait_for(asyncio.gather(*(client() for _ in range(clients))), timeout_s)
        return out

    start = time.perf_counter()
    outcomes = asyncio.run(main())
    return sorted(outcomes, key=lambda o: o.id), time.perf_counter() - start


def compare(calls: list[Call], load: list[Outcome], alone: list[Outcome]) -> dict:
    """How the load's answers stand against the same calls served one at a time."""
    by_id = {o.id: o for o in alone}
    done = [o for o in load if o.status == 200 and not o.cancelled]
    cut = [o for o in load if o.cancelled]
    seen = [i for o in load for i in o.ids]
    return {
        "requests": len(calls),
        "completed": len(done),
        "cancelled": len(cut),
        "failed": sum(o.status != 200 for o in load),
        "lost": len({c.id for c in calls} - {o.id for o in load}),
        "answered_twice": len(load) - len({o.id for o in load}) + len(seen) - len(set(seen)),
        "mismatches": sum((o.text, o.finish) != (by_id[o.id].text, by_id[o.id].finish) for o in done),
        "cancelled_not_prefix": sum(not by_id[o.id].text.startswith(o.text) for o in cut),
        "rejected_429": sum(o.rejected for o in load),
    }


def settled(backend, timeout_s: float = 60.0) -> dict:
    """The backend's stats once nothing runs and no row is held (the engine's thread releases rows at its own
    pace), or as they are after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (s := backend.stats())["running"] or s.get("rows_held"):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return s


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def serve_and_load(service, calls: list[Call], clients: int, timeout_s: float = 3600) -> list[dict]:
    """One-at-a-time and concurrent passes of `calls` against `service` (each bounded by `timeout_s`); one
    row per pass."""
    from evalkit.serve.app import make_app

    full = [Call(c.id, c.path, c.body) for c in calls]  # one at a time, nobody cancels
    with Background(make_app(service)) as server:
        alone, alone_s = run_load(server.url, full, clients=1, timeout_s=timeout_s)
        load, load_s = run_load(server.url, calls, clients=clients, timeout_s=timeout_s)  # after Retry-After
        idle = settled(service.backend)
    checked = compare(calls, load, alone)
    rows = []
    for mode, outcomes, wall in (("one at a time", alone, alone_s), (f"{clients} clients", load, load_s)):
        answered = [o for o in outcomes if o.status == 200 and not o.cancelled]
        tokens = sum(o.tokens for o in answered)
        latencies = [o.latency_s for o in answered]
        rows.append(
            {
                "mode": mode,
                "rows": idle["rows"],
                "queue_limit": idle["queue_limit"],
                "tokens": tokens,
                "wall_s": round(wall, 2),
                "tokens_per_s": round(tokens / wall, 2),
                "p50_s": round(percentile(latencies, 0.5), 3),
                "p99_s": round(percentile(latencies, 0.99), 3),
                **(checked if outcomes is load else {"requests": len(full), "completed": len(answered)}),
                "rows_held_after": idle.get("rows_held"),
            }
        )
    rows[1]["speedup"] = round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 2)
    return rows


def run(ctx: Context) -> list[dict]:
    from evalkit.serve.live import engine_service

    n, clients = ctx.size((12, 6), (200, 32))  # the one-at-a-time pass dominates: ~27 min on 2 busy cores
    service = engine_service(
        ctx.model, ctx.tokenizer, name=ctx.model_name, method="snapstream", budget=128, rows=8, queue_limit=4
    )
    calls = mixed_calls(ctx.model_name, n, budgets=(None, 64, 96), max_tokens=(4, 8, 16, 32))
    return serve_and_load(service, calls, clients)


def note(rows: list[dict]) -> str:
    load = rows[-1]
    return (
        f"`make serve`'s engine (SnapStream 128, per-request budgets 64/96 mixed in; {load['rows']} rows, "
        f"queue limit {load['queue_limit']}) on 127.0.0.1: {load['requests']} mixed requests (completions "
        "and chat, 6-200 word prompts, 4-32 tokens, a third streamed, some cancelled mid-stream, a fifth "
        "sampled with seeds) one at a time, then from concurrent clients. Concurrent: "
        f"{load['speedup']}x the tokens per second; {int(load['rejected_429'])} answers 429 (queue full), "
        f"retried; {int(load['mismatches'])} answers differ from one at a time, {int(load['lost'])} lost, "
        f"{int(load['answered_twice'])} answered twice; rows held after: {int(load['rows_held_after'])}. "
        "Latency is per request, queueing included."
    )


MEASUREMENT = Measurement(
    "serving", "serving.csv", "The server under concurrent load (make serve)", run, note
)
