"""The entry point: `python -m evalkit [overrides]` evaluates one (model, task, method, budget) with lm-eval.

Reads top to bottom: validate the config (no model yet), skip if this run is already done, load data and
model, generate through lm-eval with the evalkit model (journaled: a killed run resumes), score, aggregate,
write `samples.jsonl` and `metrics.json`, print a table.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class
from omegaconf import DictConfig, ListConfig, OmegaConf

from evalkit.config import CONF_DIR, ConfigError, check_choice, group_config, make_method, model_spec
from evalkit.models import ModelLoadError
from evalkit.results import Journal, atomic_write, config_yaml, run_dir, write_json
from evalkit.summary import print_table, summarize

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"
_MODELS: dict[str, tuple] = {}  # one load per process across the jobs of a sweep
log = logging.getLogger("evalkit")


class DataError(RuntimeError):
    """The task's data could not be loaded (missing file, bad source); the message says which and how to fix."""


@dataclass
class Plan:
    cfg: DictConfig
    method: object
    spec: object
    task_module: object
    out: Path


def plan(cfg: DictConfig) -> Plan:
    """Everything that can fail on a bad config, before any model or data is loaded."""
    choices = HydraConfig.get().runtime.choices if HydraConfig.initialized() else {}
    for group in ("model", "task", "method"):
        if group in choices:
            check_choice(group, choices[group])
    method_name = choices.get("method") or cfg.method._target_.rsplit(".", 1)[-1].lower()
    if (
        not getattr(get_class(cfg.method._target_), "budget_applies", True)
        and cfg.method.get("budget") is not None
    ):
        # a sweep lists `full` beside compressed methods: its budgets all name the one uncompressed run
        log.info("%s keeps every entry: budget=%s does not apply", method_name, cfg.method.budget)
        cfg = OmegaConf.merge(cfg, {"method": {"budget": None}})
    method = make_method(cfg.method)
    for key, value, ok, rule in (
        ("batch_size", cfg.get("batch_size"), lambda v: isinstance(v, int) and v >= 1, "a positive integer"),
        ("limit", cfg.get("limit"), lambda v: v is None or isinstance(v, int) and v >= 1, "null or a positive integer"),
        ("seed", cfg.get("seed"), lambda v: isinstance(v, int), "an integer"),
        ("task.repeats", cfg.task.get("repeats"), lambda v: isinstance(v, int) and v >= 1, "a positive integer"),
    ):  # fmt: skip
        if not ok(value):
            raise ConfigError(f"{key} must be {rule}, got {value!r}")
    out = run_dir(cfg, method_name, group_config("method", method_name))
    try:
        task_module = importlib.import_module(cfg.task.module)
    except ImportError as e:
        raise ConfigError(f"task {cfg.task.name}: cannot import {cfg.task.module} ({e})") from None
    if not isinstance(getattr(task_module, "VERSION", None), int):
        raise ConfigError(
            f"task module {cfg.task.module} must define VERSION (an int, bumped when prompts change)"
        )
    return Plan(cfg, method, model_spec(cfg.model), task_module, out)


def check_resume(p: Plan) -> bool:
    """True if this run finished already. A folder holding another config is refused, never mixed."""
    saved = p.out / "config.yaml"
    want = config_yaml(p.cfg)
    if saved.exists() and _without_results_dir(saved.read_text()) != _without_results_dir(want):
        raise ConfigError(
            f"{p.out} holds a run with a different config (see its config.yaml). "
            "Use another results_dir, or delete that folder to redo it."
        )
    return (p.out / "metrics.json").exists()


def _without_results_dir(config_text: str) -> str:
    """Where the results live is not part of what was run: a moved results folder still resumes."""
    return "\n".join(line for line in config_text.splitlines() if not line.startswith("results_dir:"))


def get_model(spec):
    from evalkit.models import load_model

    key = repr(spec)
    if key not in _MODELS:
        _MODELS.clear()  # one model resident at a time
        _MODELS[key] = load_model(spec)
    return _MODELS[key]


