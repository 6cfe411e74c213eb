"""Writing the report, atomically: report.md (evalkit.report.tables), report.csv (one row per compressed run
and metric key, its columns in evalkit.report.columns' order) and the plots (evalkit.report.plots)."""

from __future__ import annotations

from pathlib import Path

from evalkit.report import columns
from evalkit.report.build import Report
from evalkit.report.plots import write_plots
from evalkit.report.tables import markdown
from evalkit.results import atomic_write


def csv_text(rep: Report) -> str:
    """report.csv: the registered report columns first, in their groups' order, then any other figure."""
    cells = rep.cells
    if len(cells):
        first = [c.name for c in columns.in_csv("report", rep.settings.hardware) if c.name in cells]
        cells = cells[first + [c for c in cells if c not in first]]
    return cells.to_csv(index=False, float_format="%.6g")


def write(rep: Report) -> dict[str, Path]:
    out = Path(rep.settings.results_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(rep, out)
    paths = {"md": out / "report.md", "csv": out / "report.csv"}
    atomic_write(paths["csv"], csv_text(rep))
    atomic_write(paths["md"], markdown(rep, plots))
    return paths | {f"{k}_{m}_{t}": p for (m, t), d in plots.items() for k, p in d.items()}
