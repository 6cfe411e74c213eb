"""The report's plots per model and task: a forest plot (paired difference and CI against budget, the
+-delta band), a Pareto plot (score against modelled KV bytes) and a length plot (compressed against full
output tokens per paired problem). The same marker means the same verdict in every plot."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from evalkit.report.build import Report  # noqa: E402
from evalkit.report.columns import budget_key, budget_label, config_label  # noqa: E402
from evalkit.results import save_figure  # noqa: E402

# worse: a downward triangle; an X crossed by the vertical CI line read as two stacked markers
STYLE = {"non-inferior": ("o", "full"), "worse": ("v", "full"), "inconclusive": ("o", "none")}


def _save(fig, path: Path) -> None:
    save_figure(fig, path)  # atomic like every other output
    plt.close(fig)


def _verdict_legend(ax) -> None:
    """Legend entries for the markers: the same shape means the same verdict in both plots."""
    for verdict, (marker, fill) in STYLE.items():
        ax.plot([], [], "k" + marker, fillstyle=fill, ls="none", label=verdict)


def forest(head: pd.DataFrame, title: str, path: Path, confidence: float = 0.95) -> None:
    """Paired difference and CI against budget, one series per cache, the +-delta band shaded."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    budgets = sorted(
        {budget_label(b) for b in head.budget}, key=lambda b: budget_key(None if b == "all" else b)
    )
    pos = {b: i for i, b in enumerate(budgets)}
    groups = list(head.groupby(["method", "settings", "storage", "query_aware"], sort=True))
    margin = float(head.margin.iloc[0])
    ax.axhspan(-margin, margin, color="tab:green", alpha=0.12, label=f"±δ ({margin:g} points)")
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(-margin, color="tab:green", lw=1, ls="--")
    for g, ((method, sett, kv, aware), rows) in enumerate(groups):
        shift = (g - (len(groups) - 1) / 2) * 0.12
        color = f"C{g}"
        for r in rows.itertuples():
            x = pos[budget_label(r.budget)] + shift
            ax.plot([x, x], [r.ci_low, r.ci_high], color=color, lw=2, zorder=2)
            marker, fill = STYLE[r.verdict]
            ax.plot(x, r.paired_diff, marker=marker, ms=9, color=color, fillstyle=fill, mec=color, zorder=3)
            if fill == "none":  # hollow: the CI line must not show through
                ax.plot(x, r.paired_diff, marker=marker, ms=7, color="white", zorder=3)
        ax.plot([], [], color=color, marker="o", label=config_label(method, sett, aware, kv))
    _verdict_legend(ax)
    ax.set_xticks(range(len(budgets)), budgets)
    ax.set(
        xlabel="budget (KV entries per layer and KV head)",
        ylabel=f"compressed - full (points; bars: {confidence:.0%} CI)",
        title=title,
    )
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    _save(fig, path)


