"""Per-GPU weight and KV bytes of a torchrun layout (`parallel.tp_size` x `parallel.dp_size` processes, one
GPU each), exactly as transformers shards the model: the model is built on torch's meta device (no memory, no
weights) and each parameter is split or replicated by the tensor-parallel plan transformers itself resolves
from the config's `base_model_tp_plan` (plus the model class's `lm_head` rule and the vocabulary-sharded
input embeddings it adds). Llama's plan shards q/k/v/o and the MLP, so each rank caches `n_kv / tp` KV
heads; DeepseekV3's shards only the MLP and MoE experts, so its MLA attention, and the latent cache, are on
every rank. Data-parallel replicas each hold a whole tp-sharded copy: `dp_size` changes the GPU count, not
the bytes per GPU.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from evalkit.memory.model import KVGeometry, MemoryReportError, dtype_bits

# Which dimension of a weight each tensor-parallel style of transformers 5.24 splits
# (transformers.distributed.tensor_parallel, the styles' `shard_param`). A style missing here does not split
# parameters (e.g. `moe_tp_experts` only hooks the experts' forward; their tensors have their own rules).
COLWISE = ("colwise", "colwise_gather_output", "colwise_rep")  # weight and bias: Shard(ndim - 2)
ROWWISE = ("rowwise", "rowwise_split_input", "rowwise_rep")  # weight: Shard(-1); bias replicated
PACKED = {"packed_colwise": -2, "packed_rowwise": -1}  # gate|up packed in one tensor: each half split
EMBEDDING = {"embedding_rowwise": 0, "embedding_colwise": 1}
PACKED_SPLIT = 2  # halves in a packed tensor (transformers' split_factor)


def split_length(shape: tuple[int, ...], style: str | None, is_bias: bool) -> int | None:
    """The length of the dimension `style` splits across ranks (of a packed tensor: one half's), or None
    when it splits none."""
    if style in COLWISE:
        return shape[len(shape) - 2]
    if style in ROWWISE and not is_bias:
        return shape[-1]
    if style in EMBEDDING:
        return shape[EMBEDDING[style]]
    if style in PACKED and not (style == "packed_rowwise" and len(shape) == 1):
        return shape[-1] if len(shape) == 1 else shape[PACKED[style]] // PACKED_SPLIT
    return None


def shard_numel(shape: tuple[int, ...], style: str | None, tp: int, is_bias: bool) -> int:
    """Elements the largest rank holds of a tensor of `shape` under `style`. Torch's DTensor gives rank 0
    ceil(n / tp) of a split dimension (the last rank the remainder), so rank 0 is the largest."""
    numel, n = math.prod(shape), split_length(shape, style, is_bias)
    if n is None or tp == 1:
        return numel
    if style in PACKED and len(shape) > 1:
        return numel // (n * PACKED_SPLIT) * PACKED_SPLIT * math.ceil(n / tp)
    return numel // n * math.ceil(n / tp)


def uneven_splits(model, plan: dict[str, str], tp: int, heads: int) -> list[str]:
    """What `tp` cannot split evenly in the decoder layers: the attention heads where the plan splits
    attention projections (a rank holds whole heads), and each dimension the plan splits (every rank holds an
    equal part: transformers' sharded layers fail on the first forward pass otherwise), one per parameter
    name with its layer index as `*`."""
    out = []
    if heads % tp and any(".self_attn." in name for name in plan):
        out.append(f"num_attention_heads={heads} (the attention projections are split by head)")
    for name, p in model.named_parameters():
        n = split_length(tuple(p.shape), plan.get(name), name.endswith(".bias"))
        where = re.sub(r"\.\d+\.", ".*.", name)
        if ".layers." in name and n is not None and n % tp and not any(o.startswith(where) for o in out):
            out.append(f"{where} ({n} along the dimension {plan[name]} splits)")
    return out


def meta_model(hf_config: dict):
    """The causal LM transformers builds from `hf_config`, on the meta device (shapes only)."""
    import torch  # heavy imports, only when a layout is asked for
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(hf_config)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise MemoryReportError(
            "model.hf_config lacks 'model_type', needed to build the model transformers would shard "
            "(e.g. model_type: llama); or set model.hf"
        )
    for key in ("architectures", "transformers_version", "_name_or_path"):
        fields.pop(key, None)
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except (KeyError, ValueError) as e:
        raise MemoryReportError(
            f"model.hf_config: transformers cannot build a {model_type!r} config: {e}"
        ) from e
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def resolved_plan(model, tp: int) -> dict[str, str]:
    """transformers' own plan for `tp_size=tp`: one entry per concrete module or parameter name."""
    from transformers.distributed import DistributedConfig

    if tp == 1:
        return {}
    try:
        plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp))
    except ValueError as e:  # e.g. a model without a tensor-parallel plan
        raise MemoryReportError(f"parallel.tp_size={tp}: transformers refuses this model: {e}") from e
    return plan


