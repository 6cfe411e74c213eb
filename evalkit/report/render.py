"""Writing the report: report.md (recommendation first, then problems, then one section per model and task),
report.csv (one row per compressed run and metric key) and two plots per model and task, all atomically."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from evalkit.report.build import GROUP, Report  # noqa: E402
from evalkit.report.lengths import MAX_LOOP_PERIOD, MIN_LOOP_REPEATS, MIN_LOOP_WORDS  # noqa: E402
from evalkit.results import atomic_write, save_figure  # noqa: E402

MARK = {"non-inferior": "✓", "worse": "✗", "inconclusive": "?"}
# worse: a downward triangle; an X crossed by the vertical CI line read as two stacked markers
STYLE = {"non-inferior": ("o", "full"), "worse": ("v", "full"), "inconclusive": ("o", "none")}
CSV_FIRST = GROUP + [
    "budget",
    "metric",
    "is_headline",
    "n_paired",
    "only_compressed",
    "only_full",
    "full",
    "compressed",
    "paired_diff",
    "ci_low",
    "ci_high",
    "ci_method",
    "p_value",
    "test",
    "margin",
    "verdict",
    "why",
    "n_needed",
    "n_more",
    "kv_kept_fraction",
]


def _table(headers: list[str], lines: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(
        out + ["| " + " | ".join("" if x is None else str(x) for x in line) + " |" for line in lines]
    )


def _f(x, fmt="{:+.2f}") -> str:
    return "-" if x is None or pd.isna(x) else fmt.format(x)


def _mib(n) -> str:
    return "-" if n is None or pd.isna(n) else f"{n / 2**20:,.1f} MiB"


SMALL = "†"  # a CI from fewer than min_problems paired problems: said under each table that shows one


def _cell(r, min_problems: int = 0) -> str:
    small = SMALL if r.n_paired < min_problems else ""
    return f"{_f(r.paired_diff)} [{_f(r.ci_low)}, {_f(r.ci_high)}]{small} {MARK[r.verdict]}"


def _small_note(rows: pd.DataFrame, min_problems: int) -> str:
    few = sorted({int(n) for n in rows.n_paired if n < min_problems})
    if not few:
        return ""
    return (
        f"\n\n{SMALL} n = {', '.join(map(str, few))} < min_problems = {min_problems}: a percentile bootstrap "
        "CI over this few problems is too narrow (it undercovers), so it is shown but never decides alone; "
        "the verdict then follows the exact test (p), and `worse` needs both."
    )


def _decide(r) -> str:
    if r.verdict != "inconclusive":
        return ""
    return "unknown" if pd.isna(r.n_needed) else f"{int(r.n_needed)} (+{int(r.n_more)})"


def _config(method: str, settings: str, query_aware=True) -> str:
    """A configuration's label: `snapstream recent64`; a query-agnostic run says so."""
    name = method if settings == "default" else f"{method} {settings}"
    return name if query_aware is not False else f"{name} (query-agnostic)"


# --- markdown ---------------------------------------------------------------------------------------


