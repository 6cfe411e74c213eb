"""What the engine runs and hands back: a `Conversation` is context ids prefilled with a method, then its
`Turn`s on that cache (each forced tokens, then an answer; a `Followup` is a second call on a fresh cache
built from the previous answer); each answered turn comes back as a `Done`. An `Inbox` holds the
conversations waiting for a row. Built from lm-eval's requests by `evalkit.conversation`, by a server
(`evalkit.serve`), or directly (`ask`: a one-turn conversation).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from evalkit.kv.prefill import PrefillRecord


@dataclass
class Turn:
    """One answer of a conversation on its cache: `forced` fed teacher-forced first (query_aware=false: the
    question and answer prefix; a later question: its chat markup too), then up to `max_new` tokens
    generated. `answer`: a turn answered before (a resumed conversation), fed back as the cache held it and
    not generated again (no Done)."""

    max_new: int
    config: GenerationConfig  # do_sample, temperature, top_k, top_p (request.generation_config)
    seed: int  # this turn's own sampling seed
    forced: list[int] = field(default_factory=list)
    until: list[str] = field(default_factory=list)  # stop strings (lm-eval's `until`)
    min_new: int = 0  # EOS is suppressed until this many tokens (transformers' min_new_tokens)
    keep_logits: bool = False  # keep each step's raw float32 logits (transformers' output_logits)
    tag: object = None  # the caller's, handed back with its Done
    answer: list[int] | None = None  # answered before: its tokens as they stand in the cache (no final EOS)


@dataclass(frozen=True)
class Followup:
    """A second call on a fresh cache, a conversation's last turn: `build(done)` makes its conversation from
    the previous turn's answer (a two-call protocol; it runs next, ahead of the waiting conversations)."""

    build: Callable[[Done], Conversation]


@dataclass(eq=False)
class Conversation:
    """Context `ids` (already fitted to the model context) prefilled with `method`, then its turns in order.
    `record`: keep this prefill for the conversations that `replay` it (a prompt's other budgets); the engine
    drops both references once prefilled, so a record lives only until its last budget is in."""

    key: str
    ids: list[int]
    method: object
    turns: list[Turn | Followup]
    record: PrefillRecord | None = None
    replay: PrefillRecord | None = None


def ask(key: str, ids: list[int], max_new: int, method, config, seed: int, **turn) -> Conversation:
    """A one-turn conversation: the prompt, then its answer (`turn`: the Turn's other fields; `record` /
    `replay`: the conversation's)."""
    shared = {k: turn.pop(k) for k in ("record", "replay") if k in turn}
    return Conversation(key, ids, method, [Turn(max_new, config, seed, **turn)], **shared)


def fed_tokens(conv: Conversation) -> int:
    """Tokens a conversation writes into its cache after the prefill, at most: each turn's forced and
    generated ones (an answered turn's answer), and before each later turn the previous answer's last
    token, fed back."""
    turns = [t for t in conv.turns if isinstance(t, Turn)]
    answered = [t for t in turns if t.answer is not None]
    asked = [t for t in turns if t.answer is None]
    fed = sum(len(t.forced) + len(t.answer) for t in answered)
    return fed + sum(t.max_new + len(t.forced) for t in asked) + max(len(asked) - 1, 0)


class Inbox:
    """Conversations waiting for a row, taken between decode steps. `Engine.run` makes one of a list; a
    caller that keeps its own can `put` more while the engine decodes (they take the next free rows)."""

    def __init__(self, conversations: Iterable[Conversation] = ()):
        self._waiting = deque(conversations)

    def put(self, conv: Conversation, first: bool = False) -> None:
        (self._waiting.appendleft if first else self._waiting.append)(conv)

    def take(self) -> Conversation:
        return self._waiting.popleft()

    def drop(self, keys: set[str]) -> list[Conversation]:
        """Forget the waiting conversations `keys` names (their caller went away); the ones forgotten."""
        gone = [c for c in self._waiting if c.key in keys]
        self._waiting = deque(c for c in self._waiting if c.key not in keys)
        return gone

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Conversation]:
        return iter(self._waiting)


@dataclass
class Done:
    key: str  # the conversation's
    turn: Turn
    tokens: list[int]  # generated, the EOS included when it ended there
    ended: str  # "eos", "stop", "limit" or "cancelled" (dropped by a live caller)
    stats: dict  # the row's KV figures, timing
    logits: list[torch.Tensor] | None = None  # (V,) float32 per generated token, when the turn kept them
    layer_bytes: list[int] = field(default_factory=list)  # bytes per layer as the row ended (not journaled)

    @property
    def tag(self):
        return self.turn.tag
