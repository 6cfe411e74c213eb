"""Every column of the report and the leaderboard, declared once: its name, where it goes, its headers in
report.md's tables, its decimals, its glossary line (docs/report.md is checked against `glossary()`), and, for
a figure no other module computes, its value.

A column is one `Column` in COLUMNS. Where it lands follows from the entry alone:
- `csv`: "report" puts it among report.csv's leading columns (the rest of a cell's figures follow in the
  order they were computed), "long" in leaderboard.csv; `wide` names its per-budget column
  `<budget>_<wide>` of leaderboard_wide.csv (`""`: the bare `<budget>`);
- `headers`: the report.md tables that show it, each with its header there: "headline" (the section's first
  table), "budget" (what the budget buys), "lengths" (length and failure), "query" (query-agnostic vs
  query-aware); a table lists its columns in COLUMNS' order;
- the CSVs order columns by `group` (ORDER), then by COLUMNS' order.
Figures come from stats.compare, lengths.length_stats, budget.memory_row and metrics.json; a column with
`value` is computed here from the run and its pairing, so a new figure is one entry. `per_hw` columns carry
`{hw}` in name and headers, one per configured hardware."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import pandas as pd

GROUPS = {  # the glossary's sections, in its order
    "label": "what tells runs apart",
    "score": "the score of a metric key",
    "cell": "paired against the full run, per metric key (stats.compare)",
    "lengths": "length and failure, paired per problem (lengths.length_stats)",
    "gains": "decode gains (modelled bound, and it times the token gain)",
    "memory": "what the budget buys (the memory model, budget.memory_row)",
    "shares": "the run's own failure shares, over all its outputs",
    "run": "the run's own figures (metrics.json)",
}
ORDER = {  # each CSV's column groups, in order
    "report": ("label", "score", "cell", "run", "lengths", "gains", "memory"),
    "long": ("label", "score", "lengths", "gains", "shares", "run", "cell"),
    "wide": ("score", "cell", "lengths", "shares", "gains"),
}
TABLES = ("headline", "budget", "lengths", "query")


@dataclass(frozen=True)
class Column:
    name: str
    doc: str  # one line: the glossary's meaning (Markdown)
    group: str
    csv: frozenset[str] = frozenset()  # "report", "long"
    wide: str | None = None  # per-budget suffix in leaderboard_wide.csv
    decimals: int | None = None  # CSV figures rounded to this many (the leaderboard); None: as they are
    # report.md table -> its header there
    headers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    fmt: str | None = None  # its report.md cell: the value in this format ("-" when missing) ...
    show: Callable[[dict, Column, dict], str] | None = None  # ... or this, of the row (dict) and the context
    value: Callable | None = None  # (run, pairing | None) -> the figure, where no other module computes it
    per_hw: bool = False  # one column per configured hardware: `{hw}` in name and headers
    optional: bool = False  # a report.md table shows it only where some row has a value

    def cell(self, row: dict, ctx: dict) -> str:
        if self.show is not None:
            return self.show(row, self, ctx)
        value = row.get(self.name)
        return f_(value, self.fmt) if self.fmt else ("" if value is None else str(value))

    def header(self, table: str, ctx: dict) -> str:
        return self.headers[table].format(**ctx)


# --- formatting --------------------------------------------------------------------------------------------


def missing(x) -> bool:
    return x is None or (not isinstance(x, str) and pd.isna(x))


def f_(x, fmt="{:+.2f}") -> str:
    return "-" if missing(x) else fmt.format(x)


def mib(n) -> str:
    return "-" if missing(n) else f"{n / 2**20:,.1f} MiB"


MARK = {"non-inferior": "✓", "worse": "✗", "inconclusive": "?"}
SMALL = "†"  # a CI from fewer than min_problems paired problems: said under each table that shows one


def config_label(method: str, settings: str, query_aware=True, storage="none") -> str:
    """`snapstream recent64`, `snapstream + int4` (a storage but the model dtype), `(query-agnostic)`."""
    name = method if settings == "default" else f"{method} {settings}"
    name += "" if missing(storage) or storage == "none" else f" + {storage}"
    return name if query_aware is not False else f"{name} (query-agnostic)"


def budget_label(budget) -> str:  # `all`: no budget (the full cache in a quantized storage; budget_key's inf)
    return "all" if missing(budget) or budget == float("inf") else str(int(budget))


budget_key = lambda budget: float("inf") if missing(budget) else float(budget)  # noqa: E731 (`all` last)


def diff_ci(r: dict, min_problems: int = 0) -> str:
    """`-6.25 [-16.67, +0.00]† ?`: the paired difference, its CI (small-n marked) and the verdict's mark."""
    small = SMALL if r["n_paired"] < min_problems else ""
    return f"{f_(r['paired_diff'])} [{f_(r['ci_low'])}, {f_(r['ci_high'])}]{small} {MARK[r['verdict']]}"


