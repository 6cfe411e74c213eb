"""The report's tables: the context x method x budget sweep, the paper's Table 5 check, and predicted
versus measured KV bytes for the runs evalkit executed (`<results_dir>/runs/**/metrics.json`)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import OmegaConf

from evalkit import metrics as metrics_record
from evalkit.memory.model import MemoryReportError, kv_geometry, load_hf_config, model_spec
from evalkit.memory.sharding import Sharding, shard_model
from evalkit.memory.sim import (
    METHOD_ALIASES,
    Deployment,
    GiB,
    Hardware,
    canonical_method,
    kv_entries,
    method_of,
    ring_entries,
)
from evalkit.memory.validate import validate

log = logging.getLogger(__name__)

# SnapStream (arXiv 2511.03092) Table 5, DeepSeek-R1-0528 on one 16-socket SN40L node, tok/s with x2.4
# MTP: (context, SnapStream cache, max batch full, max batch SnapStream, tok/s full, tok/s SnapStream).
PAPER_TABLE5 = [
    (131072, 32768, 16, 64, 434, 1832),
    (65536, 16384, 32, 128, 908, 3928),
    (32768, 8192, 64, 256, 1832, 7903),
]
PAPER_MTP = 2.4  # the paper's multi-token-prediction factor, included in its tok/s


def hf_config_of(m: dict) -> dict:
    hf_config = load_hf_config(m["hf"]) if m.get("hf") else m.get("hf_config")
    if not hf_config:
        raise MemoryReportError(
            "model: set model.hf (a Hub id or local folder) or model.hf_config (its fields)"
        )
    return hf_config


def kv_storage(name_or_cfg):
    """The KV storage `model.kv` names (conf/kv/: none, fp8_e4m3, int4, ... or a node with `_target_`), None
    for `none` (entries in `model.kv_dtype`); a bad one is a MemoryReportError naming the setting."""
    from evalkit.config import ConfigError
    from evalkit.kv.storage import make_storage

    if name_or_cfg in (None, "none"):
        return None
    try:
        storage = make_storage(name_or_cfg if isinstance(name_or_cfg, str) else OmegaConf.create(name_or_cfg))
    except ConfigError as e:
        raise MemoryReportError(f"model.kv: {e}") from None
    return None if storage.name == "none" else storage


def record_storage(m):
    """A run's KV storage from its metrics.json record `m`: its saved config's `kv` node (every setting it
    ran with), else the storage name it recorded; None for `none`."""
    node = (m.config or {}).get("kv")
    return kv_storage(node if isinstance(node, dict) and node.get("_target_") else m.storage.get("name"))


def deployment(cfg: dict) -> Deployment:
    """The Deployment described by a resolved `conf/memory.yaml` (as plain dicts)."""
    m = cfg["model"]
    hf_config = hf_config_of(m)
    spec = model_spec(
        m["name"],
        hf_config,
        m["weight_dtype"],
        m["kv_dtype"],
        m.get("kv_layout"),
        m.get("num_parameters"),
        kv_storage(m.get("kv")),
    )
    hw = Hardware.from_cfg(cfg["hardware"])
    par = cfg["parallel"]
    return Deployment(spec, hw, par["tp"], par["attention"], float(cfg["mtp_factor"]))


def sharding_of(dep: Deployment, cfg: dict) -> Sharding | None:
    """The torchrun layout `parallel.tp_size` x `parallel.dp_size`, or None for one process (tp = dp = 1:
    the report is then exactly the single-device one)."""
    tp, dp = cfg["parallel"].get("tp_size", 1), cfg["parallel"].get("dp_size", 1)
    if tp == dp == 1:
        return None
    m = cfg["model"]
    other = m.get("other_dtype") or m["weight_dtype"]
    return shard_model(hf_config_of(m), dep.model.kv, tp, dp, dep.hw.sockets, m["weight_dtype"], other)


def per_gpu_rows(sharding: Sharding, dep: Deployment, rows: list[dict]) -> list[dict[str, Any]]:
    """Per GPU, for one request of each sweep row: weights, KV at the row's cache size, HBM left, whether it
    fits, and how many such requests one GPU could hold at once."""
    out = []
    for r in rows:
        kv = sharding.kv_bytes_gpu(r["kv_entries"])
        room = dep.hw.hbm_bytes - sharding.weight_bytes_gpu
        out.append(
            {
                "model": r["model"],
                "hardware": r["hardware"],
                "tp_size": sharding.tp,
                "dp_size": sharding.dp,
                "world_size": sharding.world,
                "nodes": sharding.nodes,
                "context": r["context"],
                "decode": r["decode"],
                "method": r["method"],
                "budget": r["budget"],
                "kv_entries": r["kv_entries"],
                "kv_heads_gpu": sharding.kv_heads_gpu,
                "weight_bytes_gpu": sharding.weight_bytes_gpu,
                "kv_bytes_gpu": kv,
                "hbm_bytes_gpu": dep.hw.hbm_bytes,
                "hbm_free_bytes": room - kv,
                "fits": room - kv >= 0,
                "max_requests_gpu": max(room, 0) // kv,
            }
        )
    return out


def kv_reserve_bytes(cfg: dict) -> int | None:
    gib = cfg.get("kv_reserve_gib")
    return None if gib is None else round(gib * GiB)


def _batch(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MemoryReportError(f"batch must be 'max' or a positive integer, got {value!r}")
    return value


def row(dep: Deployment, cfg: dict, context: int, method: str, budget: int | None) -> dict[str, Any]:
    """One configuration: KV sizes, capacity-limited and reservation-calibrated max batch, placement and
    throughput at the configured batch ("max" = the capacity-limited max batch), SRAM tile."""
    decode, method = cfg["decode_len"], canonical_method(method)
    entries = kv_entries(method, budget, context, decode, dep.model.kv.shape)
    made = method_of(method, budget)
    dep = replace(dep, ring=min(ring_entries(made), entries))  # a quantized storage keeps a ring raw
    max_batch = dep.max_batch(entries)
    max_batch_cal = dep.max_batch(entries, kv_reserve_bytes(cfg))
    batch = max_batch if cfg["batch"] == "max" else _batch(cfg["batch"])
    cal = dep.step(max_batch_cal, entries)
    tile = dep.sram_tile_bytes(entries, cfg.get("tile_tokens"))
    return {
        "model": dep.model.name,
        "hardware": dep.hw.name,
        "context": context,
        "decode": decode,
        "method": method,
        "budget": budget if made.budget_applies else None,
        "kv_entries": entries,
        "kept_fraction": entries / (context + decode),  # kept / seen
        "kv_bytes_per_token": dep.model.kv.bytes_per_entry,
        "kv_bytes_per_seq": dep.model.kv.sequence_bytes(entries, dep.ring),  # in its storage: codes + scales
        "kv_bytes_per_seq_socket": dep.kv_bytes_socket(entries),
        "weight_bytes_socket": dep.weight_bytes_socket,
        "max_batch": max_batch,
        # Unfloored sequences that fit: the pure memory arithmetic, whose ratios are exact.
        "max_batch_frac": dep.seq_groups * dep.kv_room_socket / dep.kv_bytes_socket(entries),
        "max_batch_cal": max_batch_cal,
        **dep.step(batch, entries),
        "step_ms_cal": cal["step_ms"],
        "tok_s_cal": cal["tok_s"],
        "sram_tile_bytes": tile,
        "sram_tile_frac": tile / dep.hw.sram_bytes,
    }


def sweep_rows(dep: Deployment, cfg: dict) -> tuple[list[dict], list[str]]:
    """Rows for every context length x method x budget; a budget above a context is skipped for that
    context (a grid naturally has such cells) but one above every context is an error."""
    rows, skipped = [], []
    for method in cfg["methods"]:
        budgets = list(cfg["budgets"]) if method_of(method).budget_applies else [None]
        for budget in budgets:
            fits = [c for c in cfg["context_lens"] if budget is None or budget <= c]
            if not fits:
                raise MemoryReportError(
                    f"method.budget={budget} exceeds every context_len {cfg['context_lens']}"
                )
            skipped += [f"{method} B={budget} at context {c}" for c in cfg["context_lens"] if c not in fits]
            rows += [row(dep, cfg, int(c), method, budget) for c in fits]
    rows.sort(key=lambda r: (r["context"], r["method"] != "full", r["method"], r["budget"] or 0))
    return rows, skipped


def paper_check(dep: Deployment, cfg: dict) -> list[dict[str, Any]]:
    """Table 5 recomputed for this deployment: full vs SnapStream max batch and tok/s, capacity-limited
    and calibrated, next to the paper's figures."""
    out = []
    for context, budget, pb_full, pb_snap, pt_full, pt_snap in PAPER_TABLE5:
        full, snap = row(dep, cfg, context, "full", None), row(dep, cfg, context, "snapstream", budget)
        r = {
            "context": context,
            "budget": budget,
            "memory_ratio": full["kv_bytes_per_seq"] / snap["kv_bytes_per_seq"],
        }
        for tag, key in (("", "max_batch"), ("_cal", "max_batch_cal")):  # capacity-limited, calibrated
            b_full, b_snap = full[key], snap[key]
            t_full = dep.step(b_full, full["kv_entries"])["tok_s"]  # at that max batch, whatever cfg.batch
            t_snap = dep.step(b_snap, snap["kv_entries"])["tok_s"]
            r |= {f"batch_full{tag}": b_full, f"batch_snap{tag}": b_snap}
            r |= {f"tok_s_full{tag}": t_full, f"tok_s_snap{tag}": t_snap}
            r[f"batch_ratio{tag}"] = b_snap / b_full if b_full else float("nan")
            r[f"gain{tag}"] = t_snap / t_full if t_full else float("nan")
        r |= {"paper_batch_full": pb_full, "paper_batch_snap": pb_snap, "paper_tok_s_full": pt_full}
        r |= {"paper_tok_s_snap": pt_snap, "paper_gain": pt_snap / pt_full}
        # Bandwidth share the paper's step time implies for the same bytes (full cache, paper batch).
        step = dep.step(pb_full, full["kv_entries"])
        moved = step["weights_hbm_bytes"] + step["kv_hbm_bytes"]
        r["paper_bw_frac"] = moved / (pb_full * PAPER_MTP / pt_full) / dep.hw.hbm_bw
        out.append(r)
    return out


