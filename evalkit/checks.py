"""Everything refused before a model loads, each with one line that names the setting and the way out
(`ConfigError`, exit 2), never a traceback after loading.

Two moments, both before any weight is read:
- `check_plan` when a run is planned (no data, no model): the run settings, the names that become folders,
  the task module's contract (versions, score keys, load settings, the question split, the headline) and the
  model backend's capabilities (`ModelBackend.check`: a served model is full-cache, one process, one question
  per request);
- `check_model` once the model's config is read (no weights): the budget against its context, a TP size
  against its heads, and what each method refuses on this model and task (`method_refusal`).
`lm_eval --model evalkit` runs the same checks on its own settings (`check_lm`) before loading the weights;
what depends on the task there is checked when the task loads (`evalkit.task.ask_later_problem`).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from evalkit.config import ConfigError, check_choice
from evalkit.errors import EvalkitError
from evalkit.kv.cache import NONE
from evalkit.kv.methods import RunFacts
from evalkit.kv.storage import KVStorage
from evalkit.task import ask_later_problem, run_setting_problem

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # run-folder components: no separators, no "..", no "-x"
RUNNER_LOAD_KEYS = {
    "tokenizer",
    "model_context",
    "prompt_format",
    "multi_question",
}  # the runner passes these


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# --- when a run is planned: no data, no model ------------------------------------------------------------
def check_names(cfg: DictConfig, choices: dict) -> None:
    """Every group choice names a conf, and the names that become run-folder components are plain."""
    for group in ("model", "task", "method", "kv"):
        if group in choices:
            check_choice(group, choices[group])
    for key in ("task.name", "model.name", "task.lm_eval_task"):
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, str) or not NAME.fullmatch(value):
            raise ConfigError(
                f"{key} must be a plain name (letters, digits, '_', '.', '-', '+'), got {value!r}"
            )


def check_run_settings(cfg: DictConfig) -> None:
    for key, value, ok, rule in (
        ("batch_size", cfg.get("batch_size"), lambda v: _int(v) and v >= 1, "a positive integer"),
        ("limit", cfg.get("limit"), lambda v: v is None or _int(v) and v >= 1, "null or a positive integer"),
        ("seed", cfg.get("seed"), _int, "an integer"),
        ("compile", cfg.get("compile"), lambda v: isinstance(v, bool), "true or false"),
        ("query_aware", cfg.get("query_aware", True), lambda v: isinstance(v, bool), "true or false"),
        ("multi_question", cfg.get("multi_question", False), lambda v: isinstance(v, bool), "true or false"),
        (
            "model.max_new_tokens",
            cfg.model.get("max_new_tokens"),
            lambda v: v is None or _int(v) and v >= 1,
            "null (the task's own limit) or a positive integer",
        ),
        ("task.repeats", cfg.task.get("repeats"), lambda v: _int(v) and v >= 1, "a positive integer"),
        (
            "task.load.n",
            cfg.task.load.get("n"),
            lambda v: v is None or _int(v) and v >= 1,
            "null (all) or a positive integer",
        ),
    ):
        if not ok(value):
            raise ConfigError(f"{key} must be {rule}, got {value!r}")


def check_task(cfg: DictConfig, module) -> None:
    """The task module's contract (tasks/README.md) as far as this run reads it, before its data loads."""
    for attr, what in (
        ("VERSION", "bumped when prompts or data change"),
        ("SCORER_VERSION", "bumped when scoring changes"),
    ):
        if not _int(getattr(module, attr, None)):
            raise ConfigError(f"task module {cfg.task.module} must define {attr} (an int, {what})")
    if not callable(getattr(module, "score_keys", None)):
        raise ConfigError(
            f"task module {cfg.task.module} must define score_keys(repeats) (the metrics its score returns)"
        )
    check_load_keys(cfg, module)
    check_question_split(cfg, module)
    check_headline(cfg, module)


def check_load_keys(cfg: DictConfig, module) -> None:
    """A `task.load.<key>` the task's `load()` does not name would be swallowed by its `**_`: refused
    instead."""
    params = inspect.signature(module.load).parameters.values()
    known = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - RUNNER_LOAD_KEYS
    unknown = sorted(set(cfg.task.get("load") or {}) - known)
    if unknown:
        raise ConfigError(
            f"task {cfg.task.name}: unknown setting(s) {', '.join('task.load.' + k for k in unknown)}; "
            f"its load settings: {', '.join(sorted(known))}"
        )


def check_question_split(cfg: DictConfig, module) -> None:
    """query_aware=false needs a task that says where its question starts (`question_start`), multi_question
    needs query_aware=false (what the model backend must support is its own check)."""
    why = ask_later_problem(
        cfg.task.name,
        cfg.get("query_aware", True),
        cfg.get("multi_question", False),
        getattr(module, "question_start", None),
        getattr(module, "NO_QUESTION_SPLIT", None),
    )
    if why is not None:
        raise ConfigError(why)


def check_headline(cfg: DictConfig, module) -> None:
    """The headline names one of the metrics the task declares (`score_keys`), or one of their
    `<metric>/<subset>` breakdowns: known before anything is generated."""
    keys = module.score_keys(int(cfg.task.repeats))
    headline = cfg.task.get("headline")
    if not isinstance(headline, str) or headline.partition("/")[0] not in keys:
        raise ConfigError(
            f"task.headline={headline!r} names no metric of task {cfg.task.name} (its metrics: "
            f"{', '.join(sorted(keys))}, and their '<metric>/<subset>' breakdowns)"
        )


