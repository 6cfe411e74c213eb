"""evalkit's lm-eval model, registered as "evalkit": Hugging Face generation through a compressed KV cache.

`EvalkitLM` subclasses lm-eval's `HFLM` (loglikelihood requests keep HFLM's path, which has no cache) and
replaces generation: every request gets a fresh `KVCache(method)`. For evalkit task docs it renders the prompt
itself from the `Sample` fields (chat template, optional system message, assistant prefill = answer prefix)
and honours the sample's `max_new_tokens`, so `python -m evalkit` and `lm_eval --model evalkit` see identical
text. With a journal it records each finished generation (resume after a crash) and its KV statistics.

    lm_eval --model evalkit --model_args model=smollm2_135m,method=snapstream,budget=256 \
            --include_path tasks --tasks evalkit_ruler --metadata '{"tokenizer": "smollm2_135m"}'
"""

from __future__ import annotations

import hashlib
import importlib
import json
import time
from collections import Counter
from dataclasses import dataclass

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import stop_sequences_criteria
from tqdm import tqdm
from transformers import GenerationConfig

from evalkit.kv import Full, KVCache
from evalkit.sample import Sample, render_sample
from evalkit.scoring import request_key

DOC_FIELDS = {"id", "task", "prompt", "answers", "max_new_tokens"}


def prompt_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def sample_prompt(tokenizer, sample: Sample) -> str:
    """The exact text the model is given for an evalkit sample (journaled by its hash, checked on re-scoring)."""
    return render_sample(tokenizer, sample)


def generation_config(gen: dict, max_new_tokens: int, eos: list[int], pad: int) -> GenerationConfig:
    """Exactly the task's decoding settings: nothing leaks in from the model's own generation_config.

    evalkit choice: top_k is off unless the task sets it (vLLM/OpenAI-style servers, which the upstream
    protocols used, apply no top-k; Hugging Face's default would be 50).
    """
    temperature = float(gen.get("temperature", 0.0) or 0.0)
    sample = bool(gen.get("do_sample", temperature > 0)) and temperature > 0
    settings = dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, do_sample=sample)
    # transformers fills fields left unset from the model's generation_config: pin the neutral values
    settings.update(repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, epsilon_cutoff=0.0,
                    eta_cutoff=0.0, min_p=None, min_new_tokens=0)  # fmt: skip
    if sample:
        settings.update(
            temperature=temperature, top_p=float(gen.get("top_p", 1.0)), top_k=int(gen.get("top_k", 0))
        )
    return GenerationConfig(**settings)


@dataclass
class Prompt:
    key: str
    text: str
    max_new: int
    gen: dict  # the request's generation kwargs (until, sampling)
    sample: Sample | None = None
    # "module:function" making a second call from the first output (LongBench CoT)
    followup: str | None = None


# --- what every evalkit LM shares (EvalkitLM here, the served LM in evalkit.served): request keys, prompts, the
# context fit, output post-processing and journal records, so both see and record exactly the same things ----------
def request_seed(seed: int, key: str) -> int:
    """A request's own sampling seed: a sample never depends on its batch, a resumed run samples the same."""
    return int(hashlib.sha256(f"{seed}/{key}".encode()).hexdigest()[:8], 16)


def keyed(requests) -> list[str]:
    """The journal key of each lm-eval request, in order (lm-eval repeats a request k times: repeat 0..k-1)."""
    repeat, keys = Counter(), []
    for req in requests:
        base = (req.task_name, req.doc_id, req.idx)
        keys.append(request_key(*base, repeat[base]))
        repeat[base] += 1
    return keys


def request_prompt(req, key: str, tokenizer, limit: int, cap) -> Prompt:
    """The prompt of one request: evalkit docs are rendered from their Sample (chat template, prefill) and keep
    their own `max_new_tokens` within `limit`; a plain lm-eval task's context is used as lm-eval rendered it."""
    context, gen = req.args[0], dict(req.args[1])
    followup = gen.pop("evalkit_followup", None)
    limit = cap(int(gen.get("max_gen_toks", limit)))
    doc = req.doc if isinstance(req.doc, dict) and set(req.doc) >= DOC_FIELDS else None
    if doc is None:  # a plain lm-eval task: lm-eval rendered the context
        return Prompt(key, context, limit, gen, followup=followup)
    sample = Sample.from_doc(doc)
    return Prompt(
        key, sample_prompt(tokenizer, sample), min(sample.max_new_tokens, limit), gen, sample, followup
    )


def followup_prompt(p: Prompt, first: str, tokenizer, cap) -> Prompt:
    """The second call of a two-call protocol (LongBench CoT), made from the first call's output."""
    module, name = p.followup.split(":")
    s = getattr(importlib.import_module(module), name)(p.sample, first)
    return Prompt(p.key, sample_prompt(tokenizer, s), cap(s.max_new_tokens), p.gen, s)


