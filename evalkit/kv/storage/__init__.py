"""KV storage: how a cache holds its entries (`conf/kv/`), the axis beside the method (`conf/method/`).

from evalkit.kv.storage import make_storage
storage = make_storage("int4")            # or make_storage("fp8_e4m3", scale="tensor")
storage.layer_bytes(slots=1024, ring=0, heads=8, key_width=128, value_width=128, model_bits=16)

Kinds: `none` (the model dtype, `base.py`), `fp8_e4m3` / `fp8_e5m2` (`fp8.py`), `int8` / `int4` / `int2`
(KIVI, `kivi.py`); `stored.StoredCache` is the full cache held by a storage (transformers' `generate`).
"""

from hydra.utils import instantiate
from omegaconf import OmegaConf

from evalkit.config import ConfigError, group_config, registered_class
from evalkit.kv.storage.base import KVStorage, NoStorage
from evalkit.kv.storage.fp8 import Fp8Storage
from evalkit.kv.storage.kivi import IntStorage
from evalkit.kv.storage.stored import StoredCache


def storage_class(target) -> type[KVStorage]:
    """The class `_target_` names; it may only be an evalkit KV storage (`_target_` is a registry, not an
    eval)."""
    return registered_class(target, "evalkit.kv.storage", KVStorage, "kv", "KV storage")


def make_storage(name_or_cfg, **overrides) -> KVStorage:
    """A storage from a conf name (`make_storage("int4", residual=64)`) or a composed `kv` node. Invalid
    settings raise `ConfigError` naming the setting and the rule, before any model loads."""
    import dataclasses

    cfg = group_config("kv", name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    cfg = OmegaConf.merge(cfg, overrides)
    cls = storage_class(cfg.get("_target_"))
    fields = {f.name for f in dataclasses.fields(cls)}
    label = name_or_cfg if isinstance(name_or_cfg, str) else cls.__name__
    for key in cfg:
        if key != "_target_" and key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            raise ConfigError(f"kv {label}: unknown setting {key!r}; settings: {known}")
    try:
        return instantiate(cfg)
    except Exception as e:  # hydra wraps the dataclass's ValueError in an InstantiationException
        cause = e.__cause__ or e
        if isinstance(cause, ValueError | TypeError):
            raise ConfigError(str(cause)) from None
        raise


__all__ = [
    "KVStorage",
    "NoStorage",
    "Fp8Storage",
    "IntStorage",
    "StoredCache",
    "make_storage",
    "storage_class",
]
