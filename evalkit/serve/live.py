"""The real backend: `evalkit.engine.Engine` driven from the server's inbox through the engine's `Feed` hooks
(`Engine.run(feed=...)`): choices join the continuous batch between steps as rows free up, each token is
handed to its ticket as it is chosen (its logprobs computed here, from the logits it was chosen from, only
when asked for), and a cancelled choice's row is released at the next step.

Under tensor parallelism (`make serve NPROC=2 ARGS="parallel.tp_size=2"`) rank 0 serves HTTP and polls the
inbox; what each poll takes (the choices, the keys to drop, the close) is broadcast to the other ranks
(`Team.from_writer`), whose `Follower` engines run the same conversations in the same steps on their shards;
the engine's own agreement (`Team.agree` on each step's logits) does the rest. An idle rank 0 broadcasts an
empty poll every few seconds, so the followers' wait never reaches the process group's timeout.

Everything else is the engine's own: each choice prefilled alone into its compressed cache, copied into a
free row of the slot pool (rows of different budgets side by side), sampled with its own generator, so a
choice decodes the same whatever else the server is serving.
"""

from __future__ import annotations

import time

from evalkit.engine import Engine, Intake
from evalkit.kv.cache import NONE
from evalkit.kv.storage import KVStorage
from evalkit.request import generation_config
from evalkit.serve.backend import End, EngineLoop, Work, token_event
from evalkit.team import Team
from evalkit.turns import Conversation, Turn, ask

REASONS = {"eos": "stop", "stop": "stop", "limit": "length", "cancelled": "cancelled"}
HEARTBEAT_S = 5.0  # TP: an idle rank 0 tells the followers "nothing yet" this often
SNAPSHOT_S = 0.5  # the KV figures of the rows held are read at most this often (a few host reads)


def eos_ids(model, tokenizer) -> list[int]:
    """The model's EOS ids and the tokenizer's, as the in-process LM stops (EvalkitLM._eos_ids)."""
    eos = model.generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, list | tuple) else [eos] if eos is not None else []
    return sorted({*eos, tokenizer.eos_token_id} - {None})


def conversation(work: Work, eos: list[int], pad: int | None) -> Conversation:
    """The engine's conversation for one choice (the same on every TP rank)."""
    gen = {"temperature": work.temperature, "top_p": work.top_p, "top_k": work.top_k}
    config = generation_config(gen, work.max_new, eos, pad)
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


def heartbeat_s(team: Team) -> float | None:
    """How long an idle rank 0 waits for work before it broadcasts an empty poll (TP only): well inside the
    process group's timeout, which a follower waiting in the broadcast would otherwise reach."""
    return min(HEARTBEAT_S, team.ranks.timeout_s / 4) if team.world > 1 else None


class EngineBackend(EngineLoop):
    """The engine behind the server: `rows` rows in its slot pool, `queue_limit` choices waiting; under TP,
    rank 0's (the other ranks are `Follower`s)."""

    def __init__(
        self,
        model,
        tokenizer,
        rows: int,
        queue_limit: int,
        compile=False,
        team: Team | None = None,
        storage: KVStorage = NONE,
    ):
        super().__init__(rows, queue_limit)
        self.team = team or Team.single()
        self.eos = eos_ids(model, tokenizer)
        self.pad = tokenizer.pad_token_id
        self.engine = Engine(
            model, tokenizer, self.eos, rows=rows, compile=compile, team=self.team, storage=storage
        )
        self._kv: dict = {}
        self._read_at = 0.0

    def _run(self) -> None:
        for done in self.engine.run([], feed=self):
            stats = {**done.stats, "ended": done.ended}
            self.inbox.finish(done.key, End(REASONS[done.ended], stats))

    # --- evalkit.engine.Feed ------------------------------------------------------------------------------
    def poll(self, free: int, idle: bool) -> Intake:
        self._read_kv(force=idle)
        taken = self.inbox.poll(free, idle, heartbeat_s(self.team))
        works, drop, closed = self.team.from_writer(taken)  # TP: what the followers run next
        return Intake([conversation(w, self.eos, self.pad) for w in works], drop, closed)

    def token(self, key: str, turn: Turn, token: int, logits) -> None:
        self.inbox.token(key, token_event(token, logits, turn.tag.logprobs))

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
            "kv_pool_bytes": pool.allocated_bytes(),  # the storage's per-row tensors counted
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


class Follower:
    """A TP rank other than 0: its engine runs rank 0's polls on this rank's shard of the model, in the same
    steps (every collective of the engine matched), and answers nobody. `run` returns once rank 0 closes."""

    def __init__(self, model, tokenizer, rows: int, team: Team, compile=False, storage: KVStorage = NONE):
        self.team = team
        self.eos = eos_ids(model, tokenizer)
        self.pad = tokenizer.pad_token_id
        self.engine = Engine(
            model, tokenizer, self.eos, rows=rows, compile=compile, team=team, storage=storage
        )

    def run(self) -> None:
        for _ in self.engine.run([], feed=self):
            pass

    def poll(self, free: int, idle: bool) -> Intake:
        works, drop, closed = self.team.from_writer(None)
        return Intake([conversation(w, self.eos, self.pad) for w in works], drop, closed)

    def token(self, key: str, turn: Turn, token: int, logits) -> None:
        pass  # rank 0 streams it


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
    team: Team | None = None,
    storage: KVStorage = NONE,
):
    """A Service over the engine for a loaded model: `method` a conf name or a composed `method` node (at
    `budget`, when given); `context` the model's unless given; `team`: rank 0's TP group, when sharded;
    `storage`: how its slot pool holds K/V (conf/kv/, the card reports it)."""
    from omegaconf import OmegaConf

    from evalkit.config import group_config
    from evalkit.kv.config import make_method
    from evalkit.results import git_sha
    from evalkit.serve.service import Card, Service

    conf = group_config("method", method) if isinstance(method, str) else method
    if budget is not None:
        conf = OmegaConf.merge(conf, {"budget": budget})
    backend = EngineBackend(model, tokenizer, rows, queue_limit, compile=compile, team=team, storage=storage)
    held = {"dtype": str(model.dtype).removeprefix("torch."), **storage.describe()}  # the model's, and how
    context = context or model.config.max_position_embeddings
    card = Card(name, context, make_method(conf), conf, held, source, git_sha(), max_n, kv=storage)
    return Service(card, tokenizer, backend)
