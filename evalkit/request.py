"""The request layer both evalkit LMs share (EvalkitLM in process, evalkit.served's LM over HTTP): an lm-eval
request rendered into a `Prompt` (chat template and prefill from the Sample), its follow-up call, its fit into
the model context, its stop strings, new-token cap, sampling seed and decoding settings, and the decoded text
as the scorer sees it. Both LMs see, and journal, exactly the same things.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass

from transformers import GenerationConfig

from evalkit.sample import FOLLOWUP_KEY, QUESTION_KEY, TEMPLATE_KEY, Sample, render_sample

DOC_FIELDS = {"id", "task", "prompt", "answers", "max_new_tokens"}


def sample_prompt(tokenizer, sample: Sample) -> str:
    """The exact text the model is given for an evalkit sample (journaled by its hash, checked on
    re-scoring)."""
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
    settings.update(
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        min_p=None,
        min_new_tokens=0,
    )
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
    # "module:function" making a second call from the first output (LongBench CoT: its Sample says so)
    followup: str | None = None
    question_at: int | None = None  # query_aware=false: where the question starts in `text` (a char offset)


def request_seed(seed: int, key: str) -> int:
    """A request's own sampling seed: a sample never depends on its batch, a resumed run samples the same."""
    return int(hashlib.sha256(f"{seed}/{key}".encode()).hexdigest()[:8], 16)


def stop_strings(p: Prompt) -> list[str]:
    """The request's stop strings (lm-eval's `until`), empty ones dropped."""
    return [s for s in p.gen.get("until", []) or [] if s]


def new_tokens_cap(spec, n: int) -> int:
    """The model conf's cap on new tokens (the embedded CPU model), recorded with the run's config."""
    return min(n, spec.max_new_tokens) if spec.max_new_tokens else n


def request_prompt(req, key: str, tokenizer, limit: int, cap, split: bool = False) -> Prompt:
    """The prompt of one request: evalkit docs are rendered from their Sample (chat template, prefill) and
    keep their own `max_new_tokens` within `limit`; a plain lm-eval task's context is used as lm-eval rendered
    it. The Sample says whether a follow-up call comes after it and, query_aware=false, where its question
    starts (`split`: the in-process LM cuts the prompt there; a served model sends it whole)."""
    context, gen = req.args[0], dict(req.args[1])
    limit = cap(int(gen.get("max_gen_toks", limit)))
    doc = req.doc if isinstance(req.doc, dict) and set(req.doc) >= DOC_FIELDS else None
    if doc is None:  # a plain lm-eval task: lm-eval rendered the context
        return Prompt(key, context, limit, gen)
    sample = Sample.from_doc(doc)
    text = sample_prompt(tokenizer, sample)
    start = question_start(sample) if split else None
    at = None if start is None else question_offset(text, sample, start)
    return Prompt(
        key, text, min(sample.max_new_tokens, limit), gen, sample, sample.meta.get(FOLLOWUP_KEY), at
    )


def question_start(sample: Sample) -> int | None:
    """query_aware=false: where the sample's question starts in its user message (the task module's
    `question_start`, put on the sample when the run compresses before the question); None: query-aware."""
    return sample.meta.get(QUESTION_KEY)


def question_offset(text: str, sample: Sample, start: int) -> int:
    """Where the question starts in the rendered prompt `text`, given where it starts in the user message
    (`start`, the task's `question_start`): the user message sits verbatim inside the rendered text."""
    at = text.find(sample.prompt)
    if at < 0 or not 0 < start < len(sample.prompt):
        raise ValueError(
            f"{sample.id}: cannot split the prompt at its question (query_aware=false): the chat template "
            "alters the user message, or the question does not start inside it"
        )
    return at + start


ANSWER_MARK = "EVALKIT_ANSWER_SLOT_7f3a"  # stands for an answer while the chat template renders a next turn


def next_turn_text(tokenizer, sample: Sample, question: str) -> str:
    """multi_question: the text that asks `question` as the conversation's next turn, right after an answer:
    the chat template's end of the assistant turn, a user turn holding the question, the assistant turn's
    start, then the sample's answer prefix (the template renders a conversation; its text after the answer
    is taken)."""
    if sample.rendered or sample.meta.get(TEMPLATE_KEY) or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{sample.id}: multi_question asks the next question as a chat turn, so it needs the tokenizer's "
            "chat template (a task's own single-turn template, a raw prompt or a base model has no next turn)"
        )
    messages = [{"role": "system", "content": sample.system}] if sample.system else []
    messages += [
        {"role": "user", "content": "context"},
        {"role": "assistant", "content": ANSWER_MARK},
        {"role": "user", "content": question},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text[text.index(ANSWER_MARK) + len(ANSWER_MARK) :] + sample.answer_prefix


def question_tokens(tokenizer, p: Prompt, ids: list[int]) -> int:
    """How many of the fitted prompt's last tokens `ids` are the question and answer prefix (fed on the
    compressed context as decoded tokens are); the rest is the context, prefilled and compressed.

    Exact by construction: the whole prompt is tokenized once, as query-aware runs tokenize it, and its ids
    are split at the first token that does not end before the question's first character (a token that
    straddles the boundary goes to the question), so context + question == today's ids, token for token. A
    prompt cut in the middle keeps its tail, where the question is; at least one token is prefilled."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("query_aware=false splits prompts by token offsets: it needs a fast tokenizer")
    enc = tokenizer(p.text, add_special_tokens=p.sample is None, return_offsets_mapping=True)
    ends = [end for _, end in enc["offset_mapping"]]
    context = next((i for i, end in enumerate(ends) if end > p.question_at), len(ends))
    return min(len(ends) - context, len(ids) - 1)


def followup_prompt(p: Prompt, first: str, tokenizer, cap) -> Prompt:
    """The second call of a two-call protocol (LongBench CoT), made from the first call's output as the model
    produced it (pred.py passes the completion): without the `<think>\n` that finish_text put back."""
    module, name = p.followup.split(":")
    produced = first.removeprefix("<think>\n") if p.text.endswith("<think>\n") else first
    s = getattr(importlib.import_module(module), name)(p.sample, produced)
    return Prompt(p.key, sample_prompt(tokenizer, s), cap(s.max_new_tokens), p.gen, s)


def fit_prompt(tokenizer, p: Prompt, context: int) -> tuple[list[int], bool, int]:
    """(token ids, truncated, new-token limit) of a prompt within the model context.

    Prompt + generation must fit the context. A short prompt with a long generation budget (AIME's 32k
    tokens on an 8k model) has its generation capped ("capped by the model context"); a long prompt is cut
    in the middle, keeping the instructions and the question (as LongBench does), and counted."""
    ids = tokenizer(p.text, add_special_tokens=p.sample is None)["input_ids"]
    if len(ids) + p.max_new <= context:
        return ids, False, p.max_new
    if len(ids) <= context // 2:
        return ids, False, context - len(ids)
    keep = max(context - p.max_new, context // 2)
    return ids[: keep // 2] + ids[len(ids) - (keep - keep // 2) :], True, min(p.max_new, context - keep)


def finish_text(p: Prompt, text: str, until: list[str]) -> str:
    """A decoded generation as the scorer sees it: cut at the task's stop strings; R1-style templates open the
    thinking block in the prompt, so it is put back in front."""
    for stop in until:
        text = text.split(stop)[0]
    return "<think>\n" + text if p.text.endswith("<think>\n") else text
