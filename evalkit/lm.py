"""evalkit's lm-eval model, registered as "evalkit": Hugging Face generation through a compressed KV cache.

`EvalkitLM` subclasses lm-eval's `HFLM` (loglikelihood requests keep HFLM's path, which has no cache) and
replaces generation with `evalkit.engine` (continuous batching: each conversation prefilled into its own
compressed cache, decoded as one row of a slot pool, a finished row refilled at once). For evalkit task docs
it renders the prompt itself from the `Sample` fields (chat template, optional system message, assistant
prefill = answer prefix) and honours the sample's `max_new_tokens`, so `python -m evalkit` and `lm_eval
--model evalkit` see identical text; what is fed after each prompt is built by `evalkit.conversation`. With a
journal it records each finished generation (resume after a crash) and its KV statistics.

    lm_eval --model evalkit --model_args model=smollm2_135m,method=snapstream,budget=256 \
            --include_path tasks --tasks evalkit_ruler --metadata '{"tokenizer": "smollm2_135m"}'
"""

from __future__ import annotations

import torch
from lm_eval.models.huggingface import HFLM
from omegaconf import DictConfig
from tqdm import tqdm

from evalkit.checks import check_methods, run_facts
from evalkit.conversation import Budget, Encoder, conversations, grouped
from evalkit.journal import journal_record, keyed
from evalkit.request import Prompt, new_tokens_cap, request_prompt
from evalkit.team import Team
from evalkit.turns import Turn


class EvalkitLM(HFLM):  # `--model evalkit` is its subclass evalkit.lm_eval_cli.CliLM (lm_eval_plugin.py)
    """HFLM whose generations run through `evalkit.kv.KVCache(method)`."""

    # Decode a prompt's budgets (`also`) as rows of one batch; the bench turns it off to measure what it buys
    # (the budgets then decode one after another, still replaying one prefill). Outputs are the same either
    # way.
    batch_budgets = True

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
        kv="none",  # how the cache holds K/V: a conf/kv name or an `evalkit.kv.storage` object
        query_aware=True,  # lm-eval's --model_args: run settings, which reach the task's docs through its
        multi_question=False,  # metadata (evalkit.task.lm_eval_hooks); checked here before any weight loads
        **method_settings,
    ):
        from evalkit.checks import check_lm
        from evalkit.config import model_spec
        from evalkit.kv.config import make_method
        from evalkit.kv.storage import make_storage
        from evalkit.loading import load_model
        from evalkit.sources import context_length

        # a model conf name or node (lm-eval's --model_args), or a ModelSpec already made
        spec = model_spec(model) if isinstance(model, str | dict | DictConfig) else model
        self.team = team or Team.single()
        if isinstance(method, str):
            method = make_method(
                method, **({"budget": budget} if budget is not None else {}), **method_settings
            )
        storage = make_storage(kv) if isinstance(kv, str) else kv
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            from evalkit.config import ConfigError

            raise ConfigError(
                f"batch_size must be a positive integer (no 'auto': prompts are long), got {batch_size!r}"
            )
        self.compile = str(compile).lower() in ("true", "1")  # lm-eval's --model_args pass strings
        if hf_model is None:  # lm-eval's CLI: what `python -m evalkit` refuses before loading, refused here
            check_lm(spec, method, self.compile, query_aware, multi_question, storage)
            hf_model, tokenizer = load_model(spec, self.team)
            if device and spec.device_map is None and (device == "cpu" or torch.cuda.is_available()):
                hf_model = hf_model.to(device)  # lm-eval's --device, for models without a device_map
        self.kv_method, self.spec, self.seed, self.journal = method, spec, seed, journal
        self.storage = storage
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

        prompts = [(i, self._prompt(req, key)) for i, (req, key) in enumerate(zip(requests, keyed(requests)))]
        # lm-eval's CLI knows the task only now: what a method cannot run with it, refused before generating
        if any(p.followup for _, p in prompts):
            facts = run_facts(self.spec.name, self.model.config, self.compile, followup=True)
            check_methods([b.method for b in self.budgets()], facts, self.storage)
        # DP: another replica's request is answered by its journal ("" here; scoring reads journals);
        # conversations are dealt whole, balanced by questions across the replicas
        groups = self.team.take(grouped(prompts))
        owned = {i for g in groups for i, _ in g}
        convs, journaled = conversations(groups, self.budgets(), self.encoder)
        results = [journaled.get(i) if i in owned else "" for i in range(len(requests))]
        methods = 1 + len(self.also)
        todo = sum(isinstance(t, Turn) and t.answer is None for c in convs for t in c.turns)
        rows = max(
            1, min(self.batch_size * (methods if self.batch_budgets else 1), len(convs))
        )  # no idle rows
        engine = Engine(
            self.model,
            self.tokenizer,
            self._eos_ids(),
            rows=rows,
            compile=self.compile,
            team=self.team,
            storage=self.storage,
        )
        total = len(requests) * methods
        bar = tqdm(total=total, initial=total - todo, desc=self._label(), unit="gen", disable=disable_tqdm)
        finished = engine.run(convs)
        del convs  # the engine holds them now: a prompt's prefill record is freed once its budgets are in
        for done in finished:
            ask = done.tag
            if ask.leads:
                continue  # a first call: its follow-up runs next, and is what gets journaled
            text, stats = self._result(done)
            if ask.budget.journal is not None:
                ask.budget.journal.append(journal_record(ask.prompt, text, stats))
            if ask.budget.primary:
                results[ask.index] = text
            bar.update(1)
            bar.set_postfix(**engine.rates(), idle=f"{engine.idle_fraction():.0%}")
        bar.close()
        self.team.note_kv(engine.pool)  # this rank's KV bytes, for metrics.json's layout record
        return results

    @property
    def encoder(self) -> Encoder:
        """The tokenizer side of this LM's conversations (`evalkit.conversation`)."""
        return Encoder(self.tokenizer, self.max_length, tuple(self._eos_ids()), self._cap, self.seed)

    def budgets(self) -> list[Budget]:
        """The LM's own method (answering lm-eval) and each of `also`, with their journals."""
        return [Budget(self.kv_method, self.journal, True), *(Budget(m, j, False) for m, j in self.also)]

    def _result(self, done) -> tuple[str, dict]:
        """(text, stats) of a finished generation as journaled: a follow-up's text with the first call's
        stats (the follow-up's own under `followup`); a conversation's turn with its answer ids, fed back
        when a run resumes."""
        ask = done.tag
        text = self.encoder.text(ask.last, done.tokens)
        stats = {**done.stats, "truncated": ask.truncated}
        if ask.turn is not None:
            conversation = ask.prompt.sample.meta.get("conversation")
            stats |= {"conversation": conversation, "turn": ask.turn, "answer_ids": list(done.tokens)}
        if ask.first is not None:
            stats = {
                **ask.first.stats,
                "truncated": ask.truncated,
                "first_output": ask.first.text,
                "followup_method": "full",
                "followup": {**done.stats, "truncated": ask.first.truncated},
            }
        return text, stats

    def _label(self) -> str:
        budgets = [m.budget for m in [self.kv_method, *(m for m, _ in self.also)]]
        return f"{self.kv_method.name} {','.join(str(b) for b in budgets if b is not None)}".strip()

    def _prompt(self, req, key: str) -> Prompt:
        return request_prompt(req, key, self.tokenizer, self.max_gen_toks, self._cap, split=True)

    def _cap(self, n: int) -> int:
        return new_tokens_cap(self.spec, n)

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, list | tuple) else [eos] if eos is not None else []
        return sorted({*eos, self.tokenizer.eos_token_id} - {None})
