"""Writing the memory report: the Markdown (tables plus every assumption in words) and the plots."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt  # noqa: E402

from evalkit.memory.sharding import Sharding  # noqa: E402
from evalkit.memory.sim import GB, TB, Deployment, GiB, MiB  # noqa: E402
from evalkit.results import save_figure  # noqa: E402


def _table(headers: list[str], lines: list[list[Any]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(out + ["| " + " | ".join(str(x) for x in line) + " |" for line in lines])


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _label(r: dict) -> str:
    return "full" if r["method"] == "full" else f"{r['method']} B={r['budget']}"


def _setup(dep: Deployment, cfg: dict) -> str:
    m, hw, kv = dep.model, dep.hw, dep.model.kv
    counted = (
        "given (model.num_parameters)" if cfg["model"].get("num_parameters") else "counted from the config"
    )
    source = cfg["model"].get("hf") or "fields in conf/memory.yaml (model.hf_config)"
    reserve = cfg.get("kv_reserve_gib")
    return _table(
        ["setting", "value"],
        [
            ["model", f"{m.name} (config: {source})"],
            [
                "parameters",
                f"{m.num_parameters / 1e9:.1f} B, {counted}; {m.active_parameters / 1e9:.1f} B active per "
                "token",
            ],
            [
                "weights",
                f"{m.weight_bits}-bit: {_gib(m.weight_bytes)} GiB in all, {_gib(dep.weight_bytes_socket)} "
                f"GiB per socket (TP{dep.tp})",
            ],
            [
                "KV per token",
                f"{kv.bytes_per_entry:,} B = layers x cached heads x (key + value width) x bytes = "
                f"{kv.layers} x {kv.cached_heads} x ({kv.key_width} + {kv.value_width}) x {kv.kv_bits / 8:g} "
                f"({kv.layout})",
            ],
            [
                "hardware",
                f"{hw.name}: {hw.sockets} sockets; per socket SRAM {hw.sram_bytes / MiB:g} MiB, HBM "
                f"{_gib(hw.hbm_bytes)} GiB at {hw.hbm_bw / TB:g} TB/s, DDR {_gib(hw.ddr_bytes)} GiB at "
                f"{hw.ddr_bw / GB:g} GB/s, {hw.flops / TB:g} TFLOP/s; efficiency {hw.efficiency:g}",
            ],
            [
                "mapping",
                f"projections TP{dep.tp}; attention {dep.attention} (KV of one sequence split "
                f"{dep.kv_shard}-way, sequences spread over {dep.seq_groups} socket groups)",
            ],
            [
                "decode",
                f"decode_len {cfg.get('decode_len') or 0}, batch {cfg.get('batch', 'max')}, MTP factor "
                f"{dep.mtp_factor:g}",
            ],
            [
                "KV reservation (calibrated columns)",
                "none: same as capacity" if reserve is None else f"{reserve:g} GiB per socket",
            ],
        ],
    )


def _sweep(rows: list[dict]) -> str:
    headers = [
        "context",
        "cache",
        "entries",
        "kept/seen",
        "KV/seq GiB",
        "KV/seq/socket GiB",
        "max batch",
        "max batch (cal.)",
        "tok/s at batch",
        "tok/s (cal.)",
        "SRAM tile MiB (% of SRAM)",
    ]
    lines = [
        [
            r["context"],
            _label(r),
            r["kv_entries"],
            f"{r['kept_fraction']:.3f}",
            _gib(r["kv_bytes_per_seq"]),
            _gib(r["kv_bytes_per_seq_socket"]),
            r["max_batch"],
            r["max_batch_cal"],
            f"{r['tok_s']:.0f}",
            f"{r['tok_s_cal']:.0f}",
            f"{r['sram_tile_bytes'] / MiB:.1f} ({100 * r['sram_tile_frac']:.0f}%)",
        ]
        for r in rows
    ]
    return _table(headers, lines)


def _placement(rows: list[dict]) -> str:
    headers = [
        "context",
        "cache",
        "batch",
        "seqs/socket",
        "weights HBM/DDR GiB",
        "KV HBM/DDR GiB",
        "HBM free GiB",
        "fits",
        "step ms",
        "bound",
    ]
    lines = [
        [
            r["context"],
            _label(r),
            r["batch"],
            r["seqs_per_socket"],
            f"{_gib(r['weights_hbm_bytes'])} / {_gib(r['weights_ddr_bytes'])}",
            f"{_gib(r['kv_hbm_bytes'])} / {_gib(r['kv_ddr_bytes'])}",
            _gib(r["hbm_free_bytes"]),
            "yes" if r["fits"] else "NO",
            f"{r['step_ms']:.1f}",
            r["bound"],
        ]
        for r in rows
    ]
    return _table(headers, lines)


def _sharding(sharding: Sharding, per_gpu: list[dict]) -> str:
    """The torchrun layout: what every GPU holds, then one request per sweep row."""
    kv = sharding.kv
    heads = (
        f"{sharding.kv_heads_gpu} of {kv.cached_heads} KV heads per layer"
        if kv.layout == "per_head"
        else "the whole MLA latent (attention is not sharded: replicated on every rank)"
    )
    split = (
        f"of the whole model's {_gib(sharding.sharded_bytes + sharding.replicated_bytes)} GiB, "
        f"{_gib(sharding.sharded_bytes)} GiB are split {sharding.tp}-way by the tensor-parallel plan and "
        f"{_gib(sharding.replicated_bytes)} GiB are on every GPU"
        if sharding.tp > 1
        else "no tensor parallelism: the whole model on every GPU"
    )
    setup = (
        f"{sharding.world} processes (tp_size {sharding.tp} x dp_size {sharding.dp}), {sharding.nodes} "
        f"node(s) of {sharding.gpus_per_node} GPUs. Weights per GPU: {_gib(sharding.weight_bytes_gpu)} GiB "
        f"({sharding.parameters / 1e9:.3f} B parameters as transformers builds the model; {split}). "
        f"KV per GPU: {heads}."
    )
    headers = ["context", "cache", "entries", "weights GiB", "KV GiB (1 request)", "HBM free GiB", "fits"]
    headers.append("requests/GPU")
    lines = [
        [
            r["context"],
            _label(r),
            r["kv_entries"],
            _gib(r["weight_bytes_gpu"]),
            _gib(r["kv_bytes_gpu"]),
            _gib(r["hbm_free_bytes"]),
            "yes" if r["fits"] else "NO",
            r["max_requests_gpu"],
        ]
        for r in per_gpu
    ]
    return setup + "\n\n" + _table(headers, lines) + "\n\n" + LAYOUT_NOTE


LAYOUT_NOTE = """\
Per GPU = the largest rank (torch gives rank 0 ceil(n / tp) of a split dimension). KV GiB is what one GPU
holds for one request whose cache holds `entries` slots per layer and head (full: context + decode; a
fixed-size cache, snapstream, streamingllm, h2o, ...: the budget; an appending one, snapkv, knorm, ...:
budget + decode), the same bytes a run records per rank. Weights: the
decoder layers' matrices in model.weight_dtype, embeddings, lm_head, norms and routers in model.other_dtype;
fp8 block scales, buffers, activations, the CUDA context and allocator slack are not counted: keep a few GiB
free. requests/GPU = HBM left after the weights / KV of one request."""


def _paper(paper: list[dict]) -> str:
    headers = [
        "context -> cache",
        "KV ratio",
        "max batch full -> SnapStream: capacity; calibrated; paper",
        "batch ratio cap. / cal. / paper",
        "tok/s full -> SnapStream: capacity; calibrated; paper",
        "gain cap. / cal. / paper",
        "paper's implied HBM bw share",
    ]
    lines = [
        [
            f"{r['context'] // 1024}k -> {r['budget'] // 1024}k",
            f"{r['memory_ratio']:.2f}x",
            f"{r['batch_full']}->{r['batch_snap']}; {r['batch_full_cal']}->{r['batch_snap_cal']}; "
            f"{r['paper_batch_full']}->{r['paper_batch_snap']}",
            f"{r['batch_ratio']:.2f} / {r['batch_ratio_cal']:.2f} / "
            f"{r['paper_batch_snap'] / r['paper_batch_full']:.2f}",
            f"{r['tok_s_full']:.0f}->{r['tok_s_snap']:.0f}; "
            f"{r['tok_s_full_cal']:.0f}->{r['tok_s_snap_cal']:.0f}; "
            f"{r['paper_tok_s_full']}->{r['paper_tok_s_snap']}",
            f"{r['gain']:.2f} / {r['gain_cal']:.2f} / {r['paper_gain']:.2f}",
            f"{100 * r['paper_bw_frac']:.0f}%",
        ]
        for r in paper
    ]
    return _table(headers, lines)


def _measured(measured: list[dict], notes: list[str]) -> str:
    headers = [
        "run",
        "method",
        "budget",
        "layout",
        "dtype",
        "B/entry",
        "entries pred. (from) / meas.",
        "bytes predicted",
        "bytes measured",
        "agree",
    ]
    lines = [
        [
            r["run"],
            r["method"],
            r["budget"],
            r["cache_layout"],
            r["dtype"],
            f"{r['bytes_per_entry']:,}",
            f"{r['predicted_entries']} ({r['entries_from']}) / {r['measured_entries']}",
            f"{r['predicted_bytes']:,}",
            f"{r['measured_bytes']:,}",
            "yes" if r["match"] else "**NO**",
        ]
        for r in measured
    ]
    text = _table(headers, lines) if measured else ""
    return text + "".join(f"\n- {n}" for n in notes)


ASSUMPTIONS = """\
- **Units.** Capacities are binary (MiB, GiB = 2^30 bytes), bandwidths decimal (TB/s = 10^12 bytes/s), as
  vendors quote them.