def ratio_ci(r: dict) -> str:
    """Median length ratio with its CI; `longer`/`shorter` when the CI excludes 1."""
    if missing(r.get("length_ratio")):
        return "-"
    lo, hi = r.get("length_ratio_ci_low"), r.get("length_ratio_ci_high")
    ci = f"[{f_(lo, '{:.2f}')}, {f_(hi, '{:.2f}')}]".replace("-", "unbounded")
    side = " longer" if lo > 1 else " shorter" if hi < 1 else ""
    return f"x{r['length_ratio']:.2f} {ci}{side}"


def _pair_pct(r: dict, col: Column, ctx: dict) -> str:
    """`13.3% (0.0%)`: the compressed share and, in brackets, the full run's on the same problems."""
    key = col.name.removesuffix("_compressed")
    c, f = r.get(f"{key}_compressed"), r.get(f"{key}_full")
    return "-" if missing(c) or missing(f) else f"{c:.1f}% ({f:.1f}%)"


def _decide(r: dict, col: Column, ctx: dict) -> str:
    if r["verdict"] != "inconclusive":
        return ""
    return "unknown" if missing(r["n_needed"]) else f"{int(r['n_needed'])} (+{int(r['n_more'])})"


def _batch(r: dict, col: Column, ctx: dict) -> str:
    hw = col.name.removeprefix("max_batch_")
    return f"{f_(r.get(col.name), '{:.0f}')} ({f_(r.get(f'max_batch_full_{hw}'), '{:.0f}')})"


def _bench(r: dict, col: Column, ctx: dict) -> str:
    speedup = r.get("bench_speedup")
    return "-" if missing(speedup) else f"{speedup:.2f}x at {int(r['bench_prompt_tokens'])} tokens"


def _run_figure(section: str, key: str) -> Callable:
    """A figure of the run's metrics.json (`kv.peak_bytes`, `generation.wall_time_s`)."""
    return lambda run, pairing: getattr(run.metrics, section).get(key)


def _show(fn: Callable[[dict], str]) -> Callable[[dict, Column, dict], str]:
    return lambda r, col, ctx: fn(r)


def H(**headers: str) -> Mapping[str, str]:  # noqa: N802 (reads as a table of headers)
    return MappingProxyType(headers)


REPORT, LONG, BOTH = frozenset({"report"}), frozenset({"long"}), frozenset({"report", "long"})
CACHE = H(headline="cache", budget="cache", lengths="cache", query="cache")
BUDGET = H(headline="budget", budget="budget", lengths="budget", query="budget")


def _paired(fn: Callable) -> Callable:
    """A figure of the pairing; None for a full or unpaired run."""
    return lambda run, pairing: None if pairing is None else fn(pairing)