def has_followup(cfg: DictConfig, module) -> bool:
    """The task makes a second call after each first one with these load settings (its module's
    `followup`: LongBench-v2 CoT's answer call)."""
    followup = getattr(module, "followup", None)
    return (
        followup is not None and followup(**OmegaConf.to_container(cfg.task.load, resolve=True)) is not None
    )


def check_backend(cfg: DictConfig, spec, method_name: str, processes: int = 1, storage: str = "none") -> None:
    """What the model backend cannot do with this run, refused by the backend itself (a served model: method
    full unless evalkit's own server serves another, one process, one question per request; a model conf's
    own single-turn template: no next turn)."""
    spec.check(
        RunNeeds(
            method=method_name,
            task=cfg.task.name,
            query_aware=cfg.get("query_aware", True),
            multi_question=cfg.get("multi_question", False),
            processes=processes,
            storage=storage,
        )
    )


@dataclass(frozen=True)
class RunNeeds:
    """What a run asks of its model backend, refused by `ModelBackend.check` when the backend cannot do it."""

    method: str  # the method's conf name
    task: str
    query_aware: bool = True  # false: the context compressed before the question
    multi_question: bool = False  # a context's questions asked one after another on one cache
    processes: int = 1  # the run's world size (parallel.tp_size x parallel.dp_size)
    storage: str = "none"  # the KV storage's name (conf/kv/)


# --- once the model's config is read: no weights ----------------------------------------------------------
def check_budget(plans: list, context: int) -> None:
    """A budget above the model's context keeps nothing more than the full cache, yet the static cache would
    be allocated at that size (tens of GB at a typo's budget): refused before the model loads."""
    for p in plans:
        budget = p.method.budget  # None for full
        if budget is not None and budget > context:
            raise ConfigError(
                f"method.budget={budget} is above {p.cfg.model.name}'s context of {context} tokens: no "
                f"prompt can fill it. Choose a budget below {context}, or METHOD=full for the uncompressed "
                "cache"
            )


def check_tp(model_name: str, model_cfg, tp: int) -> None:
    """Tensor parallelism shards attention by heads: a TP size that does not divide the attention heads and
    the KV heads cannot be laid out (transformers would load, then fail on a shape on every rank)."""
    text = model_cfg.get_text_config()
    attention = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or attention
    if tp == 1 or attention is None or (attention % tp == 0 and kv % tp == 0):
        return
    fits = [d for d in range(1, attention + 1) if attention % d == 0 and kv % d == 0]
    raise ConfigError(
        f"parallel.tp_size={tp}: {model_name} has {attention} attention and {kv} KV heads, which {tp} "
        f"processes cannot share evenly: use a TP size that divides both ({', '.join(map(str, fits))}), and "
        "parallel.dp_size for the other processes"
    )


def run_facts(
    model_name: str, model_cfg, compile: bool, followup: bool, tp: int = 1, task: str = ""
) -> RunFacts:
    mla = getattr(model_cfg.get_text_config(), "kv_lora_rank", None) is not None
    return RunFacts(model_name, mla, followup, bool(compile), tp, task)


def check_methods(methods: list, facts: RunFacts, storage: KVStorage = NONE, model_cfg=None) -> None:
    """What each method refuses in this run, then what the run's KV storage refuses to hold for it (int
    storage with a method that overwrites chosen slots, on MLA, or a ring budget of partial key groups; fp8's
    per-tensor scale under TP), and whether it can code this model's heads (`model_cfg`, when given)."""
    for method in methods:
        if (why := method.refusal(facts)) is not None:
            raise ConfigError(why)
    for method in methods:
        if (why := storage.refusal(method, facts)) is not None:
            raise ConfigError(why)
    if model_cfg is not None and not facts.mla:
        from evalkit.memory.model import kv_geometry

        try:
            geometry = kv_geometry(model_cfg, "float32")
        except EvalkitError:  # a config the memory model cannot read: the storage checks the heads it gets
            return
        try:
            storage.check_widths(geometry.key_width, geometry.value_width)
        except ValueError as e:  # e.g. a value group wider than this model's heads
            raise ConfigError(f"{e}: set kv.group") from None


def check_model(plans: list, model_cfg, context: int, tp: int = 1) -> None:
    """Once the model's config is read: each plan's budget, the TP layout, what each method refuses."""
    p = plans[0]
    check_budget(plans, context)
    check_tp(p.cfg.model.name, model_cfg, tp)
    followup = has_followup(p.cfg, p.task_module)
    facts = run_facts(p.cfg.model.name, model_cfg, p.cfg.compile, followup, tp, p.cfg.task.name)
    check_methods([q.method for q in plans], facts, p.storage, model_cfg)


# --- lm_eval --model evalkit --------------------------------------------------------------------------------
def check_lm(spec, method, compile: bool, query_aware, multi_question, storage: KVStorage = NONE) -> None:
    """`lm_eval --model evalkit`'s own settings, before its weights load: the run settings in --model_args and
    what the method refuses on this model (lm-eval's CLI runs one process; the task's follow-up call is known
    only when its requests come, and refused then)."""
    from evalkit.sources import model_config, resolve_source

    if (why := run_setting_problem(query_aware, multi_question)) is not None:
        raise ConfigError(why)
    model_cfg = model_config(spec, resolve_source(spec))
    check_methods([method], run_facts(spec.name, model_cfg, compile, followup=False), storage, model_cfg)
