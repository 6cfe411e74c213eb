"""The entry point: `python -m evalkit [overrides]` evaluates one (model, task, method, budget) with lm-eval.

Reads top to bottom: validate the config (no data, no model), check what each run folder already holds, load
the data, then
- generate: lm-eval drives the task's requests through the evalkit model; every finished generation is
  journaled (`generations.jsonl`), so a killed run resumes where it stopped;
- score: every sample is scored from the journal by the task's own scorer, and `samples.jsonl` +
  `metrics.json` are written.
A finished run is skipped; a finished run whose scorer version or grading settings (`task.setup`) changed is
re-scored from its journal without loading the model; one whose data changed is refused, never skipped.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from evalkit import metrics as metrics_record
from evalkit import parallel
from evalkit.config import (
    CONF_DIR,
    ConfigError,
    check_choice,
    choices,
    compose,
    group_config,
    model_spec,
)
from evalkit.errors import EvalkitError, exit_with
from evalkit.identity import check_folder, classify
from evalkit.journal import Journal, request_keys
from evalkit.kv.config import canonical, make_method, method_class
from evalkit.results import RunLock, atomic_write, check_writable, config_yaml, run_dir
from evalkit.summary import announce, next_step, print_table, summarize
from evalkit.task import DataError

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"
_MODELS: dict[str, tuple] = {}  # one load per process across the jobs of a sweep
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")  # run-folder components: no separators, no "..", no "-x"
log = logging.getLogger("evalkit")


@dataclass(eq=False)
class Plan:
    cfg: DictConfig
    method: object
    spec: object
    task_module: object
    out: Path
    # new (no metrics yet), rescore (metrics from another scorer), rebuild (samples.jsonl lost), done
    # (skipped)
    state: str = "new"
    journal: Journal | None = field(default=None, repr=False)


# --- configuration: everything that can fail before data or a model is loaded ------------------------------
def plan(cfg: DictConfig) -> Plan:
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    for group in ("model", "task", "method"):
        if group in choices:
            check_choice(group, choices[group])
    for key in ("task.name", "model.name", "task.lm_eval_task"):
        value = OmegaConf.select(cfg, key)
        if not isinstance(value, str) or not NAME.fullmatch(value):
            raise ConfigError(
                f"{key} must be a plain name (letters, digits, '_', '.', '-', '+'), got {value!r}"
            )
    cls = method_class(cfg.method._target_)
    method_name = choices.get("method") or cls.name  # the conf's name (SnapKVDecode: snapkv_decode)
    if not cls.budget_applies and cfg.method.get("budget") is not None:
        # a sweep lists `full` beside compressed methods: its budgets all name the one uncompressed run
        log.info("%s keeps every entry: budget=%s does not apply", method_name, cfg.method.budget)
        cfg = OmegaConf.merge(cfg, {"method": {"budget": None}})
    method = make_method(cfg.method)
    defaults = group_config("method", method_name)
    if (same := canonical(cfg.method, method, defaults)) is not cfg.method:  # e.g. recent=32 at budget 256
        cfg = OmegaConf.merge(cfg, {"method": same})
    check_run_settings(cfg)
    out = run_dir(cfg, method_name, defaults, conf_defaults(cfg))
    try:
        task_module = importlib.import_module(cfg.task.module)
    except ImportError as e:
        raise ConfigError(f"task {cfg.task.name}: cannot import {cfg.task.module} ({e})") from None
    for attr, what in (
        ("VERSION", "bumped when prompts or data change"),
        ("SCORER_VERSION", "bumped when scoring changes"),
    ):
        if not _int(getattr(task_module, attr, None)):
            raise ConfigError(f"task module {cfg.task.module} must define {attr} (an int, {what})")
    check_load_keys(cfg, task_module)
    check_question_split(cfg, task_module)
    spec = model_spec(cfg.model)
    spec.check(method_name)  # a served model: method full, a valid address, a tokenizer
    return Plan(cfg, method, spec, task_module, out)


def conf_defaults(cfg: DictConfig) -> DictConfig | None:
    """The config `task=<task> model=<model>` composes to with nothing else set: what a run's folder name is
    measured against (None for a task or model that is not a conf of conf/)."""
    if cfg.task.name not in choices("task") or cfg.model.name not in choices("model"):
        return None
    return compose(overrides=[f"task={cfg.task.name}", f"model={cfg.model.name}"])


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


def check_question_split(cfg: DictConfig, task_module) -> None:
    """query_aware=false needs a task whose prompt has a context before its question, and that says where the
    question starts (`question_start`); a task without one is refused with its own reason. multi_question
    needs query_aware=false and the tokenizer's chat template (its next questions are chat turns)."""
    if cfg.get("multi_question", False):
        if cfg.get("query_aware", True):
            raise ConfigError(
                "multi_question=true asks several questions on one context compressed before any of them: "
                "it needs query_aware=false"
            )
        if cfg.model.get("prompt_format") or cfg.model.get("base_url"):
            raise ConfigError(
                f"multi_question=true: model {cfg.model.name} "
                + (
                    "is served (a served cache is not held between requests): run it in process"
                    if cfg.model.get("base_url")
                    else f"renders {cfg.task.name} with its own single-turn template "
                    f"(model.prompt_format={cfg.model.prompt_format}): set model.prompt_format=null"
                )
            )
    if cfg.get("query_aware", True):
        return
    if getattr(task_module, "question_start", None) is None:
        why = getattr(task_module, "NO_QUESTION_SPLIT", "its module does not say where the question starts")
        raise ConfigError(
            f"query_aware=false: task {cfg.task.name} cannot compress its context before the question: "
            f"{why}. Run it with query_aware=true (the default)"
        )


