"""A fake backend for fast server tests: the engine loop's protocol (rows, poll between steps, a token per
row per step, drops at the next step) with no model. Each choice's tokens are a deterministic function of
its prompt, position and (when sampling) seed, drawn from a few word tokens; `prefill_s` and `step_s` slow it
down where a test needs requests to overlap; `eos_after` ends every choice with EOS after that many tokens.
"""

from __future__ import annotations

import time

import torch

from evalkit.serve.backend import End, EngineLoop, Token, Work, token_event

WORDS = " the quick brown fox jumps over a lazy dog while seven cats sleep"


class FakeBackend(EngineLoop):
    def __init__(
        self,
        tokenizer,
        rows: int = 4,
        queue_limit: int = 16,
        prefill_s: float = 0.0,
        step_s: float = 0.0,
        eos_after: int | None = None,
        slot_bytes: int = 64,
    ):
        super().__init__(rows, queue_limit)
        self.tokenizer, self.prefill_s, self.step_s, self.eos_after = tokenizer, prefill_s, step_s, eos_after
        self.words = tokenizer(WORDS, add_special_tokens=False)["input_ids"]
        self.vocab, self.slot_bytes = len(tokenizer), slot_bytes
        self.live: list[tuple[Work, list[int]] | None] = [None] * rows  # (work, tokens) per row
        self.prefill_tokens = self.decode_tokens = 0

    def next_token(self, work: Work, tokens: list[int]) -> int:
        if self.eos_after is not None and len(tokens) == self.eos_after:
            return self.tokenizer.eos_token_id
        salt = work.seed if work.temperature > 0 else 0
        return self.words[(sum(work.ids) * 31 + len(tokens) * 7 + salt) % len(self.words)]

    def _run(self) -> None:
        while True:
            busy = sum(row is not None for row in self.live)
            new, drop, closed = self.inbox.poll(self.rows - busy, idle=busy == 0)
            for work in new:
                time.sleep(self.prefill_s)
                self.prefill_tokens += len(work.ids)
                self._place(work)
            for r, row in enumerate(self.live):
                if row is not None and row[0].key in drop:
                    self._end(r, "cancelled")
            if closed and not any(self.live):
                return
            if any(self.live):
                time.sleep(self.step_s)
                for r in range(self.rows):
                    if self.live[r] is not None:
                        self._advance(r)

    def _place(self, work: Work) -> None:
        r = self.live.index(None)
        self.live[r] = (work, [])
        self._advance(r)  # the first token comes from the prefill

    def _advance(self, r: int) -> None:
        work, tokens = self.live[r]
        token = self.next_token(work, tokens)
        tokens.append(token)
        self.decode_tokens += 1
        self.inbox.token(
            work.key,
            token_event(token, self._logits(token), work.logprobs)
            if work.logprobs is not None
            else Token(token),
        )
        text = self.tokenizer.decode(tokens, skip_special_tokens=True) if work.stops else ""
        if token == self.tokenizer.eos_token_id or any(s in text for s in work.stops):
            self._end(r, "stop")
        elif len(tokens) >= work.max_new:
            self._end(r, "length")

    def _logits(self, token: int) -> torch.Tensor:
        """(1, V): the chosen token most likely (4.0), then two other words (2.0, 1.0), the rest 0."""
        logits = torch.zeros(1, self.vocab)
        second, third = [w for w in dict.fromkeys(self.words) if w != token][:2]
        logits[0, [token, second, third]] = torch.tensor([4.0, 2.0, 1.0])
        return logits

    def _end(self, r: int, reason: str) -> None:
        work, tokens = self.live[r]
        seen = len(work.ids) + len(tokens) - 1  # the last token is never fed
        budget = getattr(work.method, "budget", None) or seen
        kept = min(seen, budget)
        stats = {"kv_seen": seen, "kv_kept": kept, "kv_slots": kept, "kv_bytes": kept * self.slot_bytes}
        self.live[r] = None
        self.inbox.finish(work.key, End(reason, {**stats, "kv_evicted_generated": 0}))

    def _engine_stats(self) -> dict:
        return {
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "rows_held": sum(row is not None for row in self.live),
        }
