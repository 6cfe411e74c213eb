"""Continuous batching over evalkit's compressed caches: conversations in, a fixed pool of rows, refill on
finish.

A `Conversation` is what is fed after a prompt, and the only way to feed it: its context ids are prefilled
alone (their own compressed cache, or replayed from another budget's recorded prefill, `evalkit.kv.prefill`),
then copied into a free row of one static slot pool (`evalkit.kv.pool.SlotPool`), where its `Turn`s run one
after another on that cache: each feeds its forced tokens (a question and its markup) teacher-forced, one per
decode step, then generates its answer (EOS, a stop string, its token limit). A `Followup` turn is a second
call on a fresh cache whose prompt is built from the previous answer (LongBench CoT's answer call). Every row
keeps its own method, budget, ring and positions, so rows of different budgets of one prompt decode side by
side, and a row whose conversation ends takes the next one at once instead of idling until the longest row of
a static batch ends. Token choice is transformers' own (float32 logits, the temperature / top-k / top-p
warpers, softmax, multinomial), with one random generator per turn seeded from its key: a turn samples the
same whatever row, batch or moment it lands in, and a resumed run samples what the killed one would.

    engine = Engine(model, tokenizer, eos_ids=[2], rows=8)
    for done in engine.run(conversations):   # one Done per generated turn, in completion order
        journal(done.key, done.tag, done.tokens, done.stats)

`run` takes conversations from an `Inbox` between decode steps (a list becomes one): what arrives while
others decode takes the next free row. A server hands conversations over while the engine runs instead
(`run(feed=...)`, evalkit.serve): the engine polls its `Feed` once between steps for new ones (as many as rows
are free) and for the ones whose caller went away (their rows are released at once, "cancelled"), and tells it
each token as it is chosen.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import CompileConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from evalkit.kv.cache import NONE, KVCache
from evalkit.kv.layout import Shape, slots_needed
from evalkit.kv.pool import BUCKETS, Buckets, SlotPool
from evalkit.kv.prefill import shared_prefill
from evalkit.kv.select import agree_for
from evalkit.kv.static import compile_config
from evalkit.kv.storage import KVStorage
from evalkit.team import Team
from evalkit.turns import Conversation, Done, Followup, Inbox, Turn, fed_tokens


@dataclass
class Intake:
    """What a feed hands the engine between two steps."""

    new: list[Conversation]  # to run next, at most the `free` rows asked for
    drop: set[str] = field(default_factory=set)  # keys of conversations to release now (their caller left)
    closed: bool = False  # nothing more will come: the engine returns once nothing runs


class Feed(Protocol):
    """Conversations that arrive while the engine runs (a server's queue); the keys it hands over are
    unique."""

    def poll(self, free: int, idle: bool) -> Intake:
        """Polled once between steps; `idle`: nothing runs, so the feed may wait for one or a close."""

    def token(self, key: str, turn: Turn, token: int, logits: torch.Tensor) -> None:
        """Each generated token of conversation `key` as it is chosen, with the raw float32 logits it was
        chosen from (1, V)."""


@dataclass(eq=False)
class _Row:
    key: str
    turn: Turn
    rest: list  # the conversation's turns after this one
    tokens: list[int]
    stops: list  # lm-eval's MultiTokenEOSCriteria, one per stop string
    generator: torch.Generator | None
    warpers: LogitsProcessorList
    # tokens in the cache before this answer (a conversation's later turn: the context, the earlier turns and
    # its own question), and of them the ones the prefill compressed (the conversation's context)
    before: int
    prefill: int
    prefill_s: float = 0.0
    replayed: bool = False  # the prefill came from a record
    share_s: float = 0.0  # this row's share of the decode steps' wall time
    logits: list[torch.Tensor] | None = None  # kept raw logits, (V,) each
    forced: deque = field(default_factory=deque)  # forced tokens still to feed


class Engine:
    """Decode many conversations through one pool of `rows` rows. `continuous=False` is static batching (a
    batch is refilled only when all its rows are done), kept for comparison. A step attends over the pool's
    filled slots rounded up to one of `buckets` (`evalkit.kv.pool.Buckets`); `compile=True` compiles the
    decode step once per (rows, slots, bucket) shape (`evalkit.kv.static.compile_config`), counted in
    `shapes`. Under tensor parallelism
    every rank of `team`'s TP group runs the same conversations and takes its root's decisions (logits,
    replicated kept sets)."""

    def __init__(
        self,
        model,
        tokenizer,
        eos_ids: list[int],
        rows: int,
        continuous: bool = True,
        compile=False,
        team: Team | None = None,
        buckets: Buckets = BUCKETS,
        storage: KVStorage = NONE,
    ):
        self.model, self.tokenizer, self.eos = model, tokenizer, set(eos_ids)
        self.buckets = buckets
        self.shapes: set[tuple[int, int, int]] = set()  # (rows, slots, visible) the decode step ran in
        self.storage = storage  # how every cache and the pool hold K/V (`evalkit.kv.storage`): one per run
        self.team = team or Team.single()
        self.cache_agree = agree_for(self.team, model)  # kept indices -> the TP group's (MLA)
        self.n_rows, self.continuous = rows, continuous
        text = model.config.get_text_config()  # what a request's slots may depend on (adaptive budgets)
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        self.shape = Shape(heads, text.num_hidden_layers)  # MLA caches fewer: an upper bound is enough
        self.step_fn = model.forward
        self._keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        if (
            compile
        ):  # True (inductor), a torch.compile backend or a CompileConfig: transformers' compiled call
            cfg = compile
            if not isinstance(compile, CompileConfig):
                cfg = compile_config(model, backend="inductor" if compile is True else compile)
            self.step_fn = model.get_compiled_call(cfg)
            # one graph per (rows, slots, bucket): dynamo's default of 8 per code object would silently fall
            # back to eager after the 8th (a run rarely reaches more than a few buckets; room for regrowths)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.pool: SlotPool | None = None
        self.capacity = 1
        self.steps = 0
        self.row_steps = 0  # rows x steps decoded
        self.idle_row_steps = 0  # of them, rows holding no conversation
        self.generated = 0
        self.started = 0.0
        # the progress bar's rates: prefill and decode apart (a prefill of 2k tokens is not slow decoding)
        self.prefill_s = self.decode_s = 0.0
        self.prefill_tokens = self.decode_tokens = 0
        # the KV heads this process caches (all the model's, or its share under tensor parallelism), from the
        # first prefill
        self.kv_heads: int | None = None
        self._feed: Feed | None = None  # run(feed=...): told each token
        self.live: list[_Row | None] = []  # while running: each row's turn, None where idle (a feed reads)

    # --- the loop -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, conversations: Iterable[Conversation] | Inbox, feed: Feed | None = None) -> Iterator[Done]:
        """Every generated turn's Done, in completion order. Conversations are taken from the inbox whenever
        a row is free (between decode steps); a follow-up call goes ahead of the waiting ones. With a `feed`,
        conversations also arrive between steps until it closes; a dropped one ends as "cancelled"."""
        inbox = conversations if isinstance(conversations, Inbox) else Inbox(conversations)
        del conversations  # the inbox alone holds them (and their prefill records) until they run
        self.capacity = max([self.capacity, *(self._need(c) for c in inbox)])  # the pool's size, once
        live: list[_Row | None] = [None] * self.n_rows
        last = torch.zeros(self.n_rows, dtype=torch.long, device=self.model.device)  # (rows,) last token
        self.started = time.perf_counter()
        self._feed, self.live = feed, live
        while inbox or any(live) or feed is not None:
            if feed is not None:
                busy = sum(row is not None for row in live) + len(inbox)
                intake = feed.poll(max(self.n_rows - busy, 0), idle=busy == 0)
                for conv in intake.new:
                    inbox.put(conv)
                yield from self._drop(intake.drop, inbox, live)
                if intake.closed and not inbox and not any(live):
                    return
            if self.continuous or not any(live):
                yield from self._refill(inbox, live, last)
            if any(live):
                yield from self._step(live, last, inbox)

    def _drop(self, keys: set[str], inbox: Inbox, live: list) -> Iterator[Done]:
        """The conversations `keys` names end now as "cancelled": a waiting one is forgotten, a row is
        released (its slots take the next conversation)."""
        if not keys:
            return
        for conv in inbox.drop(keys):
            yield Done(conv.key, conv.turns[0], [], "cancelled", {})
        held = [r for r, row in enumerate(live) if row is not None and row.key in keys]
        kv = self.pool.row_stats() if held else []
        for r in held:
            yield self._done(live[r], "cancelled", kv[r])
            live[r] = None
            self.pool.idle_row(r)

    def _refill(self, inbox: Inbox, live: list, last: torch.Tensor) -> Iterator[Done]:
        """Free rows take the next conversations (prefilled alone, then copied in)."""
        for r in range(self.n_rows):
            while live[r] is None and inbox:
                conv = inbox.take()
                self.capacity = max(self.capacity, self._need(conv))  # a follow-up, or one that arrived
                start = time.perf_counter()
                cache, logits, replayed = self._prefill(conv)
                self.kv_heads = self.kv_heads or int(cache.layers[0].keys.shape[1])  # (B, H_kv, T, D)
                row = self._first_row(conv, time.perf_counter() - start, replayed)
                self.prefill_s += row.prefill_s
                self.prefill_tokens += len(conv.ids)
                if row.forced:  # the prefill's logits predict the first forced token: not a choice
                    token = row.forced.popleft()
                else:
                    token = self._choose(row, logits)
                    ended = self._append(row, token, logits)
                    if ended is not None:  # its turn is done at its first token
                        done = self._done(row, ended, cache.row_stats()[0])
                        yield done
                        row = self._next(row, done, inbox)
                        if row is None:  # nothing more on this cache: it never needs a row
                            continue
                        token = row.forced.popleft()  # a later turn always feeds its question first
                if self.pool is None:
                    self.pool = SlotPool.shaped_like(cache, self.n_rows, self.capacity, self.buckets)
                elif self.pool.capacity < self.capacity:  # by half again at least: few regrowths, recompiles
                    self.pool.grow(max(self.capacity, self.pool.capacity * 3 // 2))
                self.pool.load_row(r, cache)
                live[r], last[r] = row, token

    def _step(self, live: list, last: torch.Tensor, inbox: Inbox) -> Iterator[Done]:
        """One decode step of every row: a token each, the finished turns handed out."""
        start = time.perf_counter()
        positions = self.pool.rows.next_pos.clone()[:, None]  # (rows, 1) this token's position per row
        self.shapes.add((self.n_rows, self.pool.capacity, self.pool.visible))
        out = self.step_fn(
            input_ids=last[:, None],
            position_ids=positions,
            cache=self.pool,
            use_cache=True,
            **self._keep_last(),
        )
        logits = self.team.agree(out.logits[:, -1].to(copy=True, dtype=torch.float32))  # (rows, V): root's
        greedy = torch.argmax(logits, dim=-1)  # (rows,)
        chosen = greedy.tolist()  # one host read per step, not one per row
        active = [r for r, row in enumerate(live) if row is not None]
        self.pool.decoded(active)  # between steps: a decode-time method's periodic re-selection
        finished = []
        for r in active:
            row = live[r]
            if row.forced:  # teacher-forced: the next input is the next forced token, whatever was predicted
                chosen[r] = row.forced.popleft()
                continue
            if row.generator is not None or row.logits is not None or len(row.tokens) < row.turn.min_new:
                chosen[r] = self._choose(row, logits[r : r + 1])
            ended = self._append(row, chosen[r], logits[r : r + 1])
            if ended is not None:
                finished.append((r, ended))
        last.copy_(torch.tensor(chosen, device=last.device))  # one host-to-device write
        wall = time.perf_counter() - start
        self.decode_s += wall
        self.decode_tokens += len(active)
        for r in active:
            live[r].share_s += wall / len(active)
        self.steps += 1
        self.row_steps += self.n_rows
        self.idle_row_steps += self.n_rows - len(active)
        kv = self.pool.row_stats() if finished else []  # every row's figures at once (a few host reads)
        for r, ended in finished:
            done = self._done(live[r], ended, kv[r])
            yield done
            live[r] = self._next(live[r], done, inbox)
            if live[r] is not None:  # the conversation's next question, on the same row's cache
                last[r] = live[r].forced.popleft()
            else:
                self.pool.idle_row(r)

    def _next(self, row: _Row, done: Done, inbox: Inbox) -> _Row | None:
        """What follows a finished turn: the next turn on the same cache (the last answer token fed back,
        unless an EOS: the turn's markup closes the answer, then the turn's own forced tokens), or None (a
        follow-up call goes to the front of the inbox on a fresh cache, or the conversation is over)."""
        if not row.rest:
            return None
        nxt, rest = row.rest[0], row.rest[1:]
        if isinstance(nxt, Followup):  # the conversation's last turn (`_need`)
            inbox.put(nxt.build(done), first=True)
            return None
        new = self._new_row(row.key, nxt, rest, before=0, prefill=row.prefill)
        new.forced.extendleft([] if row.tokens[-1] in self.eos else [row.tokens[-1]])
        # the cache holds everything before the last answer token (written only when fed back), then this turn
        new.before, new.prefill = row.before + len(row.tokens) - 1 + len(new.forced), row.prefill
        return new

    # --- one conversation -----------------------------------------------------------------------------------
    def _prefill(self, conv: Conversation) -> tuple[KVCache, torch.Tensor, bool]:
        """The conversation's own one-row cache after its prefill, the last position's float32 logits (1, V),
        and whether the prefill was replayed from a record."""
        replay = conv.replay
        replay = replay if replay is not None and replay.usable and replay.logits is not None else None
        cache = KVCache.for_model(
            conv.method,
            self.model,
            record=conv.record,
            replay=replay,
            max_new_tokens=fed_tokens(conv),
            agree=self.cache_agree,
            storage=self.storage,
        )
        ids = torch.tensor([conv.ids], device=self.model.device)
        with shared_prefill(self.model, self.tokenizer):
            out = self.model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                cache=cache,
                use_cache=True,
                **self._keep_last(),
            )
        # the owner and each replaying conversation drop their reference once prefilled, so a prompt's record
        # lives only until its last budget is in (a record holds the prompt's whole K/V)
        conv.replay = conv.record = None
        logits = self.team.agree(out.logits[:, -1].to(copy=True, dtype=torch.float32))  # TP: the root's
        return cache, logits, replay is not None

    def _first_row(self, conv: Conversation, prefill_s: float, replayed: bool) -> _Row:
        """The row of a conversation's first turn still to answer: the answered turns before it (a resumed
        conversation) are fed back first, teacher-forced, exactly as the cache held them."""
        turns = list(conv.turns)
        history = []
        while isinstance(turns[0], Turn) and turns[0].answer is not None:
            done = turns.pop(0)
            history += done.forced + done.answer
        first = turns[0]
        # in the cache before its answer: the context, the answered turns fed back, and its own forced tokens
        before = len(conv.ids) + len(history) + len(first.forced)
        row = self._new_row(conv.key, first, turns[1:], before, len(conv.ids), prefill_s, replayed)
        row.forced.extendleft(reversed(history))
        return row

    def _new_row(
        self, key: str, turn: Turn, rest: list, before: int, prefill: int, prefill_s=0.0, replayed=False
    ) -> _Row:
        from lm_eval.models.utils_hf import MultiTokenEOSCriteria

        cfg = turn.config
        generator, warpers = None, LogitsProcessorList()
        if cfg.do_sample:  # transformers' warpers for these settings, in its order
            generator = torch.Generator(device=self.model.device).manual_seed(turn.seed)
            if cfg.temperature is not None and cfg.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(cfg.temperature))
            if cfg.top_k is not None and cfg.top_k != 0:
                warpers.append(TopKLogitsWarper(top_k=cfg.top_k, min_tokens_to_keep=1))
            if cfg.top_p is not None and cfg.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=cfg.top_p, min_tokens_to_keep=1))
        stops = [MultiTokenEOSCriteria(s, self.tokenizer, 0, 1) for s in turn.until]
        return _Row(
            key=key,
            turn=turn,
            rest=rest,
            tokens=[],
            stops=stops,
            generator=generator,
            warpers=warpers,
            before=before,
            prefill=prefill,
            prefill_s=prefill_s,
            replayed=replayed,
            logits=[] if turn.keep_logits else None,
            forced=deque(turn.forced),
        )

    def _choose(self, row: _Row, logits: torch.Tensor) -> int:
        """transformers' token choice from logits (1, V): EOS masked before `min_new` tokens, then argmax, or
        warpers, softmax and one multinomial draw from the row's own generator (the same stream as generate's
        global one seeded with the turn's seed)."""
        if row.logits is not None:
            row.logits.append(logits[0].clone())
        if len(row.tokens) < row.turn.min_new and self.eos:  # MinNewTokensLengthLogitsProcessor
            logits = logits.clone()
            logits[:, sorted(self.eos)] = float("-inf")
        if row.generator is None:
            return int(torch.argmax(logits, dim=-1)[0])
        scores = row.warpers(None, logits)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=row.generator)[0, 0])

    def _append(self, row: _Row, token: int, logits: torch.Tensor) -> str | None:
        """Add a token chosen from `logits` (1, V); why the turn ends here (transformers' stopping criteria),
        or None."""
        row.tokens.append(token)
        self.generated += 1
        if self._feed is not None:  # a server streams it now
            self._feed.token(row.key, row.turn, token, logits)
        if token in self.eos:
            return "eos"
        if row.stops:  # lm-eval's criteria read only their last sequence_id_len tokens
            ids = torch.tensor([row.tokens[-max(s.sequence_id_len for s in row.stops) :]])
            if any(bool(stop(ids, None)) for stop in row.stops):
                return "stop"
        return "limit" if len(row.tokens) >= row.turn.max_new else None

    def _done(self, row: _Row, ended: str, kv: dict) -> Done:
        turn = row.turn
        stats = dict(
            prompt_tokens=row.before,  # every token before the answer: a conversation's earlier turns too
            prefill_tokens=row.prefill,  # of them, those the prefill compressed (the rest was fed after it)
            max_new_tokens=turn.max_new,
            output_tokens=len(row.tokens),
            hit_limit=ended == "limit",
            wall_s=row.prefill_s + row.share_s,
            tokens_per_s=self.generated
            / max(time.perf_counter() - self.started, 1e-9),  # the engine's, so far
            prefill_replayed=row.replayed,
            kv_slots=kv["slots"],
            kv_bytes=kv["bytes"],
            kv_ragged_bytes=kv["ragged_bytes"],  # what a ragged layout would hold (adaptive budgets: less)
            kv_seen=kv["seen"],
            kv_kept=kv["kept"],
            kv_evicted_generated=kv["evicted_generated"],
            kv_heads=self.kv_heads,  # kv_bytes hold these heads: under TP a rank's share of the cache
        )
        if turn.forced:  # query_aware=false: the question's tokens were fed as decoded ones (counted as such)
            stats["question_tokens"] = len(turn.forced)
        return Done(row.key, turn, row.tokens, ended, stats, row.logits, kv["layer_bytes"])

    def _need(self, conv: Conversation) -> int:
        """Slots a conversation needs in the pool (all its turns on its one cache)."""
        turns = [t for t in conv.turns if isinstance(t, Turn)]
        if len(turns) > 1 and not all(t.forced for t in turns):
            raise ValueError(
                "a conversation's every turn feeds its question (forced tokens) before it answers"
            )
        if any(isinstance(t, Followup) for t in conv.turns[:-1]):
            raise ValueError("a follow-up call is a conversation's last turn (it runs on a cache of its own)")
        return slots_needed(conv.method, len(conv.ids), fed_tokens(conv), self.shape)

    def _keep_last(self) -> dict:
        """logits_to_keep=1 where the model takes it, as generate passes it (same numbers, less work)."""
        return {"logits_to_keep": 1} if self._keep else {}

    def rates(self) -> dict[str, str]:
        """Prefill and decode tokens per second so far, apart, and the decode shapes (graphs, compiled): what
        the progress bar shows."""
        return {
            "prefill_tok_s": f"{self.prefill_tokens / max(self.prefill_s, 1e-9):.0f}",
            "decode_tok_s": f"{self.decode_tokens / max(self.decode_s, 1e-9):.1f}",
            "shapes": str(len(self.shapes)),
        }

    def idle_fraction(self) -> float:
        """Share of decoded row-steps that held no conversation (static batching's waste)."""
        return self.idle_row_steps / self.row_steps if self.row_steps else 0.0
