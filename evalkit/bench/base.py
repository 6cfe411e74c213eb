"""What every measurement shares: its record (`Measurement`), the run's `Context`, and CSV input/output.

A measurement is one module with one function `run(ctx) -> list[dict]` (its rows, written to its CSV) and a
module-level `MEASUREMENT` naming its CSV and its section of `summary.md`. The CLI lists them in one place
(`evalkit/bench/__main__.py`); the summary is assembled from whatever CSVs are in the output folder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20


def _all_rows(rows: list[dict]) -> list[dict]:
    return rows


@dataclass(frozen=True)
class Measurement:
    """One measurement: `--only <name>` selects it; its rows go to `<out>/<csv>`; `note(rows)` and
    `table(rows)` give its section of summary.md (the note says the target and how to read the figures)."""

    name: str
    csv: str
    title: str
    run: Callable[[Context], list[dict]]
    note: Callable[[list[dict]], str]
    table: Callable[[list[dict]], list[dict]] = _all_rows  # e.g. per-step rows -> one slope row per config


@dataclass
class Context:
    """What a measurement gets: the size preset, the output folder (for extra files: plots, profiles) and
    the embedded model, loaded on first use (measurements that run in child processes never load it here)."""

    quick: bool
    out: Path
    model_name: str = "smollm2_135m"
    _loaded: tuple | None = field(default=None, repr=False)

    def size(self, quick, full):
        """The quick preset's value (a smoke run of a few minutes) or the full bench's."""
        return quick if self.quick else full

    def _load(self) -> tuple:
        if self._loaded is None:
            from evalkit.config import model_spec
            from evalkit.loading import load_model

            self._loaded = load_model(model_spec(self.model_name))
        return self._loaded

    @property
    def model(self):
        return self._load()[0]

    @property
    def tokenizer(self):
        return self._load()[1]


def read_csv(path: Path) -> list[dict]:
    import pandas as pd

    return pd.read_csv(path).to_dict("records")


def write_csv(path: Path, rows: list[dict]) -> None:
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)  # a fresh --out: never lose a finished measurement
    pd.DataFrame(rows).to_csv(path, index=False)
