"""Make `lm_eval --model evalkit` work: register evalkit's model with lm-eval when lm-eval loads its registry.

lm-eval 0.4 has no plugin discovery for models, so `make setup` writes `evalkit-lm-eval.pth` into the venv,
whose one line imports this module at interpreter start. It costs nothing until lm-eval itself is imported:
only then (an import hook on `lm_eval.api.registry`) is "evalkit" registered, lazily, as `evalkit.lm:EvalkitLM`,
beside lm-eval's own models.
"""

import importlib.abc
import importlib.machinery
import sys

TARGET = "lm_eval.api.registry"


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        sys.modules[TARGET] = module
        import lm_eval.models  # noqa: F401  lm-eval's own lazy entries first (it imports them only if empty)

        module.model_registry.register("evalkit", target="evalkit.lm:EvalkitLM")


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
