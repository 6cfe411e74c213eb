"""summary.md, assembled from the CSVs in the output folder: one section per registered measurement whose CSV
is there (its note, where its figures came from, its table), whether or not this command measured it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import torch

from evalkit.bench.base import Measurement, read_csv

PROVENANCE = "provenance.json"  # measurement name -> the command, preset, time and git sha that wrote its CSV


def record_provenance(out: Path, name: str, command: str, quick: bool) -> None:
    from evalkit.results import git_sha

    path = out / PROVENANCE
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = {
        "command": command,
        "quick": quick,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        "git": git_sha(),
        "torch_threads": torch.get_num_threads(),
        "cores": psutil.cpu_count(),
    }
    path.write_text(json.dumps(data, indent=2) + "\n")


def origin(name: str, measured: set[str], provenance: dict) -> str:
    p = provenance.get(name)
    when = (
        f"`{p['command']}` at {p['finished']} (git {p['git']}, {p['torch_threads']} torch threads)"
        if p
        else "an earlier run (no provenance recorded)"
    )
    return (
        ("Measured by this command: " if name in measured else "Kept from ")
        + when
        + ("; --quick sizes (a smoke run, not figures to publish)" if p and p["quick"] else "")
    )


def write_summary(out: Path, measurements: list[Measurement], measured: set[str], command: str) -> str:
    """Write and return summary.md for every measurement in `measurements` whose CSV is in `out`."""
    import pandas as pd

    path = out / PROVENANCE
    provenance = json.loads(path.read_text()) if path.exists() else {}
    present = [m for m in measurements if (out / m.csv).exists()]
    kept = [m.name for m in present if m.name not in measured]
    lines = [
        "# evalkit bench (SmolLM2-135M, fp32, CPU)",
        "",
        f"torch threads: {torch.get_num_threads()}; cores: {psutil.cpu_count()}; command: `{command}`; "
        f"measured by it: {', '.join(sorted(measured)) or 'nothing'}"
        + (f"; kept from earlier runs (their CSVs): {', '.join(kept)}" if kept else ""),
        "",
    ]
    for m in present:
        rows = read_csv(out / m.csv)
        table = pd.DataFrame(m.table(rows)).to_markdown(index=False)
        lines += [
            f"## {m.title}",
            "",
            m.note(rows),
            "",
            origin(m.name, measured, provenance) + ".",
            "",
            table,
            "",
        ]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text)
    return text
