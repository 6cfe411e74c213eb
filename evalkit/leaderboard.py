"""Leaderboard: every `metrics.json` under `<results_dir>/runs` into two CSVs and one plot per model and task.

Reads only fields stored inside each metrics.json and samples.jsonl (never meaning parsed from paths); runs
no model. Every distinct configuration (method settings, query_aware, task version, scorer version, data,
generation identity) is its own labelled row or column: nothing is ever averaged across configurations.
    results/leaderboard.csv       long: one row per (run, metric, subset), each run's headline row first and
                                  flagged (`headline`); beside the score the report's length columns (token
                                  ratio to the full run and its CI, full/compressed tokens, memory-bound and
                                  effective decode gains) and the run's failure shares (hit limit, no answer,
                                  repeating tail); the run's KV bytes, wall time and output tokens, and the
                                  paired columns of the report (difference to the full run on the same
                                  samples, CI, p, verdict)
    results/leaderboard_wide.csv  headline score and n per configuration row and budget column, and per budget
                                  the paired difference to `full`, its CI, p-value and verdict
    results/plots/<task>_<model>.png   headline score vs budget, one panel per problem set, one line per
                                  configuration, `full` dashed
Columns, their order and fixed decimals are evalkit.report.columns' (the report's registry); a missing value
is an empty cell, never NaN. A metrics.json that cannot be read is skipped with a warning naming it. Paired
statistics use the settings of conf/report.yaml, so the leaderboard and `make report` agree.
Usage: `python -m evalkit.leaderboard [results_dir=]<folder>` (default: results).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import pandas as pd

from evalkit.errors import EvalkitError, OutputError, exit_with
from evalkit.report import columns
from evalkit.report import settings as report_settings
from evalkit.report.build import join_gains, pair_all
from evalkit.report.columns import config_label
from evalkit.report.lengths import run_shares
from evalkit.report.runs import Run, RunError, load_runs
from evalkit.results import atomic_write, save_figure

log = logging.getLogger(__name__)

# The wide table's rows: one per configuration and metric (the labels that tell configurations apart).
WIDE_INDEX = [
    "model",
    "task",
    "metric",
    "method",
    "settings",
    "storage",  # a KV storage is its own row: two storages are never averaged or pivoted together
    "query_aware",
    "task_version",
    "scorer_version",
    "data_hash",
    "generation",
]


def long_columns(hardware: list[str]) -> list[str]:
    """leaderboard.csv's columns, in order (evalkit.report.columns)."""
    return [c.name for c in columns.in_csv("long", hardware)]


def labels(run: Run) -> dict:
    """What tells `run` apart from every other (its label columns)."""
    return {c.name: c.value(run, None) for c in columns.COLUMNS if c.group == "label" and "long" in c.csv}


def _pair_figures(pairing) -> dict:
    """A pairing's figures: the length columns and the gains (empty for a full or unpaired run)."""
    return (pairing.lengths | pairing.gains) if pairing else {}


def long_rows(run: Run, pairing=None, hardware: list[str] = ()) -> list[dict]:
    """One row per score key (`metric/subset`); the registry's figures of the run, its pairing's, its own
    failure shares, and the paired columns where paired."""
    try:
        shares = run_shares(run.samples())
    except RunError:  # an empty or unreadable samples.jsonl: its shares stay empty (pairing says why)
        shares = {}
    base = columns.figures(run, pairing, "long", hardware) | _pair_figures(pairing) | shares
    paired = [c.name for c in columns.COLUMNS if c.group == "cell" and "long" in c.csv]
    rows = []
    for key, v in run.metrics.scores.items():
        metric, _, subset = key.partition("/")
        cell = pairing.cells.get(key, {}) if pairing else {}
        cells = {c: cell.get(c) for c in paired} | {"paired_with": pairing.full.rel if pairing else None}
        if not run.is_full and pairing is None:
            cells["verdict"] = "unpaired"  # the warning logged by `build` says why
        rows.append(
            {
                **base,
                "headline": key == run.headline,
                "metric": metric,
                "subset": subset or "all",
                "score": v["mean"],
                "stderr": v.get("stderr"),
                "n": v.get("n"),
                **cells,
            }
        )
    return rows


