"""Assembling the report: pair every compressed run, join the memory model, recommend budgets, list gaps.

Every failure is local: a run that cannot be paired, an empty run or a memory model that cannot be built
becomes a line under "Problems" naming the folder(s), and the rest of the report is still computed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import pandas as pd

from evalkit.config import CONF_DIR
from evalkit.memory.model import MemoryReportError
from evalkit.report import columns
from evalkit.report.budget import bench_speedup, load_hardware, memory_row
from evalkit.report.columns import budget_key, budget_label
from evalkit.report.config import ReportConfigError, ReportSettings
from evalkit.report.frontier import equal_bytes, frontier, gain_check, recommend_bytes
from evalkit.report.pairing import Pairing, PairingError, pair, sections
from evalkit.report.reference import find_partner, pair_any, reference_target
from evalkit.report.runs import Run, RunError, load_runs, unfinished

# one configuration, apart from its budget; another KV storage or query-agnostic runs (`query_aware: false`)
# are other ones: two storages never share a group, a row or a recommendation
GROUP = ["model", "task", "method", "settings", "storage", "query_aware"]


@dataclass
class Report:
    settings: ReportSettings
    runs: list[Run]
    cells: pd.DataFrame  # one row per (compressed run, metric key)
    problems: list[str] = field(default_factory=list)  # refused pairings, empty runs, bad files
    notes: list[str] = field(default_factory=list)  # caveats that do not stop a pairing
    missing: list[str] = field(default_factory=list)
    by_task: list[dict] = field(default_factory=list)  # recommendation per (model, task, method, settings)
    by_model: list[dict] = field(default_factory=list)  # per (model, method, settings), across tasks
    lengths: dict[str, dict] = field(default_factory=dict)  # compressed run -> lengths.per_problem (the plot)
    query: pd.DataFrame = field(default_factory=pd.DataFrame)  # query-agnostic vs query-aware, per metric key
    frontier: dict = field(
        default_factory=dict
    )  # (model, task) -> frontier.frontier's rows, fewest bytes first
    by_bytes: list[dict] = field(default_factory=list)  # per (model, task): the cheapest safe configuration
    equal: pd.DataFrame = field(default_factory=pd.DataFrame)  # equal-bytes pairs' paired statistics

    @property
    def headline(self) -> pd.DataFrame:
        return self.cells[self.cells.is_headline] if len(self.cells) else self.cells


def effective_gains(memory: dict, lengths: dict) -> dict:
    """Per hardware, the effective decode gain: the memory-bound tok/s gain the budget allows times full
    tokens / compressed tokens (the tokens the deployer must generate for the same work)."""
    gain = lengths.get("token_gain")
    return {
        f"effective_gain_{k.removeprefix('tok_s_gain_')}": None if v is None or gain is None else v * gain
        for k, v in memory.items()
        if k.startswith("tok_s_gain_")
    }


def join_gains(pairings: list[Pairing], settings: ReportSettings, problems: list[str]) -> list[dict]:
    """The memory model joined per pairing (a list parallel to `pairings`; {} where it could not be, with a
    problem saying why), and each pairing's `gains`: tok_s_gain_<hw> and effective_gain_<hw>."""
    hardware, full_rows, out = load_hardware(settings.hardware), {}, []
    for p in pairings:
        memory = memory_of(p, hardware, settings, problems, full_rows)
        p.gains = {k: v for k, v in memory.items() if k.startswith("tok_s_gain_")}
        p.gains |= effective_gains(memory, p.lengths)
        out.append(memory)
    return out


def _cell_rows(p: Pairing, memory: dict, hardware: list[str]) -> list[dict]:
    """One row per metric key of a pairing: the registry's figures (labels, the run's own), the lengths and
    gains, the key's paired statistics and the memory model."""
    comp = p.compressed
    base = columns.figures(comp, p, "report", hardware) | p.lengths | p.gains
    return [
        {**base, "metric": key, "is_headline": key == comp.headline, **cell, **memory}
        for key, cell in sorted(p.cells.items())
    ]


