"""FP8 KV storage (`kv=fp8_e4m3`, `kv=fp8_e5m2`): one byte per element and a float32 scale, frozen at prefill.

The scale is calibrated once on the prompt (its real tokens: left pads never count) and then frozen, as
transformers' `Fp8QuantizedLayer` and vLLM's dynamic KV scales do: `scale = amax |x| / (fp8_max /
headroom)`, per layer, batch row and KV head (`scale: head`, the default) or per layer and batch row over all
heads (`scale: tensor`, transformers' per-tensor scale). A value is cast as `x / scale` clamped to
[-fp8_max, fp8_max] (saturation: a decode token beyond the prompt's range never becomes inf or NaN) and read
back as `code * scale` in the model dtype. Every element is coded alone, so any slot can be written or
overwritten at any step: fp8 composes with every method, ring and decode-time eviction included.
Deviations from transformers and vLLM: docs/deviations.md#kv-storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evalkit.kv.storage.base import KVStorage, tensor_bytes

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALES = ("head", "tensor")
SCALE_BYTES = 4  # float32, as transformers keeps it


@dataclass
class Fp8Storage(KVStorage):
    """FP8 codes with a frozen float32 scale per layer, row and KV head (or per layer and row)."""

    format: str = "e4m3"
    scale: str = "head"  # head: a scale per KV head; tensor: one per layer over all heads (transformers')
    headroom: float = 1.0  # the prompt's amax lands at fp8_max / headroom (vLLM's k_scale: 448 / 200 = 2.24)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"kv fp8: format must be one of {sorted(FORMATS)}, got {self.format!r}")
        if self.scale not in SCALES:
            raise ValueError(
                f"kv {self.name}: scale must be 'head' (per KV head) or 'tensor' (per layer), "
                f"got {self.scale!r}"
            )
        if isinstance(self.headroom, bool) or not isinstance(self.headroom, int | float) or self.headroom < 1:
            raise ValueError(
                f"kv {self.name}: headroom must be a number >= 1 (the prompt's largest value is coded at "
                f"fp8_max / headroom), got {self.headroom!r}"
            )

    @property
    def name(self) -> str:
        return f"fp8_{self.format}"

    @property
    def dtype(self) -> torch.dtype:
        return FORMATS[self.format]

    @property
    def limit(self) -> float:
        return torch.finfo(self.dtype).max

    def refusal(self, method, facts=None) -> str | None:
        tp, mla = getattr(facts, "tp", 1), getattr(facts, "mla", False)
        if self.scale == "tensor" and tp > 1 and not mla:
            return (
                f"kv {self.name}: scale=tensor takes one amax over every KV head of a layer, but under "
                f"tensor parallelism (tp={tp}) each rank holds only its own heads: use scale=head"
            )
        return None

    def layer_bytes(self, slots, ring, heads, key_width, value_width, model_bits) -> int:
        scales = 2 * (heads if self.scale == "head" else 1)  # K and V
        return heads * slots * (key_width + value_width) + scales * SCALE_BYTES

    # --- the codec ------------------------------------------------------------------------------------------
    def calibrate(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The frozen scale of x (B, H, T, D): (B, H, 1, 1) per head or (B, 1, 1, 1) per tensor, float32.
        valid (B, T) bool: the row's real columns (pads excluded), None = all."""
        a = x.abs()
        if valid is not None:
            a = a.masked_fill(~valid[:, None, :, None], 0)
        amax = a.amax(dim=(2, 3) if self.scale == "head" else (1, 2, 3), keepdim=True).float()
        # an all-zero head would give a null scale (transformers clamps the same way)
        return (amax / (self.limit / self.headroom)).clamp(min=torch.finfo(torch.float32).tiny)

    def encode(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, D) -> fp8 codes of x / scale, saturated at the format's largest finite value."""
        return (x.float() / scale).clamp(-self.limit, self.limit).to(self.dtype)

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """fp8 codes (B, H, T, D) -> code * scale in `dtype` (the model's)."""
        return (codes.float() * scale).to(dtype)

    def hold(self, keys, values):
        return Fp8Held(self, keys, values)

    # --- the slot caches: codes in the layer's buffers as uint8 (gather / index_put have no fp8 kernels on
    # every device), the frozen scales (B, H | 1, 1, 1) float32 beside them --------------------------------
    def seal(self, layer, keys, values, real) -> None:
        layer.scales = (self.calibrate(keys, real), self.calibrate(values, real))
        layer.keys, layer.values = self.store(layer, layer.keys, layer.values)

    def store(self, layer, k, v):
        k_scale, v_scale = layer.scales
        return self.encode(k, k_scale).view(torch.uint8), self.encode(v, v_scale).view(torch.uint8)

    def load(self, layer, keys, values):
        k_scale, v_scale = layer.scales
        return (
            self.decode(keys.view(self.dtype), k_scale, layer.dtype),
            self.decode(values.view(self.dtype), v_scale, layer.dtype),
        )


class Fp8Held:
    """A full cache in fp8: the prompt calibrates the scales, every later token is coded with them."""

    def __init__(self, storage: Fp8Storage, keys: torch.Tensor, values: torch.Tensor):
        self.storage, self.dtype = storage, keys.dtype
        self.k_scale, self.v_scale = storage.calibrate(keys), storage.calibrate(values)
        self.k, self.v = storage.encode(keys, self.k_scale), storage.encode(values, self.v_scale)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k = torch.cat([self.k, self.storage.encode(k, self.k_scale)], -2)
        self.v = torch.cat([self.v, self.storage.encode(v, self.v_scale)], -2)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.storage
        return s.decode(self.k, self.k_scale, self.dtype), s.decode(self.v, self.v_scale, self.dtype)

    def nbytes(self) -> int:
        return tensor_bytes(self.k, self.v, self.k_scale, self.v_scale)