def load_data(p: Plan, tokenizer_source: str, context: int):
    from evalkit.task import load_task

    kwargs = {**OmegaConf.to_container(p.cfg.task.load, resolve=True), "tokenizer": tokenizer_source}
    kwargs["model_context"] = context
    if p.spec.prompt_format:  # a task with its own template for this model family renders with it
        kwargs["prompt_format"] = p.spec.prompt_format
    try:
        return load_task(p.cfg.task.name, p.task_module.load, **kwargs), kwargs
    except (LookupError, ValueError, OSError, RuntimeError) as e:  # bad data or data options
        raise DataError(f"task {p.cfg.task.name}: {e}") from None


def evaluate(plans: list[Plan]) -> list[tuple[dict, list[dict]]]:
    """Evaluate one or more budgets of one method; every budget after the first replays the first's prefills."""
    from evalkit.lm import EvalkitLM
    from evalkit.models import context_length, model_config, resolve_source, tokenizer_path

    p = plans[0]
    source = tokenizer_path(p.spec)
    context = context_length(p.spec, model_config(p.spec, resolve_source(p.spec)))
    loaded, load_kwargs = load_data(p, source, context)  # data problems surface before the model loads
    setup = configure_task(p)
    model, tokenizer = get_model(p.spec)
    for q in plans:  # written once data and model are ready: a failed start leaves no folder behind
        atomic_write(q.out / "config.yaml", config_yaml(q.cfg))
    journals = [Journal(q.out / "generations.jsonl") for q in plans]
    common = dict(model=p.spec, hf_model=model, tokenizer=tokenizer, batch_size=p.cfg.batch_size,
                  max_length=context, seed=p.cfg.seed)  # fmt: skip
    also = [(q.method, j) for q, j in zip(plans[1:], journals[1:])]
    results = []
    for i, (q, journal) in enumerate(zip(plans, journals)):
        # the first pass generates every budget (one prefill each prompt); later passes only score their journals
        lm = EvalkitLM(method=q.method, journal=journal, also=also if i == 0 else (), **common)
        logged = lm_eval_samples(q, lm, load_kwargs)
        metrics, samples = summarize(q, loaded, logged, journal, model)
        if setup is not None:
            metrics["task_setup"] = setup
        results.append((metrics, samples))
    for journal in journals:
        journal.close()
    return results


def lm_eval_samples(p: Plan, lm, load_kwargs: dict) -> list[dict]:
    """Run the task's lm-eval YAML with evalkit's model; lm-eval's logged per-sample results."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=load_kwargs)
    tasks = get_task_dict([p.cfg.task.lm_eval_task], manager)
    for task in tasks.values():
        task.config.repeats = int(p.cfg.task.repeats)
    result = simple_evaluate(
        model=lm, tasks=list(tasks.values()), limit=p.cfg.limit, log_samples=True, bootstrap_iters=0,
        gen_kwargs=OmegaConf.to_container(p.cfg.task.generation) or None, task_manager=manager,
    )  # fmt: skip
    return result["samples"][p.cfg.task.lm_eval_task]


def configure_task(p: Plan) -> dict | None:
    """A task module's optional `configure(**task.setup)` (e.g. the code sandbox), run before generating;
    what it returns (settings, detected isolation) is recorded in metrics.json."""
    configure = getattr(p.task_module, "configure", None)
    if configure is None:
        return None
    try:
        return configure(**OmegaConf.to_container(p.cfg.task.get("setup") or {}, resolve=True))
    except (ValueError, RuntimeError, OSError) as e:
        raise ConfigError(f"task {p.cfg.task.name} setup: {e}") from None


def plans_for(cfg: DictConfig) -> list[Plan]:
    """One plan per budget: `method.budget=[64,128,256]` evaluates several budgets with one prefill each prompt."""
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


def run(cfg: DictConfig) -> list[dict]:
    plans = plans_for(cfg)
    todo = [p for p in plans if not check_resume(p)]
    if todo:
        for p, (metrics, samples) in zip(todo, evaluate(todo)):
            atomic_write(p.out / "samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
            write_json(p.out / "metrics.json", metrics)
    all_metrics = []
    for p in plans:
        if p not in todo:
            print(f"evalkit: {p.out} is complete; skipping (delete it to rerun)")
        all_metrics.append(json.loads((p.out / "metrics.json").read_text()))
        print_table(all_metrics[-1])
    return all_metrics


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # lm-eval warns per breakdown key ("no aggregation defined"): evalkit aggregates those itself
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    try:
        run(cfg)
    except (ConfigError, ModelLoadError, DataError) as e:
        print(f"evalkit: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