COLUMNS: tuple[Column, ...] = (
    # --- labels ---
    Column("model", "the model's conf name (metrics.json `model.name`)", "label", BOTH,
           value=lambda run, p: run.model),
    Column("task", "the task's conf name (a multi-question run: `<task>-multi_question`, a task of its own)",
           "label", BOTH, value=lambda run, p: run.task),
    Column("method", "the method's conf name (`method.name`); report.md's `cache` is it with its settings "
           "and `(query-agnostic)`", "label", BOTH, headers=CACHE, value=lambda run, p: run.method,
           show=_show(lambda r: config_label(r["method"], r["settings"], r.get("query_aware"),
                                             r.get("storage")))),
    Column("settings", "method settings changed from the conf defaults (`recent64`), or `default`", "label",
           BOTH, value=lambda run, p: run.settings),
    Column("query_aware", "the run setting: False = compressed before the question was seen (a run without "
           "it: True); its own rows", "label", BOTH, value=lambda run, p: run.query_aware),
    Column("storage", "the KV storage (`storage.name`: none = the model dtype, fp8_e4m3, int4 ...): its own "
           "rows, never averaged with another", "label", BOTH, value=lambda run, p: run.storage),
    Column("budget", "KV entries kept per layer and KV head; empty for `full` (report.md: `all`)", "label",
           BOTH, headers=BUDGET, value=lambda run, p: run.budget,
           show=_show(lambda r: budget_label(r["budget"]))),
    Column("task_version", "the task module's prompt/data version", "label", LONG,
           value=lambda run, p: run.metrics.task_version),
    Column("scorer_version", "the task module's scorer version", "label", LONG,
           value=lambda run, p: run.metrics.scorer_version),
    Column("data_source", "where the samples came from", "label", LONG,
           value=lambda run, p: run.metrics.data_source),
    Column("data_hash", "the hash of the samples' content", "label", LONG,
           value=lambda run, p: run.metrics.data_hash),
    Column("generation", "hash of everything that decides a generation except the method and KV storage "
           "(`identity.generation`)", "label", LONG, value=lambda run, p: run.generation),
    Column("run", "the run folder under `<results_dir>/runs`", "label", BOTH, value=lambda run, p: run.rel),
    Column("full_run", "the `full` run it is paired with", "label", REPORT,
           value=_paired(lambda p: p.full.rel)),
    Column("reference", "where that full run ran: `in process`, or `served: <model> at <url> (<server>)`, a "
           "served reference (`model.reference_for`)", "label", BOTH,
           value=_paired(lambda p: p.reference or "in process")),
    # --- the score of a metric key ---
    Column("headline", "True on the row of the task's headline metric (the first row of each run)", "score",
           LONG),
    Column("metric", "a score key: leaderboard.csv `metric` and `subset` (`all` for the metric itself), "
           "report.csv the whole `metric/subset`", "score", BOTH),
    Column("is_headline", "True on the headline metric's rows", "score", REPORT),
    Column("subset", "the breakdown of `metric` (`all`: none)", "score", LONG),
    Column("score", "the run's mean of that key (points); wide: at each budget", "score", LONG, wide="",
           decimals=2),
    Column("stderr", "its standard error of the mean", "score", LONG, decimals=2),
    Column("n", "its number of samples; wide: at each budget", "score", LONG, wide="n"),
    # --- the run's own kept/seen (in the tables early, in the CSVs with the run's figures) ---
    Column("kv_kept_fraction", "measured kept/seen: cache entries kept over tokens seen, mean over requests "
           "(1 = nothing dropped; its inverse is the compression, e.g. 0.203 = 4.9x)", "run", BOTH,
           decimals=4, fmt="{:.3f}", value=_run_figure("kv", "kept_fraction"),
           headers=H(headline="kept/seen", budget="kept/seen (measured)")),
    # --- paired statistics, per metric key ---
    Column("paired_with", "the `full` run compared with", "cell", LONG),
    Column("n_paired", "problems both runs have (paired)", "cell", BOTH,
           headers=H(headline="paired n", query="paired n"), show=_show(lambda r: str(int(r["n_paired"])))),
    Column("only_compressed", "samples only in the compressed run (left out)", "cell", REPORT,
           headers=H(headline="one side only (C/F)"), value=_paired(lambda p: len(p.only_compressed)),
           show=_show(lambda r: f"{r['only_compressed']}/{r['only_full']}")),
    Column("only_full", "samples only in the full run (left out)", "cell", REPORT,
           value=_paired(lambda p: len(p.only_full))),
    Column("full", "the full run's mean on the paired problems (query table: the query-aware run's)", "cell",
           REPORT, fmt="{:.2f}", headers=H(headline="full", query="query-aware")),
    Column("compressed", "the compressed run's mean on the paired problems", "cell", REPORT, fmt="{:.2f}",
           headers=H(headline="compressed", query="query-agnostic")),
    Column("paired_diff", "compressed - full on the shared problems (points); report.md: with its CI and the "
           "verdict's mark, † below min_problems", "cell", LONG, wide="vs_full", decimals=2,
           headers=H(headline="diff [CI]", query="diff [CI]"),
           show=lambda r, col, ctx: diff_ci(r, ctx.get("min_problems", 0))),
    Column("ci_low", "the CI's lower bound (paired bootstrap over problems, or exact)", "cell", LONG,
           wide="ci_low", decimals=2),
    Column("ci_high", "the CI's upper bound", "cell", LONG, wide="ci_high", decimals=2),
    Column("ci_method", "how the CI was computed (exact lattice bootstrap, Monte Carlo, all-equal bound)",
           "cell", REPORT),
    Column("p_value", "the exact McNemar or sign-flip p-value", "cell", LONG, wide="p", decimals=4,
           headers=H(headline="p (test)", query="p (test)"),
           show=_show(lambda r: f"{r['p_value']:.3g} ({r['test']})")),
    Column("test", "which test gave the p-value", "cell", LONG),
    Column("margin", "delta, the non-inferiority margin (points)", "cell", LONG, decimals=2),
    Column("verdict", "non-inferior / worse / inconclusive (`unpaired`: no full run to pair with)", "cell",
           LONG, wide="verdict", headers=H(headline="verdict", query="verdict"),
           show=_show(lambda r: r["verdict"] + (f" ({r['why']})" if r["why"] else ""))),
    Column("why", "why a cell is inconclusive at a small n", "cell", REPORT),
    Column("n_needed", "paired problems that would decide an inconclusive cell at the observed variance "
           "(report.md: with how many more)", "cell", REPORT,
           headers=H(headline="problems to decide", query="problems to decide"), show=_decide),
    Column("n_more", "of them, how many more than paired now", "cell", REPORT),
    Column("sd_diff", "the standard deviation of the per-problem differences", "cell", REPORT),
    Column("left_out", "problems left out of this key (repeat counts differ and it is no mean over repeats)",
           "cell", REPORT),
    # --- what the budget buys (modelled at the full run's median request) ---
    Column("kv_entries", "modelled cache entries per layer and KV head at that request", "memory", REPORT,
           fmt="{:.0f}", headers=H(budget="entries")),
    Column("kv_bytes_seq", "modelled KV bytes per sequence in the run's KV storage (codes, scales, zero "
           "points, full-precision residual; `none`: the deployment's KV dtype)", "memory", REPORT,
           headers=H(budget="KV / sequence ({kv_dtype})"), show=lambda r, col, ctx: mib(r.get(col.name))),
    Column("memory_saving", "1 - modelled KV bytes / the full cache's (in the KV dtype)", "memory", REPORT,
           fmt="{:.1%}",
           headers=H(budget="saving")),
    Column("max_batch_{hw}", "the largest batch whose KV fits beside the weights on `<hw>` (memory-bound "
           "upper bound; report.md: the full cache's beside it)", "memory", REPORT, per_hw=True,
           headers=H(budget="max batch bound {hw} (full)"), show=_batch),
    Column("max_batch_full_{hw}", "the same for the full cache", "memory", REPORT, per_hw=True),
    Column("tok_s_gain_{hw}", "the memory-bound decode tok/s gain at the max batch on `<hw>` (modelled), at "
           "the full run's median request", "gains", BOTH, wide="tok_s_gain_{hw}", decimals=3, per_hw=True,
           fmt="{:.2f}x", headers=H(budget="tok/s gain bound {hw}")),
    Column("effective_gain_{hw}", "`tok_s_gain_<hw>` x `token_gain`: what the budget buys once its outputs' "
           "length change is paid", "gains", BOTH, wide="effective_gain_{hw}", decimals=3, per_hw=True,
           fmt="{:.2f}x", headers=H(budget="effective gain {hw}")),
    Column("kv_peak_bytes_measured", "the compressed run's measured `kv.peak_bytes` (its own dtype)",
           "memory", REPORT, fmt="{:,.0f}", headers=H(budget="peak KV bytes (measured, {run_dtype})")),
    Column("bench_speedup", "`make bench`'s measured decode speedup over full at the bench prompt length "
           "nearest the context (the embedded model, batch 1, CPU)", "memory", REPORT, optional=True,
           headers=H(budget="decode speedup (measured, bench)"), show=_bench),
    Column("bench_prompt_tokens", "that bench prompt length", "memory", REPORT),
    Column("context_tokens", "tokens of the request the memory model is joined at (the full run's median "
           "request by cache length, or its longest)", "memory", REPORT),
    Column("context_prompt_tokens", "of them, every token before its answer", "memory", REPORT),
    Column("context_prefill_tokens", "of them, what the compressed run's prefill compressed (the rest, a "
           "question fed after compression and a conversation's earlier turns, is appended)", "memory",
           REPORT),
    Column("context_basis", "which request: `median request of <n>` or `longest request ...`", "memory",
           REPORT),
    Column("kv_dtype_modelled", "the deployment's KV dtype (`deploy.kv_dtype`)", "memory", REPORT),
    Column("dtype_measured", "the run's own dtype (of its measured bytes)", "memory", REPORT),
    Column("kv_entries_full", "the full cache's entries at that request", "memory", REPORT),
    Column("kv_bytes_seq_full", "the full cache's KV bytes per sequence", "memory", REPORT),
    Column("tp_{hw}", "the tensor-parallel degree modelled on `<hw>` (`deploy.tp`)", "memory", REPORT,
           per_hw=True),
    # --- length and failure, paired per problem ---
    Column("n_length", "paired problems with output lengths on both sides", "lengths", REPORT, fmt="{:.0f}",
           headers=H(lengths="problems")),
    Column("tokens_full", "mean over problems of the full run's mean output tokens", "lengths", REPORT,
           fmt="{:.1f}", headers=H(lengths="tokens full")),
    Column("tokens_compressed", "the same, compressed", "lengths", REPORT, fmt="{:.1f}",
           headers=H(lengths="tokens compressed")),
    Column("length_ratio", "the median over problems of compressed / full tokens (a 0-token side counts as "
           "1); report.md: with its CI, `longer` / `shorter` where the CI excludes 1", "lengths", BOTH,
           wide="length_ratio", decimals=3, show=_show(ratio_ci),
           headers=H(lengths="length ratio [CI]", query="length ratio agnostic/aware [CI]")),
    Column("length_ratio_ci_low", "its distribution-free CI (order statistics: the sign-test interval of a "
           "median; empty = unbounded, below n = 6 at 95%)", "lengths", BOTH, decimals=3),
    Column("length_ratio_ci_high", "the CI's upper bound", "lengths", BOTH, decimals=3),
    Column("token_gain", "full / compressed output tokens summed over the paired problems (those with an "
           "empty output on either side left out; none where every output hit the limit on both sides)",
           "lengths", BOTH, decimals=3, fmt="{:.2f}", headers=H(lengths="full/compressed tokens")),
    Column("token_limit", "the largest per-generation token limit of the paired outputs", "lengths", REPORT),
    Column("length_caveat", "why the token gain leaves problems out or is not computed (empty outputs, "
           "lengths truncated at the limit)", "lengths", REPORT),
    Column("hit_limit_compressed", "percent of the compressed outputs that hit the token limit (report.md: "
           "the full run's on the same problems in brackets)", "lengths", REPORT, show=_pair_pct,
           headers=H(lengths="hit limit")),
    Column("hit_limit_full", "the same, full", "lengths", REPORT),
    Column("empty_compressed", "percent of the compressed outputs with no token", "lengths", REPORT),
    Column("empty_full", "the same, full", "lengths", REPORT),
    Column("no_answer_compressed", "percent of the compressed outputs with no answer, by the task's "
           "`no_answer` score (`-`: the task reports none)", "lengths", REPORT, show=_pair_pct,
           headers=H(lengths="no answer")),
    Column("no_answer_full", "the same, full", "lengths", REPORT),
    Column("repeating_compressed", "percent of the compressed outputs ending in a loop: the last L words "
           "repeat with a period p <= 128, L >= 64 and L >= 3p (the last word also tried dropped)", "lengths",
           REPORT,           show=_pair_pct, headers=H(lengths="repeating tail")),
    Column("repeating_full", "the same, full", "lengths", REPORT),
    # --- the run's own failure shares (leaderboard) ---
    Column("hit_limit", "percent of the run's outputs that hit the token limit; wide: of the compressed "
           "outputs on the paired problems", "shares", LONG, wide="hit_limit", decimals=2),
    Column("no_answer", "percent of the run's outputs with no answer (the task's `no_answer` score; empty "
           "where the task reports none)", "shares", LONG, decimals=2),
    Column("repeating", "percent of the run's outputs ending in a repeating tail", "shares", LONG,
           decimals=2),
    # --- the run's own figures ---
    Column("kv_peak_bytes", "the largest cache of any request, whole (every KV head), measured in the run's "
           "dtype", "run", LONG, value=_run_figure("kv", "peak_bytes")),
    Column("kv_peak_bytes_per_rank", "what one process held of it (under tensor parallelism its share of the "
           "KV heads; MLA's latent is whole on every rank)", "run", LONG,
           value=_run_figure("kv", "peak_bytes_per_rank")),
    Column("wall_time_s", "generation wall time of the run's own requests, seconds", "run", LONG, decimals=1,
           value=_run_figure("generation", "wall_time_s")),
    Column("mean_output_tokens", "mean generated tokens per request", "run", LONG, decimals=1,
           value=_run_figure("generation", "mean_output_tokens")),
    Column("git_sha", "the commit that produced the run", "run", LONG,
           value=lambda run, p: run.metrics.git_sha),
)  # fmt: skip
# leaderboard_wide.csv's own columns, beside the labels: the paired full run's headline score and its n
WIDE_LEAD = (
    ("full", "wide: the paired full run's headline score"),
    ("full_n", "wide: its n"),
)


