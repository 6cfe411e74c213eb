"""What every benchmark module in `tasks/` shares: its load result, and the lm-eval hooks built from it.

A task module (`tasks/<name>/<name>.py`) defines `load(...) -> Loaded` and
`score(predictions, sample) -> dict[str, float]`, then exposes lm-eval's hooks with one line:

    custom_dataset, process_results = lm_eval_hooks("<name>", load, score)

lm-eval exec's the module from its file path (a second copy beside `import tasks.<name>.<name>`), so the
load memo lives here, in one shared module, keyed by task name and arguments: the runner calls `load()` once
before any model loads (bad data fails early) and lm-eval's `custom_dataset` then reuses that result.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

from evalkit.errors import EvalkitError
from evalkit.sample import FOLLOWUP_KEY, QUESTION_KEY, Sample, Skipped


class DataError(EvalkitError, RuntimeError):
    """The task's data could not be loaded (missing file, bad source); the message says which and how to
    fix."""


@dataclass
class Loaded:
    samples: list[Sample]
    source: str  # "sample" (bundled), "hub:<repo>@<revision>" or "local:<absolute path>"
    data_hash: str  # sha256 of the raw bytes read (or of the generated rows), see `sha256_*`
    skipped: list[Skipped] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # task-specific counts, e.g. {"truncated": 3}


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_rows(rows: list[dict]) -> str:
    return sha256_bytes(json.dumps(rows, sort_keys=True, ensure_ascii=False).encode())


def data_file(source: str, sample: Path, repo: str, filename: str, revision: str) -> tuple[Path, str]:
    """The file `source` names and its provenance tag: "sample" (the bundled file), "hub" (one pinned file of
    a hub dataset repo, downloaded as is: no dataset loader script runs) or a local path."""
    if source == "sample":
        return sample, "sample"
    if source == "hub":
        from huggingface_hub import hf_hub_download

        return Path(
            hf_hub_download(repo, filename, repo_type="dataset", revision=revision)
        ), f"hub:{repo}@{revision}"
    path = Path(source).resolve()
    if not path.exists():
        raise ValueError(f"task.load.source: {path} does not exist")
    if not (path.is_file() or path.is_dir()):  # /dev/zero, a FIFO: reading would never end
        raise ValueError(f"task.load.source: {path} is not a regular file or a folder")
    return path, f"local:{path}"


def decode(raw: bytes, path: Path) -> str:
    """A data file's bytes as text: UTF-8, a leading byte-order mark dropped (editors on Windows write one;
    kept, it would break the first row), anything else an error naming the file and the byte."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_text(path: Path) -> str:
    return decode(Path(path).read_bytes(), path)


def read_json(path: Path):
    """A JSON data file; an unreadable or malformed file is an error that names it (and where it broke)."""
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def parse_rows(text: str, path: Path, array: bool) -> list[dict | Skipped]:
    """Rows of a JSON array file (`array`) or of a JSON-lines file. A JSON-lines row that does not parse
    becomes `Skipped("<file>:<line>", reason)`, reported with the others; a broken array file is an error
    naming it."""
    if array:
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    rows: list[dict | Skipped] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            rows.append(Skipped(f"{Path(path).name}:{number}", f"line {number} is not valid JSON ({e.msg})"))
    return rows


def unique(items: Iterable[Sample | Skipped], what: str = "id") -> tuple[list[Sample], list[Skipped]]:
    """Samples in input order, and the rows set aside: malformed ones and repeats of an id."""
    samples, skipped, seen = [], [], set()
    for item in items:
        if isinstance(item, Sample) and item.id in seen:
            item = Skipped(item.id, f"duplicate {what}")
        if isinstance(item, Skipped):
            skipped.append(item)
            continue
        seen.add(item.id)
        samples.append(item)
    return samples, skipped


def subsample(items: list, n: int | None, seed: int) -> list:
    """A seeded random subset of `n` items kept in input order (all of them when n is None or too large)."""
    if n is None or n >= len(items):
        return items
    return [items[i] for i in sorted(random.Random(seed).sample(range(len(items)), n))]


@cache
def get_tokenizer(name_or_path: str):
    """Tokenizers are passed to `load` by name (lm-eval metadata must stay JSON); load each once."""
    from transformers import AutoTokenizer

    from evalkit.sources import tokenizer_source

    source = tokenizer_source(name_or_path)  # a model conf name, folder or hub id
    return AutoTokenizer.from_pretrained(source)


_MEMO: dict[tuple, Loaded] = {}


def _freeze(v):
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, list | tuple):
        return tuple(_freeze(x) for x in v)
    return v


def load_task(name: str, load: Callable[..., Loaded], **kwargs) -> Loaded:
    """`load(**kwargs)` once per (task, arguments); a `tokenizer` given by name is resolved here."""
    key = (name, _freeze(kwargs))
    if key not in _MEMO:
        if isinstance(kwargs.get("tokenizer"), str):
            kwargs = {**kwargs, "tokenizer": get_tokenizer(kwargs["tokenizer"])}
        _MEMO[key] = load(**kwargs)
    return _MEMO[key]