- **KV entries per sequence** (per layer and KV head, at the end of decoding): `full` keeps context +
  decode tokens; a fixed-size method (`snapstream`, `streamingllm`, the decode-time evictors `h2o`,
  `tova_decode`, `snapkv_decode`, the `*_ring` rivals) keeps exactly B (a static, padded cache: its size
  does not depend on the length); an appending one (`snapkv`, `knorm`, `keydiff`, `tova`,
  `expected_attention`, `kvzip`) keeps B after prefill compression and then appends every generated token
  like `full` (as in the SnapKV paper), so its cache grows with decode_len. Each follows from the method's
  class, as the runner sizes its caches. `context` is the
  sequence length the paper's Table 5 quotes (decode_len 0 by default); a budget above a context length
  is skipped for that length.
- **Weights.** Counted from the config (embeddings, attention, gated MLPs or MoE experts, norms; no biases
  and no multi-token-prediction module) unless model.num_parameters is given (DeepSeek-R1: 671e9, stored
  in fp8). The weight dtype and KV dtype are separate settings.
- **Mapping.** Projections are tp-way tensor parallel, so a socket stores weights / tp. With
  `dp_attention` (SnapStream's decode mapping, paper section 4.2) each socket holds only its own
  sequences' KV: no replication. `tp_kv_heads` splits each sequence's KV heads tp-way; `replicated`
  keeps a whole copy per socket of a TP group (what plain TP does with a one-head latent cache).
- **Placement** (SN40L, arXiv 2405.07518 section V-A): HBM first while everything fits; weights have the
  highest priority to stay in HBM; what overflows spills to DDR, KV before weights. A GPU has no DDR
  tier: overflow there means the batch does not fit.
- **Max batch (capacity-limited)** = sequence groups x floor(HBM left after the weight shard / KV per
  sequence per socket). No HBM is held back for activations, compiler buffers or the prefill hand-off,
  so this is an upper bound: for DeepSeek-R1 in fp8 about 25 GiB per socket stay free, room for two
  full 128k sequences per socket, where the paper reports one.
- **Max batch (calibrated)** caps the KV at one stated per-socket reservation (kv_reserve_gib, see
  Setup). The default, 9 GiB per socket, reproduces the paper's absolute batch column (16/64, 32/128,
  64/256) for DeepSeek-R1 in bf16 KV: one full 128k sequence (8.58 GiB) fits, two do not, and 16 of the
  8k caches (0.54 GiB each) fit, 17 do not; any value in [8.58, 9.11) GiB gives the same column.
