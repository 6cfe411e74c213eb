"""The column registry (evalkit/report/columns.py): one entry declares a column for report.md's tables,
report.csv, the leaderboard's CSVs and docs/report.md's glossary, which is checked against it here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from evalkit import leaderboard
from evalkit.report import columns, settings, write_report
from evalkit.report.columns import Column
from tests.runs_fixture import sample_row, write_run

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "report.md"
START, END = "<!-- columns: evalkit/report/columns.py -->", "<!-- /columns -->"


def glossary_drift() -> list[str]:
    """The docs check: glossary lines the registry renders that docs/report.md lacks, then lines the docs
    hold that the registry no longer renders."""
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC} lost its glossary markers"
    documented = text.split(START, 1)[1].split(END, 1)[0].strip().splitlines()
    rendered = columns.glossary().splitlines()
    return [x for x in rendered if x not in documented] + [x for x in documented if x not in rendered]


def test_docs_glossary_is_the_registry():
    text = DOC.read_text()
    documented = text.split(START, 1)[1].split(END, 1)[0].strip()
    assert documented == columns.glossary(), (
        "docs/report.md's glossary differs from evalkit/report/columns.py:\n"
        + "\n".join(glossary_drift())
        + "\nreplace the block between the markers with columns.glossary()"
    )


def _runs(root: Path) -> None:
    """A full run and one budget, 8 problems with known output lengths."""
    full = [sample_row(f"s{i}", [{"score": 100.0}], tokens=[20 + i]) for i in range(8)]
    comp = [sample_row(f"s{i}", [{"score": 100.0}], tokens=[30 + 5 * i]) for i in range(8)]
    write_run(root, full, method="full", budget=None)
    write_run(root, comp, budget=256)


def test_a_new_report_column_is_one_registry_entry(tmp_path, monkeypatch):
    """Declared here alone, a figure computed from the pairing reaches report.md's length table under its
    header, report.csv and leaderboard.csv (at its decimals), and the docs check names it as undocumented."""
    longest = Column(
        "tokens_max_compressed",
        "the longest compressed output of the paired problems (tokens)",
        "lengths",
        frozenset({"report", "long"}),
        decimals=1,
        headers=columns.H(lengths="longest compressed"),
        fmt="{:.0f}",
        value=lambda run, p: None if p is None else float(np.max(p.per_problem["c_tokens"])),
    )
    monkeypatch.setattr(columns, "COLUMNS", (*columns.COLUMNS, longest))
    _runs(tmp_path)
    paths = write_report(settings(results_dir=str(tmp_path)))
    md = Path(paths["md"]).read_text()
    lengths = md.split("### Length and failure", 1)[1].split("###", 1)[0]
    header = next(line for line in lengths.splitlines() if line.startswith("| cache |"))
    assert header.endswith("| repeating tail | longest compressed |")  # appended: registry order
    assert "| snapstream | 256 | 8 |" in lengths and lengths.count("| 65 |") == 1  # 30 + 5 * 7
    assert pd.read_csv(paths["csv"]).tokens_max_compressed.tolist() == [65.0]
    leaderboard.build(tmp_path)
    long = pd.read_csv(tmp_path / "leaderboard.csv", dtype=str, keep_default_na=False)
    assert long.columns.get_loc("tokens_max_compressed") == long.columns.get_loc("token_gain") + 1
    snap = long[long.method == "snapstream"]
    assert set(snap.tokens_max_compressed) == {"65.0"} and set(
        long[long.method == "full"].tokens_max_compressed
    ) == {""}
    drift = glossary_drift()
    assert len(drift) == 1 and drift[0].startswith("| `tokens_max_compressed` | report, leaderboard |")
    assert "| longest compressed (lengths) | the longest compressed output" in drift[0]


def test_per_hardware_columns_expand_for_each_configured_hardware():
    names = [c.name for c in columns.in_csv("long", ["h100", "sn40l"])]
    assert names[names.index("token_gain") + 1 :][:4] == [
        "tok_s_gain_h100", "tok_s_gain_sn40l", "effective_gain_h100", "effective_gain_sn40l"
    ]  # fmt: skip
    by_name, by_suffix = columns.decimals(["h100"])
    assert by_name["effective_gain_h100"] == by_suffix["effective_gain_h100"] == 3
    assert (by_suffix[""], by_suffix["vs_full"], by_suffix["p"], by_name["kv_kept_fraction"]) == (2, 2, 4, 4)


def test_every_table_and_csv_names_each_column_once():
    for where in ("report", "long"):
        names = [c.name for c in columns.in_csv(where, ["h200"])]
        assert len(names) == len(set(names)), where
    for table in columns.TABLES:
        cols = columns.in_table(table, ["h200"])
        assert cols and cols[0].name == "method" and cols[1].name == "budget", table
    assert {c.group for c in columns.COLUMNS} <= set(columns.GROUPS)


def test_a_budget_sorted_last_is_still_labelled_all():
    """The breakdown table sorts by `budget_key` (the full cache in a quantized storage: inf) and labels
    what it sorted: it crashed on the bytes_matched sweep's RULER subsets (int(inf))."""
    assert [columns.budget_label(columns.budget_key(b)) for b in (None, 128.0, 2048)] == [
        "all",
        "128",
        "2048",
    ]
