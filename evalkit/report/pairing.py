"""Pairing a compressed run with the `full` run that generated from the same prompts, sample by sample.

The partner is the full run of the same model and task whose generation identity (model, task, task
version, data hash, generation settings, repeats, limit, seed, max_new_tokens) is equal and whose scoring
identity is equal. Anything else is refused with both folders named and the field that differs. Samples are
paired on their id (and the repeat index within one); a prompt hash that differs refuses the pair, samples
on one side only are counted and left out.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from evalkit import identity
from evalkit.errors import EvalkitError
from evalkit.report.budget import cache_lengths
from evalkit.report.lengths import length_stats, limit_mismatch, per_problem
from evalkit.report.runs import Run, RunError
from evalkit.report.stats import StatSettings, compare


class PairingError(EvalkitError, ValueError):
    """Two runs that must not be compared; the message names both folders and what differs."""


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# what evalkit.identity hashes, as a reader names it
LABELS = {"data_hash": "data hash", "setup": "task.setup", "headline": "task.headline"}


def generation_fields(run: Run) -> dict:
    """What must be equal for a full partner: the generation identity's fields but `query_aware` and `kv`."""
    m = run.metrics
    config = {k: v for k, v in run.config.items() if k not in ("query_aware", "kv")}
    return _flat(identity.generation_fields(config, m.task_version, m.data_hash))


def scoring_fields(run: Run) -> dict:
    return _flat(identity.scoring_fields(run.config.get("task") or {}, run.metrics.scorer_version))


def differences(a: Run, b: Run, fields, key: str) -> str:
    """The settings (of what identity `key` hashes, read by `fields`) in which two runs differ."""
    fa, fb = fields(a), fields(b)
    diffs = [
        f"{LABELS.get(k, k)} {fa.get(k)!r} vs {fb.get(k)!r}"
        for k in sorted(set(fa) | set(fb), key=lambda k: (k not in ("task_version", "scorer_version"), k))
        if fa.get(k) != fb.get(k)
    ]
    return ", ".join(diffs) or f"identity.{key} {a.identity[key]} vs {b.identity[key]}"


def sections(runs: list[Run]) -> dict[str, str]:
    """Run folder -> its task as the report groups it: the task, or where a model's task ran under several
    generation settings (a limit, a seed, max_new_tokens), the task with the settings that tell them apart
    (`ruler (limit=20)`), so runs of other settings never share a section, a row, a frontier or a
    recommendation (each is paired with the full run of its own settings)."""
    by: dict[tuple, dict] = {}  # (model, task) -> {base generation: its fields}
    for r in runs:
        by.setdefault((r.model, r.task), {}).setdefault(r.base_generation, r)
    labels = {}
    for (model, task), gens in by.items():
        fields = {g: generation_fields(r) if r.config else {} for g, r in gens.items()}
        keys = {k for f in fields.values() for k in f}
        differ = sorted(k for k in keys if len({repr(f.get(k)) for f in fields.values()}) > 1)
        for g, f in fields.items():
            what = ", ".join(f"{LABELS.get(k, k)}={f.get(k)}" for k in differ) or f"generation {g}"
            labels[(model, task, g)] = task if len(gens) == 1 else f"{task} ({what})"
    return {r.rel: labels[(r.model, r.task, r.base_generation)] for r in runs}


