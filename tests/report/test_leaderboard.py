"""The leaderboard (evalkit/leaderboard.py): every configuration its own labelled row or column, never
averaged; bad metrics.json files skipped by name; paired columns from the report; an argparse CLI."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from evalkit import leaderboard
from evalkit.report.runs import load_runs
from tests.runs_fixture import binary_rows, sample_row, write_run

ROOT = Path(__file__).resolve().parents[2]
FULL = [1] * 30
SNAP = [1] * 27 + [0] * 3


def read(results: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    leaderboard.build(results)
    return pd.read_csv(results / "leaderboard.csv"), pd.read_csv(results / "leaderboard_wide.csv")


def test_method_settings_are_separate_rows_never_averaged(tmp_path):
    """`BUDGET=128` and `BUDGET=128 method.recent=64` used to land in one cell as their mean."""
    write_run(tmp_path, binary_rows(FULL), method="full", budget=None)
    write_run(tmp_path, binary_rows([1] * 30), budget=128)
    write_run(tmp_path, binary_rows([0] * 30), budget=128, settings={"recent": 64})
    _, wide = read(tmp_path)
    snap = wide[wide.method == "snapstream"].set_index("settings")
    assert sorted(snap.index) == ["default", "recent64"]
    assert snap.loc["default", "128"] == 100.0 and snap.loc["recent64", "128"] == 0.0  # not 50 (the mean)
    assert (snap["full"] == 100.0).all()


def test_task_versions_are_separate_rows_each_against_its_own_full(tmp_path):
    """Two `full` runs for one model and task put pandas Series text into the `full` cells."""
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
    assert snap.loc[2, "full"] == 0.0 and snap.loc[2, "256"] == round(100 / 30, 2)  # CSVs hold 2 decimals
    assert len(wide[wide.method == "full"]) == 2


def test_long_rows_can_be_told_apart(tmp_path):
    write_run(tmp_path, binary_rows(FULL), method="full", budget=None)
    write_run(tmp_path, binary_rows(SNAP), budget=128)
    write_run(tmp_path, binary_rows(SNAP), budget=128, settings={"recent": 64})
    write_run(tmp_path, binary_rows(SNAP), budget=128, settings={"window": 16})
    long, _ = read(tmp_path)
    labels = [c for c in long.columns if c in leaderboard.labels(load_runs(tmp_path)[0][0])]
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


def _valid_but(change: dict) -> str:
    m = {"task": "ruler", "headline": "score", "model": {"name": "smollm2_135m"}, "method": {"name": "x"}}
    return json.dumps(m | {"scores": {"score": {"mean": 1.0, "stderr": 0.0, "n": 1}}} | change)


def test_bad_metrics_files_are_skipped_with_a_warning_naming_them(tmp_path, caplog):
    """One truncated metrics.json stopped the whole leaderboard without naming the file."""
    write_run(tmp_path, binary_rows(FULL), method="full", budget=None)
    write_run(tmp_path, binary_rows(SNAP), budget=256)
    bad = {
        "truncated": '{"task": "ruler", "model": {"na',
        "not_object": "[1, 2, 3]",
        "old_schema": json.dumps({"task": "ruler", "model": {"name": "m"}}),  # no method, no scores
        # readable JSON, wrong values: each would crash a pivot or sort, or print as a score
        "string_mean": _valid_but({"scores": {"score": {"mean": "90", "stderr": 1.0, "n": 3}}}),
        "nan_mean": _valid_but({"scores": {"score": {"mean": float("nan"), "stderr": 1.0, "n": 3}}}),
        "string_budget": _valid_but({"budget": "256"}),
        "deep": "[" * 100_000 + "]" * 100_000,
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
    # the CSVs hold fixed decimals (evalkit.report.columns): points to 2, p-values to 4, each exactly rounded
    assert row.paired_diff == round(100 * (27 - 29) / 29, 2)  # over the 29 shared samples
    assert row.paired_diff != round(100 * 27 / 29 - 100 * 29 / 30, 2)  # not the unpaired gap
    assert (row.ci_low, row.ci_high, row.p_value, row.verdict, row.n_paired) == (
        round(cells["ci_low"], 2),
        round(cells["ci_high"], 2),
        round(cells["p_value"], 4),
        cells["verdict"],
        29,
    )
    w = wide[wide.method == "snapstream"].iloc[0]
    assert w["256_vs_full"] == pytest.approx(row.paired_diff) and w["256_verdict"] == row.verdict


def test_cli_help_prints_usage_and_writes_nothing(tmp_path):
    """`python -m evalkit.leaderboard --help` created a folder named `--help`."""
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


def _retag(results: Path, n: int) -> None:
    """Record `task.load.n=<n>` in every run's config under results/runs, as a run with that setting would."""
    for path in (results / "runs").rglob("metrics.json"):
        m = json.loads(path.read_text())
        m["provenance"]["config"]["task"]["load"]["n"] = n
        m["identity"]["generation"] = f"{m['identity']['generation']}-n{n}"  # the setting is in the identity
        path.write_text(json.dumps(m))


