"""The report at equal bytes: every configuration (method, budget, KV storage) of a model and task placed by
the KV bytes one sequence holds, the cheapest safe one recommended, and equal-bytes pairs compared.

- frontier: per model and task, each configuration's headline score against its modelled KV bytes per
  sequence (evalkit.memory in its storage: codes, scales, residual), non-inferior ones (paired against the
  full cache in the model dtype, per problem) marked, the full cache as the reference row;
- recommend_bytes: the configuration with the fewest KV bytes that is non-inferior and whose effective decode
  gain is above 1, whatever its kind, with the cheapest qualifying one of the other kind beside it (eviction:
  a method that drops entries, in any storage; quantization: the full cache in a quantized storage);
- equal_bytes: compressed configurations in different storages whose bytes match within EQUAL_BYTES, paired
  per problem like a run with the full one: diff = the cheaper - the dearer.
"""

from __future__ import annotations

from collections import defaultdict

import pandas as pd

from evalkit.report.columns import budget_key, budget_label, config_label, mib
from evalkit.report.pairing import PairingError, pair
from evalkit.report.runs import Run, RunError

EQUAL_BYTES = 0.10  # two configurations' KV bytes per sequence match when they differ by at most this share
KINDS = ("eviction", "quantization")


def kind(method: str) -> str:
    """`eviction` for a method that drops entries (whatever its storage), `quantization` for the full cache
    (held in a quantized storage: the model dtype's full cache is the reference, never a candidate)."""
    return "quantization" if method == "full" else "eviction"


def label(r) -> str:
    """`snapstream 2048 + fp8_e4m3`, `full + int4`: a configuration with its budget."""
    name = r["method"] if r["settings"] == "default" else f"{r['method']} {r['settings']}"
    name += "" if pd.isna(r["budget"]) else f" {int(r['budget'])}"
    return config_label(name, "default", r.get("query_aware"), r.get("storage", "none"))


def gain_check(row) -> tuple[bool | None, str]:
    """(effective gain above 1 on every hardware, why not): None when it could not be computed (no output
    lengths recorded, or no memory model joined), and then the reason."""
    hw = [k.removeprefix("effective_gain_") for k in row.index if k.startswith("effective_gain_")]
    gains = {h: row[f"effective_gain_{h}"] for h in hw}
    if not gains or any(v is None or pd.isna(v) for v in gains.values()):
        why = "memory model not joined"
        if pd.isna(row.get("token_gain")):
            caveat = row.get("length_caveat")
            why = caveat if isinstance(caveat, str) else "no output lengths recorded"
        return None, f"effective gain not computed ({why})"
    if all(v > 1 for v in gains.values()):
        return True, ""
    eff = ", ".join(f"{v:.2f}x on {h}" for h, v in gains.items())
    tok = ", ".join(f"{row[f'tok_s_gain_{h}']:.2f}x" for h in hw)
    what = "length inflation erases the gain" if row.token_gain < 1 else "the budget buys no decode gain"
    return False, (
        f"{budget_label(row.budget)}: {what} (effective gain {eff}: memory-bound gain {tok} x "
        f"full/compressed tokens {row.token_gain:.2f})"
    )


def frontier(head: pd.DataFrame) -> dict[tuple[str, str], pd.DataFrame]:
    """Per (model, task): every configuration's headline row by KV bytes per sequence (fewest first), with
    `kind`, `label`, `qualifies` (non-inferior, fewer bytes than the full cache, and an effective gain not
    at or below 1: one not computed qualifies with its reason in `why`) and `why` not; the full cache in
    the model dtype as a last row (`kind` full)."""
    out = {}
    if head.empty or "kv_bytes_seq" not in head:
        return out
    for (model, task), rows in head.groupby(["model", "task"], sort=True):
        rows = rows[rows.kv_bytes_seq.notna()].copy()
        if rows.empty:
            continue
        checks = [gain_check(r) for _, r in rows.iterrows()]
        rows["kind"] = [kind(m) for m in rows.method]
        rows["label"] = [label(r) for _, r in rows.iterrows()]
        rows["saves"] = rows.kv_bytes_seq < rows.kv_bytes_seq_full  # no smaller than the full cache: none
        rows["gain_known"] = [ok is True for ok, _ in checks]
        rows["qualifies"] = [
            v == "non-inferior" and ok is not False and bool(s)
            for v, (ok, _), s in zip(rows.verdict, checks, rows.saves)
        ]
        rows["why"] = [
            _why(q, v, ok, why, s)
            for q, v, (ok, why), s in zip(rows.qualifies, rows.verdict, checks, rows.saves)
        ]
        rows = rows.sort_values(["kv_bytes_seq", "compressed"], ascending=[True, False])
        first = rows.iloc[0]
        full = {"model": model, "task": task, "kind": "full", "label": "full (model dtype)",
                "kv_bytes_seq": first.kv_bytes_seq_full, "compressed": first.full, "qualifies": False,
                "why": "the reference", "run": first.full_run}  # fmt: skip
        out[(model, task)] = pd.concat([rows, pd.DataFrame([full])], ignore_index=True)
    return out