def pair_all(runs: list[Run], settings: ReportSettings) -> tuple[list[Pairing], list[str]]:
    """Every compressed run paired with its full run; problems say which could not be and why."""
    fulls: dict[tuple, list[Run]] = defaultdict(list)
    refs: dict[tuple, list[Run]] = defaultdict(list)  # served references, by the model they stand in for
    for r in runs:
        if r.is_full:
            fulls[(r.model, r.task)].append(r)
            if target := reference_target(r):
                refs[(target, r.task)].append(r)
    pairings, problems, read = [], [], {}
    for r in runs:
        if r.is_full:
            continue
        try:
            full = find_partner(r, fulls[(r.model, r.task)], refs[(r.model, r.task)])
            if full.rel not in read:
                read[full.rel] = full.samples()
            pairings.append(pair_any(r, full, settings, read[full.rel]))
        except (PairingError, RunError) as e:
            problems.append(str(e))
    return pairings, problems


def memory_of(p: Pairing, hardware, settings: ReportSettings, problems: list[str], full_rows: dict) -> dict:
    # a served reference measured no lengths of its cache: the compressed run's are the full cache's
    full = p.compressed if p.reference else p.full
    try:
        if full.rel not in full_rows:
            full_rows[full.rel] = full.samples()  # read once per full run: its request lengths
        row = memory_row(p.compressed, full, hardware, settings.deploy, full_rows[full.rel], p.requests)
    except (MemoryReportError, RunError, KeyError, TypeError) as e:
        problems.append(f"{p.compressed.rel}: memory model not joined ({type(e).__name__}: {e})")
        return {}
    tp = row.pop("tp")
    # the results folder's own bench first, then the figures published in the repository
    benches = [settings.results_dir / "bench", CONF_DIR.parent / "results" / "bench"]
    c = p.compressed
    # the bench measures the model dtype: none of its figures is a quantized storage's
    bench = bench_speedup(benches, c.model, c.method, c.budget, row["context_tokens"])
    return row | {f"tp_{k}": v for k, v in tp.items()} | (bench if c.in_model_dtype else {})


def _sort_key(col: pd.Series) -> pd.Series:
    """Sort key: a query-aware configuration before its query-agnostic counterpart, the model dtype first."""
    if col.name == "storage":
        return col.map(lambda v: "" if v == "none" else v)
    return ~col.astype(bool) if col.name == "query_aware" else col


def build(settings: ReportSettings) -> Report:
    if not (settings.results_dir / "runs").is_dir():
        raise ReportConfigError(
            f"no runs under {settings.results_dir / 'runs'}: run `make eval` (full and a budget) or "
            "`make sweep SWEEP=report_ruler` first, or set results_dir"
        )
    runs, bad_files = load_runs(settings.results_dir)
    pairings, problems = pair_all(runs, settings)
    problems = bad_files + problems
    rows, notes, report_lengths = [], [], {}
    for p, memory in zip(pairings, join_gains(pairings, settings, problems)):
        rows += _cell_rows(p, memory, settings.hardware)
        report_lengths[p.compressed.rel] = p.per_problem
        notes += p.notes
        if p.only_compressed or p.only_full:
            notes.append(
                f"{p.compressed.rel} ~ {p.full.rel}: {len(p.only_compressed)} samples only in the "
                f"compressed run, {len(p.only_full)} only in the full run: left out of the paired "
                f"statistics (first: {(p.only_compressed + p.only_full)[:3]})"
            )
    cells, tasks = pd.DataFrame(rows), sections(runs)  # a task run under other settings: its own section
    if len(cells):
        cells["task"] = cells.run.map(tasks)
        cells = cells.sort_values(GROUP + ["budget", "metric"], key=_sort_key).reset_index(drop=True)
    report = Report(settings, runs, cells, problems, notes, lengths=report_lengths)
    report.query = query_cells(runs, settings, problems, notes)
    if len(report.query):
        report.query["task"] = report.query.run.map(tasks)
    report.missing = missing_cells(runs, settings) + unfinished(settings.results_dir)
    report.by_task = recommend_tasks(report.headline)
    report.by_model = recommend_models(report.headline, runs, tasks)
    report.frontier = frontier(report.headline)
    report.by_bytes = recommend_bytes(report.frontier)
    report.equal = equal_bytes(report.headline, runs, settings, report.problems)
    return report


# --- recommendations -------------------------------------------------------------------------------
# On the headline metric: the smallest non-inferior budget of a configuration, per task and across the
# model's tasks. "No budget" always says what the evidence lacks (worse, or how many problems would decide).


