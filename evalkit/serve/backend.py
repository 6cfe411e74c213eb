"""The server's side of the engine: one engine loop (a thread) owns the model; HTTP handlers submit work,
receive its tokens as they are produced, and may cancel it.

    ticket = backend.submit([Work(...), ...])   # a request's choices; QueueFull / Closed before any row
    async for index, event in ticket:           # Token as each is chosen, then one End per choice
        ...
    backend.cancel(ticket)                      # the client went away: its rows are released at the next step
    backend.stats()                             # queue depth, rows held, rates, KV figures (/metrics)

`Inbox` is the bounded queue between the two threads: handlers put tickets in, the engine loop polls it once
between steps for as many choices as it has free rows and for the ones to drop (the same poll an
`evalkit.engine.Feed` answers), and hands each token and end back to the ticket's asyncio queue. A backend
is an `EngineLoop`: the inbox plus a thread that drives an engine from it (evalkit.serve.live for the real
engine, evalkit.serve.fake for tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Work:
    """One choice for the engine: a prompt already tokenized and fitted to the context."""

    ids: list[int]
    max_new: int
    method: object  # the KV method at this request's budget
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    stops: list[str] = field(default_factory=list)
    min_new: int = 0  # EOS is suppressed until this many tokens
    logprobs: int | None = None  # alternatives reported per token (0: the chosen token's own); None: none
    key: str = ""  # unique on this server ("<ticket>/<choice>"), set when submitted


@dataclass(frozen=True)
class Token:
    id: int
    logprob: float | None = None  # of the raw model distribution (before temperature and top-p)
    top: tuple[tuple[int, float], ...] = ()  # the most likely alternatives, best first


@dataclass(frozen=True)
class End:
    reason: str  # "stop" (EOS or a stop string), "length", "cancelled" or "error"
    stats: dict = field(default_factory=dict)  # the row's KV figures when it ended
    message: str = ""  # why, for "error"


class QueueFull(Exception):
    """The queue holds `limit` choices already: HTTP 429, try again after `retry_after` seconds."""

    def __init__(self, limit: int, retry_after: int):
        super().__init__(
            f"the queue is full ({limit} choices waiting for a row): retry after {retry_after} s"
        )
        self.retry_after = retry_after


class Closed(Exception):
    """The server takes no more work (shutting down, or its engine failed): HTTP 503."""


def token_event(token: int, logits: torch.Tensor, alternatives: int | None) -> Token:
    """The token with its logprob and `alternatives` best alternatives from the logits it was chosen from
    (1, V), or alone when no logprobs were asked for."""
    if alternatives is None:
        return Token(token)
    logp = torch.log_softmax(logits[0].float(), dim=-1)  # (V,)
    top = torch.topk(logp, alternatives) if alternatives else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return Token(token, float(logp[token]), pairs)


class Ticket:
    """A request's choices in the engine: their events, in the order produced, as (choice index, event)."""

    def __init__(self, number: int, works: list[Work], loop: asyncio.AbstractEventLoop):
        self.id, self.works, self._loop = number, works, loop
        self._events: asyncio.Queue = asyncio.Queue()
        self._open = len(works)

    def put(self, index: int, event: Token | End) -> None:
        """From any thread (the engine loop's)."""
        with contextlib.suppress(RuntimeError):  # the event loop closed (the server is gone): nobody listens
            self._loop.call_soon_threadsafe(self._events.put_nowait, (index, event))

    async def __aiter__(self) -> AsyncIterator[tuple[int, Token | End]]:
        while self._open:
            index, event = await self._events.get()
            self._open -= isinstance(event, End)
            yield index, event