def test_long_csv_leads_each_run_with_its_flagged_headline_and_carries_its_figures(tmp_path):
    rows = [
        sample_row(f"s{i}", [{"score": 100.0 * (i % 3 == 0), "score/a": 100.0 * (i % 3 == 0)}])
        for i in range(9)
    ]
    write_run(tmp_path, rows, method="full", budget=None)
    write_run(tmp_path, rows, budget=256)
    long, wide = read(tmp_path)
    firsts = long.groupby("run", sort=False).head(1)
    assert firsts.headline.all() and (firsts.metric == "score").all() and (firsts.subset == "all").all()
    assert long.headline.sum() == 2 and "output_tokens" not in set(long.metric)
    assert long.loc[0, "method"] == "full"  # the reference first
    m = json.loads(next((tmp_path / "runs").rglob("256/metrics.json")).read_text())
    snap = long[(long.method == "snapstream") & long.headline].iloc[0]
    assert snap.kv_peak_bytes == m["kv"]["peak_bytes"] and snap.mean_output_tokens == 3.0
    assert "wall_time_s" in long.columns
    assert (wide.loc[wide.method == "full", "full_n"] == 9).all() and wide.loc[
        wide.method != "full", "256_n"
    ].item() == 9


def test_csv_figures_have_fixed_decimals_and_no_nan_cells(tmp_path):
    write_run(tmp_path, binary_rows([1, 0, 0] * 10), method="full", budget=None)  # 33.333...
    write_run(tmp_path, binary_rows([1, 0, 0] * 9 + [0, 0, 0]), budget=256)
    leaderboard.build(tmp_path)
    for name in ("leaderboard.csv", "leaderboard_wide.csv"):
        text = (tmp_path / name).read_text()
        assert "nan" not in text.lower() and "33.33333" not in text, text
        table = pd.read_csv(tmp_path / name, dtype=str, keep_default_na=False)
        for col in ("score", "stderr", "full", "256", "256_vs_full", "paired_diff"):
            if col in table:
                cells = [v for v in table[col] if v]
                assert cells and all(len(v.rpartition(".")[2]) == 2 for v in cells), (name, col, cells)
    long = pd.read_csv(tmp_path / "leaderboard.csv", dtype=str, keep_default_na=False)
    assert long.loc[long.method == "full", "paired_diff"].tolist() == [""]  # empty, not NaN


@pytest.mark.parametrize("arg", ["results_dir={}", "{}"])
def test_cli_takes_results_dir_like_make_report_and_the_old_positional_form(tmp_path, capsys, arg):
    write_run(tmp_path, binary_rows(FULL), method="full", budget=None)
    leaderboard.main([arg.format(tmp_path)])
    assert (
        tmp_path / "leaderboard.csv"
    ).is_file() and f"wrote {tmp_path}/leaderboard.csv" in capsys.readouterr().out


def test_cli_other_settings_are_an_error_naming_the_one_it_takes(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        leaderboard.main([f"result_dir={tmp_path}"])
    assert e.value.code == 2
    assert "unknown setting 'result_dir': the only one is results_dir=<folder>" in capsys.readouterr().err


def test_plot_never_joins_runs_on_different_problem_sets(tmp_path):
    """Runs on 24 problems and on 6 (task.load.n=1) used to share one `full` line told apart by hashes."""
    write_run(tmp_path / "big", binary_rows(FULL[:24]), method="full", budget=None)
    write_run(tmp_path / "big", binary_rows(SNAP[:24]), budget=256)
    write_run(tmp_path / "big", binary_rows(SNAP[:24]), budget=512)
    write_run(tmp_path / "small", binary_rows(FULL[:6]), method="full", budget=None, seed=0)
    write_run(tmp_path / "small", binary_rows([0] * 6), budget=256)
    _retag(tmp_path / "small", n=1)
    # one results tree holding both, as `make eval` with task settings in the folder name writes it
    for sub in ("big", "small"):
        for path in (tmp_path / sub / "runs").rglob("metrics.json"):
            dest = tmp_path / "runs" / sub / path.parent.name
            dest.mkdir(parents=True)
            for f in path.parent.iterdir():
                (dest / f.name).write_text(f.read_text())
    from evalkit.report.runs import load_runs

    runs, _ = load_runs(tmp_path)
    (pans,) = leaderboard.panels(runs).values()
    assert [p["title"] for p in pans] == ["task.load.n=1, 6 problems", "task.load.n=2, 24 problems"]
    small, big = pans
    assert [f[1:] for f in small["full"]] == [(100.0, 0.0, 6)] and len(big["full"]) == 1
    assert small["lines"] == {"snapstream": [(256, 0.0, 0.0)]}
    assert [b for b, *_ in big["lines"]["snapstream"]] == [256, 512]
    assert leaderboard.plot(runs, tmp_path / "plots") == [tmp_path / "plots" / "ruler_smollm2_135m.png"]


def test_plot_panel_names_come_from_settings_never_hashes(tmp_path):
    write_run(tmp_path, binary_rows(FULL), method="full", budget=None)
    write_run(tmp_path, binary_rows(SNAP), budget=128, settings={"recent": 64})
    from evalkit.report.runs import load_runs

    runs, _ = load_runs(tmp_path)
    (pans,) = leaderboard.panels(runs).values()
    assert [p["title"] for p in pans] == ["30 problems"] and list(pans[0]["lines"]) == ["snapstream recent64"]