# --- reading the registry ----------------------------------------------------------------------------------


def expanded(hardware) -> list[Column]:
    """COLUMNS with each per-hardware column once per `hardware`, in order."""
    out = []
    for c in COLUMNS:
        if not c.per_hw:
            out.append(c)
            continue
        for hw in hardware:
            headers = {t: h.replace("{hw}", hw) for t, h in c.headers.items()}
            wide = None if c.wide is None else c.wide.replace("{hw}", hw)
            out.append(replace(c, name=c.name.replace("{hw}", hw), headers=H(**headers), wide=wide))
    return out


def in_csv(where: str, hardware) -> list[Column]:
    """The columns of a CSV ("report" or "long"), in its order: its groups (ORDER), then COLUMNS' order."""
    cols = [c for c in expanded(hardware) if where in c.csv]
    return sorted(cols, key=lambda c: ORDER[where].index(c.group))


def wide(hardware) -> list[Column]:
    """The per-budget columns of leaderboard_wide.csv, in its order (`<b>` and `<b>_n` first)."""
    cols = [c for c in expanded(hardware) if c.wide is not None]
    return sorted(cols, key=lambda c: ORDER["wide"].index(c.group))


def in_table(table: str, hardware) -> list[Column]:
    return [c for c in expanded(hardware) if table in c.headers]