def _header(rep: Report) -> str:
    s, st = rep.settings, rep.settings.stats
    per_task = ", ".join(f"{t} {m:g}" for t, m in sorted(s.margins.items())) or "none"
    n_comp = sum(not r.is_full for r in rep.runs)
    paired = rep.cells["run"].nunique() if len(rep.cells) else 0
    return "\n".join(
        [
            "# Deployment report: is the compressed cache as good as the full one?",
            "",
            f"{len(rep.runs)} runs read under `{s.results_dir}/runs`; {paired} of {n_comp} compressed runs "
            "paired sample by sample with the `full` run that generated from the same prompts.",
            "",
            f"- margin delta = {st.margin:g} points (per task: {per_task}); a verdict needs >= "
            f"{st.min_problems} paired problems",
            f"- difference = compressed - full, {st.confidence:.0%} CI by a paired percentile bootstrap over "
            f"problems ({st.resamples} resamples, seed {s.seed}; the k repeats of a problem stay together); "
            "all equal: exact bound",
            "- p-value: exact McNemar (one binary outcome per problem), otherwise a two-sided sign-flip "
            "permutation test",
            "- output length: the median per-problem ratio of output tokens compressed / full with the "
            f"distribution-free {st.confidence:.0%} CI of a median (order statistics, the sign-test "
            "interval); effective decode gain = the memory-bound tok/s gain x full / compressed tokens; a "
            "budget is recommended only when it is non-inferior and its effective gain is above 1",
            "- problems to decide: normal-approximation sample size for a paired non-inferiority test "
            f"(Chow, Shao & Wang 2008, 3.1) at one-sided alpha {(1 - st.confidence) / 2:g}, power "
            f"{st.power:g}, the observed mean and SD",
            f"- memory: **modelled** by evalkit.memory with {s.deploy['weight_dtype']} weights, "
            f"{s.deploy['kv_dtype']} KV, tp {s.deploy['tp']}, {s.deploy['attention']}; hardware "
            f"{', '.join(s.hardware)}; at each full run's median request (its longest where the run recorded "
            "no per-request lengths: each section says). Max batch and tok/s gain are memory-bound upper "
            "bounds (KV capacity, bytes read), not predictions of measured speed; measured figures "
            "(kept/seen, the run's peak KV bytes in its own dtype, the bench's decode speedup) are labelled "
            "as such",
        ]
    )


def _recommendation(rep: Report) -> str:
    hw = rep.settings.hardware
    lines = [
        "## Recommendation",
        "",
        "Per model: the smallest budget non-inferior, with an effective decode gain above 1, on every task "
        "it was evaluated on.",
        "",
    ]
    lines.append(
        _table(
            ["model", "cache", "tasks", "budget", "status"],
            [
                [
                    r["model"],
                    _config(r["method"], r["settings"], r.get("query_aware")),
                    ", ".join(r["tasks"]),
                    r.get("budget") or "-",
                    r["status"]
                    + "".join(
                        f"; {b}: {', '.join(f'{t} {v}' for t, v in bl.items())}"
                        for b, bl in (r.get("blockers") or {}).items()
                    ),
                ]
                for r in rep.by_model
            ],
        )
    )
    lines += [
        "",
        "Per task: the smallest budget that is non-inferior and whose effective decode gain is above 1 on "
        "every hardware, its paired difference, what it saves (modelled), the decode gain's memory-bound "
        "upper bound (modelled; see What the budget buys), the full/compressed output tokens (measured) and "
        "their product, the effective gain. A non-inferior budget whose longer outputs erase its gain is "
        "named in the status, not recommended.",
        "",
    ]
    lines.append(
        _table(
            ["model", "task", "cache", "budgets run", "budget", "diff [CI]", "KV saving"]
            + [f"tok/s gain bound {h}" for h in hw]
            + ["tokens full/compressed"]
            + [f"effective gain {h}" for h in hw]
            + ["status"],
            [
                [
                    r["model"],
                    r["task"],
                    _config(r["method"], r["settings"], r.get("query_aware")),
                    ", ".join(map(str, r["budgets"])),
                    r.get("budget") or "-",
                    f"{_f(r['diff'])} [{_f(r['ci'][0])}, {_f(r['ci'][1])}]" if r.get("budget") else "-",
                    _f(r.get("memory_saving"), "{:.1%}"),
                ]
                + [_f(r.get(f"tok_s_gain_{h}"), "{:.2f}x") for h in hw]
                + [_f(r.get("token_gain"), "{:.2f}")]
                + [_f(r.get(f"effective_gain_{h}"), "{:.2f}x") for h in hw]
                + [r["status"]]
                for r in rep.by_task
            ],
        )
    )
    return "\n".join(lines)


def _bullets(title: str, items: list[str], empty: str) -> str:
    return f"## {title} ({len(items)})\n\n" + ("\n".join(f"- {x}" for x in items) if items else empty)