def long_table(runs: list[Run], pairings: dict, hardware: list[str]) -> pd.DataFrame:
    df = pd.DataFrame(
        [r for run in runs for r in long_rows(run, pairings.get(run.rel), hardware)],
        columns=long_columns(hardware),
    )
    for c in ("budget", "n", "kv_peak_bytes", "n_paired"):
        df[c] = df[c].astype("Int64")
    # run by run (full first), each run's headline row first, then its breakdown keys
    df["_rest"] = ~df["headline"].astype(bool)
    order = ["model", "task", "method", "settings", "storage", "budget", "run", "_rest", "metric", "subset"]
    df = df.sort_values(order, na_position="first", key=_full_first).drop(columns="_rest")
    return df.reset_index(drop=True)


def _full_first(col: pd.Series) -> pd.Series:
    if col.name == "storage":  # the model dtype first
        return col.map(lambda v: "" if v == "none" else v)
    return col.map(lambda v: "" if v == "full" else v) if col.name == "method" else col


def rounded(df: pd.DataFrame, hardware: list[str]) -> pd.DataFrame:
    """Fixed decimals per column (evalkit.report.columns; a wide per-budget column `<b>_<suffix>` by its
    suffix, `<b>` as the score)."""
    by_name, by_suffix = columns.decimals(hardware)
    out = df.copy()
    for c in out.columns:
        c = str(c)
        if c[:1].isdigit() or c.startswith("all_"):
            places = by_suffix.get(c.split("_", 1)[1] if "_" in c else "")
        else:
            places = by_name.get(c)
        if places is None:
            continue
        if out[c].dtype == object:  # a pivot of mixed columns: numbers held as objects
            try:
                out[c] = pd.to_numeric(out[c]).astype(float)
            except (ValueError, TypeError):
                continue
        if pd.api.types.is_float_dtype(out[c]):
            out[c] = [("" if pd.isna(v) else f"{v:.{places}f}") for v in out[c]]
    return out


def to_csv(df: pd.DataFrame, hardware: list[str]) -> str:
    return rounded(df, hardware).to_csv(index=False, na_rep="")


def _per_budget(hardware: list[str]) -> dict[str, str]:
    """Each per-budget column of the wide table: its source column -> its suffix (`<b>` and `<b>_n` apart)."""
    return {c.name: c.wide for c in columns.wide(hardware) if c.name not in ("score", "n")}


