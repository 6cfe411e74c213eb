"""The leaderboard (evalkit/leaderboard.py): every configuration its own labelled row or column, never averaged;
bad metrics.json files skipped by name; paired columns from the report; an argparse CLI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from evalkit import leaderboard
from tests.runs_fixture import binary_rows, sample_row, write_run

ROOT = Path(__file__).resolve().parents[1]
FULL = [1] * 30
SNAP = [1] * 27 + [0] * 3


def read(results: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    leaderboard.build(results)
    return pd.read_csv(results / "leaderboard.csv"), pd.read_csv(results / "leaderboard_wide.csv")


def test_method_settings_are_separate_rows_never_averaged(tmp_path):
    """Issue 15.1: `BUDGET=128` and `BUDGET=128 method.recent=64` used to land in one cell as their mean."""
    write_run(tmp_path, binary_rows(FULL), method="full", budget=None)
    write_run(tmp_path, binary_rows([1] * 30), budget=128)
    write_run(tmp_path, binary_rows([0] * 30), budget=128, settings={"recent": 64})
    _, wide = read(tmp_path)
    snap = wide[wide.method == "snapstream"].set_index("settings")
    assert sorted(snap.index) == ["default", "recent64"]
    assert snap.loc["default", "128"] == 100.0 and snap.loc["recent64", "128"] == 0.0  # not 50 (the mean)
    assert (snap["full"] == 100.0).all()


def test_task_versions_are_separate_rows_each_against_its_own_full(tmp_path):
    """Issue 15.1: two `full` runs for one model and task put pandas Series text into the `full` cells."""
    write_run(tmp_path / "a", binary_rows(FULL), method="full", budget=None, task_version=1)
    write_run(tmp_path / "a", binary_rows(SNAP), budget=256, task_version=1)
    write_run(tmp_path / "b", binary_rows([0] * 30), method="full", budget=None, task_version=2)
    write_run(tmp_path / "b", binary_rows([0] * 29 + [1]), budget=256, task_version=2)
    # two results folders merged into one tree, as `rsync` of two machines' results would
    for sub in ("a", "b"):
        for path in (tmp_path / sub / "runs").rglob("metrics.json"):
            dest = tmp_path / "runs" / sub / path.relative_to(tmp_path / sub / "runs").parent
            dest.mkdir(parents=True)
            for f in path.parent.iterdir():
                (dest / f.name).write_text(f.read_text())
    _, wide = read(tmp_path)
    assert pd.api.types.is_numeric_dtype(wide["full"])  # numbers, not "0    100.0\n1    0.0 ..." text
    snap = wide[wide.method == "snapstream"].set_index("task_version")
    assert snap.loc[1, "full"] == 100.0 and snap.loc[1, "256"] == 90.0
    assert snap.loc[2, "full"] == 0.0 and snap.loc[2, "256"] == pytest.approx(100 / 30)
    assert len(wide[wide.method == "full"]) == 2


def test_long_rows_can_be_told_apart(tmp_path):
    write_run(tmp_path, binary_rows(FULL), method="full", budget=None)
    write_run(tmp_path, binary_rows(SNAP), budget=128)
    write_run(tmp_path, binary_rows(SNAP), budget=128, settings={"recent": 64})
    write_run(tmp_path, binary_rows(SNAP), budget=128, settings={"window": 16})
    long, _ = read(tmp_path)
    labels = [c for c in long.columns if c in leaderboard.LABELS]
    assert {"settings", "task_version", "scorer_version", "data_hash", "generation", "run"} <= set(labels)
    assert not long.duplicated(subset=labels + ["metric", "subset"]).any()
    assert set(long.loc[long.method == "snapstream", "settings"]) == {"default", "recent64", "window16"}


def test_a_duplicate_configuration_refuses_the_pivot_instead_of_averaging(tmp_path):
    """The wide table pivots with a pivot that raises on duplicates; the labels make duplicates impossible,
    and if two rows ever share every label they are told apart by their run folder, never averaged."""
    write_run(tmp_path / "x", binary_rows([1] * 30), budget=128)
    write_run(tmp_path / "y", binary_rows([0] * 30), budget=128)
    for sub in ("x", "y"):
        src = next((tmp_path / sub / "runs").rglob("metrics.json")).parent
        dest = tmp_path / "runs" / sub
        dest.mkdir(parents=True)
        for f in src.iterdir():
            (dest / f.name).write_text(f.read_text())
    _, wide = read(tmp_path)
    assert sorted(wide["128"]) == [0.0, 100.0]
    assert wide["settings"].str.contains("run ").all()


def test_bad_metrics_files_are_skipped_with_a_warning_naming_them(tmp_path, caplog):
    """Issue 15.6: one truncated metrics.json stopped the whole leaderboard without naming the file."""
    write_run(tmp_path, binary_rows(FULL), method="full", budget=None)
    write_run(tmp_path, binary_rows(SNAP), budget=256)
    bad = {
        "truncated": '{"task": "ruler", "model": {"na',
        "not_object": "[1, 2, 3]",
        "old_schema": json.dumps({"task": "ruler", "model": {"name": "m"}}),  # no method, no scores
    }
    for name, text in bad.items():
        folder = tmp_path / "runs" / "ruler" / "smollm2_135m" / "snapstream" / name
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(text)
    with caplog.at_level(logging.WARNING):
        long, wide = read(tmp_path)
    for name in bad:
        assert any(f"snapstream/{name}/metrics.json" in r.getMessage() for r in caplog.records), name
    assert set(long["run"]) == {"ruler/smollm2_135m/full/none", "ruler/smollm2_135m/snapstream/256"}
    assert wide.loc[wide.method == "snapstream", "256"].item() == 90.0


def test_paired_columns_come_from_the_report(tmp_path):
    """The compressed run lacks one sample: the paired difference leaves it out (means differ otherwise)."""
    from evalkit.report import settings as report_settings
    from evalkit.report.pairing import pair
    from evalkit.report.runs import load_runs

    full = binary_rows([1] * 29 + [0])
    write_run(tmp_path, full, method="full", budget=None)
    write_run(tmp_path, binary_rows([1] * 27 + [0] * 2), budget=256)  # s29 (a miss under full) is absent
    long, wide = read(tmp_path)
    runs, _ = load_runs(tmp_path)
    cells = pair(runs[1], runs[0], report_settings()).cells["score"]
    row = long[(long.method == "snapstream") & (long.metric == "score") & (long.subset == "all")].iloc[0]
    csv = {"rel": 1e-5}  # the CSVs keep 6 significant digits
    assert row.paired_diff == pytest.approx(100 * (27 - 29) / 29, **csv)  # over the 29 shared samples
    assert row.paired_diff != pytest.approx(row.score - 100 * 29 / 30, **csv)  # not the unpaired gap
    assert (row.ci_low, row.ci_high, row.p_value, row.verdict, row.n_paired) == (
        pytest.approx(cells["ci_low"], **csv),
        pytest.approx(cells["ci_high"], **csv),
        pytest.approx(cells["p_value"], **csv),
        cells["verdict"],
        29,
    )
    w = wide[wide.method == "snapstream"].iloc[0]
    assert w["256_vs_full"] == pytest.approx(row.paired_diff) and w["256_verdict"] == row.verdict


def test_cli_help_prints_usage_and_writes_nothing(tmp_path):
    """Issue 16: `python -m evalkit.leaderboard --help` created a folder named `--help`."""
    out = subprocess.run(
        [sys.executable, "-m", "evalkit.leaderboard", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and "results_dir" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_cli_unknown_flag_is_an_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        leaderboard.main(["--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cli_missing_results_dir_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        leaderboard.main([str(tmp_path / "nope")])
    assert e.value.code == 2 and "no runs under" in capsys.readouterr().err


def test_runs_from_the_current_runner_without_identity_or_scorer_version(tmp_path):
    """metrics.json files written before `identity` and `scorer_version` existed: paired on an identity
    derived from their config, and their rows kept (a missing label used to drop them from groupby)."""
    old = {"identity": False, "scorer_version": None}
    write_run(tmp_path, binary_rows(FULL), method="full", budget=None, **old)
    write_run(tmp_path, binary_rows(SNAP), budget=256, **old)
    write_run(tmp_path, binary_rows(FULL), budget=512, **old)
    long, wide = read(tmp_path)
    snap = wide[wide.method == "snapstream"].iloc[0]
    assert (snap["full"], snap["256"], snap["512"]) == (100.0, 90.0, 100.0)
    assert snap["256_vs_full"] == pytest.approx(-10.0) and pd.isna(snap["scorer_version"])
    scored = long[(long.method == "snapstream") & (long.metric == "score")]
    assert set(scored.paired_with) == {"ruler/smollm2_135m/full/none"}


def test_breakdown_rows_carry_their_own_paired_cell(tmp_path):
    """Each `metric/subset` row is paired on its own problems: subset a loses 4 of 10, subset b none, so the
    rows differ from the headline's cell and from each other; every CI brackets its own difference."""

    def rows(outcomes: dict[str, list[int]]) -> list[dict]:
        return [
            sample_row(f"{sub}{i}", [{"score": 100.0 * o, f"score/{sub}": 100.0 * o}], subset=sub)
            for sub, outs in outcomes.items()
            for i, o in enumerate(outs)
        ]

    write_run(tmp_path, rows({"a": [1] * 10, "b": [1] * 10}), method="full", budget=None)
    write_run(tmp_path, rows({"a": [1] * 6 + [0] * 4, "b": [1] * 10}), budget=256)
    long, wide = read(tmp_path)
    snap = long[(long.method == "snapstream") & (long.metric == "score")].set_index("subset")
    assert snap.loc["all", "paired_diff"] == pytest.approx(-20.0)
    assert snap.loc["a", "paired_diff"] == pytest.approx(-40.0)
    assert snap.loc["b", "paired_diff"] == pytest.approx(0.0)
    assert snap.loc["a", "n_paired"] == snap.loc["b", "n_paired"] == 10 and snap.loc["all", "n_paired"] == 20
    assert snap.loc["a", "ci_low"] != snap.loc["all", "ci_low"]
    for _, r in snap.iterrows():
        assert r.ci_low <= r.paired_diff <= r.ci_high, r
    w = wide[wide.method == "snapstream"].iloc[0]
    assert w["256_ci_low"] <= w["256_vs_full"] <= w["256_ci_high"] and w["256_ci_low"] < w["256_ci_high"]
