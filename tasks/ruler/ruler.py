"""RULER: What's the Real Context Size of Your Long-Context Language Models? (Hsieh et al., 2024,
arXiv 2404.06654; code NVIDIA/RULER). 13 synthetic tasks (8 needle-in-a-haystack variants, variable tracking,
common and frequent words extraction, SQuAD v2 dev and HotpotQA dev-distractor QA) at chosen lengths.

Data: generated here by `tasks/ruler/generate.py` with upstream's templates, answer prefixes, seeds and length
rule (prompt tokens + tokens to generate <= length, counted with the evaluated model's tokenizer on the
chat-rendered prompt, or on RULER's own template for the model family when the model conf names one in
`prompt_format`, e.g. "meta-llama3" for Llama-3.1), then frozen to JSONL (`tasks/ruler/frozen.py`). The essay
and QA tasks read local files in upstream's format (`essay_path`, `squad_path`, `hotpotqa_path`, or
`$EVALKIT_RULER_DATA`); the default task list needs none. Scoring: upstream's `string_match_all` /
`string_match_part`, in percent. Deviations from upstream: docs/deviations.md#ruler.
"""

from __future__ import annotations

import re
from dataclasses import asdict, replace

from evalkit.sample import PROMPT_SLOT, Sample
from evalkit.task import Loaded, keep_all, lm_eval_hooks, sha256_rows
from tasks.ruler import frozen, generate
from tasks.ruler.constants import MODEL_TEMPLATES, NIAH_PREFIX, NIAH_TEMPLATE, NO_DATA_TASKS, TASKS
from tasks.ruler.data import RulerData, resolve
from tasks.ruler.generate import singular

VERSION = 1  # bump when the prompts or data handling change (generate.GENERATOR_VERSION keys frozen files)
SCORER_VERSION = 2  # bump when extraction or scoring changes: finished runs re-score from their journals
# (2: `no_answer`, the standard key: an output with no text to match)

DEFAULT_N = 500  # upstream NUM_SAMPLES per task and length


def task_list(tasks) -> list[str]:
    """Task names from a list or a comma-separated string; "all" and "no_data" (the tasks that need no
    external file) expand in place."""
    groups = {"all": list(TASKS), "no_data": list(NO_DATA_TASKS)}
    items = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    names = list(dict.fromkeys(name for t in items for name in groups.get(t, [t])))
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise ValueError(f"unknown RULER task(s) {unknown}; known: {list(TASKS)} or all, no_data")
    return names


def model_template(prompt_format: str | None) -> str | None:
    """RULER's template for a model family, with evalkit's `{prompt}` slot; None keeps the chat template."""
    if prompt_format is None:
        return None
    if prompt_format not in MODEL_TEMPLATES:
        raise ValueError(
            f"RULER has no prompt format {prompt_format!r} (model.prompt_format); "
            f"its formats (scripts/data/template.py): {', '.join(MODEL_TEMPLATES)}"
        )
    return MODEL_TEMPLATES[prompt_format].replace("{task_template}", PROMPT_SLOT)


def load(
    source: str = "generate",
    n: int | None = None,
    seed: int = 42,
    tokenizer=None,
    lengths=(1024, 2048),
    tasks="no_data",
    essay_path: str | None = None,
    squad_path: str | None = None,
    hotpotqa_path: str | None = None,
    english_words_path: str | None = None,
    cache_dir: str | None = None,
    model_context: int | None = None,
    prompt_format: str | None = None,
    multi_question: bool = False,
    **_,
) -> Loaded:
    """Generate (or reuse the frozen) `n` samples per task and length; ordered by length, then task.
    A length above the evaluated model's context (passed by the runner) is refused, not truncated.
    `prompt_format` (the model conf's) selects RULER's template for the model family."""
    if source != "generate":
        raise ValueError(f"RULER is generated: source must be 'generate', got {source!r}")
    if tokenizer is None:
        raise ValueError("RULER counts tokens with the evaluated model's tokenizer: pass tokenizer=...")
    names, n = task_list(tasks), DEFAULT_N if n is None else n
    template = model_template(prompt_format)
    needed = {kind for t in names for kind in TASKS[t].data}
    paths = {"essay": essay_path, "squad": squad_path, "hotpotqa": hotpotqa_path}
    data = RulerData({k: resolve(k, p) if k in needed else None for k, p in paths.items()})
    data.paths["english_words"] = resolve("english_words", english_words_path, english_words_path is not None)
    root, samples, reused = frozen.cache_root(cache_dir), [], 0
    fingerprint = frozen.tokenizer_fingerprint(tokenizer)
    used: dict[str, str] = {}
    lengths = [int(x) for x in lengths]
    if model_context and max(lengths) > model_context:
        raise ValueError(
            f"lengths {lengths} exceed the model's context of {model_context} tokens; "
            "use shorter lengths or set model.max_length (beyond the trained window)"
        )
    for length in lengths:
        for task in names:
            kinds = TASKS[task].data + (("english_words",) if task == "cwe" else ())
            files = data.fingerprint(kinds)
            used.update(files)
            path = frozen.frozen_path(root, task, length, seed, tokenizer, fingerprint, files, template)
            got = frozen.read(path, n)
            reused += got is not None
            if got is None:
                got = generate.generate_task(task, length, n, seed, tokenizer, data, template)
                frozen.write(path, got)
            samples += got
    if multi_question:  # the runner's multi_question: each niah needle's key asked in turn
        samples = [q for s in samples for q in questions(s)]
    src = f"generated:ruler@{generate.GENERATOR_VERSION}" + "".join(
        f";{k}={v}" for k, v in sorted(used.items())
    )
    stats = {"frozen_reused": reused, "frozen_dir": str(root), "tasks": names, "lengths": lengths}
    stats["prompt_format"] = prompt_format or "chat_template"
    return Loaded(samples, src, sha256_rows([asdict(s) for s in samples]), stats=stats)


