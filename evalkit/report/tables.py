"""report.md: the recommendation first, then problems, missing cells and notes, then one section per model and
task, whose tables show the columns evalkit.report.columns registers for them."""

from __future__ import annotations

import pandas as pd

from evalkit.report import columns
from evalkit.report.build import Report
from evalkit.report.columns import (
    SMALL,
    budget_key,
    budget_label,
    config_label,
    diff_ci,
    f_,
    markdown_table,
    mib,
)
from evalkit.report.frontier import EQUAL_BYTES, sentence
from evalkit.report.lengths import MAX_LOOP_PERIOD, MIN_LOOP_REPEATS, MIN_LOOP_WORDS


def _small_note(rows: pd.DataFrame, min_problems: int) -> str:
    few = sorted({int(n) for n in rows.n_paired if n < min_problems})
    if not few:
        return ""
    return (
        f"\n\n{SMALL} n = {', '.join(map(str, few))} < min_problems = {min_problems}: a percentile bootstrap "
        "CI over this few problems is too narrow (it undercovers), so it is shown but never decides alone; "
        "the verdict then follows the exact test (p), and `worse` needs both."
    )


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


def _blockers(r: dict) -> str:
    """`; 256: ruler worse, aime24 missing`: why each smaller budget is not the model's."""
    return "".join(f"; {b}: {', '.join(f'{t} {v}' for t, v in bl.items())}" for b, bl in r.items())


RECOMMEND = [  # per model: (header, cell of a recommendation)
    ("model", lambda r, hw: r["model"]),
    ("cache", lambda r, hw: config_label(r["method"], r["settings"], r.get("query_aware"), r.get("storage"))),
    ("tasks", lambda r, hw: ", ".join(r["tasks"])),
    ("budget", lambda r, hw: r.get("budget") or "-"),
    ("status", lambda r, hw: r["status"] + _blockers(r.get("blockers") or {})),
]


def _per_hw(header: str, key: str, fmt: str, hw: list[str]) -> list:
    return [(f"{header} {h}", lambda r, _, h=h: f_(r.get(f"{key}_{h}"), fmt)) for h in hw]


def recommend_task_columns(hw: list[str]) -> list:
    """Per task: (header, cell of a recommendation) in order."""
    return (
        [
            ("model", lambda r, _: r["model"]),
            ("task", lambda r, _: r["task"]),
            ("cache", lambda r, _: config_label(r["method"], r["settings"], r.get("query_aware"),
                                                r.get("storage"))),
            ("budgets run", lambda r, _: ", ".join(map(str, r["budgets"]))),
            ("budget", lambda r, _: r.get("budget") or "-"),
            ("diff [CI]", lambda r, _: f"{f_(r['diff'])} [{f_(r['ci'][0])}, {f_(r['ci'][1])}]"
             if r.get("budget") else "-"),
            ("KV saving", lambda r, _: f_(r.get("memory_saving"), "{:.1%}")),
        ]
        + _per_hw("tok/s gain bound", "tok_s_gain", "{:.2f}x", hw)
        + [("tokens full/compressed", lambda r, _: f_(r.get("token_gain"), "{:.2f}"))]
        + _per_hw("effective gain", "effective_gain", "{:.2f}x", hw)
        + [("status", lambda r, _: r["status"])]
    )  # fmt: skip


def _best(key: str, what: str):
    return lambda r, _: "-" if not r.get(key) else f"{r[key]['label']}: {mib(r[key][what])}"


BY_BYTES = [  # per model and task: (header, cell of frontier.recommend_bytes' record)
    ("model", lambda r, _: r["model"]),
    ("task", lambda r, _: r["task"]),
    ("configurations", lambda r, _: r["configs"]),
    ("recommended: KV / sequence", _best("best", "kv_bytes_seq")),
    ("its kind", lambda r, _: (r.get("best") or {}).get("kind", "-")),
    ("saving", lambda r, _: f_((r.get("best") or {}).get("memory_saving"), "{:.1%}")),
    ("diff [CI]", lambda r, _: diff_ci(r["best"]) if r.get("best") else "-"),
    ("the other kind: KV / sequence", _best("other", "kv_bytes_seq")),
    ("status", lambda r, _: r["status"]),
]


def _rows(spec: list, recs: list[dict], hw: list[str]) -> str:
    return markdown_table([h for h, _ in spec], [[cell(r, hw) for _, cell in spec] for r in recs])