def partner(run: Run, fulls: list[Run]) -> Run:
    """The one full run `run` can be compared with, or PairingError saying why there is none. `query_aware`
    is no difference here (a full cache keeps everything either way); of two full runs differing only in it,
    the one with the run's own setting."""
    if not fulls:
        raise PairingError(
            f"{run.rel}: no `full` run of model {run.model} on task {run.task}: run "
            f"`make eval TASK={run.task} MODEL={run.model} METHOD=full` with the same task settings"
        )
    gid = run.base_generation
    if gid is None:
        raise PairingError(f"{run.rel}: metrics.json has neither `identity` nor `provenance.config`")
    same = [f for f in fulls if f.base_generation == gid]
    if len(same) > 1:
        same = [f for f in same if f.query_aware == run.query_aware] or same
    if not same:
        raise PairingError(
            "; ".join(
                f"{run.rel} cannot be paired with {f.rel}: "
                f"{differences(run, f, generation_fields, 'generation')}"
                for f in fulls
            )
        )
    if len(same) > 1:
        raise PairingError(
            f"{run.rel}: several full runs share its generation identity: {[f.rel for f in same]}"
        )
    full = same[0]
    if full.identity["scoring"] != run.identity["scoring"]:
        why = differences(run, full, scoring_fields, "scoring")
        raise PairingError(f"{run.rel} cannot be paired with {full.rel}: scored differently ({why})")
    return full


def _repeats(row: dict) -> int:
    return len(row.get("predictions") or row.get("repeat_scores") or [None])


def keyed(scores: dict, subset: str, headline: str) -> dict:
    """A sample's scores plus the crossed breakdown `<metric>/<a>@<b>` for a two-part subset `a|b` whose
    parts are both breakdown keys (LongBench-v2 easy@short ...; RULER already reports task@length)."""
    out = dict(scores)
    parts = (subset or "").split("|")
    if len(parts) == 2 and all(f"{headline}/{p}" in scores for p in parts):
        out.setdefault(f"{headline}/{parts[0]}@{parts[1]}", scores.get(headline))
    return out


def _repeat_mean(row: dict, key: str, headline: str, upto: int) -> float | None:
    """The mean of `key` over the first `upto` repeats, when `key` is a mean over repeats (its value over
    all repeats equals the mean of its per-repeat values: pass@1 yes, cons@k no); else None."""
    reps = [keyed(r, row.get("subset", ""), headline) for r in row.get("repeat_scores") or []]
    if not reps or any(key not in r or r[key] is None for r in reps):
        return None
    whole = keyed(row["scores"], row.get("subset", ""), headline).get(key)
    if whole is None or not np.isclose(np.mean([r[key] for r in reps]), whole):
        return None
    return float(np.mean([r[key] for r in reps[:upto]]))


@dataclass
class Pairing:
    compressed: Run
    full: Run
    only_compressed: list[str]
    only_full: list[str]
    cells: dict[str, dict] = field(default_factory=dict)  # metric key -> stats.compare() output
    notes: list[str] = field(default_factory=list)
    per_problem: dict = field(default_factory=dict)  # lengths.per_problem: tokens and failures per problem
    lengths: dict = field(default_factory=dict)  # lengths.length_stats: the run's length and failure columns
    gains: dict = field(default_factory=dict)  # tok_s_gain_<hw> and effective_gain_<hw>, once joined
    # budget.cache_lengths of the compressed run: (prefill, prompt, seen) per (sample id, repeat)
    requests: dict = field(default_factory=dict)
    reference: str | None = None  # a served full-cache reference: who served it (evalkit.report.reference)


def wanted(key: str, headline: str, extras: list[str]) -> bool:
    return any(key == m or key.startswith(m + "/") for m in [headline, *extras])


def paired_values(comp: dict, full: dict, ids: list[str], headline: str, extras: list[str]):
    """{key: (compressed values, full values, binary, problems left out)} over the shared sample ids."""
    out: dict[str, list] = {}
    for sid in ids:
        c, f = comp[sid], full[sid]
        cs, fs = (
            keyed(c["scores"], c.get("subset", ""), headline),
            keyed(f["scores"], f.get("subset", ""), headline),
        )
        kc, kf = _repeats(c), _repeats(f)
        for key in sorted(set(cs) & set(fs)):
            if not wanted(key, headline, extras) or cs[key] is None or fs[key] is None:
                continue
            cell = out.setdefault(key, [[], [], kc == kf == 1, 0])
            if kc != kf:  # repeats paired by index: only those both sides have
                cv, fv = (
                    _repeat_mean(c, key, headline, min(kc, kf)),
                    _repeat_mean(f, key, headline, min(kc, kf)),
                )
                cell[2] = False
                if cv is None or fv is None:
                    cell[3] += 1
                    continue
            else:
                cv, fv = float(cs[key]), float(fs[key])
            cell[0].append(cv)
            cell[1].append(fv)
    result = {}
    for key, (cv, fv, k1, left_out) in out.items():
        c_arr, f_arr = np.array(cv), np.array(fv)
        binary = k1 and bool(np.isin(c_arr, (0.0, 100.0)).all() and np.isin(f_arr, (0.0, 100.0)).all())
        result[key] = (c_arr, f_arr, binary, left_out)
    return result