# --- query_aware=false: where the question starts (docs/query-agnostic.md) -------------------------------
# Everything before the line that asks (the instructions, the haystack, QA's repeated instruction) is the
# context, compressed before the question exists; that line, the model template's turn end and the answer
# prefix are the question. The last match counts (vt's and cwe's in-context example asks its own question
# earlier in the prompt).
QUESTION_MARKS = {
    "niah": ("\nWhat are all the special magic ", "\nWhat is the special magic "),
    "vt": ("\nQuestion: ",),
    "cwe": ("\nQuestion: ",),
    "fwe": ("\nQuestion: ",),
    "qa": ("\n\nQuestion: ",),
}


def question_start(sample: Sample) -> int:
    """The offset in the user message (`sample.prompt`) of the question's first character (the line that
    asks, after its newline)."""
    marks = QUESTION_MARKS[TASKS[sample.meta["task"]].generator]
    at = max(sample.prompt.rfind(m) for m in marks)
    if at < 0:
        raise ValueError(f"{sample.id}: no question found in the prompt (looked for {marks})")
    mark = next(m for m in marks if sample.prompt.startswith(m, at))
    return at + len(mark) - len(mark.lstrip("\n"))


# --- multi_question: the needles of one haystack asked one after another ----------------------------------
MAX_QUESTIONS = 4  # questions per haystack (niah_multikey_2/3's haystack is hundreds of needle lines)
NEEDLE = re.compile(r"One of the special magic (\w+) for ([\w-]+) is: ([\w-]+)\.")
ASKED = re.compile(r" for (.+) mentioned in the provided text\?$")


def questions(sample: Sample) -> list[Sample]:
    """One sample per question on the sample's context (its `conversation`, in `turn` order): for niah, each
    needle key of the haystack asked alone (the queried keys first, then the others in text order, at most
    MAX_QUESTIONS), in upstream's own question and answer prefix (singular for one value); any other task
    asks its one question. A question identical to the sample's own keeps the sample's id."""
    meta = {**sample.meta, "conversation": sample.id}
    if TASKS[sample.meta["task"]].generator != "niah":
        return [replace(sample, meta={**meta, "turn": 0})]
    at = question_start(sample)
    context, values = sample.prompt[:at], {}
    found = NEEDLE.findall(context)  # [(kind, key, value)]: every needle of the haystack, in text order
    for _, key, value in found:
        values.setdefault(key, []).append(value)
    kind = found[0][0]  # "numbers", "uuids" or "words": one kind per haystack
    asked = re.split(r", and |, ", ASKED.search(sample.prompt[at:]).group(1))
    keys = list(dict.fromkeys(asked + list(values)))[:MAX_QUESTIONS]
    out = []
    for turn, key in enumerate(keys):
        line, prefix, kinds = NIAH_TEMPLATE.split("{context}\n")[1], NIAH_PREFIX, kind
        if len(values[key]) == 1:
            line, prefix, kinds = singular(line), singular(prefix), kind[:-1]
        prompt = context + line.format(type_needle_v=kinds, query=key)
        prefix = prefix.format(type_needle_v=kinds, query=key)
        same = prompt == sample.prompt and prefix == sample.answer_prefix
        out.append(
            replace(
                sample,
                id=sample.id if same else f"{sample.id}/q{turn}",
                prompt=prompt,
                answer_prefix=prefix,
                answers=values[key],
                meta={**meta, "turn": turn},
            )
        )
    return out


# --- scoring (upstream scripts/eval/evaluate.py postprocess + scripts/eval/synthetic/constants.py)
def postprocess(prediction: str) -> str:
    """Upstream: strip, control characters to newlines, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of references found in the prediction (case-insensitive substring)."""
    return sum(r.lower() in prediction.lower() for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 if any reference is found in the prediction (case-insensitive substring)."""
    return float(max(r.lower() in prediction.lower() for r in references))


METRICS = {"all": string_match_all, "part": string_match_part}


def score(predictions: list[str], sample: Sample) -> dict[str, float]:
    """Percent, averaged over the k predictions (each the continuation after the answer prefix); `no_answer`,
    the standard key: the share of predictions with no text at all to match (an empty continuation)."""
    metric = METRICS[sample.meta["metric"]]
    texts = [postprocess(p) for p in predictions]
    v = 100 * sum(metric(t, sample.answers) for t in texts) / len(texts)
    task, length = sample.meta["task"], sample.meta["length"]
    empty = 100 * sum(not t for t in texts) / len(texts)
    scores = {"score": v, f"score/{task}": v, f"score/{length}": v, f"score/{task}@{length}": v}
    return scores | {"no_answer": empty}


def score_keys(repeats: int) -> set[str]:
    """The metrics `score` returns (its breakdowns are `score/<task>`, `score/<length>`)."""
    return {"score"}


custom_dataset, process_results = lm_eval_hooks("ruler", load, score, question_start=question_start)
__all__ = ["load", "score", "custom_dataset", "process_results", "keep_all"]