def _recommendation(rep: Report) -> str:
    hw = rep.settings.hardware
    return "\n".join(
        [
            "## Recommendation",
            "",
            "Per model and task, the cheapest safe KV cache: the configuration (method, budget, KV storage) "
            "with the fewest modelled KV bytes per sequence that is non-inferior to the full cache in the "
            "model dtype and whose effective decode gain is above 1, whatever its kind, and beside it the "
            "cheapest such one of the other kind (eviction: a method that drops entries, in any storage; "
            "quantization: the full cache in a quantized storage). Every configuration is in the section's "
            "frontier.",
            "",
            _rows(BY_BYTES, rep.by_bytes, hw),
            "",
            "Per model: the smallest budget non-inferior, with an effective decode gain above 1, on every "
            "task it was evaluated on.",
            "",
            _rows(RECOMMEND, rep.by_model, hw),
            "",
            "Per task: the smallest budget that is non-inferior and whose effective decode gain is above 1 "
            "on every hardware, its paired difference, what it saves (modelled), the decode gain's "
            "memory-bound upper bound (modelled; see What the budget buys), the full/compressed output "
            "tokens (measured) and their product, the effective gain. A non-inferior budget whose longer "
            "outputs erase its gain is named in the status, not recommended.",
            "",
            _rows(recommend_task_columns(hw), rep.by_task, hw),
        ]
    )


def _bullets(title: str, items: list[str], empty: str) -> str:
    return f"## {title} ({len(items)})\n\n" + ("\n".join(f"- {x}" for x in items) if items else empty)


def _headline_table(rows: pd.DataFrame, hw: list[str], min_problems: int) -> str:
    ctx = {"min_problems": min_problems}
    return columns.table("headline", rows, hw, ctx) + _small_note(rows, min_problems)


def _prefilled(rows: pd.DataFrame) -> str:
    """`, of which 848 compressed at prefill` where a compressed run fed tokens after its prefill."""
    prompt, pre = rows.iloc[0].context_prompt_tokens, rows.get("context_prefill_tokens")
    if pre is None or pre.isna().all() or (pre == prompt).all():
        return ""
    return ", of which " + "/".join(str(int(x)) for x in sorted(set(pre.dropna()))) + " compressed at prefill"