- **The 4x from memory alone.** A 4x smaller cache per sequence fits exactly 4x more sequences
  (unfloored: `max_batch_frac` in the CSV, "KV ratio" above); whole-sequence floors move the
  capacity-limited integer ratio away from 4x, the calibrated one lands on it.
- **Decode step.** Each socket reads its weight shard and its sequences' KV once per step; step time =
  bytes / (bandwidth x efficiency), HBM and DDR reads added (no overlap assumed), or the compute time
  (2 x active parameters x batch / sockets plus attention FLOPs, at peak x efficiency) if larger.
  The whole weight shard is read every step: exact for dense models, an upper bound for MoE at small
  batch (at 16+ sequences most of DeepSeek's 256 experts are touched). tok/s = batch / step time x the
  multi-token-prediction factor (the paper's figures include x2.4). Interconnect traffic, MTP
  verification, prefill and scheduling are not modelled, so absolute tok/s come out above the paper's;
  the "implied HBM bw share" column says what share of peak bandwidth the paper's step times amount to.
- **SRAM tile**: one layer of one sequence's attention on one socket: its cache slots (the whole cache
  unless tile_tokens is set), the query and fp32 score rows, against the on-chip SRAM.
- **Measured**: for runs under results_dir/runs, the predicted bytes are bytes per entry (from the run's
  own HF config, dtype and cache layout) x the entries the method holds for the peak request's prompt and
  decoded lengths (metrics.json records both): the budget for fixed-size caches, every token for full,
  min(prompt, budget) + decoded tokens for snapkv (entries_from "lengths"). A metrics.json written before
  the lengths were recorded falls back to the budget (fixed-size) or echoes the measured entries
  (growing, entries_from "measured": not a check). A run agrees when bytes and entries both match exactly.
  peak_bytes is taken as one sequence's cache (batch 1).
"""


def render_markdown(dep: Deployment, cfg: dict, tables: dict, paths: dict[str, Path]) -> str:
    """The whole report.md: setup, sweep, placement, Table 5 check, measured runs, plots, assumptions."""
    rows, paper = tables["rows"], tables["paper"]
    parts = [
        f"# Simulated memory report: {dep.model.name} on {dep.hw.sockets} x {dep.hw.name}",
        "Written by `python -m evalkit.memory`; all numbers are in report.csv. cal. = calibrated "
        "(KV capped at the stated per-socket reservation).",
        "## Setup", _setup(dep, cfg),
        "## KV memory, max batch and throughput", _sweep(rows),
        f"## Placement per socket at batch = {cfg.get('batch', 'max')}", _placement(rows),
    ]  # fmt: skip
    if tables["skipped"]:
        parts.append("Skipped (budget above the context): " + "; ".join(tables["skipped"]) + ".")
    if tables.get("layout"):
        sharding = tables["layout"]
        parts += [
            f"## GPU layout: TP{sharding.tp} x DP{sharding.dp} under transformers' tensor-parallel plan",
            _sharding(sharding, tables["per_gpu"]),
        ]
    if paper:
        parts += [
            "## Paper check: SnapStream Table 5 (DeepSeek-R1-0528, 16 x SN40L, tok/s incl. x2.4 MTP)",
            _paper(paper),
            "The paper's figures are for DeepSeek-R1 on SN40L; compare the columns only when this report "
            "is configured that way (the default).",
        ]
    parts += [
        "## Measured runs: predicted vs reported KV bytes",
        _measured(tables["measured"], tables["notes"]),
    ]
    parts += ["## Plots"] + [f"![{k}]({p.name})" for k, p in paths.items() if p.suffix == ".png"]
    parts += ["## Assumptions", ASSUMPTIONS]
    return "\n\n".join(parts) + "\n"


def _savefig(fig, path: Path) -> Path:
    fig.tight_layout()
    save_figure(fig, path)  # atomic, like every output
    plt.close(fig)
    return path


def _context_axis(ax, contexts: list[int]) -> None:
    """Log2 context axis ticked at the contexts computed, as plain numbers (8192, not 2^13 or 10^4)."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{c // 1024}k" if c % 1024 == 0 else str(c) for c in contexts])
    ax.xaxis.set_minor_locator(NullLocator())


