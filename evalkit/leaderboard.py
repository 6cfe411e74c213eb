"""Leaderboard: every `metrics.json` under `<results_dir>/runs` into two CSVs and one plot per model and task.

Reads only fields stored inside each metrics.json (never meaning parsed from paths); runs no model.
    results/leaderboard.csv       long: one row per (run, metric, subset)
    results/leaderboard_wide.csv  headline score, methods x budgets per model and task, and the gap to `full`
    results/plots/<task>_<model>.png   headline score vs budget, one line per method, `full` as a reference
Sorted rows and fixed float formats, so reruns diff cleanly: `python -m evalkit.leaderboard [results_dir]`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from evalkit.results import atomic_write

LONG_COLUMNS = ["model", "task", "subset", "method", "budget", "measured_compression", "metric", "score", "stderr",
                "n", "data_source", "git_sha"]  # fmt: skip


def runs(results_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("runs/**/metrics.json"))]


def long_rows(metrics: dict) -> list[dict]:
    base = {
        "model": metrics["model"]["name"],
        "task": metrics["task"],
        "method": metrics["method"]["name"],
        "budget": metrics["budget"],
        "measured_compression": metrics["kv"]["compression_ratio"],
        "data_source": metrics["data"]["source"],
        "git_sha": metrics["provenance"].get("git_sha"),
    }
    rows = []
    for key, v in metrics["scores"].items():
        metric, _, subset = key.partition("/")
        rows.append({**base, "metric": metric, "subset": subset or "all", "score": v["mean"],
                     "stderr": v["stderr"], "n": v["n"]})  # fmt: skip
    gen = metrics["generation"]
    if gen.get("mean_output_tokens") is not None:
        rows.append({**base, "metric": "output_tokens", "subset": "all", "score": gen["mean_output_tokens"],
                     "stderr": None, "n": gen["requests"]})  # fmt: skip
    return rows


def long_table(all_metrics: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame([r for m in all_metrics for r in long_rows(m)], columns=LONG_COLUMNS)
    df["budget"] = df["budget"].astype("Int64")
    return df.sort_values(
        ["model", "task", "metric", "subset", "method", "budget"], na_position="first"
    ).reset_index(drop=True)


def wide_table(all_metrics: list[dict]) -> pd.DataFrame:
    """Headline score per (model, task, method) row and budget column, plus `<budget> vs full` gaps."""
    rows = [
        {
            "model": m["model"]["name"],
            "task": m["task"],
            "metric": m["headline"],
            "method": m["method"]["name"],
            "budget": m["budget"],
            "score": m["scores"].get(m["headline"], {}).get("mean"),
        }  # fmt: skip
        for m in all_metrics
    ]
    df = pd.DataFrame(rows, columns=["model", "task", "metric", "method", "budget", "score"])
    if df.empty:
        return df
    full = df[df.method == "full"].set_index(["model", "task"])["score"]
    comp = df[df.method != "full"]
    wide = comp.pivot_table(index=["model", "task", "metric", "method"], columns="budget", values="score")
    wide.columns = [str(int(b)) for b in wide.columns]
    wide = wide.reset_index()
    wide.insert(4, "full", [full.get((r.model, r.task)) for r in wide.itertuples()])
    for b in [c for c in wide.columns if c.isdigit()]:
        wide[f"{b}_vs_full"] = wide[b] - wide["full"]
    fulls = df[df.method == "full"].assign(full=lambda d: d.score)[
        ["model", "task", "metric", "method", "full"]
    ]
    return (
        pd.concat([fulls, wide], ignore_index=True)
        .sort_values(["model", "task", "method"])
        .reset_index(drop=True)
    )


def plot(all_metrics: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    groups: dict[tuple, list[dict]] = {}
    for m in all_metrics:
        groups.setdefault((m["task"], m["model"]["name"]), []).append(m)
    for (task, model), ms in sorted(groups.items()):
        head = ms[0]["headline"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for method in sorted({m["method"]["name"] for m in ms} - {"full"}):
            pts = sorted((m["budget"], m["scores"][head]["mean"], m["scores"][head]["stderr"]) for m in ms
                         if m["method"]["name"] == method and head in m["scores"])  # fmt: skip
            if pts:
                xs, ys, es = zip(*pts)
                ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=method)
        for m in ms:
            if m["method"]["name"] == "full" and head in m["scores"]:
                ax.axhline(m["scores"][head]["mean"], color="black", linestyle="--", label="full")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="budget (KV entries per layer and head)", ylabel=head, title=f"{task} - {model}")
        ax.grid(alpha=0.3)
        ax.legend()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{task}_{model}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def build(results_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, list[Path]]:
    results_dir = Path(results_dir)
    all_metrics = runs(results_dir)
    long, wide = long_table(all_metrics), wide_table(all_metrics)
    atomic_write(results_dir / "leaderboard.csv", long.to_csv(index=False, float_format="%.4f"))
    atomic_write(results_dir / "leaderboard_wide.csv", wide.to_csv(index=False, float_format="%.4f"))
    return long, wide, plot(all_metrics, results_dir / "plots")


def main() -> None:
    results_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "results")
    long, wide, plots = build(results_dir)
    print(
        f"{len(long)} rows from {long[['model', 'task', 'method', 'budget']].drop_duplicates().shape[0]} runs"
    )
    if not wide.empty:
        print(wide.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(
        f"wrote {results_dir}/leaderboard.csv, leaderboard_wide.csv and {len(plots)} plot(s) in {results_dir}/plots"
    )


if __name__ == "__main__":
    main()
