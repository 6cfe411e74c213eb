"""The entry point: `python -m evalkit [overrides]` evaluates one (model, task, method, budget) with lm-eval.

Reads top to bottom (`run`): plan every budget and check everything that can be checked (evalkit.checks: no
data, no model), check what each run folder already holds, read the model's config and check the plans
against it, load the data, then
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
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf

from evalkit import checks
from evalkit import metrics as metrics_record
from evalkit.config import CONF_DIR, ConfigError, choices, compose, group_config, model_spec
from evalkit.errors import EvalkitError, exit_with
from evalkit.identity import check_folder, classify, run_dir, run_identity
from evalkit.journal import Journal, fold_shards, open_journals, request_keys
from evalkit.kv.cache import NONE
from evalkit.kv.config import canonical, make_method, method_class
from evalkit.kv.storage import KVStorage, NoStorage, make_storage
from evalkit.results import RunLock, atomic_write, check_writable, config_yaml
from evalkit.summary import announce, next_step, print_table, summarize
from evalkit.task import DataError
from evalkit.team import Ranks, Team

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"
_MODELS: dict[str, tuple] = {}  # one load per process across the jobs of a sweep
log = logging.getLogger("evalkit")
SAYS = {
    "rebuild": "samples.jsonl is missing; rebuilding it from its journal",
    "rescore": "scorer or grading settings changed; re-scoring from its journal",
}


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
    left: int = 0  # requests not journaled yet (0: scoring needs no model)
    storage: KVStorage = field(
        default_factory=NoStorage
    )  # how the run's caches hold K/V (conf/kv/), chosen once here


# --- the plan: everything that can fail before data or a model is loaded ----------------------------------
def plan(cfg: DictConfig, processes: int = 1) -> Plan:
    hydra_choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    checks.check_names(cfg, hydra_choices)
    cfg, method, method_name = resolve_method(cfg, hydra_choices)
    checks.check_run_settings(cfg)
    storage, storage_defaults = resolve_storage(cfg, hydra_choices)
    out = run_dir(
        cfg,
        method_name,
        group_config("method", method_name),
        conf_defaults(cfg),
        storage.name,
        storage_defaults,
    )
    try:
        task_module = importlib.import_module(cfg.task.module)
    except ImportError as e:
        raise ConfigError(f"task {cfg.task.name}: cannot import {cfg.task.module} ({e})") from None
    checks.check_task(cfg, task_module)
    spec = model_spec(cfg.model)
    checks.check_backend(
        cfg, spec, method_name, processes, storage.name
    )  # e.g. a served model: method full, one process, an address, its server's own KV storage
    return Plan(cfg, method, spec, task_module, out, storage=storage)


def resolve_storage(cfg: DictConfig, hydra_choices: dict) -> tuple[KVStorage, DictConfig | None]:
    """(the run's KV storage, made once from `cfg.kv` and handed down; its conf's defaults, for the folder
    name). A config without `kv` holds K/V in the model dtype."""
    if cfg.get("kv") is None:
        return NONE, None
    storage = make_storage(cfg.kv)
    name = hydra_choices.get("kv") or storage.name
    return storage, (group_config("kv", name) if name in choices("kv") else None)


def resolve_method(cfg: DictConfig, hydra_choices: dict) -> tuple[DictConfig, object, str]:
    """(the config with its method settings in their one spelling, the method, its conf name)."""
    cls = method_class(cfg.method._target_)
    if not cls.budget_applies and cfg.method.get("budget") is not None:
        # a sweep lists `full` beside compressed methods: its budgets all name the one uncompressed run
        log.info("%s keeps every entry: budget=%s does not apply", cls.name, cfg.method.budget)
        cfg = OmegaConf.merge(cfg, {"method": {"budget": None}})
    method = make_method(cfg.method)
    # the conf's name (SnapKVDecode: snapkv_decode; Ringed: its scorer's, expected_attention_ring)
    method_name = hydra_choices.get("method") or method.describe()["name"]
    defaults = group_config("method", method_name)
    if (same := canonical(cfg.method, method, defaults)) is not cfg.method:  # e.g. recent=32 at budget 256
        cfg = OmegaConf.merge(cfg, {"method": same})
    return cfg, method, method_name


def conf_defaults(cfg: DictConfig) -> DictConfig | None:
    """The config `task=<task> model=<model>` composes to with nothing else set: what a run's folder name is
    measured against (None for a task or model that is not a conf of conf/)."""
    if cfg.task.name not in choices("task") or cfg.model.name not in choices("model"):
        return None
    return compose(overrides=[f"task={cfg.task.name}", f"model={cfg.model.name}"])


def plans_for(cfg: DictConfig, team: Team | None = None) -> list[Plan]:
    """One plan per budget: `method.budget=[64,128,256]` evaluates several budgets with one prefill each
    prompt (`team`: the run's processes, one by default)."""
    processes = team.world if team is not None else 1
    budgets = cfg.method.get("budget")
    if not isinstance(budgets, ListConfig):
        return [plan(cfg, processes)]
    if not budgets:
        raise ConfigError("method.budget: an empty list names no run; give one budget or a non-empty list")
    out: dict[Path, Plan] = {}
    for b in budgets:
        q = plan(OmegaConf.merge(cfg, {"method": {"budget": b}}), processes)
        out.setdefault(q.out, q)  # `full` ignores budgets: one run
    return list(out.values())


def read_model(plans: list[Plan], team: Team | None = None) -> int:
    """The model's context, from its config (no weights), with the plans checked against that config."""
    from evalkit.sources import context_length, model_config, resolve_source

    spec = plans[0].spec
    model_cfg = model_config(spec, resolve_source(spec))
    context = context_length(spec, model_cfg)
    checks.check_model(plans, model_cfg, context, team.tp if team is not None else 1)
    return context


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
    journal = Journal(path, run=run_identity(p.cfg))  # a replica shard is stamped with (and checked for) it
    for number, reason in journal.rejected:
        print(
            f"evalkit: {journal.path} line {number} set aside ({reason}) into {journal.path.name}.rejected; "
            "that request runs again",
            file=sys.stderr,
        )
    return journal


def open_runs(plans: list[Plan], loaded, team: Team) -> None:
    """Each plan's state (from the writer's reading of its folder) and journal, and what it still needs."""
    writer = team.writer
    states = team.from_writer([classify(p, loaded) for p in plans] if writer else None)
    for p, state in zip(plans, states):
        p.state = state
    open_journals(plans, open_journal, team)  # each replica's shard; TP peers: their root's records
    for p in plans:
        if p.state != "done":
            keys = request_keys(p.cfg.task.lm_eval_task, len(evaluated(p, loaded)), int(p.cfg.task.repeats))
            p.left = sum(k not in p.journal.records for k in keys)
    if writer:
        announce(plans, loaded, len(evaluated(plans[0], loaded)), {p.out: p.left for p in plans})


# --- generation ------------------------------------------------------------------------------------------
def get_model(spec, team: Team | None = None):
    from evalkit.loading import load_model

    key = repr(spec)
    if key not in _MODELS:
        _MODELS.clear()  # one model resident at a time
        _MODELS[key] = load_model(spec, team)
    return _MODELS[key]


def generate(plans: list[Plan], load_kwargs: dict, context: int, team: Team) -> None:
    """Fill the journals: lm-eval builds the requests, the model's LM generates what is not journaled yet.
    Every budget after the first replays the first's prefills. The LM is made (the weights loaded, or the
    server checked) before any config.yaml is written."""
    p = plans[0]
    # get_model looked up now: tests patch it
    lm = p.spec.make_lm(plans, context, lambda spec: get_model(spec, team), team)
    for q in plans if team.writer else ():
        atomic_write(q.out / "config.yaml", config_yaml(q.cfg))
    lm_eval_generate(p, lm, load_kwargs)


def lm_eval_generate(p: Plan, lm, load_kwargs: dict) -> None:
    """Run the task's lm-eval YAML with the evalkit model in lm-eval's predict-only mode: lm-eval builds and
    issues the requests (templates, generation settings, repeats); scoring happens afterwards, from the
    journal. The task's metadata is what its `load` got, and the run's query_aware: the task's hooks put
    where each question starts on its doc (evalkit.task.lm_eval_hooks)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager, get_task_dict

    metadata = load_kwargs if p.cfg.get("query_aware", True) else {**load_kwargs, "query_aware": False}
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata)
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
def score_all(plans: list[Plan], loaded, setup: dict | None, context: int, team: Team) -> None:
    """The writer, once every replica has journaled its share: each unfinished run's shards folded into its
    journal, then scored from it."""
    from evalkit.sources import tokenizer_path
    from evalkit.task import get_tokenizer

    for p in plans:
        if p.state == "done":
            continue
        fold_shards(p.journal)
        if p.state in SAYS:
            print(f"evalkit: {p.out}: {SAYS[p.state]}")
        score(p, loaded, setup, context, get_tokenizer(tokenizer_path(p.spec)), team)


def score(p: Plan, loaded, setup: dict | None, context: int, tokenizer, team: Team) -> None:
    """Score every sample from the journal with the task's scorer; write samples.jsonl and metrics.json."""
    from evalkit.scoring import score_journal
    from evalkit.sources import model_config, resolve_source

    samples, task, k = evaluated(p, loaded), p.cfg.task.lm_eval_task, int(p.cfg.task.repeats)
    rows = score_journal(p.task_module, samples, p.journal, task, k, tokenizer)
    keys = request_keys(task, len(samples), k)
    now = sum(key in p.journal.generated_keys for key in keys)  # what this process really generated
    counts = {"from_journal": len(keys) - now, "generated_now": now}  # resumed, or a re-score
    check_scored_headline(p, rows)
    metrics = summarize(p, loaded, rows, model_config(p.spec, resolve_source(p.spec)), context, counts)
    metrics.task_setup = setup
    metrics.extra.update(p.spec.extra_metrics(p.out))
    metrics.extra["parallel"] = team.provenance()  # the layout: provenance, not identity
    atomic_write(p.out / "config.yaml", config_yaml(p.cfg))  # the grading settings now in force
    atomic_write(p.out / "samples.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    metrics_record.write(p.out / "metrics.json", metrics)


def check_scored_headline(p: Plan, rows: list[dict]) -> None:
    """A breakdown headline (`score/<subset>`) that no sample scored: known only once the samples are scored
    (the metric itself was checked before loading); the journal holds every generation, so the corrected
    command re-scores without the model."""
    names = {k for r in rows for k in r["scores"]}
    if rows and p.cfg.task.headline not in names:
        top = sorted(k for k in names if "/" not in k)  # breakdowns (`score/vt`) are valid too, not listed
        raise ConfigError(
            f"task.headline={p.cfg.task.headline!r} names no metric of task {p.cfg.task.name} (its metrics: "
            f"{', '.join(top)}, and their '<metric>/<subset>' breakdowns). The generations are journaled: "
            "run again with a valid task.headline to score"
        )


def finish(plans: list[Plan], team: Team) -> list[dict]:
    """Each run's table, and the next step to a verdict."""
    out = []
    for p in plans:
        if p.state == "done":
            print(f"evalkit: {p.out} is complete; skipping (delete it to rerun)")
        out.append(json.loads((p.out / "metrics.json").read_text()))
        print_table(metrics_record.Metrics.from_json(out[-1]))
    next_step(plans, team.world)
    return out


# --- the recipe ------------------------------------------------------------------------------------------
def run(cfg: DictConfig, team: Team | None = None) -> list[dict]:
    from evalkit.sources import tokenizer_path

    team = team or Team.single()
    plans = plans_for(cfg, team)  # every setting checked: no data, no model
    writer = team.writer  # one writer: only rank 0 reads or writes the run folders
    for p in plans if writer else ():
        check_folder(p.out, p.cfg)
        check_writable(p.out)
    context = read_model(plans, team)  # its config checked against the plans: still no weights
    loaded, load_kwargs = load_data(plans[0], tokenizer_path(plans[0].spec), context)
    setup = configure_task(plans[0]) if writer else None
    locks = [RunLock(p.out) for p in plans] if writer else []
    try:
        for lock in locks:
            lock.acquire()
        open_runs(plans, loaded, team)
        if todo := [p for p in plans if p.left]:
            generate(todo, load_kwargs, context, team)
        team.barrier()  # every replica has journaled its share
        team.gather_kv()
        # the last collective: every rank leaves the group together, so no rank's gloo teardown (at its exit)
        # overlaps a peer still in the group (a TP rank aborted so in CI, taking the writer with it)
        team.leave()
        if writer:
            score_all(plans, loaded, setup, context, team)
    finally:
        for p in plans:
            if p.journal is not None:
                p.journal.close()
        for lock in locks:
            lock.release()
    return finish(plans, team) if writer else []


@hydra.main(config_path=str(CONF_DIR), config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # lm-eval warns per breakdown key ("no aggregation defined"): evalkit aggregates those itself
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    team = Team.single()
    try:
        team = Team.start(Ranks.from_config(cfg))  # ranks that do not fit NPROC fail here, before any load
        run(cfg, team)
    except EvalkitError as e:
        exit_with(f"evalkit{team.rank_tag()}", e)


if __name__ == "__main__":
    main()