def figures(run, pairing, where: str, hardware=()) -> dict:
    """The figures this registry computes (`value`) for a row of `run` and its pairing (or None) in a CSV
    ("report": also those report.md shows, its tables being views of report.csv's rows)."""
    return {
        c.name: c.value(run, pairing)
        for c in expanded(hardware)
        if c.value and (where in c.csv or (where == "report" and c.headers))
    }


def decimals(hardware) -> tuple[dict[str, int], dict[str, int]]:
    """({CSV column: decimals}, {wide per-budget suffix: decimals})."""
    cols = [c for c in expanded(hardware) if c.decimals is not None]
    by_name = {c.name: c.decimals for c in cols} | {"full": 2}  # WIDE_LEAD's score
    return by_name, {c.wide: c.decimals for c in cols if c.wide is not None}


def table(table: str, rows: pd.DataFrame, hardware, ctx: dict) -> str:
    """A report.md table of `rows`: its registered columns, an optional one only where some row has it."""
    records = rows.to_dict("records")
    cols = [
        c
        for c in in_table(table, hardware)
        if not c.optional or any(not missing(r.get(c.name)) for r in records)
    ]
    headers = [c.header(table, ctx) for c in cols]
    return markdown_table(headers, [[c.cell(r, ctx) for c in cols] for r in records])