def pareto(head: pd.DataFrame, title: str, path: Path, kv_dtype: str = "bfloat16", best=None) -> None:
    """The frontier: headline score (on the paired problems) against KV bytes per sequence in each
    configuration's storage; non-inferior points filled, the recommended one (`best`: its run) ringed."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if "kv_bytes_seq_full" in head and not head.kv_bytes_seq_full.isna().all():
        first = head.iloc[0]
        ax.plot(first.kv_bytes_seq_full / 2**20, first.full, "k*", ms=13, label="full")
        ax.annotate(
            "full",
            (first.kv_bytes_seq_full / 2**20, first.full),
            textcoords="offset points",
            xytext=(-8, -14),
            fontsize=8,
        )
    for g, ((method, sett, kv, aware), rows) in enumerate(
        head.groupby(["method", "settings", "storage", "query_aware"], sort=True)
    ):
        color = f"C{g}"
        ax.plot([], [], "o", color=color, label=config_label(method, sett, aware, kv))
        for r in rows.itertuples():
            if pd.isna(getattr(r, "kv_bytes_seq", float("nan"))):
                continue
            marker, fill = STYLE[r.verdict]
            ax.plot(
                r.kv_bytes_seq / 2**20,
                r.compressed,
                marker=marker,
                ms=8,
                color=color,
                fillstyle=fill,
                mec=color,
            )
            if r.run == best:
                ax.plot(r.kv_bytes_seq / 2**20, r.compressed, "o", ms=16, mfc="none", mec="black")
            ax.annotate(
                budget_label(r.budget),
                (r.kv_bytes_seq / 2**20, r.compressed),
                textcoords="offset points",
                xytext=(5, 4),
                fontsize=8,
            )
    ax.set_xscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 2.8, 5.6, 45 rather than 2.8 x 10^0
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(plain)
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set(
        xlabel=f"KV per sequence (MiB in its storage, {kv_dtype} unquantized; modelled by evalkit.memory)",
        ylabel=f"{head.metric.iloc[0]} (paired problems)",
        title=title,
    )
    ax.grid(alpha=0.3)
    _verdict_legend(ax)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    _save(fig, path)


def length_plot(rep: Report, rows: pd.DataFrame, title: str, path: Path) -> bool:
    """Per configuration a panel: compressed against full output tokens per paired problem, one colour per
    budget, the diagonal (no change) and the token limit on both axes. False (nothing drawn) without
    lengths."""
    runs = [(r, rep.lengths.get(r.run) or {}) for r in rows.itertuples()]
    runs = [(r, per) for r, per in runs if len(per.get("id", []))]
    if not runs:
        return False
    configs = sorted({(r.method, r.settings, r.storage, not r.query_aware) for r, _ in runs})
    fig, axes = plt.subplots(1, len(configs), figsize=(max(6.0, 5.2 * len(configs)), 5.0), squeeze=False)
    limits = [np.nanmax(per["limit"]) for _, per in runs if not np.isnan(per["limit"]).all()]
    limit = max(limits, default=None)
    top = max(float(np.max(np.r_[per["c_tokens"], per["f_tokens"]])) for _, per in runs)
    top = max(top, limit or 0) * 1.05
    budgets = sorted({budget_label(r.budget) for r, _ in runs})  # one colour per budget in every panel
    for ax, (method, sett, kv, agnostic) in zip(axes[0], configs):
        mine = [
            (r, per)
            for r, per in runs
            if (r.method, r.settings, r.storage, not r.query_aware) == (method, sett, kv, agnostic)
        ]
        mine.sort(key=lambda x: budget_key(x[0].budget))
        ax.plot([0, top], [0, top], color="black", lw=0.8, label="no change")
        if limit:
            ax.axvline(limit, color="tab:red", ls="--", lw=1, label=f"token limit {limit:g}")
            ax.axhline(limit, color="tab:red", ls="--", lw=1)
        for r, per in mine:
            ax.scatter(
                per["f_tokens"], per["c_tokens"], s=14, alpha=0.7,
                color=f"C{budgets.index(budget_label(r.budget))}",
                label=f"{budget_label(r.budget)}: median x{r.length_ratio:.2f}",
            )  # fmt: skip
        ax.set(
            xlim=(0, top), ylim=(0, top), xlabel="full cache: output tokens per problem",
            ylabel="compressed: output tokens per problem",
            title=config_label(method, sett, not agnostic, kv),
        )  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", title="budget", title_fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    return True


def write_plots(rep: Report, out: Path) -> dict:
    plots = {}
    head = rep.headline
    for (model, task), rows in head.groupby(["model", "task"], sort=True) if len(head) else []:
        metric, n = rows.metric.iloc[0], int(rows.n_paired.max())
        kv = rep.settings.deploy["kv_dtype"]
        name = re.sub(r"[^\w.-]+", "_", task).strip("_") + f"_{model}"  # `ruler (limit=20)`: a file name
        paths = {"forest": out / f"forest_{name}.png", "pareto": out / f"pareto_{name}.png"}
        forest(
            rows,
            f"{task} / {model} ({n} paired problems): {metric}, compressed - full",
            paths["forest"],
            rep.settings.stats.confidence,
        )
        rec = next((r for r in rep.by_bytes if (r["model"], r["task"]) == (model, task)), {})
        what = f"{task} / {model} ({n} paired problems): {metric} vs KV bytes\n(ringed: recommended)"
        pareto(rows, what, paths["pareto"], kv, (rec.get("best") or {}).get("run"))
        lengths = out / f"lengths_{name}.png"
        what = f"{task} / {model}\noutput tokens per paired problem, compressed vs full"
        if length_plot(rep, rows, what, lengths):
            paths["lengths"] = lengths
        plots[(model, task)] = paths
    return plots