def _headline_table(rows: pd.DataFrame, min_problems: int) -> str:
    return _table(
        [
            "cache",
            "budget",
            "kept/seen",
            "paired n",
            "one side only (C/F)",
            "full",
            "compressed",
            "diff [CI]",
            "p (test)",
            "verdict",
            "problems to decide",
        ],
        [
            [
                _config(r.method, r.settings, r.query_aware),
                int(r.budget),
                _f(r.kv_kept_fraction, "{:.3f}"),
                r.n_paired,
                f"{r.only_compressed}/{r.only_full}",
                _f(r.full, "{:.2f}"),
                _f(r.compressed, "{:.2f}"),
                _cell(r, min_problems),
                f"{r.p_value:.3g} ({r.test})",
                r.verdict + (f" ({r.why})" if r.why else ""),
                _decide(r),
            ]
            for r in rows.itertuples()
        ],
    ) + _small_note(rows, min_problems)


def _memory_table(rows: pd.DataFrame, hw: list[str]) -> str:
    if "kv_bytes_seq" not in rows or rows.kv_bytes_seq.isna().all():
        return "Memory model not joined (see Problems)."
    first = rows.iloc[0]
    kv_dtype, run_dtype = first.get("kv_dtype_modelled", "bf16"), first.get("dtype_measured") or "its dtype"
    bench = "bench_speedup" in rows and not rows.bench_speedup.isna().all()
    head = (
        f"Context: the full run's {first.context_basis}, {int(first.context_tokens)} tokens (prompt "
        f"{int(first.context_prompt_tokens)}; full cache {int(first.kv_entries_full)} entries, "
        f"{_mib(first.kv_bytes_seq_full)} per sequence). **Modelled** (evalkit.memory, {kv_dtype} KV): "
        "entries, KV / sequence, saving, and per hardware the max batch whose KV fits beside the weights and "
        "the decode tok/s gain at that batch: memory-bound upper bounds, not predictions of measured speed; "
        "the effective gain is that bound times full / compressed output tokens (measured on the paired "
        "problems: the tokens generated for the same work). "
        f"**Measured** by the run: kept/seen and its peak KV bytes, in the run's own dtype ({run_dtype}), so "
        f"they differ from the modelled {kv_dtype} bytes."
        + (
            " **Measured** by `make bench` (results/bench/decode_speed.csv: this model, batch 1, CPU): the "
            "decode speedup over the full cache at the bench prompt length nearest this context."
            if bench
            else ""
        )
        + "\n\n"
    )
    return head + _table(
        ["cache", "budget", "kept/seen (measured)", "entries", f"KV / sequence ({kv_dtype})", "saving"]
        + [f"max batch bound {h} (full)" for h in hw]
        + [f"tok/s gain bound {h}" for h in hw]
        + [f"effective gain {h}" for h in hw]
        + [f"peak KV bytes (measured, {run_dtype})"]
        + (["decode speedup (measured, bench)"] if bench else []),
        [
            [
                _config(r["method"], r["settings"], r.get("query_aware")),
                int(r["budget"]),
                _f(r["kv_kept_fraction"], "{:.3f}"),
                _f(r["kv_entries"], "{:.0f}"),
                _mib(r["kv_bytes_seq"]),
                _f(r["memory_saving"], "{:.1%}"),
            ]
            + [f"{_f(r[f'max_batch_{h}'], '{:.0f}')} ({_f(r[f'max_batch_full_{h}'], '{:.0f}')})" for h in hw]
            + [_f(r[f"tok_s_gain_{h}"], "{:.2f}x") for h in hw]
            + [_f(r.get(f"effective_gain_{h}"), "{:.2f}x") for h in hw]
            + [_f(r.get("kv_peak_bytes_measured"), "{:,.0f}")]
            + (
                [
                    "-"
                    if pd.isna(r.get("bench_speedup"))
                    else f"{r['bench_speedup']:.2f}x at {int(r['bench_prompt_tokens'])} tokens"
                ]
                if bench
                else []
            )
            for _, r in rows.iterrows()
        ],
    )


