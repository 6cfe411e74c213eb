"""KIVI in evalkit's slot caches (the static cache and the engine's pool): `IntStorage`'s seal / write / load.

Every slot keeps its own bytes, so growing a pool, copying a prefilled row into it (`SlotPool.load_row`),
slicing the visible slots (buckets) and sharding heads (TP) work as for any storage:
- `layer.keys` (B, H, cap, S + D_k * bits / 8) uint8: a slot's packed key codes after its 1/G share of its key
  group's parameters (S = 2 * D_k * itemsize / G bytes: the scale and zero point of the group of G slots
  [gG, gG + G) that holds it are striped over those G slots, so nothing per group lives outside the slots);
- `layer.values` (B, H, cap, P + D_v * bits / 8) uint8: the slot's own value scale and zero point (per token,
  groups of G channels, P = 2 * D_v / G * itemsize bytes), then its packed value codes;
- `layer.scales` = (key window (B, H, W_k, D_k), value window (B, H, W_v, D_v), meta (B, 3) long): the raw
  (model dtype) residual of each row, and per row [window start, W_k used, W_v used] (data, copied with the
  row). The pool's windows are as wide as its widest row's (grown as a wider row arrives, as its capacity).

Which slots are raw is KIVI's split, per row (`StepState` tensors, no kind switch):
- an append row of N filled slots: keys of slots [R * floor((N - 1) / R), N) at window index i mod R, values
  of the last R + 1 slots at index i mod (R + 1). Each decode step, inside the graph, the key block that just
  filled (slot s = N - 1 a multiple of R) is quantized into its slots, and the value leaving the window (slot
  s - R - 1) into its slot, before the new entry takes its window index (torch.where-guarded writes):
  attention sees exactly what `KiviHeld` (the full cache's reference path) holds at every step.
- a ring row: its ring (the slots decode overwrites, from `start` = the sinks, or the prompt's end when the
  prompt is shorter than the sinks) is the residual, raw at window index slot - start; sinks and top-K are
  quantized once at seal, key groups over blocks of G slots with the ring's slots left out of a group's range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evalkit.kv.storage.codes import Codes


# --- per-slot bytes ---------------------------------------------------------------------------------------
def key_slot_bytes(s, x: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Keys (B, H, T, D_k), T a multiple of G -> (B, H, T, S + C) uint8: each slot's stripe of its group's
    (scale, zero) and its codes. valid (B, H, T): the entries that count for a group's range."""
    c = s.quantize_keys(x, valid)  # codes (B, H, T, C); scale, zero (B, H, T / G, D_k)
    params = torch.stack([c.scale, c.zero], -2).flatten(-2).contiguous()  # (B, H, T / G, 2 * D_k)
    stripes = params.view(torch.uint8).unflatten(-1, (s.group, -1)).flatten(2, 3)  # (B, H, T, S)
    return torch.cat([stripes, c.codes], -1)


