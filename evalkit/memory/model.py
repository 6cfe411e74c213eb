"""Model side of the memory report: KV-cache geometry and weight size, read from a Hugging Face config.

Formulas (per token, all layers; see /work/shared/spec/sn40l.md):
- GQA / MHA: `2 · layers · kv_heads · head_dim · bytes`;
- MLA latent (what DeepSeek-V3/R1 production stacks and transformers 5.24 cache):
  `layers · (kv_lora_rank + qk_rope_head_dim) · bytes`;
- MLA expanded (`kv_layout="per_head"`): `layers · heads · (qk_nope + qk_rope + v_head_dim) · bytes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from evalkit.errors import EvalkitError


class MemoryReportError(EvalkitError, ValueError):
    """Bad input to the memory report: a missing config field, a budget above the context, a parallel
    degree that does not divide the heads, an unknown dtype or method. The message names the field."""


# Bits per element; weights may be 4-bit, so sizes are computed in bits and divided by 8 at the end.
DTYPE_BITS = {
    "float32": 32, "fp32": 32, "float": 32,
    "bfloat16": 16, "bf16": 16, "float16": 16, "fp16": 16, "half": 16,
    "float8_e4m3fn": 8, "float8_e5m2": 8, "fp8": 8, "int8": 8,
    "int4": 4, "fp4": 4, "nf4": 4,
}  # fmt: skip


def dtype_bits(dtype: Any, field: str) -> int:
    """Bits per element of a dtype given as a name ("bf16", "bfloat16", "torch.float32", ...)."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPE_BITS:
        raise MemoryReportError(f"{field}: unknown dtype {dtype!r} (known: {', '.join(DTYPE_BITS)})")
    return DTYPE_BITS[key]


