"""Continuous batching over evalkit's compressed caches: a queue of requests, a fixed pool of rows, refill on
finish.

Each request is prefilled alone (its own compressed cache, or replayed from another budget's recorded prefill,
`evalkit.kv.prefill`), then copied into a free row of one static slot pool (`evalkit.kv.pool.SlotPool`): every
row keeps its own method, budget, ring and positions, so rows of different budgets of one prompt decode side
by side, and a row that finishes (EOS, a stop string, its token limit) takes the next request at once instead
of idling until the longest row of a static batch ends. Token choice is transformers' own (float32 logits, the
temperature / top-k / top-p warpers, softmax, multinomial), with one random generator per request seeded from
its key: a request samples the same whatever row, batch or moment it lands in, and a resumed run samples what
the killed one would.

    engine = Engine(model, eos_ids=[2], rows=8)
    for done in engine.run(requests):   # in completion order
        journal(done.request, done.tokens, done.stats)
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import CompileConfig, GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from evalkit.kv.cache import KVCache
from evalkit.kv.layout import slots_needed
from evalkit.kv.pool import SlotPool
from evalkit.kv.prefill import PrefillRecord, shared_prefill
from evalkit.kv.static import compile_config
from evalkit.parallel import agree


@dataclass(eq=False)
class Request:
    key: str
    ids: list[int]  # prompt tokens (already fitted to the context)
    max_new: int
    method: object
    config: GenerationConfig  # do_sample, temperature, top_k, top_p (lm.generation_config)
    seed: int  # this request's own sampling seed
    until: list[str] = field(default_factory=list)  # stop strings (lm-eval's `until`)
    record: PrefillRecord | None = None  # keep this prefill for the requests that replay it
    replay: PrefillRecord | None = None  # take the prefill from this record instead of running it
    tag: object = None  # the caller's
    replayed: bool = False  # set at prefill: the prefill came from a record
    min_new: int = 0  # EOS is suppressed until this many tokens (transformers' min_new_tokens)
    keep_logits: bool = False  # keep each step's raw float32 logits (transformers' output_logits)
    # fed after the prefill as decoded tokens are, before anything is generated (query_aware=false: the
    # question and answer prefix, on the compressed context); teacher-forced, one token per step
    forced: list[int] = field(default_factory=list)
    # the next questions of a conversation on this request's cache (multi_question), each with its own
    # `forced` (the turn's markup, question and answer prefix), limits, seed and tag; only `ids` is unused.
    # A turn's answer stays in the cache: its last token, unless an EOS, is fed before the next turn's
    turns: list[Request] = field(default_factory=list)


def fed_tokens(req: Request) -> int:
    """Tokens a request writes into its cache after the prefill, at most: its forced and generated ones, and
    each later turn's (with the previous answer's last token, fed back)."""
    return req.max_new + len(req.forced) + sum(t.max_new + len(t.forced) + 1 for t in req.turns)


@dataclass
class Done:
    request: Request
    tokens: list[int]  # generated, the EOS included when it ended there
    ended: str  # "eos", "stop" or "limit"
    stats: dict  # the row's KV figures, timing
    logits: list[torch.Tensor] | None = None  # (V,) float32 per generated token, when the request kept them


@dataclass(eq=False)
class _Row:
    request: Request
    tokens: list[int]
    stops: list  # lm-eval's MultiTokenEOSCriteria, one per stop string
    generator: torch.Generator | None
    warpers: LogitsProcessorList
    prefill_s: float
    share_s: float = 0.0  # this row's share of the decode steps' wall time
    logits: list[torch.Tensor] | None = None  # kept raw logits, (V,) each
    forced: deque = field(default_factory=deque)  # forced tokens still to feed (the request's `forced`)


class Engine:
    """Decode many requests through one pool of `rows` rows. `continuous=False` is static batching (a batch is
    refilled only when all its rows are done), kept for comparison. `compile=True` compiles the decode step
    once per (rows, slots) shape (`evalkit.kv.static.compile_config`)."""

    def __init__(
        self, model, tokenizer, eos_ids: list[int], rows: int, continuous: bool = True, compile=False
    ):
        self.model, self.tokenizer, self.eos = model, tokenizer, set(eos_ids)
        self.n_rows, self.continuous = rows, continuous
        self.step_fn = model.forward
        self._keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        if (
            compile
        ):  # True (inductor), a torch.compile backend or a CompileConfig: transformers' compiled call
            cfg = compile
            if not isinstance(compile, CompileConfig):
                cfg = compile_config(model, backend="inductor" if compile is True else compile)
            self.step_fn = model.get_compiled_call(cfg)
        self.pool: SlotPool | None = None
        self.steps = 0
        self.row_steps = 0  # rows x steps decoded
        self.idle_row_steps = 0  # of them, rows holding no request
        self.generated = 0
        self.started = 0.0
        # the progress bar's rates: prefill and decode apart (a prefill of 2k tokens is not slow decoding)
        self.prefill_s = self.decode_s = 0.0
        self.prefill_tokens = self.decode_tokens = 0
        # bytes of one row's slot per layer (K and V), from the first prefill
        self.layer_bytes: list[int] = []

    # --- the loop -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(
        self, requests: Iterable[Request], then: Callable[[Done], Request | None] | None = None
    ) -> Iterator[Done]:
        """Every request's generation, in completion order. `then(done)` may return a follow-up request (a
        two-call protocol), which runs next, ahead of the queue."""
        queue = deque(requests)
        del requests  # the queue alone holds requests (and their prefill records) until they run
        self.capacity = max((self._need(r) for r in queue), default=1)
        live: list[_Row | None] = [None] * self.n_rows
        last = torch.zeros(self.n_rows, dtype=torch.long, device=self.model.device)  # (rows,) last token
        self.started = time.perf_counter()
        while queue or any(live):
            if self.continuous or not any(live):
                for done in self._refill(queue, live, last):
                    yield from self._finish(done, queue, then)
            if not any(live):
                continue
            for done in self._step(live, last):
                yield from self._finish(done, queue, then)

    def _finish(self, done: Done, queue: deque, then) -> Iterator[Done]:
        follow = then(done) if then is not None else None
        if follow is not None:
            self.capacity = max(self.capacity, self._need(follow))
            queue.appendleft(follow)
        yield done

    def _refill(self, queue: deque, live: list, last: torch.Tensor) -> Iterator[Done]:
        """Free rows take the next requests (prefilled alone, then copied in)."""
        for r in range(self.n_rows):
            while live[r] is None and queue:
                req = queue.popleft()
                start = time.perf_counter()
                cache, logits = self._prefill(req)
                self.layer_bytes = self.layer_bytes or [lay.entry_bytes() for lay in cache.layers]
                row = self._new_row(req, time.perf_counter() - start)
                self.prefill_s += row.prefill_s
                self.prefill_tokens += len(req.ids)
                if row.forced:  # the prefill's logits predict the first forced token: not a choice
                    token = row.forced.popleft()
                else:
                    token = self._choose(row, logits)
                    ended = self._append(row, token)
                    if ended is not None:  # done at its first token: it never needs a row
                        yield self._done(row, ended, cache.row_stats()[0])
                        continue
                if self.pool is None:
                    self.pool = SlotPool.shaped_like(cache, self.n_rows, self.capacity)
                elif self.pool.capacity < self.capacity:  # by half again at least: few regrowths, recompiles
                    self.pool.grow(max(self.capacity, self.pool.capacity * 3 // 2))
                self.pool.load_row(r, cache)
                live[r], last[r] = row, token

    def _step(self, live: list, last: torch.Tensor) -> Iterator[Done]:
        """One decode step of every row: a token each, the finished rows released."""
        start = time.perf_counter()
        positions = self.pool.rows.next_pos.clone()[:, None]  # (rows, 1) this token's position per row
        out = self.step_fn(
            input_ids=last[:, None],
            position_ids=positions,
            cache=self.pool,
            use_cache=True,
            **self._keep_last(),
        )
        logits = agree(out.logits[:, -1].to(copy=True, dtype=torch.float32))  # (rows, V), as the TP root's
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
            if row.generator is not None or row.logits is not None or len(row.tokens) < row.request.min_new:
                chosen[r] = self._choose(row, logits[r : r + 1])
            ended = self._append(row, chosen[r])
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
            yield self._done(live[r], ended, kv[r])
            if live[r].request.turns:  # a conversation: its next question, on the same row's cache
                live[r] = self._next_turn(live[r])
                last[r] = live[r].forced.popleft()
                continue
            live[r] = None
            self.pool.idle_row(r)

    def _next_turn(self, row: _Row) -> _Row:
        """The row's next question: the last answer token fed back (an EOS is left out: the turn's markup
        closes the answer), then the turn's own forced tokens."""
        nxt = row.request.turns[0]
        nxt.turns = row.request.turns[1:]
        new = self._new_row(nxt, 0.0)
        new.forced.extendleft([] if row.tokens[-1] in self.eos else [row.tokens[-1]])
        return new

    # --- one request ----------------------------------------------------------------------------------------
    def _prefill(self, req: Request) -> tuple[KVCache, torch.Tensor]:
        """The request's own one-row cache after its prefill, and the last position's float32 logits
        (1, V)."""
        replay = (
            req.replay
            if req.replay is not None and req.replay.usable and req.replay.logits is not None
            else None
        )
        cache = KVCache.for_model(
            req.method,
            self.model,
            record=req.record,
            replay=replay,
            max_new_tokens=fed_tokens(req),
        )
        ids = torch.tensor([req.ids], device=self.model.device)
        with shared_prefill(self.model, self.tokenizer):
            out = self.model(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                cache=cache,
                use_cache=True,
                **self._keep_last(),
            )
        # the owner and each replaying request drop their reference once prefilled, so a prompt's record lives
        # only until its last budget is in (a record holds the prompt's whole K/V)
        req.replayed, req.replay, req.record = replay is not None, None, None
        return cache, agree(out.logits[:, -1].to(copy=True, dtype=torch.float32))  # TP: the root's logits

    def _new_row(self, req: Request, prefill_s: float) -> _Row:
        from lm_eval.models.utils_hf import MultiTokenEOSCriteria

        cfg = req.config
        generator, warpers = None, LogitsProcessorList()
        if cfg.do_sample:  # transformers' warpers for these settings, in its order
            generator = torch.Generator(device=self.model.device).manual_seed(req.seed)
            if cfg.temperature is not None and cfg.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(cfg.temperature))
            if cfg.top_k is not None and cfg.top_k != 0:
                warpers.append(TopKLogitsWarper(top_k=cfg.top_k, min_tokens_to_keep=1))
            if cfg.top_p is not None and cfg.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=cfg.top_p, min_tokens_to_keep=1))
        stops = [MultiTokenEOSCriteria(s, self.tokenizer, 0, 1) for s in req.until]
        logits = [] if req.keep_logits else None
        return _Row(req, [], stops, generator, warpers, prefill_s, logits=logits, forced=deque(req.forced))

    def _choose(self, row: _Row, logits: torch.Tensor) -> int:
        """transformers' token choice from logits (1, V): EOS masked before `min_new` tokens, then argmax, or
        warpers, softmax and one multinomial draw from the row's own generator (the same stream as generate's
        global one seeded with the request's seed)."""
        if row.logits is not None:
            row.logits.append(logits[0].clone())
        if len(row.tokens) < row.request.min_new and self.eos:  # MinNewTokensLengthLogitsProcessor
            logits = logits.clone()
            logits[:, sorted(self.eos)] = float("-inf")
        if row.generator is None:
            return int(torch.argmax(logits, dim=-1)[0])
        scores = row.warpers(None, logits)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=row.generator)[0, 0])

    def _append(self, row: _Row, token: int) -> str | None:
        """Add a token; why the request ends here (transformers' stopping criteria), or None."""
        row.tokens.append(token)
        self.generated += 1
        if token in self.eos:
            return "eos"
        if row.stops:  # lm-eval's criteria read only their last sequence_id_len tokens
            ids = torch.tensor([row.tokens[-max(s.sequence_id_len for s in row.stops) :]])
            if any(bool(stop(ids, None)) for stop in row.stops):
                return "stop"
        return "limit" if len(row.tokens) >= row.request.max_new else None

    def _done(self, row: _Row, ended: str, kv: dict) -> Done:
        req = row.request
        stats = dict(
            prompt_tokens=len(req.ids) + len(req.forced),
            max_new_tokens=req.max_new,
            output_tokens=len(row.tokens),
            hit_limit=ended == "limit",
            wall_s=row.prefill_s + row.share_s,
            tokens_per_s=self.generated
            / max(time.perf_counter() - self.started, 1e-9),  # the engine's, so far
            prefill_replayed=req.replayed,
            kv_slots=kv["slots"],
            kv_bytes=kv["bytes"],
            kv_seen=kv["seen"],
            kv_kept=kv["kept"],
            kv_evicted_generated=kv["evicted_generated"],
        )
        if req.forced:  # query_aware=false: the question's tokens were fed as decoded ones (counted as such)
            stats["question_tokens"] = len(req.forced)
        return Done(req, row.tokens, ended, stats, row.logits)

    def _need(self, req: Request) -> int:
        """Slots a request needs in the pool (a conversation: all its turns)."""
        if req.turns and not all(t.forced for t in [req, *req.turns]):
            raise ValueError(
                "a conversation's every turn feeds its question (forced tokens) before it answers"
            )
        return slots_needed(req.method, len(req.ids), fed_tokens(req))

    def _keep_last(self) -> dict:
        """logits_to_keep=1 where the model takes it, as generate passes it (same numbers, less work)."""
        return {"logits_to_keep": 1} if self._keep else {}

    def rates(self) -> dict[str, str]:
        """Prefill and decode tokens per second so far, apart: what the progress bar shows."""
        return {
            "prefill_tok_s": f"{self.prefill_tokens / max(self.prefill_s, 1e-9):.0f}",
            "decode_tok_s": f"{self.decode_tokens / max(self.decode_s, 1e-9):.1f}",
        }

    def idle_fraction(self) -> float:
        """Share of decoded row-steps that held no request (static batching's waste)."""
        return self.idle_row_steps / self.row_steps if self.row_steps else 0.0
