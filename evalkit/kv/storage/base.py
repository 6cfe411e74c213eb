"""The KV storage axis: how a cache holds its entries, chosen once (`conf/kv/`) and handed down.

A storage owns quantization (style principle 16): it turns the K/V a layer caches into what is held (codes,
scales, zero points, a full-precision residual), gives attention its K/V back in the model dtype, and answers
how many bytes a row holds: `layer_bytes`, the one arithmetic `evalkit.memory` models with, so the bytes a run
measures and the bytes the memory report models are one formula. The method decides *which* entries are kept,
the storage *how*: every method composes with every storage it does not refuse (`refusal`).

Kinds: `NoStorage` (the model dtype), `Fp8Storage` (e4m3 / e5m2, `fp8.py`), `IntStorage` (KIVI's asymmetric
group-wise int8 / int4 / int2, `kivi.py`). `hold` is the full cache's path (a prompt, then one token per step,
`stored.StoredCache`); the fixed-shape cache and the slot pool hold the same codes in buffers allocated once
(KIVI's laid out per slot, its residual in per-row windows: `kivi_slots.py`; `hold_bytes` is then the full
cache's own figure).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


@dataclass
class KVStorage:
    """Base: a storage's settings are its dataclass fields; `name` is its folder and report name."""

    @property
    def name(self) -> str:
        raise NotImplementedError

    def describe(self) -> dict:
        """What metrics.json and the report record: the name and every setting."""
        return {"name": self.name, **asdict(self)}

    def refusal(self, method, facts=None) -> str | None:
        """Why this storage cannot hold `method`'s cache in this run (one line naming the fix), or None.
        `facts` is the run's `RunFacts` (model, mla, tp, ...), None outside a run."""
        return None

    def check_widths(self, key_width: int, value_width: int) -> None:
        """Raise ValueError naming the setting if a head of these widths cannot be stored."""

    def layer_bytes(
        self, slots: int, ring: int, heads: int, key_width: int, value_width: int, model_bits: int
    ) -> int:
        """Bytes one row holds in one layer: `heads` KV heads of `slots` entries each, `ring` of them a ring
        that decode overwrites in place (0 for append caches), K `key_width` and V `value_width` wide, the
        model dtype `model_bits` wide. Codes, scales, zero points and the full-precision residual all
        count."""
        raise NotImplementedError

    def hold_bytes(
        self, slots: int, ring: int, heads: int, key_width: int, value_width: int, model_bits: int
    ) -> int:
        """Bytes `hold` (the full cache's reference path, `stored.StoredCache`) holds per row and layer: the
        slot caches' `layer_bytes` unless the storage lays the two out differently (KIVI)."""
        return self.layer_bytes(slots, ring, heads, key_width, value_width, model_bits)

    def hold(self, keys: torch.Tensor, values: torch.Tensor):
        """The prompt's K/V (B, H, T, D) as held by a full cache: an object with `append(k, v)` (one token per
        row), `read() -> (K, V)` in the model dtype, `nbytes()` (bytes of every tensor it holds)."""
        raise NotImplementedError

    # --- the slot caches (`evalkit.kv.cache.KVCache`, the static cache, the engine's `SlotPool`) ----------
    # A layer's buffers `keys` / `values` (B, H, cap, D) hold what this storage holds per slot (the model
    # dtype, or codes); its `scales` tuple holds per-row tensors beside them ((B, ...) each: the pool
    # copies a row's with its slots, into their leading corner: a row may use less of them than the pool
    # holds). `seal` turns a prefilled layer's buffers into that form, `write` puts a static cache's decode
    # entry in (by default: coded by `store`, then written at the evictor's index), `load` gives attention
    # K/V back in the model dtype, `row_bytes` what row r holds of the per-row tensors.
    def seal(self, layer, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor) -> None:
        """After prefill: `layer.keys/values` hold the kept slots in the model dtype; keys/values (B, H, T, D)
        are the whole prompt and real (B, T) bool its real columns (what a scale is calibrated on)."""
        raise NotImplementedError(f"kv {self.name}: not held by evalkit's slot caches")

    def write(self, layer, index: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
        """A static cache's decode step: this step's K/V (B, H, 1, D) into the layer at `index` (the evictor's
        `write_index`), inside the compiled graph."""
        k, v = self.store(layer, k, v)  # as the buffers hold them (codes for a quantizing storage)
        layer.keys[index] = k[:, :, 0]  # (B, H, D_k)
        layer.values[index] = v[:, :, 0]

    def row_bytes(self, layer, r: int) -> int:
        """Bytes of the per-row tensors (`layer.scales`) row r holds."""
        return sum(s[r].numel() * s.element_size() for s in layer.scales)

    def store(self, layer, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's K/V (B, H, q, D) as the layer's buffers hold them."""
        raise NotImplementedError(f"kv {self.name}: not held by evalkit's slot caches")

    def load(self, layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers (or a slice of their slots) -> K/V in the model dtype (`layer.dtype`), for attention."""
        raise NotImplementedError(f"kv {self.name}: not held by evalkit's slot caches")


@dataclass
class NoStorage(KVStorage):
    """The model dtype, as every cache held KV before the storage axis (`kv=none`)."""

    @property
    def name(self) -> str:
        return "none"

    def layer_bytes(self, slots, ring, heads, key_width, value_width, model_bits) -> int:
        return heads * slots * (key_width + value_width) * model_bits // 8

    def hold(self, keys, values):
        return Plain(keys, values)

    def seal(self, layer, keys, values, real) -> None:
        """The buffers already hold the model dtype."""

    def store(self, layer, k, v):
        return k, v

    def load(self, layer, keys, values):
        return keys, values


class Plain:
    """A full cache in the model dtype (what transformers' DynamicLayer holds)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys, self.values = torch.cat([self.keys, k], -2), torch.cat([self.values, v], -2)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def nbytes(self) -> int:
        return tensor_bytes(self.keys, self.values)


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes the tensors' elements take (what a cache really holds, codes and scales alike)."""
    return sum(t.numel() * t.element_size() for t in tensors)