def fit_prompt(tokenizer, p: Prompt, context: int) -> tuple[list[int], bool]:
    """(token ids, truncated) within the model context; may lower `p.max_new`.

    Prompt + generation must fit the context. A short prompt with a long generation budget (AIME's 32k
    tokens on an 8k model) has its generation capped ("capped by the model context"); a long prompt is cut
    in the middle, keeping the instructions and the question (as LongBench does), and counted."""
    ids = tokenizer(p.text, add_special_tokens=p.sample is None)["input_ids"]
    if len(ids) + p.max_new <= context:
        return ids, False
    if len(ids) <= context // 2:
        p.max_new = context - len(ids)
        return ids, False
    keep = max(context - p.max_new, context // 2)
    p.max_new = min(p.max_new, context - keep)
    return ids[: keep // 2] + ids[len(ids) - (keep - keep // 2) :], True


def finish_text(p: Prompt, text: str, until: list[str]) -> str:
    """A decoded generation as the scorer sees it: cut at the task's stop strings; R1-style templates open the
    thinking block in the prompt, so it is put back in front."""
    for stop in until:
        text = text.split(stop)[0]
    return "<think>\n" + text if p.text.endswith("<think>\n") else text


def journal_record(p: Prompt, text: str, stats: dict) -> dict:
    """One journal line (evalkit.results.RECORD_FIELDS): what scoring needs, keyed by request."""
    task, doc_id, idx, rep = p.key.rsplit("/", 3)
    return {
        "key": p.key,
        "task": task,
        "doc_id": int(doc_id),
        "repeat": int(rep),
        "id": p.sample.id if p.sample else None,
        "prompt_hash": prompt_hash(p.text),
        "text": text,
        "stats": stats,
    }


def journaled(journal, prompt: Prompt) -> dict | None:
    """The journal's record of this request, if any; one made from another prompt is refused, never reused."""
    done = journal.get(prompt.key) if journal else None
    if done is not None and done["prompt_hash"] != prompt_hash(prompt.text):
        from evalkit.config import ConfigError

        raise ConfigError(
            f"{journal.path}: request {prompt.key} was generated from a different prompt; the task data "
            "changed since this run started. Delete the run folder to start over."
        )
    return done


@register_model("evalkit")
class EvalkitLM(HFLM):
    """HFLM whose generations run through `evalkit.kv.KVCache(method)`."""

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
        **method_settings,
    ):
        from evalkit.config import make_method, model_spec
        from evalkit.models import ModelSpec, context_length, load_model

        spec = model if isinstance(model, ModelSpec) else model_spec(model)
        if hf_model is None:
            hf_model, tokenizer = load_model(spec)
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
        self.also = list(also)  # [(method, journal)]: other budgets generated from the same prefills
        super().__init__(
            pretrained=hf_model,
            tokenizer=tokenizer,
            batch_size=int(batch_size),
            max_length=max_length or context_length(spec, hf_model.config),
        )

    # --- the hook lm-eval's HFLM calls: a fresh compressed cache per generate call -------------------------
    def _model_generate(self, context, max_length=None, stop=None, cache=None, **generation_kwargs):
        cache = cache if cache is not None else KVCache.for_model(self.kv_method, self.model)
        if stop:
            generation_kwargs["stopping_criteria"] = stop_sequences_criteria(
                self.tokenizer, stop, context.shape[1], context.shape[0]
            )
        return self.model.generate(input_ids=context, cache=cache, **generation_kwargs)

    # --- generation requests ---------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generate (or take from the journal) every request; with `also`, other budgets share each prefill."""
        results: list[str | None] = [None] * len(requests)
        todo: list[tuple[int, Prompt]] = []
        for i, (req, key) in enumerate(zip(requests, keyed(requests))):
            prompt = self._prompt(req, key)
            done = self._journaled(self.journal, prompt)
            if done is not None and all(self._journaled(j, prompt) is not None for _, j in self.also):
                results[i] = done["text"]
            else:
                todo.append((i, prompt))
        bar = tqdm(total=len(requests), initial=len(requests) - len(todo), desc=self._label(), unit="req",
                   disable=disable_tqdm)  # fmt: skip
        for batch in self._batches(todo):
            prompts = [p for _, p in batch]
            shared = len(self.also) > 0 and prompts[0].followup is None
            texts, stats, record = self._run(prompts, self.kv_method, record=shared)
            for (i, p), text, st in zip(batch, texts, stats):
                done = self._journaled(self.journal, p)  # resuming a budget list: keep what was scored before
                results[i] = done["text"] if done is not None else text
                if self.journal:
                    self.journal.append(self._record(p, text, st))
            replay = record if record is not None and record.usable else None
            for method, journal in self.also:  # the sweep's other budgets: same prompts, prefill replayed
                if all(self._journaled(journal, p) is not None for p in prompts):
                    continue
                other_texts, other_stats, _ = self._run(prompts, method, replay=replay)
                for p, text, st in zip(prompts, other_texts, other_stats):
                    journal.append(self._record(p, text, st))
            bar.update(len(batch))
            bar.set_postfix(gen_tok_s=f"{stats[-1].get('tokens_per_s', 0):.1f}")
        bar.close()
        return results

    def _journaled(self, journal, prompt: Prompt) -> dict | None:
        return journaled(journal, prompt)

    def _label(self) -> str:
        budgets = [getattr(m, "budget", None) for m in [self.kv_method, *(m for m, _ in self.also)]]
        return f"{self.kv_method.name} {','.join(str(b) for b in budgets if b is not None)}".strip()

    def _prompt(self, req, key: str) -> Prompt:
        return request_prompt(req, key, self.tokenizer, self.max_gen_toks, self._cap)

    def _cap(self, n: int) -> int:
        """The model conf's cap on new tokens (the embedded CPU model), recorded with the run's config."""
        return min(n, self.spec.max_new_tokens) if self.spec.max_new_tokens else n

    def _batches(self, todo):
        """Batches of up to batch_size requests that share generation settings (lm-eval order kept).

        Sampled requests run one per generate call: each is seeded from its own key, so its sample does not
        depend on the batch it lands in, and a resumed run samples exactly what the interrupted one would."""
        groups: dict[str, list] = {}
        for item in todo:
            groups.setdefault(json.dumps(item[1].gen, sort_keys=True, default=str), []).append(item)
        for items in groups.values():
            sampled = generation_config(items[0][1].gen, 1, [0], 0).do_sample
            size = 1 if sampled else max(1, int(self.batch_size))
            for start in range(0, len(items), size):
                yield items[start : start + size]

    def _run(self, prompts: list[Prompt], method, record=False, replay=None):
        """(texts, stats, prefill record) for a batch; a follow-up call (LongBench CoT) runs after the first."""
        texts, stats, rec = self._generate(prompts, method, record, replay)
        if prompts[0].followup is None:
            return texts, stats, rec
        second = [followup_prompt(p, first, self.tokenizer, self._cap) for p, first in zip(prompts, texts)]
        # The answer call carries no document: upstream's compression only ever touched the first call, so
        # evalkit runs it with a full cache at every budget (recorded as followup_method in the stats).
        finals, second_stats, _ = self._generate(second, Full())
        for st, st2, first in zip(stats, second_stats, texts):
            st.update(followup=st2, first_output=first, followup_method="full")
        return finals, stats, rec

    def _generate(self, prompts: list[Prompt], method, record=False, replay=None):
        """One batched generate call with a fresh cache of `method`: (texts, per-prompt stats, record)."""
        from evalkit.kv.prefill import PrefillRecord, shared_prefill

        encoded = [self._encode(p) for p in prompts]
        ids = [x for x, _ in encoded]
        width, pad, eos = max(len(x) for x in ids), self.tokenizer.pad_token_id, self._eos_ids()
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=self.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.device)
        config = generation_config(prompts[0].gen, max(p.max_new for p in prompts), eos, pad)
        until = [s for s in prompts[0].gen.get("until", []) or [] if s]
        windows = [getattr(m, "window", 0) for m in (method, *(m for m, _ in self.also))]
        rec = PrefillRecord(window=max(32, *windows)) if record else None
        cache = KVCache.for_model(method, self.model, record=rec, replay=replay)
        torch.manual_seed(request_seed(self.seed, prompts[0].key))
        start = time.perf_counter()
        with torch.inference_mode(), shared_prefill(self.model):
            out = self._model_generate(input_ids, stop=until or None, attention_mask=mask,
                                       generation_config=config, cache=cache)  # fmt: skip
        wall = time.perf_counter() - start
        texts, stats, rows = [], [], cache.row_stats()
        for r, p in enumerate(prompts):
            toks = out[r, width:].tolist()[: p.max_new]
            ended = next((j for j, t in enumerate(toks) if t in eos), None)
            toks = toks if ended is None else toks[: ended + 1]
            text = finish_text(p, self.tokenizer.decode(toks, skip_special_tokens=True), until)
            row = rows[r]
            texts.append(text)
            stats.append(
                dict(
                    prompt_tokens=len(ids[r]),
                    truncated=encoded[r][1],
                    max_new_tokens=p.max_new,
                    output_tokens=len(toks),
                    hit_limit=ended is None and len(toks) >= p.max_new,
                    wall_s=wall / len(prompts),
                    tokens_per_s=(out.shape[1] - width) * len(prompts) / max(wall, 1e-9),  # generated, batch
                    prefill_replayed=replay is not None,
                    kv_slots=row["slots"],
                    kv_bytes=row["bytes"],
                    kv_seen=row["seen"],
                    kv_kept=row["kept"],
                    kv_evicted_generated=row["evicted_generated"],
                )
            )
        return texts, stats, rec

    def _encode(self, p: Prompt) -> tuple[list[int], bool]:
        return fit_prompt(self.tokenizer, p, self.max_length)

    def _eos_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        eos = list(eos) if isinstance(eos, list | tuple) else [eos] if eos is not None else []
        return sorted({*eos, self.tokenizer.eos_token_id} - {None})

    def _record(self, p: Prompt, text: str, stats: dict) -> dict:
        return journal_record(p, text, stats)