@dataclass(frozen=True)
class Sharding:
    """One torchrun layout of a model: bytes on the largest rank, KV heads per rank, GPUs and nodes."""

    tp: int
    dp: int
    gpus_per_node: int
    parameters: int  # whole model, each tensor once
    weight_bytes_gpu: int
    sharded_bytes: int  # whole model: tensors the plan splits ...
    replicated_bytes: int  # ... and tensors every rank holds whole
    kv: KVGeometry
    kv_heads_gpu: int  # cached KV heads per layer on one rank

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def nodes(self) -> int:
        return math.ceil(self.world / self.gpus_per_node)

    def kv_bytes_gpu(self, entries: int, ring: int = 0) -> int:
        """Bytes of KV one GPU holds for one request whose cache holds `entries` slots per layer and head
        (`kv_entries` of the method at its budget), `ring` of them a ring (`KVGeometry.sequence_bytes`: a
        quantized storage's codes, scales and residual on this rank's heads). Not metrics.json's
        `parallel.kv_bytes_allocated_per_rank`, which is a run's slot pool: every row decoded at once
        (docs/parallel.md, two per-rank KV figures)."""
        return self.kv.sequence_bytes(entries, ring, heads=self.kv_heads_gpu)


def weight_bits_of(name: str, module, ndim: int, weight_bits: int, other_bits: int) -> int:
    """Storage of one parameter: the decoder layers' matrices (Linear weights, 3-D expert tensors) in the
    weight dtype, as quantized checkpoints store them; embeddings, lm_head, norms, routers in `other_bits`."""
    import torch

    in_layers = ".layers." in f".{name}"
    is_matrix = (isinstance(module, torch.nn.Linear) and name.endswith(".weight")) or ndim == 3
    return weight_bits if in_layers and is_matrix else other_bits


def shard_model(
    hf_config: dict, kv: KVGeometry, tp: int, dp: int, gpus_per_node: int, weight_dtype: Any, other_dtype: Any
) -> Sharding:
    """Per-GPU bytes of `hf_config`'s model under `tp` x `dp` processes; an error where transformers would
    fail."""
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    world = tp * dp
    if world > gpus_per_node and world % gpus_per_node:
        raise MemoryReportError(
            f"parallel.tp_size x parallel.dp_size = {world} GPUs is not a whole number of "
            f"{gpus_per_node}-GPU nodes (hardware.sockets): torchrun starts the same number of processes on "
            "every node"
        )
    model = meta_model(hf_config)
    plan = resolved_plan(model, tp)
    heads = get_kv_heads_per_rank(plan, kv.cached_heads, tp)
    if heads is None:
        raise MemoryReportError(
            f"parallel.tp_size={tp} does not divide num_key_value_heads={kv.cached_heads}: transformers "
            "shards k_proj/v_proj by KV head and would fail; choose a tp_size that divides it"
        )
    if uneven := uneven_splits(model, plan, tp, int(hf_config.get("num_attention_heads") or 0)):
        more = f" and {len(uneven) - 1} more" if len(uneven) > 1 else ""
        raise MemoryReportError(
            f"parallel.tp_size={tp} does not divide {uneven[0]}{more}: no such layout runs (the model would "
            "load, then fail on every rank); choose a tp_size dividing what the tensor-parallel plan splits"
        )
    w_bits = dtype_bits(weight_dtype, "model.weight_dtype")
    o_bits = dtype_bits(other_dtype, "model.other_dtype")
    modules = dict(model.named_modules())
    params = total = gpu = sharded = 0
    for name, p in model.named_parameters():  # tied weights (embeddings = lm_head) come once
        module = modules[name.rpartition(".")[0]]
        bits = weight_bits_of(name, module, p.ndim, w_bits, o_bits)
        local = shard_numel(tuple(p.shape), plan.get(name), tp, name.endswith(".bias"))
        params += p.numel()
        total += p.numel() * bits
        gpu += local * bits
        sharded += p.numel() * bits if local < p.numel() else 0
    return Sharding(tp, dp, gpus_per_node, params, gpu // 8, sharded // 8, (total - sharded) // 8, kv, heads)
