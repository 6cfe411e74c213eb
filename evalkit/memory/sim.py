"""Accelerator side of the memory report: placement, max batch and decode throughput per socket.

The model is the one in /work/shared/spec/sn40l.md: weights first into HBM, KV after them, overflow
spilled to DDR (KV before weights, since weights have the highest priority to stay in HBM); a decode
step reads each socket's weight shard and its sequences' KV once, at bandwidth x efficiency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from evalkit.memory.model import MemoryReportError, ModelSpec

GiB, MiB = 2**30, 2**20  # capacities are binary ...
TB, GB = 10**12, 10**9  # ... bandwidths decimal (as vendors quote them)

# `full` and `none` are the uncompressed cache; `streaming_llm` is the runner's spelling.
METHOD_ALIASES = {"none": "full", "streaming_llm": "streamingllm"}
ATTENTION_MAPPINGS = ("dp_attention", "tp_kv_heads", "replicated")


def canonical_method(name: str) -> str:
    """A method of conf/method (every one the runner can run), by its conf name or an alias."""
    from evalkit.config import choices

    method, known = METHOD_ALIASES.get(str(name).lower(), str(name).lower()), choices("method")
    if method not in known:
        raise MemoryReportError(f"method: unknown {name!r} (known: {', '.join(known)}, none, streaming_llm)")
    return method


def method_of(name: str, budget: int | None = None, conf=None):
    """The method object a run of conf method `name` at `budget` builds (`full` takes none): what a cache
    holds follows from it, never from its name. `conf`: the run's own composed method node (`_target_` and
    every setting it ran with: an adaptive budget's alpha or beta sizes its slots), else the conf's
    defaults."""
    from evalkit.config import ConfigError, group_config
    from evalkit.kv.config import make_method, method_class

    name = canonical_method(name)
    node = group_config("method", name)
    takes_budget = method_class(node.get("_target_")).budget_applies
    if takes_budget and isinstance(conf, dict) and conf.get("_target_") == node.get("_target_"):
        node = conf  # full keeps every entry whatever its settings (a budget list's `budget` among them)
    try:
        return make_method(node, **({"budget": budget} if takes_budget and budget is not None else {}))
    except ConfigError as e:
        raise MemoryReportError(str(e)) from None


def ring_entries(method) -> int:
    """Entries of `method`'s cache that decode overwrites in place (a ring method's recent block: a quantized
    storage keeps it in the model dtype, `KVGeometry.sequence_bytes`); 0 for an appending cache."""
    return int(method.blocks()[1]) if method.ring else 0


def kv_entries(method: str, budget: int | None, context: int, decode: int, shape) -> int:
    """Cache slots per layer and KV head at the end of decoding, as the runner's caches are sized
    (`evalkit.kv.layout.slots_needed`): full: every token; a fixed-size cache (a ring, or a decode-time
    evictor: snapstream, streamingllm, h2o, tova_decode, ...) B, padded when the prompt is shorter; an
    appending one (snapkv and the prefill rivals) B after prefill compression, then every generated token (as
    in the SnapKV paper)."""
    from evalkit.kv.layout import slots_needed

    name = canonical_method(method)
    if context <= 0 or decode < 0:
        raise MemoryReportError(f"context_len must be > 0 and decode_len >= 0, got {context}, {decode}")
    obj = method_of(name)
    if obj.budget_applies:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise MemoryReportError(f"method.budget must be a positive integer for {name}, got {budget!r}")
        if budget > context:
            raise MemoryReportError(f"method.budget={budget} exceeds context_len={context} ({name})")
        obj = method_of(name, budget)
    return slots_needed(obj, context, decode, shape)  # shape: the model's KV heads and layers


@dataclass(frozen=True)
class Hardware:
    """One accelerator kind, per socket (a GPU counts as one socket; `ddr_bytes` 0 = no DDR tier)."""

    name: str
    sockets: int
    sram_bytes: int
    hbm_bytes: int
    ddr_bytes: int
    hbm_bw: float  # bytes/s
    ddr_bw: float  # bytes/s
    flops: float  # dense bf16 FLOP/s
    efficiency: float  # achieved / peak, for both bandwidth and compute (SambaNova quotes 0.75)

    @classmethod
    def from_cfg(cls, cfg: Any) -> Hardware:
        """From a `conf/hardware/*.yaml` node: capacities in MiB/GiB, bandwidths in TB/s and GB/s."""
        try:
            return cls(
                name=str(cfg["name"]),
                sockets=int(cfg["sockets"]),
                sram_bytes=round(cfg["sram_mib"] * MiB),
                hbm_bytes=round(cfg["hbm_gib"] * GiB),
                ddr_bytes=round((cfg.get("ddr_gib") or 0) * GiB),
                hbm_bw=cfg["hbm_tb_s"] * TB,
                ddr_bw=(cfg.get("ddr_gb_s") or 0) * GB,
                flops=cfg["bf16_tflops"] * TB,
                efficiency=float(cfg["efficiency"]),
            )
        except KeyError as e:
            raise MemoryReportError(f"hardware config lacks {e.args[0]!r}") from e


@dataclass(frozen=True)
class Deployment:
    """A model on `hw.sockets` sockets: projections `tp`-way tensor parallel (sockets / tp weight
    replicas), attention KV mapped by `attention`: dp_attention (each socket holds its own sequences,
    the paper's decode mapping), tp_kv_heads (KV heads sharded tp-way) or replicated (every socket of a
    TP group holds the group's whole KV, what plain TP does with a single-head latent cache)."""

    model: ModelSpec
    hw: Hardware
    tp: int
    attention: str = "dp_attention"
    mtp_factor: float = 1.0  # accepted tokens per step with multi-token prediction (paper: 2.4)
    ring: int = (
        0  # of a sequence's entries, a ring overwritten at decode (a quantized storage keeps it in kv_bits)
    )

    def __post_init__(self):
        kv, hw = self.model.kv, self.hw
        if not self.mtp_factor >= 1:
            raise MemoryReportError(
                f"mtp_factor must be >= 1 (accepted tokens per step), got {self.mtp_factor!r}"
            )
        if self.attention not in ATTENTION_MAPPINGS:
            raise MemoryReportError(f"parallel.attention: {self.attention!r} not in {ATTENTION_MAPPINGS}")
        if self.tp <= 0 or hw.sockets % self.tp:
            raise MemoryReportError(f"parallel.tp={self.tp} does not divide hardware.sockets={hw.sockets}")
        if kv.heads % self.tp:
            raise MemoryReportError(
                f"parallel.tp={self.tp}{self._tp_source()} does not divide num_attention_heads={kv.heads} of "
                f"{self.model.name}: set parallel.tp to a divisor of both (e.g. "
                f"parallel.tp={math.gcd(hw.sockets, kv.heads)})"
            )
        if self.attention == "tp_kv_heads" and kv.cached_heads % self.tp:
            field = "num_key_value_heads" if kv.layout == "per_head" else "kv_lora_rank (latent: 1 KV head)"
            raise MemoryReportError(
                f"parallel.tp={self.tp} does not divide the {kv.cached_heads} cached KV heads ({field}); "
                "use parallel.attention=dp_attention"
            )

    def _tp_source(self) -> str:
        """Where a tp equal to the sockets most likely came from: the hardware the user chose."""
        if self.tp != self.hw.sockets:
            return ""
        return f" (hardware={self.hw.name}: one per each of its {self.hw.sockets} sockets unless set)"

    @property
    def kv_shard(self) -> int:
        """Ways one sequence's KV is split across sockets."""
        return self.tp if self.attention == "tp_kv_heads" else 1

    @property
    def seq_groups(self) -> int:
        """Groups of sockets that hold disjoint sequences (a batch is spread evenly over them)."""
        return self.hw.sockets if self.attention == "dp_attention" else self.hw.sockets // self.tp

    @property
    def weight_bytes_socket(self) -> int:
        return math.ceil(self.model.weight_bytes / self.tp)

    @property
    def kv_room_socket(self) -> int:
        """HBM left for KV on one socket once its weight shard is placed (weights go first)."""
        return max(self.hw.hbm_bytes - self.weight_bytes_socket, 0)

    def kv_bytes_socket(self, entries: int) -> int:
        """Bytes one sequence of `entries` slots occupies on each socket that holds it (in the KV storage:
        codes, scales and residual; without one, entries x the dtype's bytes)."""
        return self.model.kv.sequence_bytes(entries, min(self.ring, entries)) // self.kv_shard

    def max_batch(self, entries: int, reserve: int | None = None) -> int:
        """Largest batch whose KV fits in HBM next to the weights; `reserve` caps the KV bytes per socket
        (a deployment's static KV reservation)."""
        room = self.kv_room_socket if reserve is None else min(reserve, self.kv_room_socket)
        return self.seq_groups * (room // self.kv_bytes_socket(entries))

    def step(self, batch: int, entries: int) -> dict[str, Any]:
        """Placement on the busiest socket and one decode step's time and throughput at `batch`."""
        hw, kv = self.hw, self.model.kv
        seqs = math.ceil(batch / self.seq_groups)  # sequences on the busiest socket
        kv_bytes = seqs * self.kv_bytes_socket(entries)
        w_hbm = min(self.weight_bytes_socket, hw.hbm_bytes)
        kv_hbm = min(kv_bytes, hw.hbm_bytes - w_hbm)
        spill = self.weight_bytes_socket - w_hbm + kv_bytes - kv_hbm  # -> DDR
        fits = spill <= hw.ddr_bytes  # a GPU has no DDR: any spill means the batch does not fit
        # Memory time: every byte read once per step; HBM and DDR reads summed (conservative: no overlap).
        mem_s = (w_hbm + kv_hbm) / (hw.hbm_bw * hw.efficiency)
        if spill:
            mem_s += spill / (hw.ddr_bw * hw.efficiency) if fits else math.inf
        # Compute: projections 2·active·tokens spread over all sockets; attention 2·heads·entries·width.
        attn = 2 * kv.layers * kv.heads * entries * sum(kv.attn_widths) * seqs / self.kv_shard
        comp_s = (2 * self.model.active_parameters * batch / hw.sockets + attn) / (hw.flops * hw.efficiency)
        step_s = max(mem_s, comp_s)
        return {
            "batch": batch,
            "seqs_per_socket": seqs,
            "weights_hbm_bytes": w_hbm,
            "weights_ddr_bytes": self.weight_bytes_socket - w_hbm,
            "kv_hbm_bytes": kv_hbm,
            "kv_ddr_bytes": kv_bytes - kv_hbm,
            "hbm_free_bytes": hw.hbm_bytes - w_hbm - kv_hbm,
            "fits": fits,
            "step_ms": step_s * 1e3,
            "bound": "memory" if mem_s >= comp_s else "compute",
            "tok_s": batch / step_s * self.mtp_factor if fits and batch else 0.0,
        }

    def sram_tile_bytes(self, entries: int, tile_tokens: int | None = None) -> int:
        """On-chip working set of one attention tile: one layer, one sequence, `tile_tokens` cache slots
        (default: the whole cache) of this socket's KV heads, plus the queries and fp32 score rows."""
        kv, tokens = self.model.kv, min(tile_tokens or entries, entries)
        heads = kv.heads // self.kv_shard
        cache = tokens * kv.bytes_per_layer_entry // self.kv_shard
        query = heads * kv.attn_widths[0] * kv.kv_bits // 8
        return cache + query + heads * tokens * 4