def run_entries(method: str, budget: int | None, prefill: int, seen: int, shape, conf=None) -> int:
    """Slots an evalkit cache holds after `seen` tokens of which its prefill compressed `prefill`, as the
    runner sizes it (`slots_needed` of the method object): fixed-size caches hold B (static shape: a ring the
    question, answers and later turns pass through), full every token, an appending method (snapkv, the
    rival prefill methods) min(prefill, B) and every token fed after the prefill. Query-aware, the prefill is
    the whole prompt; query-agnostic, the context alone (the question is fed after it); in a multi-question
    conversation the context, with every later question and answer appended. Head- and layer-adaptive
    budgets hold the slots of their largest head and layer in every head (`KVMethod.slots` of the model's
    `shape`, `evalkit.kv.layout.Shape`): what their buffers hold (a ragged layout's bytes:
    `kv.peak_ragged_bytes`)."""
    from evalkit.kv.layout import slots_needed

    return slots_needed(method_of(method, budget, conf), prefill, seen - prefill, shape)


def measured_rows(results_dir: str | Path) -> tuple[list[dict], list[str]]:
    """Predicted KV bytes for each executed run next to the cache's reported peak, from the model config,
    dtype, budget and the peak request's prompt and decoded lengths (never from the measured entries)."""
    rows, notes = [], []
    root = Path(results_dir) / "runs"
    paths = sorted(root.glob("**/metrics.json"))
    for path in paths:
        rel = path.relative_to(root).as_posix()
        try:
            m = metrics_record.load(path, strict=False)
            hf_config, dtype, kv = m.model["hf_config"], m.model["dtype"], m.kv
            # any method with a conf: its cache slots follow from its class (`run_entries`)
            method, budget = METHOD_ALIASES.get(m.method["name"], m.method["name"]), m.method.get("budget")
            conf = (m.config or {}).get("method")  # the settings it ran with (None in an older metrics.json)
            peak_bytes, peak_entries = int(kv["peak_bytes"]), int(kv["peak_entries"])
            geo = kv_geometry(hf_config, dtype, kv["cache_layout"], record_storage(m))  # codes + scales
            made = method_of(method, budget, conf)
            if kv.get("peak_seen_tokens") is not None:
                # a metrics.json from before `peak_prefill_tokens`: the prompt was the prefill (query-aware)
                source, prefill = "lengths", kv.get("peak_prefill_tokens") or kv["peak_prompt_tokens"]
                seen = int(kv["peak_seen_tokens"])
                entries = run_entries(method, budget, int(prefill), seen, geo.shape, conf)
            elif made.ring:  # a fixed-size cache: its budget
                source, entries = "budget", int(budget)
            else:  # an older metrics.json without lengths: a growing cache cannot be predicted, only echoed
                source, entries = "measured", peak_entries
        except (KeyError, TypeError, ValueError) as e:  # MemoryReportError is a ValueError
            notes.append(f"{rel}: skipped ({type(e).__name__}: {e})")
            continue
        predicted = geo.sequence_bytes(entries, min(ring_entries(made), entries))  # in the run's storage
        rows.append(
            {
                "run": rel,
                "task": m.task,
                "model": m.model.get("name"),
                "method": method,
                "budget": budget,
                "cache_layout": geo.layout,
                "dtype": dtype,
                "bytes_per_entry": geo.bytes_per_entry,
                "entries_from": source,
                "predicted_entries": entries,
                "measured_entries": peak_entries,
                "predicted_bytes": predicted,
                "measured_bytes": peak_bytes,
                "match": predicted == peak_bytes and entries == peak_entries,
            }
        )
    if not paths:
        notes.append(f"no runs under {root} yet")
    return rows, notes