def _why(qualifies: bool, verdict: str, ok: bool | None, why: str, saves: bool) -> str:
    """Why a configuration does not qualify, or the caveat it qualifies with (its gain not computed)."""
    if verdict != "non-inferior":
        return verdict
    if not saves:
        return "no smaller than the full cache"
    return why if not qualifies or ok is None else ""


def _pick(rows: pd.DataFrame) -> dict | None:
    ok = rows[rows.qualifies]
    return None if ok.empty else ok.iloc[0].to_dict()  # rows are sorted fewest bytes first


def recommend_bytes(fronts: dict[tuple[str, str], pd.DataFrame]) -> list[dict]:
    """Per (model, task): `best` (the fewest KV bytes that qualifies, any kind), `other` (the cheapest that
    qualifies of the other kind, or None) and `status` (why there is none)."""
    out = []
    for (model, task), rows in sorted(fronts.items()):
        rows = rows[rows.kind != "full"]
        best = _pick(rows)
        rec = {"model": model, "task": task, "best": best, "other": None, "configs": len(rows)}
        if best is None:
            non_inf = rows[rows.verdict == "non-inferior"]
            whys = sorted(
                {"effective gain <= 1" if s else "no smaller than the full cache" for s in non_inf.saves}
            )
            rec["status"] = (
                f"no non-inferior configuration qualifies ({'; '.join(whys)})"
                if len(non_inf)
                else "no configuration is non-inferior"
            )
        else:
            other = [k for k in KINDS if k != best["kind"]][0]
            rec["other"] = _pick(rows[rows.kind == other])
            gain = "effective gain above 1" if best["gain_known"] else best["why"]  # not computed: why
            rec["status"] = f"non-inferior, {gain}" + (
                "" if rec["other"] else f"; no {other} configuration qualifies"
            )
        out.append(rec)
    return out


def sentence(rec: dict) -> str:
    """`snapstream 2048 + fp8_e4m3: 0.5 MiB; full + int4: 1.1 MiB`."""
    parts = [f"{r['label']}: {mib(r['kv_bytes_seq'])}" for r in (rec["best"], rec["other"]) if r]
    return "; ".join(parts) or "-"


# --- equal-bytes pairs --------------------------------------------------------------------------------------


def bytes_match(a: float, b: float, tolerance: float = EQUAL_BYTES) -> bool:
    return abs(a - b) <= tolerance * max(a, b)


def equal_bytes_pairs(head: pd.DataFrame) -> list[tuple[dict, dict]]:
    """(cheaper, dearer) headline rows of one model and task whose KV bytes match and whose storages differ
    (eviction in the model dtype against a quantized full cache; SnapStream 2048 in fp8 against 1024 in
    bf16)."""
    out = []
    if head.empty or "kv_bytes_seq" not in head:
        return out
    by = defaultdict(list)
    for r in head[head.kv_bytes_seq.notna()].to_dict("records"):
        by[(r["model"], r["task"], r["query_aware"])].append(r)
    for rows in by.values():
        rows.sort(key=lambda r: (r["kv_bytes_seq"], r["method"], budget_key(r["budget"]), r["storage"]))
        for i, a in enumerate(rows):
            for b in rows[i + 1 :]:
                if a["storage"] != b["storage"] and bytes_match(a["kv_bytes_seq"], b["kv_bytes_seq"]):
                    out.append((a, b))
    return out


def equal_bytes(head: pd.DataFrame, runs: list[Run], settings, problems: list[str]) -> pd.DataFrame:
    """The equal-bytes pairs' paired statistics on the headline metric (stats.compare, the dearer run as the
    reference, so diff = cheaper - dearer and `non-inferior` means the cheaper one costs under delta)."""
    by_rel = {r.rel: r for r in runs}
    rows = []
    for a, b in equal_bytes_pairs(head):
        cheap, dear = by_rel[a["run"]], by_rel[b["run"]]
        try:
            if cheap.base_generation != dear.base_generation:
                raise PairingError(f"{cheap.rel} cannot be compared with {dear.rel}: generated differently")
            if cheap.identity["scoring"] != dear.identity["scoring"]:
                raise PairingError(f"{cheap.rel} cannot be compared with {dear.rel}: scored differently")
            cell = pair(cheap, dear, settings).cells.get(cheap.headline)
        except (PairingError, RunError) as e:
            problems.append(f"equal bytes: {e}")
            continue
        if cell is None:
            continue
        rows.append(
            {"model": a["model"], "task": a["task"], "cheaper": label(a), "dearer": label(b),
             "cheaper_bytes": a["kv_bytes_seq"], "dearer_bytes": b["kv_bytes_seq"], "cheaper_run": cheap.rel,
             "dearer_run": dear.rel, "metric": cheap.headline, **cell}
        )  # fmt: skip
    return pd.DataFrame(rows)


__all__ = ["EQUAL_BYTES", "frontier", "recommend_bytes", "equal_bytes", "sentence"]