class Inbox:
    """The bounded queue between HTTP handlers and the engine loop (thread-safe). `limit` counts choices
    waiting for a row; running ones are not counted."""

    def __init__(self, limit: int, retry_after: int = 1):
        self.limit, self.retry_after = limit, retry_after
        self._cond = threading.Condition()
        self._waiting: deque[tuple[Ticket, int]] = deque()
        self._running: dict[str, tuple[Ticket, int]] = {}
        self._drop: set[str] = set()
        self._numbers = itertools.count()
        self.closed = False
        self.failed: str | None = None
        self.ended: Counter = Counter()  # choices ended, by reason
        self.totals: Counter = Counter()  # KV figures summed over ended choices (kv_seen, kv_kept)
        self.submitted = 0

    # --- the HTTP side ------------------------------------------------------------------------------------
    def submit(self, works: list[Work], loop: asyncio.AbstractEventLoop) -> Ticket:
        """A ticket for a request's choices, queued as a whole or not at all."""
        with self._cond:
            if self.closed or self.failed:
                raise Closed(self.failed or "the server is shutting down")
            if len(self._waiting) + len(works) > self.limit:
                raise QueueFull(self.limit, self.retry_after)
            ticket = Ticket(next(self._numbers), works, loop)
            for i, work in enumerate(works):
                work.key = f"{ticket.id}/{i}"
            self._waiting.extend((ticket, i) for i in range(len(works)))
            self.submitted += len(works)
            self._cond.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Its waiting choices end now; its running ones are dropped at the engine's next step."""
        with self._cond:
            mine = [(t, i) for t, i in self._waiting if t is ticket]
            for entry in mine:
                self._waiting.remove(entry)
            self._drop |= {w.key for w in ticket.works if w.key in self._running}
            self._cond.notify_all()
        for t, i in mine:
            self._end(t, i, End("cancelled"))

    def close(self) -> None:
        """No more tickets; the engine loop returns once nothing runs."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def cancel_all(self) -> None:
        with self._cond:
            tickets = {t for t, _ in [*self._waiting, *self._running.values()]}
        for ticket in tickets:
            self.cancel(ticket)

    def idle(self) -> bool:
        return not self._waiting and not self._running

    # --- the engine side ----------------------------------------------------------------------------------
    def poll(self, free: int, idle: bool, wait_s: float | None = None) -> tuple[list[Work], set[str], bool]:
        """(works to run next, at most `free`; keys to drop; closed). `idle`: wait for work or the close (at
        most `wait_s` seconds when given: then perhaps nothing)."""
        with self._cond:
            if idle:
                self._cond.wait_for(lambda: self._waiting or self.closed, wait_s)
            new = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            for ticket, i in new:
                self._running[ticket.works[i].key] = (ticket, i)
            drop, self._drop = self._drop & set(self._running), set()
            return [t.works[i] for t, i in new], drop, self.closed and not self._waiting

    def token(self, key: str, token: Token) -> None:
        entry = self._running.get(key)
        if entry is not None:
            entry[0].put(entry[1], token)

    def finish(self, key: str, end: End) -> None:
        with self._cond:
            entry = self._running.pop(key, None)
            self._cond.notify_all()
        if entry is not None:
            self._end(*entry, end)

    def fail(self, message: str) -> None:
        """The engine loop died: every ticket ends with an error, and no more are taken."""
        with self._cond:
            self.failed = message
            entries = [*self._waiting, *self._running.values()]
            self._waiting.clear()
            self._running.clear()
            self._cond.notify_all()
        for ticket, i in entries:
            self._end(ticket, i, End("error", message=message))

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(self.idle, timeout)

    def _end(self, ticket: Ticket, index: int, end: End) -> None:
        with self._cond:  # from either thread (a Condition's lock is reentrant)
            self.ended[end.reason] += 1
            self.totals.update({k: end.stats.get(k, 0) for k in ("kv_seen", "kv_kept")})
        ticket.put(index, end)

    def depth(self) -> tuple[int, int]:
        """(choices waiting, choices running)."""
        return len(self._waiting), len(self._running)


class EngineLoop:
    """A backend: the inbox plus a thread that drives one engine from it (`_run`, the subclass's). Its
    `stats()` adds the engine's own figures (`_engine_stats`) to the queue's."""

    def __init__(self, rows: int, queue_limit: int):
        self.rows = rows
        self.inbox = Inbox(queue_limit)
        self._thread = threading.Thread(target=self._main, name="evalkit-engine", daemon=True)
        self.started = time.time()

    def start(self) -> None:
        self._thread.start()

    def submit(self, works: list[Work], loop: asyncio.AbstractEventLoop | None = None) -> Ticket:
        return self.inbox.submit(works, loop or asyncio.get_running_loop())

    def cancel(self, ticket: Ticket) -> None:
        self.inbox.cancel(ticket)

    def cancel_all(self) -> None:
        self.inbox.cancel_all()

    def close(self, timeout: float) -> None:
        """Take no more work; let what runs finish for up to `timeout` seconds, then cancel it; wait for the
        engine loop to return."""
        self.inbox.close()
        if not self.inbox.wait_idle(timeout):
            self.inbox.cancel_all()
        if self._thread.is_alive():
            self._thread.join(timeout=max(timeout, 10.0))

    def join(self) -> None:
        """Until the engine loop has returned (after `close`)."""
        self._thread.join()

    def stats(self) -> dict:
        waiting, running = self.inbox.depth()
        return {
            "rows": self.rows,
            "queue_limit": self.inbox.limit,
            "waiting": waiting,
            "running": running,
            "submitted": self.inbox.submitted,
            "ended": dict(self.inbox.ended),
            "kv_seen_total": self.inbox.totals["kv_seen"],
            "kv_kept_total": self.inbox.totals["kv_kept"],
            "failed": self.inbox.failed,
            **self._engine_stats(),
        }

    def _main(self) -> None:
        try:
            self._run()
        except Exception as e:  # a bug or an out-of-memory: every waiting client hears it, /health says it
            self.inbox.fail(f"the engine failed: {type(e).__name__}: {e}")
            raise

    def _run(self) -> None:
        raise NotImplementedError

    def _engine_stats(self) -> dict:
        return {}