def check(cfg: dict) -> tuple[Deployment, list[dict], list[str], Sharding | None]:
    """Everything that can fail on bad input, before anything is written: the settings, the model and
    mapping, the sweep, the GPU layout. Returns (deployment, sweep rows, skipped cells, sharding)."""
    validate(cfg)
    dep = deployment(cfg)
    rows, skipped = sweep_rows(dep, cfg)
    return dep, rows, skipped, sharding_of(dep, cfg)


def write_report(cfg: dict) -> dict[str, Path]:
    """Compute everything and write report.csv, report.md and the plots under `<results_dir>/memory/`."""
    from evalkit.memory.render import render_markdown, write_plots  # matplotlib only when writing

    dep, rows, skipped, sharding = check(cfg)
    per_gpu = per_gpu_rows(sharding, dep, rows) if sharding else []
    paper = paper_check(dep, cfg) if cfg["paper_check"] else []
    measured, notes = measured_rows(cfg["results_dir"])
    out = Path(cfg["results_dir"]) / "memory"
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "report.csv", "md": out / "report.md"}
    frame = pd.DataFrame(rows).astype({"budget": "Int64"})  # full has no budget: keep the column integral
    frame.to_csv(paths["csv"], index=False)
    if sharding:
        paths["layout"] = out / "layout.csv"
        pd.DataFrame(per_gpu).astype({"budget": "Int64"}).to_csv(paths["layout"], index=False)
    paths |= write_plots(rows, out, f"{dep.model.name} on {dep.hw.sockets} x {dep.hw.name}")
    tables = {"rows": rows, "skipped": skipped, "paper": paper, "measured": measured, "notes": notes}
    tables |= {"layout": sharding, "per_gpu": per_gpu}
    paths["md"].write_text(render_markdown(dep, cfg, tables, paths))
    for r in paper:
        log.info(
            "Table 5 @%dk: batch %d->%d (calibrated), %d->%d (capacity); gain %.2fx (paper %.2fx)",
            r["context"] // 1024,
            r["batch_full_cal"],
            r["batch_snap_cal"],
            r["batch_full"],
            r["batch_snap"],
            r["gain_cal"],
            r["paper_gain"],
        )
    for r in per_gpu:
        log.info(
            "TP%d x DP%d, %s @%d: %.2f GiB weights + %.2f GiB KV per GPU of %.2f GiB: %s",
            r["tp_size"],
            r["dp_size"],
            r["method"] if r["budget"] is None else f"{r['method']} B={r['budget']}",
            r["context"],
            r["weight_bytes_gpu"] / GiB,
            r["kv_bytes_gpu"] / GiB,
            r["hbm_bytes_gpu"] / GiB,
            "fits" if r["fits"] else "DOES NOT FIT",
        )
    if any(not r["match"] for r in measured):
        log.warning("predicted and measured KV bytes disagree for some runs: see %s", paths["md"])
    return paths
