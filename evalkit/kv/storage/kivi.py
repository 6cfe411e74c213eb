"""Integer KV storage as KIVI (`kv=int8|int4|int2`): asymmetric group-wise quantization with a residual.

KIVI (Liu et al., 2024, arXiv 2402.02750; github jy-yuan/KIVI, `quant/new_pack.py`, `models/llama_kivi.py`):
keys are quantized per channel, in groups of `group` consecutive entries; values per entry (token), in groups
of `group` channels. A group with range [lo, hi] has `scale = (hi - lo) / (2^bits - 1)` and zero point `lo`;
`code = round(clamp((x - lo) / scale, 0, 2^bits - 1))`, read back as `code * scale + lo`. Codes are packed
8 / bits to a byte along the channels (a slot's codes are its own bytes); scales and zero points are held in
the model dtype, beside them, as KIVI holds them.

The most recent entries stay in full precision, as KIVI's residual: in a full (append) cache of N entries,
keys [0, R * floor((N - 1) / R)) are quantized (a block of R keys is quantized together once the next token
arrives, so a key group never mixes quantized and raw entries) and values [0, N - R - 1) (the oldest value
leaves the residual once R + 1 are held). Attention therefore sees, at every decode step, exactly KIVI's
split (KIVI quantizes after attention; evalkit before the next token's write, which attention cannot tell
apart). In a ring cache the ring is the residual (docs/deviations.md#kv-storage). `hold` (`KiviHeld`) is the
full cache's ragged layout; the slot caches hold the same split per slot (`kivi_slots.py`), whose bytes are
`layer_bytes` (what a run holds and evalkit.memory models), KIVI's ragged ones `hold_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evalkit.kv.storage import kivi_slots
from evalkit.kv.storage.base import KVStorage, tensor_bytes
from evalkit.kv.storage.codes import Codes

BITS = (2, 4, 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) codes in [0, 2^bits) -> (..., D * bits / 8) uint8: 8 / bits codes per byte, the first in the
    lowest bits."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)  # (8 / bits,)
    grouped = codes.to(torch.uint8).unflatten(-1, (-1, shifts.numel()))  # (..., D * bits / 8, 8 / bits)
    return (grouped << shifts).sum(-1, dtype=torch.uint8)  # disjoint bits: the sum is the bitwise or


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of `pack`: (..., D * bits / 8) uint8 -> (..., D) uint8 codes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(-2)


def _affine(x, lo, hi, bits: int, dtype: torch.dtype):
    """Codes of x (float32) against its group's [lo, hi] (broadcast); scale and zero point rounded to `dtype`
    first, so the codes are the best for the parameters actually held."""
    levels = 2**bits - 1
    zero, scale = lo.to(dtype), ((hi - lo) / levels).to(dtype)
    # a constant group (hi == lo) has scale 0: KIVI divides by it (NaN); evalkit codes it 0 and reads back lo
    step = torch.where(scale != 0, scale.float(), 1.0)
    codes = ((x - zero.float()) / step).clamp(0, levels).round()  # KIVI: clamp_, then round_
    return codes, scale, zero


def quantize_keys(x: torch.Tensor, group: int, bits: int, valid: torch.Tensor | None = None) -> Codes:
    """Keys (..., T, D), T a multiple of `group`: per channel, groups of `group` consecutive entries.
    valid (..., T) bool: entries that count for a group's range (empty slots do not), None = all."""
    t = x.shape[-2]
    g = x.float().unflatten(-2, (t // group, group))  # (..., T / G, G, D)
    lo_in, hi_in = g, g
    if valid is not None:  # an empty group gets [0, 0]: codes 0, never read (masked slots)
        m = valid.unflatten(-1, (t // group, group)).unsqueeze(-1)  # (..., T / G, G, 1)
        lo_in, hi_in = g.masked_fill(~m, float("inf")), g.masked_fill(~m, float("-inf"))
    lo, hi = lo_in.amin(-2, keepdim=True), hi_in.amax(-2, keepdim=True)  # (..., T / G, 1, D)
    if valid is not None:
        lo, hi = torch.where(lo.isinf(), 0.0, lo), torch.where(hi.isinf(), 0.0, hi)
    codes, scale, zero = _affine(g, lo, hi, bits, x.dtype)
    return Codes(pack(codes.flatten(-3, -2), bits), scale.squeeze(-2), zero.squeeze(-2))


def quantize_values(x: torch.Tensor, group: int, bits: int) -> Codes:
    """Values (..., T, D), D a multiple of `group`: per entry, groups of `group` consecutive channels."""
    g = x.float().unflatten(-1, (-1, group))  # (..., T, D / G, G)
    codes, scale, zero = _affine(g, g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), bits, x.dtype)
    return Codes(pack(codes.flatten(-2), bits), scale.squeeze(-1), zero.squeeze(-1))


def dequantize_keys(c: Codes, group: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Codes of `quantize_keys` -> keys (..., T, D) in `dtype`."""
    codes = unpack(c.codes, bits).float().unflatten(-2, (-1, group))  # (..., T / G, G, D)
    x = codes * c.scale.float().unsqueeze(-2) + c.zero.float().unsqueeze(-2)
    return x.flatten(-3, -2).to(dtype)


def dequantize_values(c: Codes, group: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Codes of `quantize_values` -> values (..., T, D) in `dtype`."""
    codes = unpack(c.codes, bits).float().unflatten(-1, (-1, group))  # (..., T, D / G, G)
    return (codes * c.scale.float().unsqueeze(-1) + c.zero.float().unsqueeze(-1)).flatten(-2).to(dtype)


@dataclass
class IntStorage(KVStorage):
    """KIVI: `bits`-bit codes, keys per channel and values per token in groups of `group`, the last `residual`
    entries (keys: up to `residual`; values: `residual` + the current one) in the model dtype."""

    bits: int = 4
    group: int = 32
    residual: int = 128

    def __post_init__(self):
        if self.bits not in BITS or isinstance(self.bits, bool):
            raise ValueError(f"kv int: bits must be 2, 4 or 8, got {self.bits!r}")
        for key in ("group", "residual"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv {self.name}: {key} must be a positive integer, got {value!r}")
        if self.residual % self.group:
            raise ValueError(
                f"kv {self.name}: residual must be a multiple of group (a block of `residual` keys is "
                "quantized in whole groups, as KIVI asserts), "
                f"got residual={self.residual}, group={self.group}"
            )

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def refusal(self, method, facts=None) -> str | None:
        if method.evictor.chooses_slots:
            return (
                f"kv {self.name}: {method.name} overwrites single cache entries chosen per KV head while "
                f"decoding, and a key group (one scale per channel over {self.group} entries) cannot take "
                "one new entry without re-quantizing the others: use kv=fp8_e4m3 or kv=none with this method"
            )
        budget = getattr(method, "budget", None)
        if method.ring and budget is not None and budget % self.group:
            return (
                f"kv {self.name}: {method.name}'s budget {budget} must be a multiple of group={self.group} "
                "(a ring row's sinks and top-K are quantized in key groups of `group` slots): choose such a "
                "budget or set kv.group"
            )
        if getattr(facts, "mla", False):
            return (
                f"kv {self.name}: this model caches one latent per token (MLA), which has no keys per "
                "channel and values per token to quantize as KIVI: use kv=fp8_e4m3 or kv=none"
            )
        return None

    def check_widths(self, key_width: int, value_width: int) -> None:
        if value_width % self.group:
            raise ValueError(
                f"kv {self.name}: group={self.group} must divide the value head width {value_width} (values "
                "are quantized per token in groups of `group` channels)"
            )
        if (2 * key_width) % self.group:
            raise ValueError(
                f"kv {self.name}: group={self.group} must divide twice the key head width {key_width} (a key "
                "group's scale and zero point are striped over its `group` slots)"
            )
        if (key_width * self.bits) % 8 or (value_width * self.bits) % 8:
            raise ValueError(
                f"kv {self.name}: head widths {key_width}, {value_width} do not fill whole bytes"
            )

    def quantized(self, slots: int, ring: int) -> tuple[int, int]:
        """(keys, values) entries of a row held quantized: a ring row quantizes all but its ring (sinks and
        top-K, written once at prefill); an append row all but KIVI's residual."""
        if ring:
            return slots - ring, slots - ring
        keys, values = self.split(slots)
        return (keys if slots else 0), max(values, 0)

    def split(self, filled):
        """KIVI's split of an append row's `filled` entries (an int, or a tensor of them: the slot caches' per
        row): (keys quantized below, values quantized below), unclamped. Keys are quantized in whole blocks of
        `residual` once the next token arrives, the oldest value once `residual + 1` are held."""
        r = self.residual
        return r * ((filled - 1) // r), filled - r - 1

    def layer_bytes(self, slots, ring, heads, key_width, value_width, model_bits) -> int:
        """The slot caches' layout (what a run holds, `kivi_slots`): every slot's codes and parameters (a key
        group's striped over its slots), and the row's raw window: an append row's last `residual` keys and
        `residual + 1` values, a ring row's ring."""
        self.check_widths(key_width, value_width)
        item = model_bits // 8
        k, v = kivi_slots.slot_widths(self, key_width, value_width, item)
        r = self.residual
        window = ring * (key_width + value_width) if ring else r * key_width + (r + 1) * value_width
        return heads * (slots * (k + v) + window * item)

    def hold_bytes(self, slots, ring, heads, key_width, value_width, model_bits) -> int:
        """KIVI's own ragged layout, what `hold` (the full cache's reference path) holds."""
        self.check_widths(key_width, value_width)
        qk, qv = self.quantized(slots, ring)
        key_groups = -(-qk // self.group)  # a ring row's last key group may be partial
        keys = qk * key_width * self.bits + key_groups * key_width * 2 * model_bits  # codes, scale + zero
        keys += (slots - qk) * key_width * model_bits  # residual
        values = qv * value_width * self.bits + qv * (value_width // self.group) * 2 * model_bits
        values += (slots - qv) * value_width * model_bits
        return heads * (keys + values) // 8

    # --- the codec (bound to this storage's settings) -------------------------------------------------------
    def quantize_keys(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> Codes:
        return quantize_keys(x, self.group, self.bits, valid)

    def quantize_values(self, x: torch.Tensor) -> Codes:
        return quantize_values(x, self.group, self.bits)

    def dequantize_keys(self, c: Codes, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_keys(c, self.group, self.bits, dtype)

    def dequantize_values(self, c: Codes, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_values(c, self.group, self.bits, dtype)

    def hold(self, keys, values):
        self.check_widths(keys.shape[-1], values.shape[-1])
        return KiviHeld(self, keys, values)

    # --- the slot caches (`kivi_slots`: codes per slot, the residual in per-row windows) --------------------
    def seal(self, layer, keys, values, real) -> None:
        kivi_slots.seal(self, layer)

    def write(self, layer, index, k, v) -> None:
        kivi_slots.write(self, layer, k, v)  # int refuses slot-choosing evictors: index is (row, slot)

    def store(self, layer, k, v):
        raise NotImplementedError(
            f"kv {self.name}: the dynamic cache does not decode integer KV (KIVI's residual moves each step "
            "on device state): decode in the static cache or the engine's slot pool"
        )

    def load(self, layer, keys, values):
        return kivi_slots.load(self, layer, keys, values)

    def row_bytes(self, layer, r: int) -> int:
        return kivi_slots.row_bytes(layer, r)


def _cat(a: Codes, b: Codes) -> Codes:
    """Entries appended along the token axis (codes, and the scales of keys' groups or values' entries)."""
    return Codes(*(torch.cat([x, y], -2) for x, y in zip(a, b)))


class KiviHeld:
    """A full cache in KIVI's layout: quantized keys and values, and their full-precision residuals
    (B, H, r, D). The split after every write is `IntStorage.quantized(N, 0)`."""

    def __init__(self, storage: IntStorage, keys: torch.Tensor, values: torch.Tensor):
        self.s, self.dtype = storage, keys.dtype
        qk, qv = storage.quantized(keys.shape[-2], 0)
        self.kq, self.k_res = storage.quantize_keys(keys[..., :qk, :]), keys[..., qk:, :]
        self.vq, self.v_res = storage.quantize_values(values[..., :qv, :]), values[..., qv:, :]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token per row (B, H, 1, D): a full key residual is quantized first, as is the oldest value once
        R + 1 are held; the new entry joins the residuals."""
        if k.shape[-2] != 1:
            raise ValueError(
                f"kv {self.s.name}: the full cache appends one token per step, got {k.shape[-2]}"
            )
        r = self.s.residual
        if self.k_res.shape[-2] == r:
            self.kq, self.k_res = _cat(self.kq, self.s.quantize_keys(self.k_res)), self.k_res[..., :0, :]
        if self.v_res.shape[-2] == r + 1:
            oldest = self.s.quantize_values(self.v_res[..., :1, :])
            self.vq, self.v_res = _cat(self.vq, oldest), self.v_res[..., 1:, :]
        self.k_res, self.v_res = torch.cat([self.k_res, k], -2), torch.cat([self.v_res, v], -2)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.cat([self.s.dequantize_keys(self.kq, self.dtype), self.k_res], -2)
        values = torch.cat([self.s.dequantize_values(self.vq, self.dtype), self.v_res], -2)
        return keys, values

    def nbytes(self) -> int:
        return tensor_bytes(*self.kq, self.k_res, *self.vq, self.v_res)