def lm_eval_hooks(
    name: str,
    load: Callable[..., Loaded],
    score: Callable[[list[str], Sample], dict],
    question_start: Callable[[Sample], int] | None = None,
    no_split: str | None = None,
    followup: Callable[..., str | None] | None = None,
):
    """lm-eval's `custom_dataset` and `process_results` for a task module, given its hooks: where a sample's
    question starts (`question_start`, or why it has no such split: `no_split`) and the follow-up call its
    load settings make (`followup`). Each request's doc carries what the LMs need of them (the question's
    start when the run compresses before the question, the follow-up call), so `python -m evalkit` and
    `lm_eval --model evalkit` (whose `--model_args` reach the task's metadata too) run the same requests."""

    register_lm_eval_model()

    def custom_dataset(**metadata):
        from datasets import Dataset

        kwargs = {k: v for k, v in metadata.items() if k not in LM_EVAL_METADATA}
        query_aware = kwargs.pop("query_aware", True)  # the run's setting, not the task's
        # lm-eval CLI: --model_args model=<conf> reaches the task's metadata; its tokenizer and prompt
        # format are the model's (`python -m evalkit` passes both itself)
        if "tokenizer" not in kwargs and isinstance(kwargs.get("model"), str):
            kwargs["tokenizer"] = kwargs["model"]
        if "prompt_format" not in kwargs and (fmt := model_prompt_format(kwargs.get("model"))):
            kwargs["prompt_format"] = fmt
        multi = kwargs.get("multi_question", False)
        why = ask_later_problem(name, query_aware, multi, question_start, no_split)
        if why is None and multi and kwargs.get("prompt_format"):
            why = f"multi_question=true: {name} renders with its own single-turn template (prompt_format="
            why += f"{kwargs['prompt_format']}), which has no next turn: use the model's chat template"
        if why is not None:
            from evalkit.config import ConfigError

            raise ConfigError(why)
        loaded = load_task(name, load, **kwargs)
        tags = {FOLLOWUP_KEY: followup(**kwargs) if followup else None}
        docs = []
        for s in loaded.samples:
            meta = {**s.meta, **{k: v for k, v in tags.items() if v is not None}}
            if not query_aware:
                meta[QUESTION_KEY] = question_start(s)
            docs.append(replace(s, meta=meta).to_doc())
        return {"test": Dataset.from_list(docs)}

    def process_results(doc: dict, results: list) -> dict[str, float]:
        # with the keep_all filter lm-eval passes [[r_1, ..., r_k]] (all repeats); without it [r_1]
        predictions = results[0] if len(results) == 1 and isinstance(results[0], list) else results
        return score(list(predictions), Sample.from_doc(doc))

    return custom_dataset, process_results


def run_setting_problem(query_aware, multi_question) -> str | None:
    """Why the run settings `query_aware` / `multi_question` cannot go together (None: they can)."""
    for key, value in (("query_aware", query_aware), ("multi_question", multi_question)):
        if not isinstance(value, bool):
            return f"{key} must be true or false, got {value!r}"
    if multi_question and query_aware:
        return (
            "multi_question=true asks several questions on one context compressed before any of them: it "
            "needs query_aware=false"
        )
    return None


def ask_later_problem(
    task: str, query_aware, multi_question, question_start, no_split: str | None = None
) -> str | None:
    """Why a task cannot run `query_aware` / `multi_question` as set (None: it can). query_aware=false needs
    a task whose prompt has a context before its question and that says where the question starts; a task
    without one is refused with its own reason (`no_split`). The same words from `python -m evalkit` (before
    any data) and `lm_eval --model evalkit` (when the task loads)."""
    if (why := run_setting_problem(query_aware, multi_question)) is not None:
        return why
    if not query_aware and question_start is None:
        why = no_split or "its module does not say where the question starts"
        return (
            f"query_aware=false: task {task} cannot compress its context before the question: {why}. Run it "
            "with query_aware=true (the default)"
        )
    return None


def register_lm_eval_model() -> None:
    """Register lm-eval's "evalkit" model before lm-eval looks it up, lazily (by name: a task knows no
    model)."""
    from lm_eval.api.registry import model_registry

    if "evalkit" not in model_registry:
        model_registry.register("evalkit", target="evalkit.lm:EvalkitLM")


LM_EVAL_METADATA = {"version", "config_source"}  # keys lm-eval adds to a task's metadata


def model_prompt_format(model) -> str | None:
    """The `prompt_format` of a model conf given by name (None for anything else)."""
    from evalkit.config import choices, model_spec

    return model_spec(model).prompt_format if isinstance(model, str) and model in choices("model") else None


def keep_all(resps, docs):
    """lm-eval filter (`function: custom, filter_fn: ...`): keep every repeat so pass@k / cons@k see all k."""
    return resps
