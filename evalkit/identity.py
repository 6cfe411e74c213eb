"""What a run is: which settings count for its generations and for its scoring, the hashes that tell two
configurations apart (`short_hash`: every identity and hashed folder-name part), the run folder's path (a pure
function of the config), and what a run folder's state means for a new invocation (new / rescore / done /
refuse).

The runner records the hashes in metrics.json (`identity`); the report pairs runs on them and derives them
with the same recipe for a metrics.json written before they were recorded (evalkit.report.runs).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from evalkit.journal import task_id

# Settings that never change a generation: where results live, how a task grades (the code sandbox's limits),
# which score a table shows first, and how a served model is reached (its address, concurrency, retries: the
# server's own identity is checked separately, evalkit.served). A change of the grading ones re-scores a
# finished run from its journal.
NOT_GENERATION = (
    "results_dir",
    "batch_size",  # continuous batching decodes every request as it would alone (the engine's tests)
    "task.setup",
    "task.headline",
    "model.base_url",
    "model.num_concurrent",
    "model.max_retries",
    "model.timeout_s",
    "model.reference_for",  # which in-process model a served full run is the reference of (the report's)
    "parallel",  # the process layout: outputs are equal under any layout (CPU, float64/float32 tests)
)

# Settings added after runs already existed, with the value that does what those runs did: a saved config that
# lacks one is read with it, so upgrading evalkit never orphans a finished or half-done run folder.
# `kv` (the KV storage, conf/kv/): runs before it held K/V in the model dtype, `kv=none`.
NO_STORAGE = {"_target_": "evalkit.kv.storage.NoStorage"}
ADDED_SETTINGS = {"compile": False, "query_aware": True, "multi_question": False, "kv": NO_STORAGE}


def saved_config(text: str) -> DictConfig:
    """A run folder's config.yaml, completed with ADDED_SETTINGS it predates."""
    cfg = OmegaConf.create(text)
    for key, value in ADDED_SETTINGS.items():
        if OmegaConf.select(cfg, key, default="<missing>") == "<missing>":
            OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def generation_settings(cfg: DictConfig | dict) -> dict:
    """The resolved config without the keys in NOT_GENERATION: what two runs must share to share a journal."""
    out = copy.deepcopy(cfg) if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=True)
    for key in NOT_GENERATION:
        *parents, leaf = key.split(".")
        node = out
        for name in parents:
            node = node.get(name) or {}
        node.pop(leaf, None)
    if out.get("kv") == NO_STORAGE:  # the model dtype: identities stay those of runs before `kv` existed
        out.pop("kv")
    task = out.get("task")
    if isinstance(task, dict) and isinstance(task.get("lm_eval_task"), str):
        task["lm_eval_task"] = task_id(task["lm_eval_task"])  # the namespace is no generation setting
    return out


def generation_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(generation_settings(cfg)), sort_keys=True)


def run_identity(cfg: DictConfig | dict) -> str:
    """What a run's journal shards are stamped with (evalkit.journal): every setting its generations depend
    on, the method included, so a shard of another configuration is never adopted."""
    return short_hash(generation_settings(cfg))


# --- the hashes ---------------------------------------------------------------------------------------------
def short_hash(obj) -> str:
    """16 hex digits of sha256 over canonical JSON: identities of configurations and folder-name parts."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def generation_fields(cfg: DictConfig | dict, task_version, data_hash) -> dict:
    """What the generation identity hashes: the generation settings but the method and the KV storage (model,
    task and its load, generation and repeats, limit, seed, batch size), the task version and the data
    hash."""
    settings = generation_settings(cfg)
    settings.pop("method", None)
    settings.pop("kv", None)  # the configuration's other axis: runs of two storages are paired as methods
    for (
        key,
        default,
    ) in ADDED_SETTINGS.items():  # a setting at the value older runs had: same identity as theirs
        if "." not in key and settings.get(key) == default:
            settings.pop(key)
    return {**settings, "task_version": task_version, "data_hash": data_hash}


def scoring_fields(task_cfg: DictConfig | dict, scorer_version) -> dict:
    """What the scoring identity hashes: what a finished run's metrics depend on beyond its generations (the
    scorer's version, the grading settings `task.setup`, the headline metric). A change re-scores the run."""
    task = OmegaConf.to_container(task_cfg, resolve=True) if OmegaConf.is_config(task_cfg) else task_cfg
    return {"scorer_version": scorer_version, "setup": task.get("setup"), "headline": task.get("headline")}