def write_plots(rows: list[dict], out: Path, setup: str = "") -> dict[str, Path]:
    """Against context length, one line per cache (full black, each SnapStream budget its own colour): KV GiB
    per sequence; max batch and decode tok/s (solid: the whole HBM left for KV; dashed: the calibrated KV
    reservation). `setup` names model and hardware in every title ("DeepSeek-R1 on 16 x sn40l")."""
    by_cache = defaultdict(list)
    for r in rows:
        by_cache[_label(r)].append(r)
    contexts = sorted({r["context"] for r in rows})
    colours = {label: "black" if label == "full" else f"C{i}" for i, label in enumerate(by_cache)}
    on = f" ({setup}; modelled)" if setup else " (modelled)"
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, rs in by_cache.items():
        xs, ys = [r["context"] for r in rs], [r["kv_bytes_per_seq"] / GiB for r in rs]
        ax.plot(xs, ys, "o-", color=colours[label], lw=2.5 if label == "full" else 1.5, label=label)
    _context_axis(ax, contexts)
    ax.set(xlabel="context length (tokens)", ylabel="KV per sequence (GiB)", title="KV memory" + on)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths = {"kv_vs_context": _savefig(fig, out / "kv_vs_context.png")}
    # Against context (never against "entries"): there a full cache at context C and a SnapStream budget of
    # C sit on one curve, and the two methods read as one.
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, key, ylabel in ((axes[0], "max_batch", "max batch"), (axes[1], "tok_s", "decode tokens/s")):
        for label, rs in by_cache.items():
            xs = [r["context"] for r in rs]
            lw = 2.5 if label == "full" else 1.5
            ax.plot(xs, [r[key] for r in rs], "o-", color=colours[label], lw=lw, label=label)
            ax.plot(xs, [r[key + "_cal"] for r in rs], "o--", color=colours[label], lw=lw, alpha=0.6)
        ax.plot([], [], "k-", label="solid: all free HBM for KV")
        ax.plot([], [], "k--", alpha=0.6, label="dashed: calibrated KV reservation")
        _context_axis(ax, contexts)
        ax.set(yscale="log", xlabel="context length (tokens)", ylabel=ylabel + " (memory-bound upper bound)")
        ax.set(title=f"{ylabel} vs context")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Max batch and decode throughput{on}")
    paths["batch_tok_s_vs_context"] = _savefig(fig, out / "batch_tok_s_vs_context.png")
    return paths