def _gains(row) -> dict:
    return {
        k: row[k]
        for k in row.index
        if k.startswith(("tok_s_gain_", "effective_gain_")) or k in ("memory_saving", "token_gain")
    }


def _budget(budget) -> int | str:
    """A recommendation's budget: the number, or `all` for the full cache in a quantized storage."""
    return budget_label(budget) if pd.isna(budget) else int(budget)


def _undecided(rows: pd.DataFrame) -> str:
    """Why no budget qualifies, and for each inconclusive one how many paired problems would decide."""
    inc = rows[rows.verdict == "inconclusive"]
    if inc.empty:
        return "every budget is worse than full" if len(rows) else "no paired budget"
    need = [
        f"{budget_label(r.budget)}: "
        + ("unknown" if pd.isna(r.n_needed) else f"~{int(r.n_needed)} (+{int(r.n_more)})")
        for r in inc.itertuples()
    ]
    return "inconclusive; paired problems that would decide: " + ", ".join(need)


def recommend_tasks(head: pd.DataFrame) -> list[dict]:
    """The smallest budget that is non-inferior and whose effective decode gain is above 1 (a budget whose
    longer outputs eat its memory gain buys nothing, and the status says so)."""
    out = []
    if head.empty:
        return out
    for key, rows in head.groupby(GROUP, sort=True):
        rows = rows.sort_values("budget")
        rec = dict(zip(GROUP, key)) | {"budgets": [_budget(b) for b in rows.budget]}
        erased = []  # non-inferior budgets refused: their length inflation erases the gain
        for _, best in rows[rows.verdict == "non-inferior"].iterrows():
            ok, why = gain_check(best)
            if ok is False:
                erased.append(why)
                continue
            caveat = best.get("length_caveat") if ok else None  # e.g. empty outputs left out of the gain
            rec |= {
                "budget": _budget(best.budget),
                "diff": best.paired_diff,
                "ci": (best.ci_low, best.ci_high),
                **_gains(best),
                "status": "; ".join(
                    ["non-inferior", *filter(None, [why]), *erased]
                    + ([caveat] if isinstance(caveat, str) else [])
                ),
            }
            break
        else:
            status = ("non-inferior but " + "; ".join(erased)) if erased else _undecided(rows)
            rec |= {"budget": None, "status": status}
        out.append(rec)
    return sorted(out, key=lambda r: [_order(k, r[k]) for k in GROUP])


def _order(key: str, value):
    """A recommendation's sort position on `key`: query-aware first, the model dtype first."""
    return not value if key == "query_aware" else (value != "none", value) if key == "storage" else value


def _qualifies(row) -> str:
    """A cell's standing for the per-model recommendation: its verdict, or why a non-inferior one fails."""
    if row.verdict != "non-inferior":
        return row.verdict
    return "non-inferior" if gain_check(row)[0] is not False else "effective gain <= 1"


def recommend_models(head: pd.DataFrame, runs: list[Run], task_of: dict[str, str]) -> list[dict]:
    """Smallest budget non-inferior, with an effective gain above 1, on every task the model was evaluated
    on (a task without that budget, or without a pairable run, disqualifies it: 'evaluated on every task' is
    checked, never assumed)."""
    out = []
    if head.empty:
        return out
    tasks = defaultdict(set)  # query-aware and query-agnostic runs: each over the tasks run that way
    for r in runs:
        tasks[(r.model, r.query_aware)].add(task_of[r.rel])
    for (model, method, settings, storage, aware), rows in head.groupby(
        ["model", "method", "settings", "storage", "query_aware"], sort=True
    ):
        verdicts = {(r.task, _budget(r.budget)): _qualifies(r) for _, r in rows.iterrows()}
        rec = {
            "model": model,
            "method": method,
            "settings": settings,
            "storage": storage,
            "query_aware": aware,
            "tasks": sorted(tasks[(model, aware)]),
        }
        for budget in sorted({b for _, b in verdicts}, key=lambda b: budget_key(None if b == "all" else b)):
            short = [t for t in rec["tasks"] if verdicts.get((t, budget)) != "non-inferior"]
            if not short:
                rec |= {"budget": budget, "status": "non-inferior on every task"}
                break
            rec.setdefault("blockers", {})[budget] = {t: verdicts.get((t, budget), "missing") for t in short}
        else:
            rec |= {"budget": None, "status": "no budget is non-inferior on every task"}
        out.append(rec)
    return sorted(
        out, key=lambda r: (r["model"], r["method"], r["settings"], r["storage"] != "none", r["storage"],
                            not r["query_aware"])
    )  # fmt: skip