def ask_later(lm, p: Plan) -> None:
    """query_aware=false: the in-process LM splits each prompt at the task's `question_start`. A served model
    keeps a full cache, which is query-agnostic by nature: its prompts go as they are (the same outputs)."""
    if not p.cfg.get("query_aware", True) and hasattr(lm, "question_start"):
        lm.question_start = p.task_module.question_start
        lm.multi_question = bool(p.cfg.get("multi_question", False))


RUNNER_LOAD_KEYS = {
    "tokenizer",
    "model_context",
    "prompt_format",
    "multi_question",
}  # what the runner itself passes to `load`


def check_load_keys(cfg: DictConfig, task_module) -> None:
    """A `task.load.<key>` the task's `load()` does not name would be swallowed by its `**_`: refused
    instead."""
    import inspect

    params = inspect.signature(task_module.load).parameters.values()
    known = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - RUNNER_LOAD_KEYS
    unknown = sorted(set(cfg.task.get("load") or {}) - known)
    if unknown:
        raise ConfigError(
            f"task {cfg.task.name}: unknown setting(s) {', '.join('task.load.' + k for k in unknown)}; "
            f"its load settings: {', '.join(sorted(known))}"
        )


def check_budget(plans: list[Plan], context: int) -> None:
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


def has_followup(cfg: DictConfig) -> bool:
    """The task's lm-eval YAML asks a second call after each first one (`evalkit_followup`: LongBench-v2
    CoT's answer call)."""
    for path in TASKS_DIR.glob("*/*.yaml"):
        text = path.read_text()
        if re.search(rf"^task:\s*{re.escape(cfg.task.lm_eval_task)}\s*$", text, re.M):
            return "evalkit_followup:" in text
    return False


