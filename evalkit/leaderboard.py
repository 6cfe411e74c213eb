"""Leaderboard: every `metrics.json` under `<results_dir>/runs` into two CSVs and one plot per model and task.

Reads only fields stored inside each metrics.json and samples.jsonl (never meaning parsed from paths); runs
no model. Every distinct configuration (method settings, task version, scorer version, data, generation
identity) is its own labelled row or column: nothing is ever averaged across configurations.
    results/leaderboard.csv       long: one row per (run, metric, subset), with the paired columns of the
                                  report (difference to the full run on the same samples, CI, p, verdict)
    results/leaderboard_wide.csv  headline score per configuration row and budget column, and per budget
                                  the paired difference to `full`, its CI, p-value and verdict
    results/plots/<task>_<model>.png   headline score vs budget, one line per configuration, `full` dashed
A metrics.json that cannot be read is skipped with a warning naming it. Paired statistics use the
settings of conf/report.yaml, so the leaderboard and `make report` agree.
Usage: `python -m evalkit.leaderboard [results_dir]`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pandas as pd

from evalkit.errors import EvalkitError, exit_with
from evalkit.report import settings as report_settings
from evalkit.report.build import pair_all
from evalkit.report.runs import Run, load_runs
from evalkit.results import atomic_write, save_figure

log = logging.getLogger(__name__)

# What tells two runs apart; `run` (the folder) is unique per run.
LABELS = [
    "model",
    "task",
    "method",
    "settings",
    "budget",
    "task_version",
    "scorer_version",
    "data_source",
    "data_hash",
    "generation",
    "run",
]
PAIRED = [
    "paired_with",
    "n_paired",
    "paired_diff",
    "ci_low",
    "ci_high",
    "p_value",
    "test",
    "margin",
    "verdict",
]
LONG_COLUMNS = (
    LABELS + ["metric", "subset", "measured_compression", "score", "stderr", "n", "git_sha"] + PAIRED
)
WIDE_INDEX = [
    "model",
    "task",
    "metric",
    "method",
    "settings",
    "task_version",
    "scorer_version",
    "data_hash",
    "generation",
]
PER_BUDGET = {
    "paired_diff": "vs_full",
    "ci_low": "ci_low",
    "ci_high": "ci_high",
    "p_value": "p",
    "verdict": "verdict",
}


def labels(run: Run) -> dict:
    m = run.metrics
    return {
        "model": run.model, "task": run.task, "method": run.method, "settings": run.settings,
        "budget": run.budget, "task_version": m.task_version, "scorer_version": m.scorer_version,
        "data_source": m.data_source, "data_hash": m.data_hash,
        "generation": run.identity["generation"], "run": run.rel,
    }  # fmt: skip


def long_rows(run: Run, pairing=None) -> list[dict]:
    """One row per score key (`metric/subset`), plus mean output tokens; paired columns where paired."""
    m = run.metrics
    base = labels(run) | {
        "measured_compression": m.kv.get("compression_ratio"),
        "git_sha": m.git_sha,
    }
    rows = []
    for key, v in m.scores.items():
        metric, _, subset = key.partition("/")
        cell = pairing.cells.get(key, {}) if pairing else {}
        paired = {c: cell.get(c) for c in PAIRED} | {"paired_with": pairing.full.rel if pairing else None}
        if not run.is_full and pairing is None:
            paired["verdict"] = "unpaired"  # the warning logged by `build` says why
        rows.append(
            {
                **base,
                "metric": metric,
                "subset": subset or "all",
                "score": v["mean"],
                "stderr": v.get("stderr"),
                "n": v.get("n"),
                **paired,
            }
        )
    gen = m.generation
    if gen.get("mean_output_tokens") is not None:
        rows.append(
            {
                **base,
                "metric": "output_tokens",
                "subset": "all",
                "score": gen["mean_output_tokens"],
                "stderr": None,
                "n": gen.get("requests"),
            }
        )
    return rows


def long_table(runs: list[Run], pairings: dict) -> pd.DataFrame:
    df = pd.DataFrame(
        [r for run in runs for r in long_rows(run, pairings.get(run.rel))], columns=LONG_COLUMNS
    )
    df["budget"] = df["budget"].astype("Int64")
    return df.sort_values(
        ["model", "task", "metric", "subset", "method", "settings", "budget", "run"], na_position="first"
    ).reset_index(drop=True)


def _headline_records(runs: list[Run], pairings: dict) -> pd.DataFrame:
    recs = []
    for run in runs:
        p = pairings.get(run.rel)
        cell = p.cells.get(run.headline, {}) if p else {}
        score = run.metrics.mean(run.headline)
        full = p.full.metrics.mean(run.headline) if p else None
        recs.append(
            {
                **{k: v for k, v in labels(run).items() if k in WIDE_INDEX},
                "metric": run.headline,
                "budget": run.budget,
                "run": run.rel,
                "score": score,
                "full": score if run.is_full else full,
                **{c: cell.get(c) for c in PER_BUDGET},
            }
        )
    df = pd.DataFrame(recs)
    # Two runs sharing every label (results trees merged by hand) are told apart by folder, never averaged.
    dup = df.duplicated(subset=WIDE_INDEX + ["budget"], keep=False)
    df.loc[dup, "settings"] = df.loc[dup, "settings"] + " (run " + df.loc[dup, "run"] + ")"
    # an older metrics.json lacks some labels: "-" keeps its row (groupby and pivot drop missing keys)
    for c in WIDE_INDEX:
        df[c] = [("-" if v is None or v != v else str(v)) for v in df[c]]
    return df


def wide_table(runs: list[Run], pairings: dict) -> pd.DataFrame:
    """One row per configuration (WIDE_INDEX), one column group per budget; `full` rows carry their score."""
    if not runs:
        return pd.DataFrame(columns=WIDE_INDEX + ["full"])
    df = _headline_records(runs, pairings)
    fulls = df[df.method == "full"][WIDE_INDEX + ["full"]]
    comp = df[df.method != "full"]
    if comp.empty:
        return fulls.reset_index(drop=True)
    values = ["score", *PER_BUDGET]
    wide = comp.pivot(
        index=WIDE_INDEX, columns="budget", values=values
    )  # raises on duplicates: never averages
    out = wide.index.to_frame(index=False)
    out["full"] = comp.groupby(WIDE_INDEX, sort=True)["full"].first().to_numpy()
    for b in sorted(wide.columns.get_level_values("budget").unique()):
        out[str(int(b))] = wide[("score", b)].to_numpy()
        for col, suffix in PER_BUDGET.items():
            out[f"{int(b)}_{suffix}"] = wide[(col, b)].to_numpy()
    out = pd.concat([fulls, out], ignore_index=True)
    for c in ("task_version", "scorer_version"):
        out[c] = pd.to_numeric(out[c], errors="coerce").astype("Int64")
    return out.sort_values(["model", "task", "task_version", "generation", "method", "settings"]).reset_index(
        drop=True
    )


def plot(runs: list[Run], out_dir: Path) -> list[Path]:
    """Headline vs budget per (task, model): a line per (method, settings, generation identity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault((r.task, r.model), []).append(r)
    for (task, model), rs in sorted(groups.items()):
        head = rs[0].headline
        several = len({r.identity["generation"] for r in rs}) > 1  # then say which identity a line is
        fig, ax = plt.subplots(figsize=(6, 4))
        lines: dict[tuple, list] = {}
        for r in rs:
            if head in r.metrics.scores:
                lines.setdefault((r.method, r.settings, r.identity["generation"]), []).append(r)
        for (method, sett, gen), members in sorted(lines.items(), key=lambda kv: tuple(map(str, kv[0]))):
            label = (
                method + ("" if sett == "default" else f" {sett}") + (f" [{str(gen)[:6]}]" if several else "")
            )
            scores = [
                (r.budget, r.metrics.scores[head]["mean"], r.metrics.scores[head].get("stderr") or 0)
                for r in members
            ]
            if method == "full":
                ax.axhline(scores[0][1], color="black", linestyle="--", label=label)
                continue
            xs, ys, es = zip(*sorted(scores))
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="budget (KV entries per layer and head)", ylabel=head, title=f"{task} - {model}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{task}_{model}.png"
        fig.tight_layout()
        save_figure(fig, path)
        plt.close(fig)
        paths.append(path)
    return paths


def build(results_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, list[Path]]:
    results_dir = Path(results_dir)
    runs, _ = load_runs(results_dir)  # unreadable files are logged as warnings, naming each
    found, problems = pair_all(runs, report_settings(results_dir=str(results_dir)))
    for problem in problems:
        log.warning("not paired: %s", problem)
    pairings = {p.compressed.rel: p for p in found}
    long, wide = long_table(runs, pairings), wide_table(runs, pairings)
    atomic_write(results_dir / "leaderboard.csv", long.to_csv(index=False, float_format="%.6g"))
    atomic_write(results_dir / "leaderboard_wide.csv", wide.to_csv(index=False, float_format="%.6g"))
    return long, wide, plot(runs, results_dir / "plots")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m evalkit.leaderboard",
        description="Collect <results_dir>/runs/**/metrics.json into leaderboard CSVs and plots "
        "(paired statistics with the settings of conf/report.yaml).",
    )
    parser.add_argument(
        "results_dir", nargs="?", default="results", help="folder holding runs/ (default: results)"
    )
    args = parser.parse_args(argv)
    results_dir = Path(args.results_dir)
    if not (results_dir / "runs").is_dir():
        parser.error(
            f"no runs under {results_dir / 'runs'}: run `make eval` first, or name another results_dir"
        )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        long, wide, plots = build(results_dir)
    except EvalkitError as e:  # e.g. a bad conf/report.yaml: the message names the setting
        exit_with("python -m evalkit.leaderboard", e)
    print(f"{len(long)} rows from {long['run'].nunique()} runs")
    if not wide.empty:
        show = [
            c
            for c in wide.columns
            if c in ("model", "task", "method", "settings", "full")
            or c.isdigit()
            or c.endswith(("_vs_full", "_verdict"))
        ]
        print(wide[show].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(
        f"wrote {results_dir}/leaderboard.csv, leaderboard_wide.csv and {len(plots)} plot(s) in {results_dir}/plots"
    )


if __name__ == "__main__":
    sys.exit(main())