def _breakdowns(cells: pd.DataFrame, min_problems: int) -> str:
    sub = cells[~cells.is_headline]
    if sub.empty:
        return "No breakdown keys."
    cols = sorted({(r.method, r.settings, not r.query_aware, int(r.budget)) for r in sub.itertuples()})
    grid = {(r.metric, (r.method, r.settings, not r.query_aware, int(r.budget))): r for r in sub.itertuples()}
    return _table(
        ["key", "n"] + [f"{_config(m, s, not a)} {b}" for m, s, a, b in cols],
        [
            [key, int(sub[sub.metric == key].n_paired.max())]
            + [_cell(grid[(key, c)], min_problems) if (key, c) in grid else "-" for c in cols]
            for key in sorted(set(sub.metric))
        ],
    ) + _small_note(sub, min_problems)


def _ratio(r) -> str:
    """Median length ratio with its CI; `longer`/`shorter` when the CI excludes 1."""
    if pd.isna(r.get("length_ratio")):
        return "-"
    lo, hi = r.get("length_ratio_ci_low"), r.get("length_ratio_ci_high")
    ci = f"[{_f(lo, '{:.2f}')}, {_f(hi, '{:.2f}')}]".replace("-", "unbounded")
    side = " longer" if lo > 1 else " shorter" if hi < 1 else ""
    return f"x{r['length_ratio']:.2f} {ci}{side}"


def _pair_pct(r, key: str) -> str:
    c, f = r.get(f"{key}_compressed"), r.get(f"{key}_full")
    return "-" if pd.isna(c) or pd.isna(f) else f"{c:.1f}% ({f:.1f}%)"


LENGTHS_INTRO = (
    "Per paired problem (repeats paired by index): output tokens (mean over repeats), the **median** of the "
    "per-problem ratios compressed / full with its distribution-free {conf:.0%} CI (order statistics: the "
    "sign-test interval of a median; `unbounded` below 6 problems; `longer` / `shorter` when it excludes "
    "1), full / compressed tokens summed over the problems (what the effective gain multiplies by), and the "
    "shares of outputs that hit the token limit, have no extractable answer (the task's own: AIME no box, "
    "LiveCodeBench no code block, LongBench-v2 no choice; `-` for a task without one) and end in a "
    "repeating tail ({words}+ words repeating with a period of at most {period} words, >= {copies} "
    "copies), compressed (full) on the same problems. All measured.\n\n"
)


def _length_table(rows: pd.DataFrame, confidence: float) -> str:
    if "n_length" not in rows or rows.n_length.isna().all():
        return "No output lengths recorded (the samples' `generation` records lack `output_tokens`)."
    intro = LENGTHS_INTRO.format(
        conf=confidence, words=MIN_LOOP_WORDS, period=MAX_LOOP_PERIOD, copies=MIN_LOOP_REPEATS
    )
    return intro + _table(
        ["cache", "budget", "problems", "tokens full", "tokens compressed", "length ratio [CI]"]
        + ["full/compressed tokens", "hit limit", "no answer", "repeating tail"],
        [
            [
                _config(r["method"], r["settings"], r.get("query_aware")),
                int(r["budget"]),
                _f(r["n_length"], "{:.0f}"),
                _f(r["tokens_full"], "{:.1f}"),
                _f(r["tokens_compressed"], "{:.1f}"),
                _ratio(r),
                _f(r["token_gain"], "{:.2f}"),
            ]
            + [_pair_pct(r, k) for k in ("hit_limit", "no_answer", "repeating")]
            for _, r in rows.iterrows()
        ],
    )


def _query_section(rep: Report, model: str, task: str) -> list[str]:
    q = rep.query
    if q.empty:
        return []
    rows = q[(q.model == model) & (q.task == task) & q.is_headline]
    if rows.empty:
        return []
    st = rep.settings.stats
    table = _table(
        ["cache", "budget", "paired n", "query-aware", "query-agnostic", "diff [CI]", "p (test)", "verdict"]
        + ["problems to decide", "length ratio agnostic/aware [CI]"],
        [
            [
                _config(r.method, r.settings),
                int(r.budget),
                r.n_paired,
                _f(r.full, "{:.2f}"),
                _f(r.compressed, "{:.2f}"),
                _cell(r, st.min_problems),
                f"{r.p_value:.3g} ({r.test})",
                r.verdict + (f" ({r.why})" if r.why else ""),
                _decide(r),
                _ratio(r._asdict()),
            ]
            for r in rows.itertuples()
        ],
    ) + _small_note(rows, st.min_problems)
    return [
        "### Query-agnostic vs query-aware",
        "",
        "The same budget and problems compressed before the question was seen (`query_aware=false`) and "
        "after it: diff = query-agnostic - query-aware (points), the same paired statistics and verdicts "
        "against the margin; each against the full cache is in the table above. Paired with "
        f"`{rows.iloc[0].aware_run}`" + (" and others." if rows.aware_run.nunique() > 1 else "."),
        "",
        table,
        "",
    ]