def check_prompts(comp: Run, full: Run, c_rows: dict, f_rows: dict, ids: list[str]) -> list[str]:
    """Refuse on a differing prompt hash; a note when hashes are missing (then they were not checked)."""
    bad = [
        s
        for s in ids
        if None not in (c_rows[s].get("prompt_hash"), f_rows[s].get("prompt_hash"))
        and c_rows[s]["prompt_hash"] != f_rows[s]["prompt_hash"]
    ]
    if bad:
        raise PairingError(
            f"{comp.rel} cannot be paired with {full.rel}: prompt hashes differ for {len(bad)} of "
            f"{len(ids)} shared samples (first: {bad[:3]}): the prompts were rendered differently"
        )
    unchecked = sum(None in (c_rows[s].get("prompt_hash"), f_rows[s].get("prompt_hash")) for s in ids)
    return [f"{comp.rel}: {unchecked} samples without a prompt hash (not checked)"] if unchecked else []


def pair(comp: Run, full: Run, settings, full_rows: dict | None = None, prompts=None) -> Pairing:
    """Pair two runs sample by sample and compute every cell (headline, breakdowns, configured extras).
    `full_rows`: the full run's samples when already read (one full run serves every budget); `prompts`: the
    prompt check (check_prompts; a served reference's is stricter)."""
    c_rows = comp.samples()  # RunError for an empty or unreadable side
    f_rows = full.samples() if full_rows is None else full_rows
    ids = sorted(set(c_rows) & set(f_rows))
    if not ids:
        raise PairingError(f"{comp.rel} cannot be paired with {full.rel}: no sample id in common")
    p = Pairing(comp, full, sorted(set(c_rows) - set(f_rows)), sorted(set(f_rows) - set(c_rows)))
    p.notes += (prompts or check_prompts)(comp, full, c_rows, f_rows, ids)
    if why := limit_mismatch(c_rows, f_rows, ids):  # a ratio of lengths under two caps is no measurement
        raise PairingError(f"{comp.rel} cannot be paired with {full.rel}: {why}")
    if comp.identity["source"] != "recorded" or full.identity["source"] != "recorded":
        p.notes.append(
            f"{comp.rel} ~ {full.rel}: no recorded identity (older runner): paired on an identity "
            "derived from provenance.config"
        )
    s: StatSettings = settings.stats_for(comp.task)
    p.requests = cache_lengths(c_rows)
    p.per_problem = per_problem(c_rows, f_rows, ids)
    p.lengths = length_stats(p.per_problem, s.confidence)
    for key, (c, f, binary, left_out) in paired_values(
        c_rows, f_rows, ids, comp.headline, settings.extras_for(comp.task)
    ).items():
        if left_out:
            p.notes.append(
                f"{comp.rel}: {key}: {left_out} problems left out (repeat counts differ and the "
                "metric is not a mean over repeats)"
            )
        if len(c):
            rng = np.random.default_rng([settings.seed, zlib.crc32(f"{comp.rel}|{key}".encode())])
            p.cells[key] = compare(c, f, binary, s, rng) | {"left_out": left_out}
    return p


__all__ = ["PairingError", "Pairing", "RunError", "partner", "pair", "differences", "keyed"]
