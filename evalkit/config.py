"""Config helpers: where `conf/` lives, composing it outside `@hydra.main`, and building objects from it.

`_target_` is the only registry: `ls conf/method` is the method catalogue, `ls conf/model` the model list.
Unknown names fail here with the list of valid choices, before any model loads.
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class ConfigError(ValueError):
    """Bad configuration: the message names the setting, the rule and, for names, the valid choices."""


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_choice(group: str, name: str) -> None:
    if name not in choices(group):
        raise ConfigError(f"unknown {group} {name!r}; valid choices: {', '.join(choices(group))}")


def compose(config_name: str = "config", overrides: list[str] | None = None) -> DictConfig:
    """The resolved config as `python -m evalkit <overrides>` would see it (single run)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides or [])


def group_config(group: str, name: str) -> DictConfig:
    check_choice(group, name)
    return OmegaConf.load(CONF_DIR / group / f"{name}.yaml")


def model_spec(name_or_cfg):
    """A `ModelSpec` from a model conf name or an already composed `model` config node."""
    cfg = group_config("model", name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    return instantiate(cfg)


def method_class(target: str):
    """The class `_target_` names; it may only be an evalkit KV method (`_target_` is a registry, not an eval)."""
    from evalkit.kv.methods import KVMethod

    try:
        cls = get_class(target) if isinstance(target, str) and target.startswith("evalkit.kv.") else None
    except Exception:  # hydra reports a missing class with a bare Exception
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, KVMethod)):
        raise ConfigError(
            f"method._target_ must name a KV method class in evalkit.kv (see conf/method/*.yaml), got {target!r}"
        )
    return cls


def make_method(name_or_cfg, **overrides):
    """A KV method from a conf name (`make_method("snapstream", budget=512)`) or a composed `method` node.

    Invalid settings raise `ConfigError` naming the setting and the rule.
    """
    cfg = group_config("method", name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    cfg = OmegaConf.merge(cfg, overrides)
    cls = method_class(cfg.get("_target_"))
    check_types(cls, OmegaConf.to_container(cfg, resolve=True))
    try:
        return instantiate(cfg)
    except Exception as e:  # hydra wraps the dataclass's ValueError in an InstantiationException
        cause = e.__cause__ or e
        if isinstance(cause, ValueError | TypeError):
            raise ConfigError(str(cause)) from None
        raise


def check_types(cls, settings: dict) -> None:
    """Each method setting has its field's type (`recent=../../y` is an error here, not a comparison crash)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key, value in settings.items():
        if key in ("_target_", "budget"):  # budget: each method's own check names the rule (_check_budget)
            continue
        if key not in fields:
            raise ConfigError(
                f"method {cls.name}: unknown setting {key!r}; settings: {', '.join(sorted(fields))}"
            )
        allowed = typing.get_args(hints[key]) or (hints[key],)
        if isinstance(value, bool) and bool not in allowed:
            ok = False
        else:
            ok = any(value is None if t is type(None) else isinstance(value, t) for t in allowed)
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ConfigError(f"method {cls.name}: {key} must be {names}, got {value!r}")


# --- command-line overrides, before Hydra composes ---------------------------------------------------------
# Hydra answers `method.window=16` on a method without `window` with "use +method.window=16", and evalkit then
# refuses the added key: the first message a user sees should be evalkit's, listing what can be set.

GROUPS = ("model", "task", "method")


def _leaves(node, prefix: str = "") -> list[str]:
    """Dotted paths of a config node's settings (`load.n`, `load.lengths`), `_target_` left out."""
    out = []
    for key, value in node.items():
        if key == "_target_":
            continue
        if isinstance(value, DictConfig) and len(value):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def check_overrides(overrides: list[str]) -> None:
    """A `group.key=value` (or top-level `key=value`) override naming a setting the chosen conf lacks raises
    ConfigError listing the valid settings. Group choices Hydra itself rejects (`task=nope`), `+`/`~`
    overrides, `hydra*` keys, nested group choices (`hydra/launcher=slurm`) and groups chosen by a sweep
    (several values) are left to Hydra and the runner."""
    pairs = [o.split("=", 1) for o in overrides if "=" in o and not o.startswith(("-", "+", "~", "hydra"))]
    pairs = [(k, v) for k, v in pairs if "/" not in k and "@" not in k]  # `hydra/launcher=...`: group choices
    chosen = {k: v for k, v in pairs if k in (*GROUPS, "sweep")}
    if not any("." in k or k not in chosen for k, _ in pairs):
        return  # only group choices: nothing to look up
    single = {g: v for g, v in chosen.items() if g in GROUPS and v in choices(g)}
    cfg = compose(overrides=[f"{g}={v}" for g, v in single.items()])
    for key, _ in pairs:
        group, _, path = key.partition(".")
        if key in chosen or OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT:
            continue
        if not path:
            run_settings = sorted(k for k in cfg if k not in (*GROUPS, "sweep"))
            raise ConfigError(
                f"unknown setting {key!r}; run settings: {', '.join(run_settings)}; "
                f"config groups: {', '.join((*GROUPS, 'sweep'))}"
            )
        if group not in GROUPS or (group not in single and (group in chosen or "sweep" in chosen)):
            continue  # a bad or multi-valued choice is Hydra's to name; a sweep may choose another conf
        name = single.get(group) or _default_choice(group)
        head = f"method {method_class(cfg.method._target_).name}" if group == "method" else f"{group} {name}"
        raise ConfigError(
            f"{head}: unknown setting {path!r}; settings: {', '.join(sorted(_leaves(cfg[group])))} "
            f"(conf/{group}/{name}.yaml)"
        )


_ABSENT = object()


def _default_choice(group: str) -> str:
    defaults = OmegaConf.load(CONF_DIR / "config.yaml").defaults
    return next(d[group] for d in defaults if isinstance(d, DictConfig) and group in d)
