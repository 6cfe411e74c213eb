"""Make `lm_eval --model evalkit` work: register evalkit's model with lm-eval when lm-eval loads its registry.

lm-eval 0.4 has no plugin discovery for models, so `make setup` writes `evalkit-lm-eval.pth` into the venv,
whose one line imports this module at interpreter start. It costs nothing until lm-eval itself is imported:
only then (an import hook on `lm_eval.api.registry`) is "evalkit" registered, lazily, as
`evalkit.lm_eval_cli:CliLM` (evalkit's LM, which also puts its KV figures into lm-eval's results JSON), beside
lm-eval's own models. lm-eval's warnings about evalkit's own tasks that say nothing wrong are dropped here
(QUIET; docs/lm-eval.md lists every warning and why); warnings about other tasks are untouched.
"""

import importlib.abc
import importlib.machinery
import logging
import os
import sys

TARGET = "lm_eval.api.registry"

# (logger, message prefix, phrase): a record of that logger starting with the prefix and holding the phrase is
# dropped. Only evalkit's tasks (`evalkit_*`) match.
QUIET = [
    # breakdown keys (`score/<subset>`) are means over their subset, which is lm-eval's default
    ("lm_eval.evaluator_utils", "[evalkit_", "No aggregation function defined for metric"),
    # a breakdown key scores only its subset's documents by design, and no evalkit task is in an lm-eval
    # group: there is no group score to over-weight (`score` itself covers every document)
    ("lm_eval.evaluator_utils", "[evalkit_", "over-weighted in the group score"),
    # advice to use --metadata, which docs/lm-eval.md gives with evalkit's keys
    ("lm_eval.api.task", "evalkit_", "Custom kwargs can be passed to `--metadata`"),
]


class QuietFilter(logging.Filter):
    def __init__(self, rules: list[tuple[str, str]]):
        super().__init__()
        self.rules = rules

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(msg.startswith(prefix) and phrase in msg for prefix, phrase in self.rules)


def quiet() -> None:
    """Attach the QUIET rules to their loggers (once; a logger's filters see only its own records)."""
    by_logger: dict[str, list] = {}
    for name, prefix, phrase in QUIET:
        by_logger.setdefault(name, []).append((prefix, phrase))
    for name, rules in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, QuietFilter) for f in logger.filters):
            logger.addFilter(QuietFilter(rules))


def _lm_eval_cli() -> bool:
    """This process is lm-eval's command line (`lm_eval ...` or `python -m lm_eval ...`)."""
    argv0 = sys.argv[0] if sys.argv else ""
    return os.path.basename(argv0) == "lm_eval" or argv0.endswith(os.path.join("lm_eval", "__main__.py"))


def one_line_errors() -> None:
    """lm-eval's command line has no error hook of its own: under it an EvalkitError (a `--model_args`
    setting refused before the model loads, a run setting its task cannot run) ends the run as `python -m
    evalkit` ends one, with one line and exit status 2 instead of a traceback. Other errors are untouched."""
    previous = sys.excepthook

    def hook(kind, error, tb):
        from evalkit.errors import EvalkitError

        if not isinstance(error, EvalkitError):
            return previous(kind, error, tb)
        sys.stdout.flush()
        print(f"lm_eval --model evalkit: error: {error}", file=sys.stderr, flush=True)
        os._exit(2)  # an excepthook cannot set the exit status otherwise

    sys.excepthook = hook


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        sys.modules[TARGET] = module
        import lm_eval.models  # noqa: F401  lm-eval's own lazy entries first (it imports them only if empty)

        module.model_registry.register("evalkit", target="evalkit.lm_eval_cli:CliLM")
        quiet()
        if _lm_eval_cli():
            one_line_errors()


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
