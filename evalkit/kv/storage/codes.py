"""What integer KV storage holds for one side (K or V) of its entries: its own home, so the full cache's codec
(`kivi.py`) and the slot caches' layout (`kivi_slots.py`) both read it without importing each other."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Codes(NamedTuple):
    """One side (K or V) of quantized entries: packed codes (..., T, D * bits / 8) uint8; scale and zero point
    in the model dtype, keys (..., T / group, D), values (..., T, D / group)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