def check_decode_eviction(plans: list[Plan], model_cfg) -> None:
    """What a decode-time eviction method (h2o, snapkv_decode: its slot pool holds rows of its own kind)
    cannot run with, refused before the model loads."""
    for p in plans:
        name, kind = p.method.name, p.method.evict
        if kind is None:
            continue
        mla = getattr(model_cfg.get_text_config(), "kv_lora_rank", None) is not None
        if kind == "refit" and mla:
            raise ConfigError(
                f"method {name} re-scores the cached keys, but {p.cfg.model.name} caches MLA's latent (keys "
                "are rebuilt from it inside attention): use h2o, snapkv or snapstream"
            )
        if mla and p.cfg.compile and parallel.LAYOUT.tp > 1:
            raise ConfigError(
                f"method {name} with compile=true under tensor parallelism on an MLA model: every step's "
                "eviction is broadcast from the TP root, which the compiled step cannot hold. Set "
                "compile=false, or run one process"
            )
        if has_followup(p.cfg):
            raise ConfigError(
                f"task {p.cfg.task.name} asks a second call on the full cache after each first one, which a "
                f"{name} slot pool cannot hold beside its rows: use method snapkv or snapstream, or "
                "task=longbench_v2"
            )


def check_refusals(plans: list[Plan], model_cfg) -> None:
    """What a method declares it cannot run with (`KVMethod.refusal`), refused before the model loads. (The
    facts are the `RunFacts` the issue-30 checks hand every method.)"""
    from types import SimpleNamespace

    mla = getattr(model_cfg.get_text_config(), "kv_lora_rank", None) is not None
    for p in plans:
        facts = SimpleNamespace(
            model_name=p.cfg.model.name, mla=mla, compile=bool(p.cfg.get("compile", False)),
            tp=parallel.LAYOUT.tp, followup=has_followup(p.cfg),
        )  # fmt: skip
        why = p.method.refusal(facts)
        if why:
            raise ConfigError(why)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def plans_for(cfg: DictConfig) -> list[Plan]:
    """One plan per budget: `method.budget=[64,128,256]` evaluates several budgets with one prefill each
    prompt."""
    budgets = cfg.method.get("budget")
    if not isinstance(budgets, ListConfig):
        return [plan(cfg)]
    if not budgets:
        raise ConfigError("method.budget: an empty list names no run; give one budget or a non-empty list")
    out: dict[Path, Plan] = {}
    for b in budgets:
        q = plan(OmegaConf.merge(cfg, {"method": {"budget": b}}))
        out.setdefault(q.out, q)  # `full` ignores budgets: one run
    return list(out.values())


# --- data and what each folder holds ---------------------------------------------------------------------
def load_data(p: Plan, tokenizer_source: str, context: int):
    from evalkit.task import load_task

    kwargs = {**OmegaConf.to_container(p.cfg.task.load, resolve=True), "tokenizer": tokenizer_source}
    kwargs["model_context"] = context
    if getattr(p.spec, "prompt_format", None):  # a task with its own template for this model family uses it
        kwargs["prompt_format"] = p.spec.prompt_format
    if p.cfg.get("multi_question", False):  # one sample per question, grouped into conversations
        kwargs["multi_question"] = True
    try:
        loaded = load_task(p.cfg.task.name, p.task_module.load, **kwargs)
    except (LookupError, ValueError, OSError, RuntimeError) as e:  # bad data or data options
        raise DataError(f"task {p.cfg.task.name}: {e}") from None
    if not loaded.samples:
        why = "; ".join(f"{s.id}: {s.reason}" for s in loaded.skipped[:10]) or "the source holds no rows"
        more = f" (and {len(loaded.skipped) - 10} more)" if len(loaded.skipped) > 10 else ""
        raise DataError(f"task {p.cfg.task.name}: no usable samples in {loaded.source}: {why}{more}")
    return loaded, kwargs


def evaluated(p: Plan, loaded) -> list:
    """The samples a run covers, in lm-eval's doc order (doc_id = index; `limit` takes the first N)."""
    return loaded.samples[: p.cfg.limit] if p.cfg.limit else loaded.samples


def open_journal(p: Plan, path: Path) -> Journal:
    if path.exists() and not path.is_file():
        raise ConfigError(f"{path} is not a file: move it away (the journal is a file this run appends to)")
    journal = Journal(path)
    for number, reason in journal.rejected:
        print(
            f"evalkit: {journal.path} line {number} set aside ({reason}) into {journal.path.name}.rejected; "
            "that request runs again",
            file=sys.stderr,
        )
    return journal