def markdown_table(headers: list[str], lines: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(
        out + ["| " + " | ".join("" if x is None else str(x) for x in line) + " |" for line in lines]
    )


def _where(c: Column) -> str:
    where = [name for key, name in (("report", "report"), ("long", "leaderboard")) if key in c.csv]
    if c.wide is not None:
        where.append("wide `<b>" + (f"_{c.wide}" if c.wide else "") + "`")
    return ", ".join(where).replace("{hw}", "<hw>")


def _shown(c: Column) -> str:
    """`diff [CI]` (headline, query): each report.md header with the tables that show it."""
    by_header: dict[str, list[str]] = {}
    for t, h in c.headers.items():
        by_header.setdefault(h.replace("{hw}", "<hw>"), []).append(t)
    return "; ".join(f"{h} ({', '.join(ts)})" for h, ts in by_header.items())


def glossary() -> str:
    """docs/report.md's glossary of columns: per group, each column, the CSVs it is in (report.csv,
    leaderboard.csv, leaderboard_wide.csv's per-budget name), its report.md headers and its meaning."""
    parts = []
    for group, title in GROUPS.items():
        lines = [
            [f"`{c.name.replace('{hw}', '<hw>')}`", _where(c), _shown(c), c.doc]
            for c in COLUMNS
            if c.group == group
        ]
        if group == "label":
            lines += [[f"`{name}`", "wide", "", doc] for name, doc in WIDE_LEAD]
        parts.append(f"**{title}**\n\n" + markdown_table(["column", "in", "report.md", "meaning"], lines))
    return "\n\n".join(parts)