def _memory_table(rows: pd.DataFrame, hw: list[str]) -> str:
    if "kv_bytes_seq" not in rows or rows.kv_bytes_seq.isna().all():
        return "Memory model not joined (see Problems)."
    first = rows.iloc[0]
    kv_dtype, run_dtype = first.get("kv_dtype_modelled", "bf16"), first.get("dtype_measured") or "its dtype"
    bench = "bench_speedup" in rows and not rows.bench_speedup.isna().all()
    head = (
        f"Context: the full run's {first.context_basis}, {int(first.context_tokens)} tokens (prompt "
        f"{int(first.context_prompt_tokens)}{_prefilled(rows)}; full cache {int(first.kv_entries_full)} "
        "entries, "
        f"{mib(first.kv_bytes_seq_full)} per sequence). **Modelled** (evalkit.memory, {kv_dtype} KV; a "
        "quantized storage's codes, scales and residual): entries, KV / sequence, saving, and per hardware "
        "the max batch whose KV fits beside the weights and "
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
    ctx = {"kv_dtype": kv_dtype, "run_dtype": run_dtype}
    return head + columns.table("budget", rows, hw, ctx)


def _breakdowns(cells: pd.DataFrame, min_problems: int) -> str:
    sub = cells[~cells.is_headline]
    if sub.empty:
        return "No breakdown keys."
    recs = sub.to_dict("records")
    key = lambda r: (r["method"], r["settings"], r["storage"], not r["query_aware"], budget_key(r["budget"]))  # noqa: E731
    cols = sorted({key(r) for r in recs})
    grid = {(r["metric"], key(r)): r for r in recs}
    return markdown_table(
        ["key", "n"] + [f"{config_label(m, s, not a, kv)} {budget_label(b)}" for m, s, kv, a, b in cols],
        [
            [k, int(sub[sub.metric == k].n_paired.max())]
            + [diff_ci(grid[(k, c)], min_problems) if (k, c) in grid else "-" for c in cols]
            for k in sorted(set(sub.metric))
        ],
    ) + _small_note(sub, min_problems)


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


def _length_table(rows: pd.DataFrame, hw: list[str], confidence: float) -> str:
    if "n_length" not in rows or rows.n_length.isna().all():
        return "No output lengths recorded (the samples' `generation` records lack `output_tokens`)."
    intro = LENGTHS_INTRO.format(
        conf=confidence, words=MIN_LOOP_WORDS, period=MAX_LOOP_PERIOD, copies=MIN_LOOP_REPEATS
    )
    caveats = [
        f"\n- {config_label(r['method'], r['settings'], r.get('query_aware'), r.get('storage'))} "
        f"{budget_label(r['budget'])}: " + r["length_caveat"]
        for r in rows.to_dict("records")
        if isinstance(r.get("length_caveat"), str)
    ]
    return intro + columns.table("lengths", rows, hw, {}) + ("\n" + "".join(caveats) if caveats else "")


def _query_section(rep: Report, model: str, task: str) -> list[str]:
    q = rep.query
    if q.empty:
        return []
    rows = q[(q.model == model) & (q.task == task) & q.is_headline]
    if rows.empty:
        return []
    st = rep.settings.stats
    ctx = {"min_problems": st.min_problems}
    table = columns.table("query", rows, rep.settings.hardware, ctx) + _small_note(rows, st.min_problems)
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
        _headline_table(head, rep.settings.hardware, rep.settings.stats.min_problems),
        "",
        "### What the budget buys",
        "",
        _memory_table(head, rep.settings.hardware),
        "",
        "### Length and failure (compressed vs full, paired)",
        "",
        _length_table(head, rep.settings.hardware, rep.settings.stats.confidence),
        "",
        *_query_section(rep, model, task),
        *_frontier_section(rep, model, task),
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


def _frontier_table(rows: pd.DataFrame, hw: list[str], min_problems: int) -> str:
    head = ["configuration", "kind", "KV / sequence", "score", "diff [CI] verdict"]
    head += [f"effective gain {h}" for h in hw] + ["qualifies"]
    lines = []
    for r in rows.to_dict("records"):
        ref = r["kind"] == "full"
        cells = [r["label"], r["kind"], mib(r["kv_bytes_seq"]), f_(r["compressed"], "{:.2f}")]
        cells += ["(reference)" if ref else diff_ci(r, min_problems)]
        cells += [f_(r.get(f"effective_gain_{h}"), "{:.2f}x") for h in hw]
        lines.append(cells + ["" if ref else "✓" if r["qualifies"] else f"✗ {r['why']}"])
    return markdown_table(head, lines)


def _equal_table(rows: pd.DataFrame, min_problems: int) -> str:
    head = ["cheaper", "KV / sequence", "dearer", "KV / sequence", "paired n", "diff [CI]", "p (test)"]
    lines = [
        [r["cheaper"], mib(r["cheaper_bytes"]), r["dearer"], mib(r["dearer_bytes"]), int(r["n_paired"]),
         diff_ci(r, min_problems), f"{r['p_value']:.3g} ({r['test']})"]
        for r in rows.to_dict("records")
    ]  # fmt: skip
    return markdown_table(head, lines) + _small_note(rows, min_problems)


def _frontier_section(rep: Report, model: str, task: str) -> list[str]:
    rows = rep.frontier.get((model, task))
    if rows is None:
        return []
    st, hw = rep.settings.stats, rep.settings.hardware
    rec = next((r for r in rep.by_bytes if (r["model"], r["task"]) == (model, task)), None)
    out = [
        "### Frontier: score against KV bytes",
        "",
        "Every configuration (method, budget, KV storage) by its **modelled** KV bytes per sequence in its "
        "storage (codes, scales, zero points and full-precision residual counted), fewest first; the score "
        "on the paired problems; qualifies = non-inferior to the full cache in the model dtype (paired per "
        "problem) with an effective decode gain above 1. Recommended: "
        + (sentence(rec) if rec and rec["best"] else f"none ({rec['status'] if rec else '-'})")
        + ".",
        "",
        _frontier_table(rows, hw, st.min_problems),
        "",
    ]
    eq = rep.equal
    mine = eq[(eq.model == model) & (eq.task == task)] if len(eq) else eq
    if len(mine):
        out += [
            "### Equal bytes",
            "",
            f"Configurations in different KV storages whose bytes match within {EQUAL_BYTES:.0%}, paired "
            "per problem: diff = cheaper - dearer (points), the same statistics and verdict against the "
            "margin as against the full cache.",
            "",
            _equal_table(mine, st.min_problems),
            "",
        ]
    return out