def _section(rep: Report, model: str, task: str, plots: dict) -> str:
    cells = rep.cells[(rep.cells.model == model) & (rep.cells.task == task)]
    head = cells[cells.is_headline]
    full = head.iloc[0]
    parts = [
        f"## {task} / {model}",
        "",
        f"Paired with `{full.full_run}`; headline `{full.metric}`, margin {full.margin:g} points.",
        "",
        _headline_table(head, rep.settings.stats.min_problems),
        "",
        "### What the budget buys",
        "",
        _memory_table(head, rep.settings.hardware),
        "",
        "### Length and failure (compressed vs full, paired)",
        "",
        _length_table(head, rep.settings.stats.confidence),
        "",
        *_query_section(rep, model, task),
        "### Breakdowns (diff [CI] verdict)",
        "",
        _breakdowns(cells, rep.settings.stats.min_problems),
        "",
    ]
    parts += [f"![{kind}]({path.name})" for kind, path in plots.get((model, task), {}).items()]
    return "\n".join(parts)


READING = """## How to read this report

Each cell compares the compressed cache with the full cache **on the same problems** (same prompts, same
data, same generation settings): `diff` is compressed - full in points, with its 95% CI. `non-inferior`
means the CI's lower bound is above -delta: with 95% confidence the cache costs less than delta points.
`worse` means the CI lies below 0. `inconclusive` means the data cannot tell: the last column says how many
paired problems would decide at the observed variance (in all, and how many more). A verdict needs at least
`min_problems` paired problems (a CI from fewer is marked †); identical results on every problem get an exact
bound, not a zero-width CI. KV bytes, max batch and tok/s gains are modelled: the batch and gain are
memory-bound upper bounds, not measured speed; kept/seen, peak KV bytes and a bench speedup are measured."""


def markdown(rep: Report, plots: dict) -> str:
    sections = [
        _header(rep),
        _recommendation(rep),
        _bullets("Problems", rep.problems, "None: every compressed run was paired."),
        _bullets("Missing cells", rep.missing, "None: the sweep is complete."),
        _bullets("Notes", rep.notes, "None."),
    ]
    if len(rep.cells):
        for model, task in sorted(set(zip(rep.cells.model, rep.cells.task))):
            sections.append(_section(rep, model, task, plots))
    return "\n\n".join(sections + [READING]) + "\n"


# --- plots ------------------------------------------------------------------------------------------


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
    budgets = sorted(set(int(b) for b in head.budget))
    pos = {b: i for i, b in enumerate(budgets)}
    groups = list(head.groupby(["method", "settings", "query_aware"], sort=True))
    margin = float(head.margin.iloc[0])
    ax.axhspan(-margin, margin, color="tab:green", alpha=0.12, label=f"±δ ({margin:g} points)")
    ax.axhline(0, color="black", lw=0.8)
    ax.axhline(-margin, color="tab:green", lw=1, ls="--")
    for g, ((method, sett, aware), rows) in enumerate(groups):
        shift = (g - (len(groups) - 1) / 2) * 0.12
        color = f"C{g}"
        for r in rows.itertuples():
            x = pos[int(r.budget)] + shift
            ax.plot([x, x], [r.ci_low, r.ci_high], color=color, lw=2, zorder=2)
            marker, fill = STYLE[r.verdict]
            ax.plot(x, r.paired_diff, marker=marker, ms=9, color=color, fillstyle=fill, mec=color, zorder=3)
            if fill == "none":  # hollow: the CI line must not show through
                ax.plot(x, r.paired_diff, marker=marker, ms=7, color="white", zorder=3)
        ax.plot([], [], color=color, marker="o", label=_config(method, sett, aware))
    _verdict_legend(ax)
    ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
    ax.set(
        xlabel="budget (KV entries per layer and KV head)",
        ylabel=f"compressed - full (points; bars: {confidence:.0%} CI)",
        title=title,
    )
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    _save(fig, path)


