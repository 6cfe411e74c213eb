"""Command-line overrides checked before Hydra composes: a setting the chosen conf lacks is named with the
valid settings, instead of Hydra's "use +method.window=16" hint (which evalkit would then refuse anyway)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from evalkit.config import CONF_DIR, ConfigError, choices, compose
from evalkit.kv.config import method_class

GROUPS = ("model", "task", "method", "kv")


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


def check_overrides(overrides: list[str], config_name: str = "eval") -> None:
    """A `group.key=value` (or top-level `key=value`) override naming a setting the chosen conf lacks raises
    ConfigError listing the valid settings (of the config `config_name`: `serve` adds the server's block).
    Group choices Hydra itself rejects (`task=nope`), `+`/`~` overrides, `hydra*` keys, nested group choices
    (`hydra/launcher=slurm`) and groups chosen by a sweep (several values) are left to Hydra and the
    runner."""
    pairs = [o.split("=", 1) for o in overrides if "=" in o and not o.startswith(("-", "+", "~", "hydra"))]
    pairs = [(k, v) for k, v in pairs if "/" not in k and "@" not in k]  # `hydra/launcher=...`: group choices
    chosen = {k: v for k, v in pairs if k in (*GROUPS, "sweep")}
    if not any("." in k or k not in chosen for k, _ in pairs):
        return  # only group choices: nothing to look up
    single = {g: v for g, v in chosen.items() if g in GROUPS and v in choices(g)}
    cfg = compose(config_name, overrides=[f"{g}={v}" for g, v in single.items()])
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
        block = OmegaConf.select(cfg, group, default=None)
        if group not in GROUPS and isinstance(block, DictConfig):  # a block of settings: parallel, serve
            known = ", ".join(sorted(_leaves(block)))
            raise ConfigError(f"unknown setting {key!r}; {group} settings: {known}")
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
    defaults = OmegaConf.load(CONF_DIR / "eval.yaml").defaults
    return next(d[group] for d in defaults if isinstance(d, DictConfig) and group in d)
