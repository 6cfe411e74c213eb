"""A served full-cache run as the reference of in-process compressed runs of the same weights (issue 35.2).

Opt-in and explicit: a served `full` run whose conf says `model.reference_for=<in-process model conf>`
(`make eval MODEL=served METHOD=full ARGS="model.reference_for=llama31_8b_instruct ..."`) may stand in for
that model's full run. It pairs with a compressed run of that model only when

- everything that decides a generation but the model's own conf, the method, the KV storage and `compile`
  is equal: task and its load, generation settings and repeats, limit, seed, task version, data hash, and
  the model's `max_length` and `max_new_tokens`;
- the scoring identity is equal;
- every shared problem was given the same prompt: its prompt hash on both sides (a missing one refuses, it
  cannot be checked) and evalkit's prompt token count of every repeat.

A mismatch is a PairingError naming the differing setting or the problems. An in-process full run of the
same generation identity is always preferred; the served one is tried when there is none. The pairing says
what differs (the server's kernels, numerics and batching) and names the server (`describe`).
"""

from __future__ import annotations

from evalkit import identity
from evalkit.report.pairing import Pairing, PairingError, _flat, differences, pair, partner, scoring_fields
from evalkit.report.runs import Run

# top-level settings a served reference may differ in: its own model conf, the method, the KV storage (of the
# compressed run) and compile (outputs equal); query_aware as for any full run (a full cache keeps everything)
FREE = ("model", "method", "kv", "compile", "query_aware")
MODEL_KEYS = ("max_length", "max_new_tokens")  # model settings that decide what is generated


def reference_target(run: Run) -> str | None:
    """The in-process model a served full run stands in for (`model.reference_for`), or None."""
    if not run.is_full or "served" not in run.metrics.extra:
        return None
    return (run.config.get("model") or {}).get("reference_for")


def reference_fields(run: Run) -> dict:
    """What must be equal between a compressed run and its served reference."""
    m = run.metrics
    config = {k: v for k, v in run.config.items() if k not in FREE}
    model = run.config.get("model") or {}
    config["model"] = {k: model.get(k) for k in MODEL_KEYS}
    return _flat(identity.generation_fields(config, m.task_version, m.data_hash))


def reference_partner(run: Run, refs: list[Run]) -> Run:
    """The one served reference `run` can be paired with, or PairingError naming what differs."""
    want = reference_fields(run)
    same = [r for r in refs if reference_fields(r) == want]
    if not same:
        raise PairingError(
            "; ".join(
                f"{run.rel} cannot be paired with served reference {r.rel}: "
                f"{differences(run, r, reference_fields, 'generation')}"
                for r in refs
            )
        )
    if len(same) > 1:
        raise PairingError(f"{run.rel}: several served references fit it: {[r.rel for r in same]}")
    ref = same[0]
    if ref.identity["scoring"] != run.identity["scoring"]:
        why = differences(run, ref, scoring_fields, "scoring")
        raise PairingError(
            f"{run.rel} cannot be paired with served reference {ref.rel}: scored differently ({why})"
        )
    return ref


def find_partner(run: Run, fulls: list[Run], refs: list[Run]) -> Run:
    """The in-process full run of `run`'s generation identity, else its served reference; PairingError
    saying why neither fits."""
    try:
        return partner(run, fulls)
    except PairingError as e:
        if not refs:
            raise
        try:
            return reference_partner(run, refs)
        except PairingError as served:
            raise PairingError(f"{e}; {served}") from None


def _prompt_tokens(row: dict) -> list:
    return [g.get("prompt_tokens") if isinstance(g, dict) else None for g in row.get("generation") or []]


def check_reference_prompts(comp: Run, ref: Run, c_rows: dict, f_rows: dict, ids: list[str]) -> list[str]:
    """Refuse unless every shared problem has the same prompt on both sides (hash and prompt tokens), naming
    the problems; notes on what the server counted differently."""
    bad = []
    for s in ids:
        a, b = c_rows[s].get("prompt_hash"), f_rows[s].get("prompt_hash")
        if a is None or b is None or a != b:
            bad.append(f"{s} (prompt hash {a} in process, {b} served)")
            continue
        ta, tb = _prompt_tokens(c_rows[s]), _prompt_tokens(f_rows[s])
        if any(x is not None and y is not None and x != y for x, y in zip(ta, tb)):
            bad.append(f"{s} (prompt tokens {ta} in process, {tb} served)")
    if bad:
        raise PairingError(
            f"{comp.rel} cannot be paired with served reference {ref.rel}: the prompts of {len(bad)} of "
            f"{len(ids)} shared problems differ: {'; '.join(bad[:3])}"
        )
    counted = sum(
        g.get("server_prompt_tokens") not in (None, g.get("prompt_tokens"))
        for s in ids
        for g in f_rows[s].get("generation") or []
        if isinstance(g, dict)
    )
    if not counted:
        return []
    return [
        f"{ref.rel}: the server counted other prompt tokens than evalkit for {counted} requests (special "
        "tokens it adds: see docs/served.md)"
    ]


def describe(ref: Run) -> str:
    """The reference as the report names it: served, by which server, and what differs from in process."""
    served = ref.metrics.extra.get("served") or {}
    model = served.get("model") or {}
    server = served.get("server_header") or "server"
    version = (
        (served.get("version") or {}).get("version") if isinstance(served.get("version"), dict) else None
    )
    build = f"{server}{f' {version}' if version else ''}"
    return f"served: {model.get('id')} at {served.get('base_url')} ({build}; its kernels, numerics, batching)"


def pair_any(comp: Run, full: Run, settings, full_rows: dict | None = None) -> Pairing:
    """pairing.pair, with a served reference's stricter prompt check and its label (`Pairing.reference`)."""
    if reference_target(full) != comp.model:
        return pair(comp, full, settings, full_rows)
    p = pair(comp, full, settings, full_rows, prompts=check_reference_prompts)
    p.reference = describe(full)
    p.notes.append(
        f"{comp.rel} ~ {full.rel}: paired with a served full-cache reference ({p.reference}): the same "
        "weights and prompts, generated outside evalkit; the memory model reads the full cache's lengths "
        "from the compressed run"
    )
    return p
