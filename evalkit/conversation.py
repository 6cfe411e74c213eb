"""What the engine is asked, built from lm-eval's requests: one `Conversation` (evalkit.turns) per prompt and
budget, or per multi-question context and budget, with what is already journaled fed back or left out.

`conversations(groups, budgets, enc)` is the one builder, a pure function of the requests' prompts (their
Sample says where the question starts, which conversation and turn it is, and whether a follow-up call comes
after), the budgets with their journals, and the tokenizer side (`Encoder`):
- a single prompt: its ids (a query_aware=false prompt split: the context prefilled, the question forced), one
  turn, and a `Followup` turn when the task makes a second call (LongBench CoT's answer call: no document, a
  full cache at every budget, as upstream only ever compressed the first call);
- a multi-question conversation: the shared context, then each question as a turn; a resumed one feeds its
  journaled turns back (questions, and answers as the ids generated) and goes on at its first unanswered
  question: nothing asked twice, nothing lost, and every turn's figures as an uninterrupted run's;
- several budgets: the first to run records its prefill, the others replay it.
Each turn's tag (`Ask`) is what the LM needs back to journal the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from evalkit.journal import journaled
from evalkit.kv import Full
from evalkit.kv.prefill import PrefillRecord
from evalkit.request import (
    Prompt,
    finish_text,
    fit_prompt,
    followup_prompt,
    generation_config,
    next_turn_text,
    question_start,
    question_tokens,
    request_seed,
    stop_strings,
)
from evalkit.turns import Conversation, Done, Followup, Turn


@dataclass(frozen=True)
class Budget:
    """One method the LM generates with, and the journal its answers go to."""

    method: object
    journal: object
    primary: bool  # the LM's own method (its text answers lm-eval), not one of `also`


@dataclass(frozen=True)
class FirstCall:
    """A follow-up call's first call: its output as the scorer sees it, its figures, and the follow-up's own
    prompt and whether it was cut."""

    text: str
    stats: dict
    prompt: Prompt
    truncated: bool


@dataclass(frozen=True)
class Ask:
    """A turn's tag: what the LM needs back from the engine to journal its answer."""

    index: int  # in lm-eval's request list
    prompt: Prompt
    budget: Budget
    truncated: bool  # the prompt was cut to fit the model context
    turn: int | None = None  # multi_question: the question's turn in its conversation
    first: FirstCall | None = None  # set on a follow-up call

    @property
    def leads(self) -> bool:
        """A first call whose follow-up answers the request: its own answer is not journaled."""
        return self.prompt.followup is not None and self.first is None

    @property
    def last(self) -> Prompt:
        """The prompt whose answer this turn generated (a follow-up's own)."""
        return self.first.prompt if self.first is not None else self.prompt


@dataclass(frozen=True)
class Encoder:
    """The tokenizer side: prompts fitted to the model `context`, split at their question, decoding settings,
    the model's EOS ids, its cap on new tokens and the run's seed."""

    tokenizer: object
    context: int
    eos: tuple[int, ...]
    cap: object  # (n) -> n capped by the model conf's max_new_tokens
    seed: int

    def split(self, p: Prompt) -> tuple[list[int], list[int], bool, int]:
        """(context ids, question ids, truncated, max_new) of a prompt fitted to the context: its ids split at
        the question (no question ids when query-aware)."""
        ids, truncated, max_new = fit_prompt(self.tokenizer, p, self.context)
        n = question_tokens(self.tokenizer, p, ids) if p.question_at is not None else 0
        return ids[: len(ids) - n], ids[len(ids) - n :], truncated, max_new

    def next_question(self, p: Prompt) -> list[int]:
        """The tokens asking a later question of a conversation: its chat turn after the previous answer."""
        question = p.sample.prompt[question_start(p.sample) :]
        text = next_turn_text(self.tokenizer, p.sample, question)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def answered(self, record: dict) -> list[int]:
        """A journaled answer as it stands in the cache when the next question comes: its generated ids, a
        final EOS left out (the next turn's markup closes the answer)."""
        ids = list(record["stats"]["answer_ids"])
        return ids[:-1] if ids and ids[-1] in self.eos else ids

    def turn(self, p: Prompt, max_new: int, tag: Ask, forced=(), answer=None) -> Turn:
        config = generation_config(p.gen, max_new, list(self.eos), self.tokenizer.pad_token_id)
        seed = request_seed(self.seed, p.key)
        return Turn(max_new, config, seed, list(forced), stop_strings(p), tag=tag, answer=answer)

    def text(self, p: Prompt, tokens: list[int]) -> str:
        """Generated tokens as the scorer sees them (decoded, cut at the stop strings, `<think>` put back)."""
        return finish_text(p, self.tokenizer.decode(tokens, skip_special_tokens=True), stop_strings(p))


