"""evalkit's lm-eval model, registered as "evalkit": Hugging Face generation through a compressed KV cache.

`EvalkitLM` subclasses lm-eval's `HFLM` (loglikelihood requests keep HFLM's path, which has no cache) and
replaces generation with `evalkit.engine` (continuous batching: each request prefilled into its own compressed
cache, decoded as one row of a slot pool, a finished row refilled at once). For evalkit task docs it renders
the prompt itself from the `Sample` fields (chat template, optional system message, assistant prefill = answer
prefix) and honours the sample's `max_new_tokens`, so `python -m evalkit` and `lm_eval --model evalkit` see
identical text. With a journal it records each finished generation (resume after a crash) and its KV
statistics.

    lm_eval --model evalkit --model_args model=smollm2_135m,method=snapstream,budget=256 \
            --include_path tasks --tasks evalkit_ruler --metadata '{"tokenizer": "smollm2_135m"}'
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lm_eval.models.huggingface import HFLM
from omegaconf import DictConfig
from tqdm import tqdm
from transformers import GenerationConfig

from evalkit.journal import journal_record, journaled, keyed
from evalkit.kv import Full
from evalkit.request import (
    Prompt,
    finish_text,
    fit_prompt,
    followup_prompt,
    generation_config,
    new_tokens_cap,
    next_turn_text,
    question_tokens,
    request_prompt,
    request_seed,
    stop_strings,
)
from evalkit.team import Team


class EvalkitLM(HFLM):  # `--model evalkit` is its subclass evalkit.lm_eval_cli.CliLM (lm_eval_plugin.py)
    """HFLM whose generations run through `evalkit.kv.KVCache(method)`."""

    # Decode a prompt's budgets (`also`) as rows of one batch; the bench turns it off to measure what it buys
    # (the budgets then decode one after another, still replaying one prefill). Outputs are the same either
    # way.
    batch_budgets = True
    # query_aware=false: the task module's `question_start(sample)` (set by the runner); each prompt's context
    # is prefilled and compressed alone, its question then fed on the compressed cache as decoded tokens are
    question_start = None
    # multi_question: the questions of one conversation (Sample.meta "conversation") are asked one after
    # another on one compressed context (`_conversation_jobs`)
    multi_question = False

    def __init__(
        self,
        model="smollm2_135m",
        method="full",
        budget=None,
        batch_size=1,
        max_length=None,
        journal=None,
        also=(),
        seed: int = 0,
        hf_model=None,
        tokenizer=None,
        device=None,
        max_batch_size=None,  # lm-eval passes it; evalkit batches exactly `batch_size`
        compile: bool = False,  # compile the decode step (static shapes; CUDA graphs on GPU)
        team: Team | None = None,  # the run's processes (one by default)
        **method_settings,
    ):
        from evalkit.config import model_spec
        from evalkit.kv.config import make_method
        from evalkit.loading import load_model
        from evalkit.sources import context_length

        # a model conf name or node (lm-eval's --model_args), or a ModelSpec already made
        spec = model_spec(model) if isinstance(model, str | dict | DictConfig) else model
        self.team = team or Team.single()
        if hf_model is None:
            hf_model, tokenizer = load_model(spec, self.team)
            if device and spec.device_map is None and (device == "cpu" or torch.cuda.is_available()):
                hf_model = hf_model.to(device)  # lm-eval's --device, for models without a device_map
        if isinstance(method, str):
            method = make_method(
                method, **({"budget": budget} if budget is not None else {}), **method_settings
            )
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            from evalkit.config import ConfigError

            raise ConfigError(
                f"batch_size must be a positive integer (no 'auto': prompts are long), got {batch_size!r}"
            )
        self.kv_method, self.spec, self.seed, self.journal = method, spec, seed, journal
        self.compile = str(compile).lower() in ("true", "1")  # lm-eval's --model_args pass strings
        self.also = list(also)  # [(method, journal)]: other budgets generated from the same prefills
        super().__init__(
            pretrained=hf_model,
            tokenizer=tokenizer,
            batch_size=int(batch_size),
            max_length=max_length or context_length(spec, hf_model.config),
        )
        # a TP group runs every request on every rank, and DP replicas split them themselves
        # (`Team.owns`): lm-eval must never split requests across evalkit's processes
        self._rank, self._world_size = 0, 1

    # --- generation requests: lm-eval's requests in, evalkit.engine's continuous batching underneath --------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generate (or take from the journal) every request. With `also`, each prompt's other budgets replay
        its prefill and decode beside it as rows of the same batch; each finished generation is journaled at
        once."""
        from evalkit.engine import Engine

        prompts = [
            (i, self._prompt(req, key))
            for i, req, key in zip(range(len(requests)), requests, keyed(requests))
        ]
        # DP: another replica's request is answered by its journal ("" here; scoring reads journals);
        # conversations are dealt whole, balanced by questions across the replicas
        groups = conversations(prompts) if self.multi_question else [[ip] for ip in prompts]
        groups = self.team.take(groups)
        owned = {i for g in groups for i, _ in g}
        results: list[str | None] = [None if i in owned else "" for i in range(len(requests))]
        if self.multi_question:
            jobs = [job for group in groups for job in self._conversation_jobs(group, results)]
        else:
            jobs = [job for ((i, p),) in groups for job in self._jobs(i, p, results)]
        methods = 1 + len(self.also)
        todo = sum(1 + len(job.turns) for job in jobs)
        rows = max(
            1, min(self.batch_size * (methods if self.batch_budgets else 1), len(jobs))
        )  # no empty rows
        engine = Engine(
            self.model, self.tokenizer, self._eos_ids(), rows=rows, compile=self.compile, team=self.team
        )
        bar = tqdm(
            total=len(requests) * methods,
            initial=len(requests) * methods - todo,
            desc=self._label(),
            unit="gen",
            disable=disable_tqdm,
        )
        finished = engine.run(jobs, then=self._followup)
        del jobs  # the engine's queue holds them now: a job's prefill record is freed once its budgets are in
        for done in finished:
            job = done.request.tag
            if job.first is None and job.prompt.followup is not None:
                continue  # a first call: its follow-up runs next (`_followup`), and is what gets journaled
            text, stats = self._result(done)
            if job.journal is not None:
                job.journal.append(journal_record(job.prompt, text, stats))
            if job.primary:
                results[job.index] = text
            bar.update(1)
            bar.set_postfix(**engine.rates(), idle=f"{engine.idle_fraction():.0%}")
        bar.close()
        self.team.note_kv(engine.pool)  # this rank's KV bytes, for metrics.json's layout record
        return results

    def _jobs(self, i: int, p: Prompt, results: list) -> list:
        """Engine requests for one lm-eval request: each budget not journaled yet. The first of several keeps
        its prefill (a record) for the others to replay."""
        from evalkit.engine import Request
        from evalkit.kv.prefill import PrefillRecord

        methods = [(self.kv_method, self.journal, True), *((m, j, False) for m, j in self.also)]
        done = [journaled(j, p) for _, j, _ in methods]
        if done[0] is not None:
            results[i] = done[0]["text"]  # resuming a budget list: keep what was scored before
        todo = [m for m, d in zip(methods, done) if d is None]
        if not todo:
            return []
        ids, forced, truncated = self._split(p)
        windows = [m.window for m, _, _ in todo]
        record = PrefillRecord(window=max(32, *windows)) if len(todo) > 1 and p.followup is None else None
        return [
            Request(
                p.key,
                ids,
                p.max_new,
                m,
                self._gen_config(p),
                request_seed(self.seed, p.key),
                self._until(p),
                record=record if n == 0 else None,
                replay=record if n > 0 else None,
                tag=_Job(i, p, j, primary, truncated),
                forced=forced,
            )
            for n, (m, j, primary) in enumerate(todo)
        ]

    def _conversation_jobs(self, group: list[tuple[int, Prompt]], results: list) -> list:
        """Engine requests for one conversation, per budget not finished: its context prefilled once (other
        budgets replay it), then each question fed and answered in turn on that cache. A resumed conversation
        feeds its journaled turns back (questions, and answers as the token ids generated) and goes on at its
        first unanswered question: nothing is asked twice, nothing lost."""
        from evalkit.kv.prefill import PrefillRecord

        parts = [self._split(p) for _, p in group]  # (context ids, question ids, truncated) per question
        if any(c != parts[0][0] for c, _, _ in parts):
            from evalkit.task import DataError

            raise DataError(
                f"conversation {group[0][1].sample.meta.get('conversation')}: its questions' prompts do not "
                "share one context (a prompt cut to fit the model differs): run with multi_question=false"
            )
        turns = [parts[0][1]] + [self._turn_ids(p) for _, p in group[1:]]
        methods = [(self.kv_method, self.journal, True), *((m, j, False) for m, j in self.also)]
        plans = []
        for m, j, primary in methods:
            done = [journaled(j, p) for _, p in group]
            for (i, _), d in zip(group, done):
                if primary and d is not None:
                    results[i] = d["text"]
            first = next((k for k, d in enumerate(done) if d is None), None)
            if first is not None:
                plans.append((m, j, primary, done, first))
        record = PrefillRecord(window=max(32, *(m.window for m, *_ in plans))) if len(plans) > 1 else None
        jobs = []
        for n, (m, j, primary, done, first) in enumerate(plans):
            asked = [t for k in range(first) for t in turns[k] + self._answered(done[k])]
            reqs = [
                self._turn_request(*group[k], turns[k], m, j, primary, parts[k][2], k)
                for k in range(first, len(group))
            ]
            head = reqs[0]
            head.ids, head.forced, head.turns = parts[0][0], asked + head.forced, reqs[1:]
            head.record, head.replay = (record, None) if n == 0 else (None, record)
            jobs.append(head)
        return jobs

    def _split(self, p: Prompt) -> tuple[list[int], list[int], bool]:
        """(context ids, question ids, truncated) of a prompt: its fitted ids split at the question (no
        question ids when query-aware)."""
        ids, truncated = self._encode(p)
        n = question_tokens(self.tokenizer, p, ids) if p.question_at is not None else 0
        return ids[: len(ids) - n], ids[len(ids) - n :], truncated

    def _turn_ids(self, p: Prompt) -> list[int]:
        """The tokens asking a later question of a conversation: its chat turn after the previous answer."""
        question = p.sample.prompt[self.question_start(p.sample) :]
        text = next_turn_text(self.tokenizer, p.sample, question)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _answered(self, record: dict) -> list[int]:
        """A journaled answer as it stands in the cache when the next question comes: its generated ids,
        a final EOS left out (the next turn's markup closes the answer)."""
        ids = list(record["stats"]["answer_ids"])
        return ids[:-1] if ids and ids[-1] in self._eos_ids() else ids

    def _turn_request(self, i: int, p: Prompt, forced, method, journal, primary, truncated, turn: int):
        from evalkit.engine import Request

        return Request(
            p.key,
            [],
            p.max_new,
            method,
            self._gen_config(p),
            request_seed(self.seed, p.key),
            self._until(p),
            tag=_Job(i, p, journal, primary, truncated, turn=turn),
            forced=list(forced),
        )

    def _followup(self, done):
        """The second call of a two-call protocol (LongBench CoT): no document, so a full cache at every
        budget (upstream's compression only ever touched the first call; recorded as followup_method)."""
        from evalkit.engine import Request

        job = done.request.tag
        if job.prompt.followup is None or job.first is not None:
            return None
        text = self.tokenizer.decode(done.tokens, skip_special_tokens=True)
        first = finish_text(job.prompt, text, self._until(job.prompt))
        second = followup_prompt(job.prompt, first, self.tokenizer, self._cap)
        ids, truncated = self._encode(second)
        tag = _Job(
            job.index,
            job.prompt,
            job.journal,
            job.primary,
            job.truncated,
            (first, done.stats, second, truncated),
        )
        return Request(
            job.prompt.key,
            ids,
            second.max_new,
            Full(),
            self._gen_config(second),
            done.request.seed,
            self._until(second),
            tag=tag,
        )

    def _result(self, done) -> tuple[str, dict]:
        """(text, stats) of a finished generation as journaled: the follow-up's text with the first call's
        stats."""
        job = done.request.tag
        last = job.first[2] if job.first is not None else job.prompt
        text = finish_text(
            last, self.tokenizer.decode(done.tokens, skip_special_tokens=True), self._until(last)
        )
        stats = {**done.stats, "truncated": job.truncated}
        if job.turn is not None:  # a conversation's turn: its answer ids are fed back when a run resumes
            conversation = job.prompt.sample.meta.get("conversation")
            stats |= {"conversation": conversation, "turn": job.turn, "answer_ids": list(done.tokens)}
        if job.first is not None:
            first, first_stats, _, second_truncated = job.first
            stats = {
                **first_stats,
                "truncated": job.truncated,
                "first_output": first,
                "followup_method": "full",
                "followup": {**done.stats, "truncated": second_truncated},
            }
        return text, stats

    def _gen_config(self, p: Prompt) -> GenerationConfig:
        return generation_config(p.gen, p.max_new, self._eos_ids(), self.tokenizer.pad_token_id)

    @staticmethod
    def _until(p: Prompt) -> list[str]:
        return stop_strings(p)

    def _label(self) -> str:
        budgets = [m.budget for m in [self.kv_method, *(m for m, _ in self.also)]]
        return f"{self.kv_method.name} {','.join(str(b) for b in budgets if b is not None)}".strip()

    def _prompt(self, req, key: str) -> Prompt:
        return request_prompt(req, key, self.tokenizer, self.max_gen_toks, self._cap, self.question_start)

    def _cap(self, n: int) -> int:
        return new_tokens_cap(self.spec, n)

    def _encode(self, p: Prompt) -> tuple[list[int], bool]:
        return fit_prompt(self.tokenizer, p, self.max_length)

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, list | tuple) else [eos] if eos is not None else []
        return sorted({*eos, self.tokenizer.eos_token_id} - {None})


def conversations(prompts: list[tuple[int, Prompt]]) -> list[list[tuple[int, Prompt]]]:
    """The requests grouped into conversations, each in turn order: the questions of one Sample.meta
    "conversation" and one repeat (a sample without one is a conversation of one question)."""
    groups: dict[tuple, list] = {}
    for i, p in prompts:
        meta = p.sample.meta if p.sample is not None else {}
        name = meta.get("conversation", p.key)
        groups.setdefault((name, p.key.rsplit("/", 1)[1]), []).append((meta.get("turn", 0), i, p))
    return [[(i, p) for _, i, p in sorted(g, key=lambda t: t[0])] for g in groups.values()]


@dataclass
class _Job:
    """What the LM needs back from the engine about one request."""

    index: int  # in lm-eval's request list
    prompt: Prompt
    journal: object
    primary: bool  # the LM's own method (its text answers lm-eval), not one of `also`
    truncated: bool
    first: tuple | None = None  # a follow-up's (first output, first stats, its Prompt, its prompt cut)
    turn: int | None = None  # multi_question: the question's turn in its conversation
