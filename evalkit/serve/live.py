"""The real backend: `evalkit.engine.Engine` driven from the server's inbox through the engine's `Feed` hooks
(`Engine.run(feed=...)`): choices join the continuous batch between steps as rows free up, each token is
handed to its ticket as it is chosen (its logprobs computed here, from the logits it was chosen from, only
when asked for), and a cancelled choice's row is released at the next step.

Everything else is the engine's own: each choice prefilled alone into its compressed cache, copied into a
free row of the slot pool (rows of different budgets side by side), sampled with its own generator, so a
choice decodes the same whatever else the server is serving.
"""

from __future__ import annotations

import time

from evalkit.engine import Engine, Intake
from evalkit.request import generation_config
from evalkit.serve.backend import End, EngineLoop, Work, token_event
from evalkit.turns import Conversation, Turn, ask

REASONS = {"eos": "stop", "stop": "stop", "limit": "length", "cancelled": "cancelled"}
SNAPSHOT_S = 0.5  # the KV figures of the rows held are read at most this often (a few host reads)


def eos_ids(model, tokenizer) -> list[int]:
    """The model's EOS ids and the tokenizer's, as the in-process LM stops (EvalkitLM._eos_ids)."""
    eos = model.generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, list | tuple) else [eos] if eos is not None else []
    return sorted({*eos, tokenizer.eos_token_id} - {None})


class EngineBackend(EngineLoop):
    """The engine behind the server: `rows` rows in its slot pool, `queue_limit` choices waiting."""

    def __init__(self, model, tokenizer, rows: int, queue_limit: int, compile=False):
        super().__init__(rows, queue_limit)
        self.eos = eos_ids(model, tokenizer)
        self.pad = tokenizer.pad_token_id
        self.engine = Engine(model, tokenizer, self.eos, rows=rows, compile=compile)
        self._kv: dict = {}
        self._read_at = 0.0

    def _run(self) -> None:
        for done in self.engine.run([], feed=self):
            stats = {**done.stats, "ended": done.ended}
            self.inbox.finish(done.key, End(REASONS[done.ended], stats))

    # --- evalkit.engine.Feed ------------------------------------------------------------------------------
    def poll(self, free: int, idle: bool) -> Intake:
        self._read_kv(force=idle)
        works, drop, closed = self.inbox.poll(free, idle)
        return Intake([self._request(w) for w in works], drop, closed)

    def token(self, key: str, turn: Turn, token: int, logits) -> None:
        self.inbox.token(key, token_event(token, logits, turn.tag.logprobs))

    def _request(self, work: Work) -> Conversation:
        gen = {"temperature": work.temperature, "top_p": work.top_p, "top_k": work.top_k}
        config = generation_config(gen, work.max_new, self.eos, self.pad)
        return ask(
            work.key,
            work.ids,
            work.max_new,
            work.method,
            config,
            work.seed,
            until=list(work.stops),
            min_new=work.min_new,
            tag=work,
        )

    # --- what /metrics shows --------------------------------------------------------------------------------
    def _read_kv(self, force: bool) -> None:
        """The KV figures of the rows held now (between steps, on the engine's thread)."""
        pool = self.engine.pool
        if pool is None or not (force or time.perf_counter() - self._read_at > SNAPSHOT_S):
            return
        held = [r for r, row in enumerate(self.engine.live) if row is not None]
        rows = pool.row_stats()
        self._kv = {
            "rows_held": len(held),
            "kv_held_bytes": sum(rows[r]["bytes"] for r in held),
            "kv_held_seen": sum(rows[r]["seen"] for r in held),
            "kv_held_kept": sum(rows[r]["kept"] for r in held),
            "kv_pool_bytes": sum(layer.entry_bytes() for layer in pool.layers) * pool.capacity,
            "kv_pool_slots": pool.capacity,
        }
        self._read_at = time.perf_counter()

    def _engine_stats(self) -> dict:
        e = self.engine
        return {
            "prefill_tokens": e.prefill_tokens,
            "prefill_s": e.prefill_s,
            "decode_tokens": e.decode_tokens,
            "decode_s": e.decode_s,
            "steps": e.steps,
            **self._kv,
        }


def engine_service(
    model,
    tokenizer,
    name: str,
    method,
    rows: int,
    queue_limit: int,
    budget: int | None = None,
    max_n: int = 8,
    context: int | None = None,
    compile=False,
    source: str = "",
):
    """A Service over the engine for a loaded model: `method` a conf name or a composed `method` node (at
    `budget`, when given); `context` the model's unless given."""
    from omegaconf import OmegaConf

    from evalkit.config import group_config
    from evalkit.kv.config import make_method
    from evalkit.results import git_sha
    from evalkit.serve.service import Card, Service

    conf = group_config("method", method) if isinstance(method, str) else method
    if budget is not None:
        conf = OmegaConf.merge(conf, {"budget": budget})
    backend = EngineBackend(model, tokenizer, rows, queue_limit, compile=compile)
    storage = {
        "dtype": str(model.dtype).removeprefix("torch.")
    }  # the storage object's, once KV storage is one
    context = context or model.config.max_position_embeddings
    card = Card(name, context, make_method(conf), conf, storage, source, git_sha(), max_n)
    return Service(card, tokenizer, backend)