def grouped(prompts: list[tuple[int, Prompt]]) -> list[list[tuple[int, Prompt]]]:
    """The requests grouped into conversations, each in turn order: the questions of one Sample.meta
    "conversation" and one repeat (multi_question); any other request is a group of its own."""
    groups: dict[tuple, list] = {}
    for i, p in prompts:
        meta = p.sample.meta if p.sample is not None else {}
        name = meta.get("conversation", p.key)
        groups.setdefault((name, p.key.rsplit("/", 1)[1]), []).append((meta.get("turn", 0), i, p))
    return [[(i, p) for _, i, p in sorted(g, key=lambda t: t[0])] for g in groups.values()]


def conversations(
    groups: list[list[tuple[int, Prompt]]], budgets: list[Budget], enc: Encoder
) -> tuple[list[Conversation], dict[int, str]]:
    """The engine's conversations for these request groups at every budget not journaled yet, and the
    journaled texts of the primary budget (a resumed run answers lm-eval with what it scored before)."""
    out, texts = [], {}
    for group in groups:
        multi = any("conversation" in (p.sample.meta if p.sample else {}) for _, p in group)
        out += _dialogue(group, budgets, enc, texts) if multi else _single(*group[0], budgets, enc, texts)
    return out, texts


def _single(i: int, p: Prompt, budgets: list[Budget], enc: Encoder, texts: dict) -> list[Conversation]:
    """One request: its prompt, one answer (and a follow-up call), for each budget not journaled. The first
    of several records its prefill for the others to replay (not with a follow-up: each budget's first call
    is followed by its own full-cache call)."""
    done = [journaled(b.journal, p) for b in budgets]
    if done[0] is not None:
        texts[i] = done[0]["text"]  # resuming a budget list: keep what was scored before
    todo = [b for b, d in zip(budgets, done) if d is None]
    if not todo:
        return []
    context, question, truncated, max_new = enc.split(p)
    window = max(32, *(b.method.window for b in todo))
    record = PrefillRecord(window=window) if len(todo) > 1 and p.followup is None else None
    out = []
    for n, b in enumerate(todo):
        ask = Ask(i, p, b, truncated)
        turns = [enc.turn(p, max_new, ask, forced=question)]
        if p.followup is not None:
            turns.append(Followup(partial(_followup, ask=ask, enc=enc)))
        out.append(
            Conversation(p.key, context, b.method, turns, *((record, None) if n == 0 else (None, record)))
        )
    return out


def _followup(first: Done, ask: Ask, enc: Encoder) -> Conversation:
    """The second call of a two-call protocol, made from the first call's output as the model produced it
    (`followup_prompt`): no document, so a full cache at every budget (recorded as followup_method)."""
    text = enc.text(ask.prompt, first.tokens)
    second = followup_prompt(ask.prompt, text, enc.tokenizer, enc.cap)
    ids, truncated, max_new = fit_prompt(enc.tokenizer, second, enc.context)
    tag = Ask(
        ask.index,
        ask.prompt,
        ask.budget,
        ask.truncated,
        first=FirstCall(text, first.stats, second, truncated),
    )
    return Conversation(second.key, ids, Full(), [enc.turn(second, max_new, tag)])  # the request's seed


def _dialogue(
    group: list[tuple[int, Prompt]], budgets: list[Budget], enc: Encoder, texts: dict
) -> list[Conversation]:
    """One multi-question conversation for each budget not finished: its context prefilled once (other
    budgets replay it), then each question fed and answered in turn on that cache; a journaled answer is fed
    back as it stood in the cache (`Turn.answer`), not asked again."""
    split = [enc.split(p) for _, p in group]  # (context ids, question ids, truncated, max_new) per question
    if any(s[0] != split[0][0] for s in split):
        from evalkit.task import DataError

        raise DataError(
            f"conversation {group[0][1].sample.meta.get('conversation')}: its questions' prompts do not "
            "share one context (a prompt cut to fit the model differs): run with multi_question=false"
        )
    asks = [split[0][1]] + [enc.next_question(p) for _, p in group[1:]]
    todo = []
    for b in budgets:
        done = [journaled(b.journal, p) for _, p in group]
        for (i, _), d in zip(group, done):
            if b.primary and d is not None:
                texts[i] = d["text"]
        first = next((k for k, d in enumerate(done) if d is None), None)
        if first is not None:
            todo.append((b, done, first))
    record = PrefillRecord(window=max(32, *(b.method.window for b, *_ in todo))) if len(todo) > 1 else None
    out = []
    for n, (b, done, first) in enumerate(todo):
        turns = []
        for k, ((i, p), (_, _, truncated, max_new)) in enumerate(zip(group, split)):
            answer = enc.answered(done[k]) if k < first else None  # answered before: fed back, not asked
            turns.append(enc.turn(p, max_new, Ask(i, p, b, truncated, turn=k), forced=asks[k], answer=answer))
        replay = (record, None) if n == 0 else (None, record)
        out.append(Conversation(group[0][1].key, split[0][0], b.method, turns, *replay))
    return out
