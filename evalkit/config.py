"""Config helpers: where `conf/` lives, composing it outside `@hydra.main`, and building objects from it.

`_target_` is the only registry: `ls conf/method` is the method catalogue, `ls conf/model` the model list.
Unknown names fail here with the list of valid choices, before any model loads. A KV method is built from its
conf by evalkit.kv.config (this module knows no method: the tasks' helpers import it).
"""

from __future__ import annotations

from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from evalkit.errors import EvalkitError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


class ConfigError(EvalkitError, ValueError):
    """Bad configuration: the message names the setting, the rule and, for names, the valid choices."""


def choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_choice(group: str, name: str) -> None:
    if name not in choices(group):
        raise ConfigError(f"unknown {group} {name!r}; valid choices: {', '.join(choices(group))}")


def compose(config_name: str = "eval", overrides: list[str] | None = None) -> DictConfig:
    """The resolved config as `python -m evalkit <overrides>` would see it (single run). Inside a Hydra app
    (`python -m evalkit`, whose search path is this same conf/) Hydra is initialized already: compose
    there."""
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config_name=config_name, overrides=overrides or [])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides or [])


def group_config(group: str, name: str) -> DictConfig:
    check_choice(group, name)
    return OmegaConf.load(CONF_DIR / group / f"{name}.yaml")


def model_spec(name_or_cfg):
    """A `ModelSpec` from a model conf name or an already composed `model` config node."""
    cfg = group_config("model", name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    return instantiate(cfg)


def registered_class(target, package: str, base: type, group: str, what: str) -> type:
    """The class a `<group>._target_` names; it may only be a `base` of `package` (`_target_` is a registry,
    not an eval): a ConfigError otherwise, naming the group's confs."""
    from hydra.utils import get_class

    try:
        prefix = package + "."
        cls = get_class(target) if isinstance(target, str) and target.startswith(prefix) else None
    except Exception:  # hydra reports a missing class with a bare Exception
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ConfigError(
            f"{group}._target_ must name a {what} class in {package} (see conf/{group}/*.yaml), "
            f"got {target!r}"
        )
    return cls