def config_dict(config: Any) -> dict:
    """A plain dict from a `transformers.PretrainedConfig` or a mapping (e.g. config.json, an OmegaConf
    node); multimodal wrappers are unwrapped to their `text_config`, where the decoder's fields live."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    elif hasattr(config, "items"):
        config = dict(config.items())
    else:
        raise MemoryReportError(
            f"model config must be a dict or a PretrainedConfig, got {type(config).__name__}"
        )
    text = config.get("text_config")
    if "num_hidden_layers" not in config and hasattr(text, "items"):
        return config_dict(text)
    return config


def need(cfg: dict, key: str, why: str) -> int:
    """A required positive integer field of the model config, or an error naming it."""
    value = cfg.get(key)
    if value is None:
        raise MemoryReportError(f"model config lacks '{key}', needed for {why}")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MemoryReportError(f"model config field '{key}' must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class KVGeometry:
    """What one cached token costs: `cached_heads` heads per layer, each `key_width + value_width` wide.
    For the MLA latent, the "key" is the 512-wide compressed KV and the "value" the 64-wide RoPE key,
    stored as one head (exactly how transformers' DeepSeek-V3 cache holds them)."""

    layout: str  # "per_head" | "latent"
    layers: int
    heads: int  # query heads (attention FLOPs, score rows)
    cached_heads: int  # KV heads held per layer: GQA kv_heads, MLA latent 1, MLA expanded = heads
    key_width: int  # elements per cached head per token
    value_width: int
    kv_bits: int
    attn_widths: tuple[int, int]  # (score, output) widths per query head: FLOPs of decode attention
    # How entries are held (`evalkit.kv.storage`, conf/kv/): None = `kv_bits` per element, nothing else. A
    # quantized storage holds codes, scales, zero points and a residual in `kv_bits` (the model dtype).
    storage: Any = None

    @property
    def shape(self):
        """What a cache's slot count may depend on (`evalkit.kv.layout.Shape`: adaptive budgets size their
        slots by the KV heads and layers)."""
        from evalkit.kv.layout import Shape

        return Shape(self.cached_heads, self.layers)

    @property
    def bytes_per_entry(self) -> int:
        """Bytes of one cache slot (one token) across all layers and cached heads, in `kv_bits` (the dtype's
        figure: a quantized storage's bytes are `sequence_bytes`)."""
        bits = self.layers * self.cached_heads * (self.key_width + self.value_width) * self.kv_bits
        return bits // 8

    def sequence_bytes(self, entries: int, ring: int = 0, heads: int | None = None) -> int:
        """Bytes one sequence holds with `entries` slots per layer and cached head, `ring` of them a ring
        overwritten in place at decode (a quantized storage keeps its ring in `kv_bits`), over `heads` cached
        heads per layer (default all; a tensor-parallel rank holds fewer). The storage's own arithmetic, the
        one a run's measured bytes come from; without a storage, `entries` x the dtype's bytes."""
        heads = self.cached_heads if heads is None else heads
        if self.storage is None:
            return self.layers * heads * (self.key_width + self.value_width) * self.kv_bits * entries // 8
        try:
            per_layer = self.storage.layer_bytes(
                entries, ring, heads, self.key_width, self.value_width, self.kv_bits
            )
        except ValueError as e:  # e.g. a value group that does not divide this model's head width
            raise MemoryReportError(str(e)) from None
        return self.layers * per_layer

    @property
    def bytes_per_layer_entry(self) -> int:
        return self.bytes_per_entry // self.layers


def kv_geometry(config: Any, kv_dtype: Any, layout: str | None = None, storage: Any = None) -> KVGeometry:
    """KV geometry from a Hugging Face config. MLA is recognised by `kv_lora_rank`; `layout` is "latent"
    (the MLA default) or "per_head" (GQA, or MLA with per-head K/V expanded); `storage` (an
    `evalkit.kv.storage` object, None = plain `kv_dtype`) holds the entries, `kv_dtype` being its full
    precision."""
    geo = _geometry(config, kv_dtype, layout)
    return geo if storage is None else dataclasses.replace(geo, storage=storage)


def _geometry(config: Any, kv_dtype: Any, layout: str | None) -> KVGeometry:
    cfg = config_dict(config)
    bits = dtype_bits(kv_dtype, "kv_dtype")
    layers = need(cfg, "num_hidden_layers", "the KV size (layers)")
    heads = need(cfg, "num_attention_heads", "the attention heads")
    if cfg.get("kv_lora_rank") is not None:
        return _mla_geometry(cfg, layers, heads, bits, layout or "latent")
    if layout not in (None, "per_head"):
        raise MemoryReportError(f"kv_layout={layout!r} needs an MLA model ('kv_lora_rank' in the config)")
    # HF convention: a config without num_key_value_heads is plain multi-head attention.
    kv_heads = (
        need(cfg, "num_key_value_heads", "the KV size (GQA)") if "num_key_value_heads" in cfg else heads
    )
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden = need(cfg, "hidden_size", "head_dim = hidden_size / num_attention_heads")
        if hidden % heads:
            raise MemoryReportError(
                f"model config lacks 'head_dim' and hidden_size {hidden} % heads {heads} != 0"
            )
        head_dim = hidden // heads
    head_dim = need({"head_dim": head_dim}, "head_dim", "the KV size")
    return KVGeometry("per_head", layers, heads, kv_heads, head_dim, head_dim, bits, (head_dim, head_dim))


def _mla_geometry(cfg: dict, layers: int, heads: int, bits: int, layout: str) -> KVGeometry:
    rank = need(cfg, "kv_lora_rank", "the MLA latent KV size")
    rope = need(cfg, "qk_rope_head_dim", "the MLA RoPE key size")
    if layout == "latent":
        # Absorbed-weight decode: scores over rank+rope per head, output over the rank-wide latent.
        return KVGeometry("latent", layers, heads, 1, rank, rope, bits, (rank + rope, rank))
    if layout != "per_head":
        raise MemoryReportError(f"kv_layout must be 'latent' or 'per_head', got {layout!r}")
    nope = need(cfg, "qk_nope_head_dim", "the expanded MLA key size")
    v_dim = need(cfg, "v_head_dim", "the expanded MLA value size")
    return KVGeometry("per_head", layers, heads, heads, nope + rope, v_dim, bits, (nope + rope, v_dim))


# --- weights ----------------------------------------------------------------------------------------
# Parameters are counted from the config so any HF decoder is covered; biases, the few per-head norms
# (Qwen3's q/k norms) and DeepSeek's multi-token-prediction module are left out (< 0.1% for dense models;
# the paper's 671B for DeepSeek-R1 also excludes the MTP module).


def count_parameters(config: Any) -> tuple[int, int]:
    """(total, active per token) parameters of a decoder-only LM from its config: embeddings (untied
    unless `tie_word_embeddings`), attention (GQA or MLA), gated MLPs (3 matrices), dense or MoE
    (routed + shared experts + router, `first_k_dense_replace` dense layers), RMSNorms."""
    cfg = config_dict(config)
    why = "the parameter count (or set model.num_parameters)"
    h = need(cfg, "hidden_size", why)
    layers = need(cfg, "num_hidden_layers", why)
    embed = need(cfg, "vocab_size", why) * h * (1 if cfg.get("tie_word_embeddings") else 2)
    per_layer = _attention_params(cfg, h, why) + 2 * h  # + input and post-attention RMSNorm
    dense, n_dense, moe_total, moe_active = _mlp_params(cfg, h, layers, why)
    base = embed + layers * per_layer + h + n_dense * dense  # + final norm
    n_moe = layers - n_dense
    return base + n_moe * moe_total, base + n_moe * moe_active


def _attention_params(cfg: dict, h: int, why: str) -> int:
    heads = need(cfg, "num_attention_heads", why)
    if cfg.get("kv_lora_rank") is None:  # GQA: q, k, v, o projections
        geo = kv_geometry(cfg, "bf16")
        return 2 * h * heads * geo.key_width + 2 * h * geo.cached_heads * geo.key_width
    rank, rope = need(cfg, "kv_lora_rank", why), need(cfg, "qk_rope_head_dim", why)
    nope, v_dim = need(cfg, "qk_nope_head_dim", why), need(cfg, "v_head_dim", why)
    q_rank = cfg.get("q_lora_rank")
    q = h * heads * (nope + rope) if q_rank is None else h * q_rank + q_rank + q_rank * heads * (nope + rope)
    kv = h * (rank + rope) + rank + rank * heads * (nope + v_dim)  # kv_a (+ its norm), kv_b
    return q + kv + heads * v_dim * h  # + o_proj


def _mlp_params(cfg: dict, h: int, layers: int, why: str) -> tuple[int, int, int, int]:
    """(dense MLP, number of dense layers, MoE layer total, MoE layer active)."""
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        return 3 * h * need(cfg, "intermediate_size", why), layers, 0, 0
    n_dense = cfg.get("first_k_dense_replace") or 0
    dense = 3 * h * need(cfg, "intermediate_size", why) if n_dense else 0
    expert = 3 * h * (cfg.get("moe_intermediate_size") or need(cfg, "intermediate_size", why))
    shared = (cfg.get("n_shared_experts") or 0) * expert + 3 * h * (
        cfg.get("shared_expert_intermediate_size") or 0
    )
    router = h * experts
    top_k = need(cfg, "num_experts_per_tok", why)
    return dense, n_dense, experts * expert + shared + router, top_k * expert + shared + router


@dataclass(frozen=True)
class ModelSpec:
    """A model as the memory report sees it: KV geometry plus weight count and storage dtype."""

    name: str
    kv: KVGeometry
    num_parameters: int
    active_parameters: int  # per token; only used for the compute-time estimate
    weight_bits: int

    @property
    def weight_bytes(self) -> int:
        return self.num_parameters * self.weight_bits // 8


def model_spec(
    name: str,
    config: Any,
    weight_dtype: Any,
    kv_dtype: Any,
    kv_layout: str | None = None,
    num_parameters=None,
    storage: Any = None,
) -> ModelSpec:
    """Build a ModelSpec; `num_parameters` overrides the count (DeepSeek-R1: 671e9, stored in fp8); `storage`
    holds the KV (`kv_geometry`)."""
    kv = kv_geometry(config, kv_dtype, kv_layout, storage)
    weight_bits = dtype_bits(weight_dtype, "weight_dtype")
    if num_parameters is None:
        total, active = count_parameters(config)
        return ModelSpec(name, kv, total, active, weight_bits)
    total = int(num_parameters)
    if total <= 0:
        raise MemoryReportError(f"model.num_parameters must be positive, got {num_parameters!r}")
    try:
        counted, active = count_parameters(config)
        active = round(active * total / counted)  # keep the config's active share under the override
    except MemoryReportError:
        active = total  # config too sparse to count: treat every weight as active (compute upper bound)
    return ModelSpec(name, kv, total, active, weight_bits)


def load_hf_config(name_or_path: str) -> dict:
    """config.json of a local folder or a Hub repo id, through transformers' AutoConfig."""
    from transformers import AutoConfig  # heavy import, only when a model is named

    try:
        return AutoConfig.from_pretrained(name_or_path).to_dict()
    except (OSError, ValueError) as e:
        raise MemoryReportError(f"model.hf: cannot load a config from {name_or_path!r}: {e}") from e