def hashes(cfg: DictConfig | dict, task_version, data_hash, scorer_version) -> dict:
    """{generation, method, scoring} of a resolved config: two runs share a leaderboard cell or are paired
    only when the identities that matter are equal."""
    task = (cfg.get("task") if isinstance(cfg, dict) else cfg.task) or {}
    return {
        "generation": short_hash(generation_fields(cfg, task_version, data_hash)),
        "method": configuration_hash(generation_settings(cfg)),
        "scoring": short_hash(scoring_fields(task, scorer_version)),
    }


def configuration_hash(settings: dict) -> str:
    """The configuration = method x budget x KV storage: the method's settings alone for `kv=none` (the hash
    runs had before the storage axis), with the storage's beside them otherwise (two storages never share a
    leaderboard cell)."""
    if "kv" not in settings:
        return short_hash(settings.get("method"))
    return short_hash({"method": settings.get("method"), "kv": settings["kv"]})


def scorer_code(module) -> str:
    """A digest of the task package's Python source (tasks/<name>/*.py: the scorer, its graders and the
    sandboxed driver). An edit that forgets to bump SCORER_VERSION still re-scores finished runs from their
    journals, never keeps stale scores; an edit of the prompt code is then caught by the journal's prompt
    hashes."""
    files = sorted(Path(module.__file__).resolve().parent.glob("*.py"))
    return short_hash({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files})


def scoring_identity(plan) -> str:
    """The runner's scoring identity: the scoring fields and the scorer's code (the report, which has only the
    recorded config, derives its scoring hashes without the code, alike for every run it compares)."""
    fields = scoring_fields(plan.cfg.task, plan.task_module.SCORER_VERSION)
    return short_hash({**fields, "code": scorer_code(plan.task_module)})


def identity(plan, loaded) -> dict:
    """The hashes of a planned run on its loaded data (recorded in metrics.json)."""
    module = plan.task_module
    return hashes(plan.cfg, module.VERSION, loaded.data_hash, module.SCORER_VERSION) | {
        "scoring": scoring_identity(plan)
    }


# --- the run folder's path ----------------------------------------------------------------------------------
def budget_tag(method_cfg: DictConfig, defaults: DictConfig) -> str:
    """`<budget>` plus `-<key><value>` for every method setting changed from its conf default."""
    tag = "none" if method_cfg.get("budget") is None else str(method_cfg.budget)
    for key in sorted(k for k in method_cfg if k not in ("_target_", "budget")):
        if isinstance(method_cfg[key], DictConfig):  # a nested object (`Ringed.scorer`): its changed leaves
            now, was = (
                _leaves(OmegaConf.to_container(n or {}, resolve=True))
                for n in (method_cfg[key], defaults.get(key))
            )
            tag += "".join(
                f"-{key}.{k}{_value(v)}" for k, v in sorted(now.items()) if v != was.get(k, object())
            )
        elif method_cfg[key] != defaults.get(key):
            tag += f"-{key}{method_cfg[key]}"
    return tag


# Task and model keys that name the conf rather than set it, or never change a generation
# (NOT_GENERATION holds the same grading/serving keys); the run settings that change what is
# generated (batch_size and compile leave outputs equal, results_dir is where).
NAMING_KEYS = {"name", "module", "lm_eval_task", "setup", "headline"}
SERVING_KEYS = {"base_url", "num_concurrent", "max_retries", "timeout_s", "reference_for"}
RUN_KEYS = ("limit", "seed", "query_aware", "multi_question")
_SAFE = re.compile(r"[A-Za-z0-9_.+]+")