def pareto(head: pd.DataFrame, title: str, path: Path, kv_dtype: str = "bfloat16") -> None:
    """Headline score (on the paired problems) against KV bytes per sequence; non-inferior points filled."""
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
    for g, ((method, sett, aware), rows) in enumerate(
        head.groupby(["method", "settings", "query_aware"], sort=True)
    ):
        color = f"C{g}"
        ax.plot([], [], "o", color=color, label=_config(method, sett, aware))
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
            ax.annotate(
                str(int(r.budget)),
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
        xlabel=f"KV cache per sequence (MiB in {kv_dtype}, modelled by evalkit.memory)",
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
    configs = sorted({(r.method, r.settings, not r.query_aware) for r, _ in runs})
    fig, axes = plt.subplots(1, len(configs), figsize=(max(6.0, 5.2 * len(configs)), 5.0), squeeze=False)
    limits = [np.nanmax(per["limit"]) for _, per in runs if not np.isnan(per["limit"]).all()]
    limit = max(limits, default=None)
    top = max(float(np.max(np.r_[per["c_tokens"], per["f_tokens"]])) for _, per in runs)
    top = max(top, limit or 0) * 1.05
    budgets = sorted({r.budget for r, _ in runs})  # one colour per budget in every panel
    for ax, (method, sett, agnostic) in zip(axes[0], configs):
        mine = [
            (r, per)
            for r, per in runs
            if (r.method, r.settings, not r.query_aware) == (method, sett, agnostic)
        ]
        mine.sort(key=lambda x: x[0].budget)
        ax.plot([0, top], [0, top], color="black", lw=0.8, label="no change")
        if limit:
            ax.axvline(limit, color="tab:red", ls="--", lw=1, label=f"token limit {limit:g}")
            ax.axhline(limit, color="tab:red", ls="--", lw=1)
        for r, per in mine:
            ax.scatter(
                per["f_tokens"], per["c_tokens"], s=14, alpha=0.7, color=f"C{budgets.index(r.budget)}",
                label=f"{int(r.budget)}: median x{r.length_ratio:.2f}",
            )  # fmt: skip
        ax.set(
            xlim=(0, top), ylim=(0, top), xlabel="full cache: output tokens per problem",
            ylabel="compressed: output tokens per problem", title=_config(method, sett, not agnostic),
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
        paths = {"forest": out / f"forest_{task}_{model}.png", "pareto": out / f"pareto_{task}_{model}.png"}
        forest(
            rows,
            f"{task} / {model} ({n} paired problems): {metric}, compressed - full",
            paths["forest"],
            rep.settings.stats.confidence,
        )
        pareto(rows, f"{task} / {model} ({n} paired problems): {metric} vs KV memory", paths["pareto"], kv)
        lengths = out / f"lengths_{task}_{model}.png"
        what = f"{task} / {model}\noutput tokens per paired problem, compressed vs full"
        if length_plot(rep, rows, what, lengths):
            paths["lengths"] = lengths
        plots[(model, task)] = paths
    return plots


def write(rep: Report) -> dict[str, Path]:
    out = Path(rep.settings.results_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(rep, out)
    cells = rep.cells
    if len(cells):
        cells = cells[[c for c in CSV_FIRST if c in cells] + [c for c in cells if c not in CSV_FIRST]]
    paths = {"md": out / "report.md", "csv": out / "report.csv"}
    atomic_write(paths["csv"], cells.to_csv(index=False, float_format="%.6g"))
    atomic_write(paths["md"], markdown(rep, plots))
    return paths | {f"{k}_{m}_{t}": p for (m, t), d in plots.items() for k, p in d.items()}