def keys_of(s, x: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    """(B, H, V, S + C) uint8 slots -> keys (B, H, V, D_k) in `dtype` (slots of a partial last group are read
    as zeros: they are raw or empty)."""
    v, g = x.shape[2], s.group
    x = F.pad(x, (0, 0, 0, -v % g)).contiguous()  # (B, H, V', S + C), V' a multiple of G
    stripe = 2 * width * dtype.itemsize // g
    params = x[..., :stripe].unflatten(2, (-1, g)).flatten(-2).contiguous().view(dtype)  # (B, H, V'/G, 2D)
    params = params.unflatten(-1, (2, width))
    keys = s.dequantize_keys(Codes(x[..., stripe:], params[..., 0, :], params[..., 1, :]), dtype)
    return keys[:, :, :v]


def value_slot_bytes(s, x: torch.Tensor) -> torch.Tensor:
    """Values (B, H, T, D_v) -> (B, H, T, P + C) uint8: each slot's (scale, zero) per G channels, codes."""
    c = s.quantize_values(x)  # codes (B, H, T, C); scale, zero (B, H, T, D_v / G)
    params = torch.stack([c.scale, c.zero], -2).flatten(-2).contiguous()  # (B, H, T, 2 * D_v / G)
    return torch.cat([params.view(torch.uint8), c.codes], -1)


def values_of(s, x: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    """(B, H, V, P + C) uint8 slots -> values (B, H, V, D_v) in `dtype`."""
    p = 2 * (width // s.group) * dtype.itemsize
    params = x[..., :p].contiguous().view(dtype).unflatten(-1, (2, -1))  # (B, H, V, 2, D_v / G)
    return s.dequantize_values(Codes(x[..., p:], params[..., 0, :], params[..., 1, :]), dtype)


def slot_widths(s, key_width: int, value_width: int, itemsize: int) -> tuple[int, int]:
    """Bytes of one slot's key and value entry (parameters and codes)."""
    keys = 2 * key_width * itemsize // s.group + key_width * s.bits // 8
    values = 2 * (value_width // s.group) * itemsize + value_width * s.bits // 8
    return keys, values


# --- seal: a prefilled layer's kept slots -> codes + windows ---------------------------------------------
def seal(s, layer) -> None:
    """After prefill: `layer.keys/values` (B, H, cap, D) hold the kept slots in the model dtype; they become
    slot bytes, and the row's raw entries its windows (eager, once per request)."""
    cache, keys, values = layer.cache, layer.keys, layer.values
    s.check_widths(keys.shape[-1], values.shape[-1])
    rows = cache.rows
    b, h, cap = keys.shape[:3]
    # (B, H, cap): empty slots count for no range, a head's own empty ones too (adaptive budgets: pos -1)
    valid = rows.valid[:, None, :cap] & (layer.pos[:, :, :cap] >= 0)
    if cache.method.ring:
        kb, vb, windows = _seal_ring(s, cache, keys, values, valid)
    else:
        kb, vb, windows = _seal_append(s, rows.n, keys, values, valid)
    layer.keys, layer.values, layer.scales = kb, vb, windows


def _seal_append(s, n: int, keys, values, valid):
    """KIVI's split of n filled slots: keys [0, qk) and values [0, qv) coded, the rest in the windows."""
    b, h, cap = keys.shape[:3]
    r, (qk, qv) = s.residual, s.quantized(n, 0)
    kw, vw = slot_widths(s, keys.shape[-1], values.shape[-1], keys.dtype.itemsize)
    kb = torch.zeros(b, h, cap, kw, dtype=torch.uint8, device=keys.device)
    vb = torch.zeros(b, h, cap, vw, dtype=torch.uint8, device=keys.device)
    if qk:
        kb[:, :, :qk] = key_slot_bytes(s, keys[:, :, :qk], valid[:, :, :qk])
    if qv:
        vb[:, :, :qv] = value_slot_bytes(s, values[:, :, :qv])
    kwin, vwin = keys.new_zeros(b, h, r, keys.shape[-1]), values.new_zeros(b, h, r + 1, values.shape[-1])
    at = torch.arange(qk, n, device=keys.device)
    kwin[:, :, at % r] = keys[:, :, qk:n]
    at = torch.arange(max(n - r - 1, 0), n, device=keys.device)
    vwin[:, :, at % (r + 1)] = values[:, :, at]
    meta = torch.tensor([0, r, r + 1], device=keys.device).expand(b, 3).clone()
    return kb, vb, (kwin, vwin, meta)


def _seal_ring(s, cache, keys, values, valid):
    """A ring row: slots [start, sink + tail) raw (the ring), the sinks and top-K coded in key groups of G
    slots that leave the ring's slots out of their range."""
    rows, (b, h, cap) = cache.rows, keys.shape[:3]
    if cap % s.group:
        raise ValueError(f"kv {s.name}: a ring row of {cap} slots is not whole groups of group={s.group}")
    dev = keys.device
    sink = min(cache.method.blocks()[0], rows.n)
    start = torch.tensor(rows.lengths, device=dev).clamp(max=sink)  # (B,) a short prompt's sinks fill later
    width = sink + rows.tail - start  # (B,) raw slots per row
    j = torch.arange(cap, device=dev)
    raw = (j >= start[:, None]) & (j < (start + width)[:, None])  # (B, cap)
    kb = key_slot_bytes(s, keys, valid & ~raw[:, None])
    vb = value_slot_bytes(s, values)
    w = int(width.max())
    at = (start[:, None] + torch.arange(w, device=dev)).clamp(max=cap - 1)[:, None, :, None]  # (B, 1, w, 1)
    kwin = keys.gather(2, at.expand(b, h, w, keys.shape[-1]))
    vwin = values.gather(2, at.expand(b, h, w, values.shape[-1]))
    return kb, vb, (kwin, vwin, torch.stack([start, width, width], 1))


# --- each decode step (inside the graph: tensor work in place, no host sync) -----------------------------
def write(s, layer, k: torch.Tensor, v: torch.Tensor) -> None:
    """This step's K/V (B, H, 1, D) into the row's window; an append row first codes its key block that just
    filled and the value that leaves its window (torch.where-guarded: a row not due writes back its bytes)."""
    state, (kwin, vwin, meta) = layer.cache.state, layer.scales
    slot, ring, row, r = state.slot, state.ring, state.row, s.residual
    if kwin.shape[2] >= r:  # a shape: some row of this cache may append
        block = (slot[:, None] - r + torch.arange(r, device=slot.device)).clamp(min=0)  # (B, R) its slots
        due = (~ring & (slot % r == 0) & (slot > 0))[:, None, None, None]
        held = layer.pos.gather(2, block[:, None].expand(-1, kwin.shape[1], -1)) >= 0  # (B, H, R) per head
        valid = layer.cache.rows.valid.gather(1, block)[:, None] & held
        coded = key_slot_bytes(s, kwin[:, :, :r], valid).transpose(1, 2)  # (B, R, H, bytes)
        at = (row[:, None], slice(None), block)
        layer.keys[at] = torch.where(due, coded, layer.keys[at])
    if vwin.shape[2] > r:
        leaving = slot - r - 1  # the slot whose value leaves the window at this step's window index
        due = (~ring & (leaving >= 0))[:, None, None]
        coded = value_slot_bytes(s, vwin[row, :, slot % (r + 1)][:, :, None])[:, :, 0]  # (B, H, bytes)
        at = (row, slice(None), leaving.clamp(min=0))
        layer.values[at] = torch.where(due, coded, layer.values[at])
    start = meta[:, 0]
    ki = torch.where(ring, slot - start, slot % r).clamp(0, kwin.shape[2] - 1)
    vi = torch.where(ring, slot - start, slot % (r + 1)).clamp(0, vwin.shape[2] - 1)
    kwin[row, :, ki] = k[:, :, 0]  # (B, H, D_k)
    vwin[row, :, vi] = v[:, :, 0]


def load(s, layer, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot bytes (B, H, V, .) -> K/V (B, H, V, D) in the model dtype: the coded slots dequantized, each row's
    raw slots read from its windows."""
    state, (kwin, vwin, meta), dtype = layer.cache.state, layer.scales, layer.dtype
    r, n = s.residual, keys.shape[2]
    j = torch.arange(n, device=keys.device)[None]  # (1, V)
    ring, start, filled = state.ring[:, None], meta[:, :1], state.next_slot[:, None]  # (B, 1) each
    coded_keys, coded_values = s.split(filled)  # (B, 1) each: below them, an append row's slots are coded
    k = _overlay(
        keys_of(s, keys, dtype, kwin.shape[-1]),
        kwin,
        torch.where(ring, j - start, j % r),
        torch.where(ring, start, coded_keys),
        torch.where(ring, start + meta[:, 1:2], filled),
    )
    v = _overlay(
        values_of(s, values, dtype, vwin.shape[-1]),
        vwin,
        torch.where(ring, j - start, j % (r + 1)),
        torch.where(ring, start, coded_values),
        torch.where(ring, start + meta[:, 2:3], filled),
    )
    return k, v


def _overlay(x, window, index, lo, hi) -> torch.Tensor:
    """x (B, H, V, D) with slots [lo, hi) (B, 1) taken from window (B, H, W, D) at index (B, V)."""
    b, h, n, d = x.shape
    j = torch.arange(n, device=x.device)[None]
    at = index.clamp(0, window.shape[2] - 1)[:, None, :, None].expand(b, h, n, d)
    return torch.where(((j >= lo) & (j < hi))[:, None, :, None], window.gather(2, at), x)


def row_bytes(layer, r: int) -> int:
    """Bytes of row r's raw windows (the part of the pool's windows it uses)."""
    kwin, vwin, meta = layer.scales
    used = meta[r].tolist()
    return kwin.shape[1] * (used[1] * kwin.shape[-1] + used[2] * vwin.shape[-1]) * kwin.element_size()
