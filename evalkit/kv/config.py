"""A KV method from its conf (`conf/method/*.yaml`): `_target_` names the class, every setting is
type-checked, and invalid settings raise `ConfigError` naming the setting and the rule, before any model
loads."""

from __future__ import annotations

from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from evalkit.config import ConfigError, group_config, registered_class
from evalkit.kv.methods import KVMethod


def method_class(target: str):
    """The class `_target_` names; it may only be an evalkit KV method (`_target_` is a registry, not an
    eval)."""
    return registered_class(target, "evalkit.kv", KVMethod, "method", "KV method")


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
    """Each method setting has its field's type (`recent=../../y` is an error here, not a comparison
    crash)."""
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
        if isinstance(value, dict) and "_target_" in value:  # a nested object (`Ringed.scorer`)
            ok = _targets(value["_target_"], allowed)
        elif isinstance(value, bool) and bool not in allowed:
            ok = False
        else:
            ok = any(value is None if t is type(None) else isinstance(value, t) for t in allowed)
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ConfigError(f"method {cls.name}: {key} must be {names}, got {value!r}")


def _targets(target, allowed: tuple) -> bool:
    """Whether `target` names an evalkit.kv class of one of the `allowed` types."""
    try:
        cls = get_class(target) if isinstance(target, str) and target.startswith("evalkit.kv.") else None
    except Exception:  # hydra reports a missing class with a bare Exception
        return False
    return isinstance(cls, type) and any(isinstance(t, type) and issubclass(cls, t) for t in allowed)


def canonical(method_cfg: DictConfig, method: KVMethod, defaults: DictConfig) -> DictConfig:
    """`method_cfg` with each setting that makes the same method as its conf default written as that default
    (`recent=32` at budget 256 and window 32, where the default `recent: null` resolves to budget // 8 = 32):
    one configuration gets one run folder, one config.yaml and one identity, however it was spelled. Each
    setting is tried with the others as given (they interact: the default recent is at least the window)."""
    out = method_cfg
    for key in [k for k in method_cfg if k not in ("_target_", "budget") and k in defaults]:
        if out[key] == defaults[key]:
            continue
        trial = OmegaConf.merge(out, {key: defaults[key]})
        try:
            same = make_method(trial) == method  # every field as made, derived ones included
        except ConfigError:  # the default does not hold with the other settings: this one is needed
            same = False
        if same:
            out = trial
    return out