def missing(p: Plan, loaded) -> int:
    """Requests of this run not in its journal yet (0: scoring needs no model)."""
    keys = request_keys(p.cfg.task.lm_eval_task, len(evaluated(p, loaded)), int(p.cfg.task.repeats))
    return sum(k not in p.journal.records for k in keys)


# --- generation ------------------------------------------------------------------------------------------
def get_model(spec):
    from evalkit.models import load_model

    key = repr(spec)
    if key not in _MODELS:
        _MODELS.clear()  # one model resident at a time
        _MODELS[key] = load_model(spec)
    return _MODELS[key]


def generate(plans: list[Plan], load_kwargs: dict, context: int) -> None:
    """Fill the journals: lm-eval builds the requests, the model's LM generates what is not journaled yet.
    Every budget after the first replays the first's prefills. The LM is made (the weights loaded, or the
    server checked) before any config.yaml is written."""
    p = plans[0]
    lm = p.spec.make_lm(
        plans, context, lambda spec: get_model(spec)
    )  # get_model looked up now: tests patch it
    ask_later(lm, p)
    for q in plans if parallel.LAYOUT.writer else ():
        atomic_write(q.out / "config.yaml", config_yaml(q.cfg))
    lm_eval_generate(p, lm, load_kwargs)


def lm_eval_generate(p: Plan, lm, load_kwargs: dict) -> None:
    """Run the task's lm-eval YAML with the evalkit model in lm-eval's predict-only mode: lm-eval builds and
    issues the requests (templates, generation settings, repeats); scoring happens afterwards, from the
    journal."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=load_kwargs)
    tasks = get_task_dict([p.cfg.task.lm_eval_task], manager)
    for task in tasks.values():
        task.config.repeats = int(p.cfg.task.repeats)
    simple_evaluate(
        model=lm,
        tasks=list(tasks.values()),
        limit=p.cfg.limit,
        predict_only=True,
        bootstrap_iters=0,
        gen_kwargs=OmegaConf.to_container(p.cfg.task.generation) or None,
        task_manager=manager,
    )


def configure_task(p: Plan) -> dict | None:
    """A task module's optional `configure(**task.setup)` (e.g. the code sandbox), run before generating;
    what it returns (settings, detected isolation) is recorded in metrics.json."""
    configure = getattr(p.task_module, "configure", None)
    if configure is None:
        return None
    try:
        return configure(**OmegaConf.to_container(p.cfg.task.get("setup") or {}, resolve=True))
    except (ValueError, TypeError, RuntimeError, OSError) as e:
        raise ConfigError(f"task {p.cfg.task.name} setup: {e}") from None


# --- scoring ---------------------------------------------------------------------------------------------
def score(p: Plan, loaded, setup: dict | None, context: int, tokenizer) -> None:
    """Score every sample from the journal with the task's scorer; write samples.jsonl and metrics.json."""
    from evalkit.models import model_config, resolve_source
    from evalkit.scoring import score_journal

    samples, task, k = evaluated(p, loaded), p.cfg.task.lm_eval_task, int(p.cfg.task.repeats)
    rows = score_journal(p.task_module, samples, p.journal, task, k, tokenizer)
    keys = request_keys(task, len(samples), k)
    now = sum(key in p.journal.generated_keys for key in keys)  # what this process really generated
    counts = {"from_journal": len(keys) - now, "generated_now": now}  # resumed, or a re-score
    check_headline(p, rows)
    metrics = summarize(p, loaded, rows, model_config(p.spec, resolve_source(p.spec)), context, counts)
    metrics.task_setup = setup
    metrics.extra.update(p.spec.extra_metrics(p.out))
    metrics.extra["parallel"] = parallel.provenance()  # the layout: provenance, not identity
    atomic_write(p.out / "config.yaml", config_yaml(p.cfg))  # the grading settings now in force
    atomic_write(p.out / "samples.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    metrics_record.write(p.out / "metrics.json", metrics)


def check_headline(p: Plan, rows: list[dict]) -> None:
    """The headline must name one of the task's metrics. Known only once a sample is scored; the journal holds
    every generation, so the corrected command re-scores without the model."""
    names = {k for r in rows for k in r["scores"]}
    if rows and p.cfg.task.headline not in names:
        top = sorted(k for k in names if "/" not in k)  # breakdowns (`score/vt`) are valid too, not listed
        raise ConfigError(
            f"task.headline={p.cfg.task.headline!r} names no metric of task {p.cfg.task.name} (its metrics: "
            f"{', '.join(top)}, and their '<metric>/<subset>' breakdowns). The generations are journaled: "
            "run again with a valid task.headline to score"
        )


# --- the recipe ------------------------------------------------------------------------------------------
def run(cfg: DictConfig) -> list[dict]:
    from evalkit.models import context_length, model_config, resolve_source, tokenizer_path
    from evalkit.task import get_tokenizer

    plans = plans_for(cfg)
    writer = parallel.LAYOUT.writer  # one writer: only rank 0 reads or writes the run folders
    for p in plans if writer else ():
        check_folder(p.out, p.cfg)
        check_writable(p.out)
    spec = plans[0].spec
    parallel.check_model(spec)
    model_cfg = model_config(spec, resolve_source(spec))
    context = context_length(spec, model_cfg)
    check_budget(plans, context)
    check_decode_eviction(plans, model_cfg)
    check_refusals(plans, model_cfg)
    loaded, load_kwargs = load_data(plans[0], tokenizer_path(spec), context)  # before any model loads
    setup = configure_task(plans[0]) if writer else None
    locks = [RunLock(p.out) for p in plans] if writer else []
    try:
        for lock in locks:
            lock.acquire()
        states = parallel.from_writer([classify(p, loaded) for p in plans] if writer else None)
        for p, state in zip(plans, states):
            p.state = state
        parallel.open_journals(plans, open_journal)  # each replica's shard; TP peers: their root's records
        left = {p.out: missing(p, loaded) for p in plans if p.state != "done"}
        if writer:
            announce(plans, loaded, len(evaluated(plans[0], loaded)), left)
        todo = [p for p in plans if left.get(p.out)]
        if todo:
            generate(todo, load_kwargs, context)
        parallel.barrier()  # every replica has journaled its share
        parallel.gather_kv()
        if not writer:
            return []
        for p in plans:
            if p.state != "done":
                parallel.fold_shards(p.journal)
            if p.state == "rebuild":
                print(f"evalkit: {p.out}: samples.jsonl is missing; rebuilding it from its journal")
            if p.state == "rescore":
                print(f"evalkit: {p.out}: scorer or grading settings changed; re-scoring from its journal")
            if p.state != "done":
                score(p, loaded, setup, context, get_tokenizer(tokenizer_path(spec)))
    finally:
        for p in plans:
            if p.journal is not None:
                p.journal.close()
        for lock in locks:
            lock.release()
    all_metrics = []
    for p in plans:
        if p.state == "done":
            print(f"evalkit: {p.out} is complete; skipping (delete it to rerun)")
        all_metrics.append(json.loads((p.out / "metrics.json").read_text()))
        print_table(metrics_record.Metrics.from_json(all_metrics[-1]))
    next_step(plans)
    return all_metrics


@hydra.main(config_path=str(CONF_DIR), config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # lm-eval warns per breakdown key ("no aggregation defined"): evalkit aggregates those itself
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    try:
        parallel.init(parallel.layout(cfg))  # a layout that does not fit NPROC fails here, before any load
        run(cfg)
    except EvalkitError as e:
        exit_with(f"evalkit{parallel.rank_tag()}", e)


if __name__ == "__main__":
    main()
