"""The one flat record every benchmark normalises to, and the generic aggregation over per-sample scores.

Deviation from kvpress's `context`/`question` split, on purpose: SnapStream (like SnapKV) compresses the whole
prompt at prefill with the question inside the observation window (query-aware), and the official templates
interleave document and question, so a sample carries the fully rendered user message.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field

PROMPT_SLOT = "{prompt}"  # where a task's own prompt template puts the user message
TEMPLATE_KEY = "prompt_template"  # Sample.meta key of that template, set by tasks that have one for the model
# Sample.meta keys the task's lm-eval hooks set on each request's doc (evalkit.task.lm_eval_hooks), read by
# the LMs: where the question starts (query_aware=false), and the follow-up call ("module:function")
QUESTION_KEY, FOLLOWUP_KEY = "question_start", "followup"


def template_parts(template: str) -> tuple[str, str]:
    """(text before, text after) the one `{prompt}` slot of a task's prompt template."""
    if template.count(PROMPT_SLOT) != 1:
        raise ValueError(f"a prompt template needs exactly one {PROMPT_SLOT} slot, got {template!r}")
    before, _, after = template.partition(PROMPT_SLOT)
    return before, after


def render(
    tokenizer,
    prompt: str,
    answer_prefix: str = "",
    system: str | None = None,
    template: str | None = None,
    rendered: bool = False,
) -> str:
    """The exact text the model sees: chat template (system + user turn), then the assistant prefill. A
    tokenizer without a chat template (a base model) gets the bare prompt, as RULER's "base" template.

    `template` is a task's own prompt format for the model's family (RULER's "meta-llama3"), used instead
    of the chat template, byte for byte: its text around the `{prompt}` slot, then the answer prefix.
    `rendered`: the prompt already is the model's whole input (a protocol's raw string, LiveCodeBench's
    DeepSeek-R1 style): nothing is added but the answer prefix."""
    if rendered:
        return prompt + answer_prefix
    if template is not None:
        if system:
            raise ValueError("a task's prompt template has no place for a system message")
        before, after = template_parts(template)
        return before + prompt + after + answer_prefix
    if not getattr(tokenizer, "chat_template", None):
        return (f"{system}\n\n" if system else "") + prompt + answer_prefix
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + answer_prefix


def render_sample(tokenizer, sample: Sample) -> str:
    """`render` for a Sample, with the prompt template its task chose for the model (if any)."""
    return render(
        tokenizer,
        sample.prompt,
        sample.answer_prefix,
        sample.system,
        sample.meta.get(TEMPLATE_KEY),
        sample.rendered,
    )


@dataclass
class Sample:
    id: str  # unique within the task (and stable across runs: results are keyed on it)
    task: str
    prompt: str  # the user message, official template filled in
    answers: list[str]  # references (RULER values, an A-D letter, an integer, ...)
    max_new_tokens: int
    answer_prefix: str = ""  # assistant-turn prefill, e.g. RULER's " The special magic number ... is"
    system: str | None = None  # system message, only where the benchmark's protocol has one
    subset: str = ""  # breakdown tag(s) joined by "|", e.g. "niah_single_1|1024" or "easy|short"
    meta: dict = field(default_factory=dict)  # task-specific extras (choices, tests, source row id, ...)
    rendered: bool = False  # prompt is the model's whole input (special tokens, turns): no chat template

    def to_doc(self) -> dict:
        """Flatten for `datasets`/lm-eval: nested, row-varying fields travel as JSON strings."""
        doc = asdict(self)
        doc["answers"] = json.dumps(self.answers)
        doc["meta"] = json.dumps(self.meta)
        doc["system"] = self.system or ""
        return doc

    @classmethod
    def from_doc(cls, doc: dict) -> Sample:
        d = dict(doc)
        d["answers"] = json.loads(d["answers"]) if isinstance(d["answers"], str) else d["answers"]
        d["meta"] = json.loads(d["meta"]) if isinstance(d["meta"], str) else d["meta"]
        d["system"] = d.get("system") or None
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass
class Skipped:
    """A source row that could not become a Sample: reported by id with the reason, never silently dropped."""

    id: str
    reason: str


def aggregate(scores: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean, standard error and n per metric key, each over the samples that report that key.

    Breakdowns come free: a sample that returns {"accuracy": 1, "hard": 1} counts towards both keys.
    """
    by_key: dict[str, list[float]] = defaultdict(list)
    for s in scores:
        for k, v in s.items():
            if v is not None:
                by_key[k].append(float(v))
    out = {}
    for k, vals in sorted(by_key.items()):
        n = len(vals)
        mean = sum(vals) / n
        var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
        out[k] = {"mean": mean, "stderr": math.sqrt(var / n), "n": n}
    return out