# --- query-agnostic vs query-aware --------------------------------------------------------------------------
# The same model, task, method, settings and budget on the same problems, compressed before (query-agnostic)
# and after (query-aware) the question was seen: the same paired statistics, the query-aware run as reference.


def query_pairs(runs: list[Run], notes: list[str]) -> list[tuple[Run, Run]]:
    """(query-agnostic run, the query-aware run it is compared with); a note for one without a partner."""
    aware = defaultdict(list)
    for r in runs:
        if not r.is_full and r.query_aware:
            aware[(r.model, r.task, r.method, r.settings, r.storage, r.budget, r.base_generation)].append(r)
    out = []
    for r in runs:
        if r.is_full or r.query_aware:
            continue
        match = aware.get((r.model, r.task, r.method, r.settings, r.storage, r.budget, r.base_generation), [])
        if len(match) == 1:
            out.append((r, match[0]))
        else:
            none = (  # multi_question needs query_aware=false: no question there is seen before compression
                " (multi-question runs have none)"
                if r.task.endswith("-multi_question")
                else " (run it with query_aware=true)"
            )
            notes.append(
                f"{r.rel}: query-agnostic, {'several' if match else 'no'} query-aware run(s) of the same "
                f"budget and generation settings to compare with"
                + (f": {[m.rel for m in match]}" if match else none)
            )
    return out


def query_cells(runs: list[Run], settings: ReportSettings, problems: list[str], notes: list[str]):
    rows = []
    for agnostic, aware in query_pairs(runs, notes):
        try:
            if agnostic.identity["scoring"] != aware.identity["scoring"]:
                raise PairingError(f"{agnostic.rel} cannot be compared with {aware.rel}: scored differently")
            p = pair(agnostic, aware, settings)
        except (PairingError, RunError) as e:
            problems.append(str(e))
            continue
        base = {k: getattr(agnostic, k) for k in ("model", "task", "method", "settings", "storage", "budget")}
        base |= {"run": agnostic.rel, "aware_run": aware.rel, **p.lengths}
        rows += [
            {**base, "metric": key, "is_headline": key == agnostic.headline, **cell}
            for key, cell in sorted(p.cells.items())
        ]
    cells = pd.DataFrame(rows)
    return cells.sort_values(GROUP[:5] + ["budget", "metric"]).reset_index(drop=True) if len(cells) else cells


def missing_cells(runs: list[Run], settings: ReportSettings) -> list[str]:
    """Cells a complete sweep would have: per model, every task seen (or expected) x every (method,
    settings, query_aware, budget) seen on any of its tasks (or expected, query-aware), and a full run per
    task. A query-agnostic run is a configuration of its own: it never stands in for a query-aware one."""
    out = []
    for model in sorted({r.model for r in runs}):
        mine = [r for r in runs if r.model == model]
        tasks = sorted({r.task for r in mine} | set(settings.expect.get("tasks", [])))
        present = {(r.task, r.method, r.settings, r.storage, r.query_aware, r.budget) for r in mine}
        configs = {(r.method, r.settings, r.storage, r.query_aware, r.budget) for r in mine if not r.is_full}
        for method in settings.expect.get("methods", []):
            budgets = [None] if method == "full" else settings.expect.get("budgets", [])
            configs |= {(method, "default", "none", True, b) for b in budgets if method != "full"}
        for task in tasks:
            if not any(
                r.task == task and (r.is_full and r.model == model or reference_target(r) == model)
                for r in runs
            ):
                out.append(f"{task}/{model}/full: missing (no full run: nothing on this task can be paired)")
            for method, sett, kv, aware, budget in sorted(
                configs, key=lambda c: (c[0], c[1], c[2] != "none", c[2], not c[3], c[4] or 0)
            ):
                if (task, method, sett, kv, aware, budget) not in present:
                    tag = ("none" if budget is None else f"{budget}") + (
                        "" if sett == "default" else f"-{sett}"
                    )
                    folder = method + ("" if kv == "none" else f"+{kv}")
                    out.append(
                        f"{task}/{model}/{folder}/{tag}{'' if aware else ' (query-agnostic)'}: missing"
                    )
    return out