def _leaves(node, prefix: str = "") -> dict:
    out = {}
    for key, value in (node or {}).items():
        if isinstance(value, dict) and value:
            out |= _leaves(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _value(v) -> str:
    """A setting's value as a folder-name part: lists joined by '+', anything not name-safe (a path)
    hashed."""
    if isinstance(v, list | tuple):
        return "+".join(_value(x) for x in v)
    text = "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    return text if _SAFE.fullmatch(text) else "h" + short_hash(text)[:8]


def settings_tag(node: dict, defaults: dict, skip: set = frozenset()) -> str:
    """`-<key><value>` for every setting that differs from its conf default (`load.` left out of the key)."""
    now, was = _leaves(node), _leaves(defaults)
    tag = ""
    for key in sorted(now):
        if key.split(".")[0] in skip or now[key] == was.get(key, object()):
            continue
        tag += f"-{key.removeprefix('load.')}{_value(now[key])}"
    return tag


def run_dir(
    cfg: DictConfig,
    method_name: str,
    method_defaults: DictConfig,
    defaults: DictConfig | None,
    storage_name: str = "none",
    storage_defaults: DictConfig | None = None,
) -> Path:
    """The output path: a pure function of the config (no timestamps, no de-duplication suffixes). Settings
    changed from the confs' defaults join the folder names, so a 6-problem run never meets a 24-problem one:
    `runs/ruler-lengths1024-n1/<model>/snapstream/256-recent64`. `defaults`: the composed default config of
    this task and model (None: a conf evalkit does not list; its settings are then the defaults). A KV
    storage other than `none` joins the method's folder (`snapstream+int4/256`, its changed settings the
    tag: `-residual64`); `none` keeps the path runs had before the storage axis."""
    task, model = cfg.task.name, cfg.model.name
    if defaults is not None:
        now = OmegaConf.to_container(cfg, resolve=True)
        was = OmegaConf.to_container(defaults, resolve=True)
        run = {k: now.get(k) for k in RUN_KEYS}
        task += settings_tag(now["task"], was["task"], NAMING_KEYS) + settings_tag(
            run, {k: was.get(k) for k in RUN_KEYS}
        )
        model += settings_tag(now["model"], was["model"], NAMING_KEYS | SERVING_KEYS)
    tag = budget_tag(cfg.method, method_defaults)
    if storage_name != "none":
        method_name += f"+{storage_name}"
        now = OmegaConf.to_container(cfg.kv, resolve=True)
        was = OmegaConf.to_container(storage_defaults, resolve=True) if storage_defaults is not None else now
        tag += settings_tag(now, was)
    return Path(cfg.results_dir) / "runs" / task / model / method_name / tag


# --- what a run folder's state means ------------------------------------------------------------------------
def check_folder(out: Path, cfg: DictConfig) -> None:
    """A folder holding a run of another configuration is refused, never mixed. Settings that only grade or
    score (`task.setup`, the headline) may change: the run is then re-scored from its journal."""
    from evalkit.config import ConfigError

    saved = out / "config.yaml"
    if not saved.exists():
        return
    old = _saved(saved)
    if generation_yaml(old) != generation_yaml(cfg):
        keys = differing(generation_settings(old), generation_settings(cfg))
        raise ConfigError(
            f"{out} holds a run with a different config: {'; '.join(keys[:8])}"
            f"{f' (and {len(keys) - 8} more)' if len(keys) > 8 else ''}. "
            "Use another results_dir, or delete that folder to redo it."
        )


def differing(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` for every leaf setting that differs between two resolved configs."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, "<unset>"), new.get(key, "<unset>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += differing(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} there, {b!r} now")
    return out


def _saved(path: Path) -> DictConfig:
    """A run folder's config.yaml; one evalkit did not write (damaged, edited into garbage) is refused by
    name."""
    from evalkit.config import ConfigError

    try:
        cfg = saved_config(path.read_text(encoding="utf-8"))
    except Exception as e:  # noqa: BLE001 (YAML, decoding and OmegaConf errors alike: the file is not ours)
        raise ConfigError(
            f"{path} is not a config evalkit wrote ({type(e).__name__}); restore it, or delete the folder to "
            "redo the run"
        ) from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(
            f"{path} is not a config evalkit wrote; restore it, or delete the folder to redo the run"
        )
    return cfg


def classify(plan, loaded) -> str:
    """done (skip), rescore (metrics from another scorer or grading settings), rebuild (finished, but its
    samples.jsonl is gone: scored again from the journal) or new (no metrics yet). Changed data under a
    finished run is an error (DataError), never a skip."""
    from evalkit import metrics
    from evalkit.task import DataError

    path = plan.out / "metrics.json"
    if not path.exists():
        return "new"
    try:
        old = metrics.load(path, strict=False)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        return "rescore"  # a damaged metrics.json is rebuilt from the journal
    recorded = old.data_hash
    if recorded is not None and recorded != loaded.data_hash:
        raise DataError(
            f"{plan.out} was scored on data {recorded[:12]}..., but {loaded.source} now hashes to "
            f"{loaded.data_hash[:12]}...: its generations answer other prompts. Restore the data, or delete "
            "the folder to run again."
        )
    if (old.identity or {}).get("scoring") != scoring_identity(plan):
        return "rescore"
    return "done" if (plan.out / "samples.jsonl").is_file() else "rebuild"