def _headline_records(runs: list[Run], pairings: dict, hardware: list[str]) -> pd.DataFrame:
    recs = []
    for run in runs:
        p = pairings.get(run.rel)
        cell = p.cells.get(run.headline, {}) if p else {}
        score = run.metrics.scores.get(run.headline, {})
        # the wide table's hit limit is the paired problems' (the long table's is the run's own share)
        figures = _pair_figures(p) | {"hit_limit": p.lengths.get("hit_limit_compressed")} if p else {}
        figures |= columns.figures(run, p, "wide", hardware)
        full = p.full.metrics.scores.get(run.headline, {}) if p else {}
        recs.append(
            {
                **{k: v for k, v in labels(run).items() if k in WIDE_INDEX},
                "metric": run.headline,
                "budget": run.budget,
                "run": run.rel,
                "reference": run.is_full,
                "score": score.get("mean"),
                "n": score.get("n"),
                "full": (score if run.is_full else full).get("mean"),
                "full_n": (score if run.is_full else full).get("n"),
                **{c: cell.get(c, figures.get(c)) for c in _per_budget(hardware)},
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


def wide_table(runs: list[Run], pairings: dict, hardware: list[str]) -> pd.DataFrame:
    """One row per configuration (WIDE_INDEX), one column group per budget; `full` rows carry their score."""
    if not runs:
        return pd.DataFrame(columns=WIDE_INDEX + ["full"])
    df = _headline_records(runs, pairings, hardware)
    reference = df.pop("reference").astype(bool)  # `Run.is_full`: a full cache in a quantized storage is
    fulls = df[reference][WIDE_INDEX + ["full", "full_n"]]  # a compressed row, its budget column `all`
    comp = df[~reference].assign(budget=[-1 if pd.isna(b) else b for b in df[~reference].budget])
    if comp.empty:
        return fulls.reset_index(drop=True)
    per_budget = _per_budget(hardware)
    values = ["score", "n", *per_budget]
    wide = comp.pivot(
        index=WIDE_INDEX, columns="budget", values=values
    )  # raises on duplicates: never averages
    out = wide.index.to_frame(index=False)
    for c in ("full", "full_n"):
        out[c] = comp.groupby(WIDE_INDEX, sort=True)[c].first().to_numpy()
    for b in sorted(wide.columns.get_level_values("budget").unique(), key=lambda b: (b < 0, b)):
        name = "all" if b < 0 else str(int(b))
        out[name] = wide[("score", b)].to_numpy()
        out[f"{name}_n"] = wide[("n", b)].to_numpy()
        for col, suffix in per_budget.items():
            out[f"{name}_{suffix}"] = wide[(col, b)].to_numpy()
    out = pd.concat([fulls, out], ignore_index=True)
    for c in ["task_version", "scorer_version", "full_n"] + [c for c in out if str(c).endswith("_n")]:
        out[c] = pd.to_numeric(out[c], errors="coerce").astype("Int64")
    order = ["model", "task", "task_version", "generation", "method", "settings", "storage"]
    return out.sort_values(order, key=_full_first).reset_index(drop=True)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def _set_labels(sets: dict[str, list[Run]]) -> dict[str, str]:
    """Each problem set named by what differs from the others (`task.load.n=1, n=6`), never by a hash alone:
    run settings from the recorded config (method settings left out: those are the lines), else
    data/version."""
    first = {g: rs[0] for g, rs in sets.items()}
    flat = {g: _flat(r.config) for g, r in first.items()}
    keys = sorted(
        {k for f in flat.values() for k in f if not k.startswith(("method.", "kv.", "results_dir"))}
    )
    differ = [k for k in keys if len({repr(f.get(k)) for f in flat.values()}) > 1]
    out = {}
    for g, r in first.items():
        parts = [f"{k}={flat[g].get(k)}" for k in differ]
        if not parts and len(sets) > 1:  # same recorded config: the data or the task version differs
            parts = [f"task_version {r.metrics.task_version}, data {str(labels(r)['data_hash'])[:8]}"]
        out[g] = ", ".join(parts + [f"{r.metrics.n if r.metrics.n is not None else '?'} problems"])
    return out


def panels(runs: list[Run]) -> dict[tuple[str, str], list[dict]]:
    """What the plots draw, per (task, model): one panel per problem set (generation identity: other problems
    or generation settings are never joined by a line), each {title, full: [(label, mean, se, n)], lines:
    {label: [(budget, mean, se)]}}; lines are labelled by method and its settings."""
    groups: dict[tuple, dict[str, list[Run]]] = {}
    for r in runs:
        if r.headline in r.metrics.scores:
            groups.setdefault((r.task, r.model), {}).setdefault(str(r.generation), []).append(r)
    out = {}
    for key, sets in sorted(groups.items()):
        names = _set_labels(sets)
        out[key] = []
        for gen, rs in sorted(sets.items(), key=lambda kv: names[kv[0]]):
            panel = {"title": names[gen], "full": [], "lines": {}}
            for r in sorted(rs, key=lambda r: (r.method, r.settings, r.storage, r.budget or 0)):
                v = r.metrics.scores[r.headline]
                label = config_label(r.method, r.settings, storage=r.storage)
                if r.budget is None:  # the full cache, in the model dtype or a quantized storage: a level
                    panel["full"].append((label, v["mean"], v.get("stderr") or 0.0, v.get("n")))
                else:
                    panel["lines"].setdefault(label, []).append((r.budget, v["mean"], v.get("stderr") or 0.0))
            out[key].append(panel)
    return out


def _model_title(rs: list[Run]) -> str:
    m, hw = (
        rs[0].metrics.model,
        rs[0].metrics.provenance.get("hardware") or "hardware not recorded by the run",
    )
    return f"{m['name']} ({m.get('dtype', '?')} weights; {hw})"


def plot(runs: list[Run], out_dir: Path) -> list[Path]:
    """Headline vs budget per (task, model): a panel per problem set, a line per (method, settings), error
    bars of one standard error, the budgets as plain numbers on a log2 axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    paths = []
    for (task, model), pans in panels(runs).items():
        head = next(r.headline for r in runs if (r.task, r.model) == (task, model))
        fig, axes = plt.subplots(
            1, len(pans), figsize=(max(7.0, 6 * len(pans)), 4.6), sharey=True, squeeze=False
        )
        for ax, pan in zip(axes[0], pans):
            budgets = sorted({b for pts in pan["lines"].values() for b, *_ in pts})
            for label, mean, se, _n in pan["full"]:
                ax.axhline(mean, color="black", ls="--", label=f"{label} (no budget): {mean:.2f} ± {se:.2f}")
                ax.axhspan(mean - se, mean + se, color="black", alpha=0.06)
            for label, pts in pan["lines"].items():
                xs, ys, es = zip(*sorted(pts))
                ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=label)
            if budgets:
                ax.set_xscale("log", base=2)
                ax.set_xticks(budgets, [str(b) for b in budgets])
                ax.xaxis.set_minor_locator(NullLocator())
                ax.set_xlim(budgets[0] / 1.5, budgets[-1] * 1.5)  # one point: no empty decades around it
            ax.set(xlabel="budget (KV entries per layer and KV head)", title=pan["title"])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0][0].set_ylabel(f"{head} (mean; bars and band: ± 1 s.e.)")
        fig.suptitle(
            f"{task}: {head} against the KV budget\n{_model_title([r for r in runs if r.model == model])}",
            fontsize=10,
        )
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
    s = report_settings(results_dir=str(results_dir))
    found, problems = pair_all(runs, s)
    for problem in problems:
        log.warning("not paired: %s", problem)
    joined: list[str] = []
    join_gains(found, s, joined)  # the memory model, for the effective decode gain
    for problem in joined:
        log.warning("no effective gain: %s", problem)
    pairings = {p.compressed.rel: p for p in found}
    long, wide = long_table(runs, pairings, s.hardware), wide_table(runs, pairings, s.hardware)
    atomic_write(results_dir / "leaderboard.csv", to_csv(long, s.hardware))
    atomic_write(results_dir / "leaderboard_wide.csv", to_csv(wide, s.hardware))
    return long, wide, plot(runs, results_dir / "plots")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m evalkit.leaderboard",
        description="Collect <results_dir>/runs/**/metrics.json into leaderboard CSVs and plots "
        "(paired statistics with the settings of conf/report.yaml).",
    )
    parser.add_argument(
        "results_dir",
        nargs="?",
        default="results",
        help="folder holding runs/, as `results_dir=<folder>` (like make eval and make report) or bare "
        "(default: results)",
    )
    args = parser.parse_args(argv)
    folder = args.results_dir.removeprefix("results_dir=")
    if "=" in folder:
        parser.error(f"unknown setting {folder.split('=')[0]!r}: the only one is results_dir=<folder>")
    results_dir = Path(folder)
    if not (results_dir / "runs").is_dir():
        parser.error(
            f"no runs under {results_dir / 'runs'}: run `make eval` first, or name another results_dir"
        )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        long, wide, plots = build(results_dir)
    except EvalkitError as e:  # e.g. a bad conf/report.yaml: the message names the setting
        exit_with("python -m evalkit.leaderboard", e)
    except OSError as e:  # the runs were read: what failed is writing the CSVs or plots
        exit_with("python -m evalkit.leaderboard", OutputError.of(e))
    print(f"{len(long)} rows from {long['run'].nunique()} runs")
    if not wide.empty:
        show = [
            c
            for c in wide.columns
            if c in ("model", "task", "method", "settings", "full")
            or c.isdigit()
            or c == "all"
            or c.endswith(("_vs_full", "_verdict"))
        ]
        print(wide[show].to_string(index=False, float_format=lambda v: f"{v:.2f}", na_rep="-"))
    print(
        f"wrote {results_dir}/leaderboard.csv, leaderboard_wide.csv and {len(plots)} plot(s) in "
        f"{results_dir}/plots"
    )


if __name__ == "__main__":
    sys.exit(main())
