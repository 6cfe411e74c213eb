"""The memory roofline of a decode step: how fast it could be if it only had to stream its bytes once.

A decode step of one token per row reads every weight once and, in each layer, the K and V of every cache
slot attention reads. On this machine that is bandwidth work, so the floor is
`(weight bytes + KV bytes read) / memory bandwidth`, with the bandwidth measured in the same run by a large
tensor copy. What is counted, exactly:
- weights: every parameter tensor once (a tied embedding is one tensor: the LM head reads all of it, the
  embedding lookup one row); buffers (RoPE frequencies) are left out;
- KV: the K and V bytes of the slots attention reads in the step, all layers, KV heads and batch rows (for a
  growing cache the mean over the measured steps);
- not counted: activations, the logits, masks and positions (kilobytes per step on the embedded model);
- bandwidth: `2 x bytes / time` of `dst.copy_(src)` (read once, written once; a CPU's write-allocate read of
  the destination is not counted, as in STREAM's copy), median of the samples.
`step_pct_of_floor` = measured step time as a percentage of that floor (100% = at the roofline).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from evalkit.bench.timing import sync

GB = 10**9  # bandwidths in decimal units, as vendors quote them


def copy_bandwidth(
    nbytes: int, reps: int, device="cpu", clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """`reps` samples (bytes/s) of copying an `nbytes` tensor into another: read + write = 2 x nbytes."""
    if nbytes <= 0 or reps <= 0:
        raise ValueError(f"copy_bandwidth needs nbytes > 0 and reps > 0, got {nbytes}, {reps}")
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # written: every page is really mapped
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: maps the destination's pages, so the samples time the copy only
    samples = []
    for _ in range(reps):
        sync(src)
        start = clock()
        dst.copy_(src)
        sync(dst)
        samples.append(2 * nbytes / (clock() - start))
    return samples


def weight_bytes(model) -> int:
    """Bytes of every parameter tensor, each counted once (`parameters()` yields a tied tensor once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def floor_columns(step_s: float, weights: int, kv_read: float, bandwidth: float) -> dict:
    """The roofline columns of one configuration: bytes one step reads, the floor time, the measured step
    time as a percentage of that floor."""
    moved = weights + kv_read
    floor = moved / bandwidth
    return {
        "step_ms": round(1e3 * step_s, 4),
        "weight_bytes": weights,
        "kv_read_bytes": round(kv_read),
        "bandwidth_gb_s": round(bandwidth / GB, 2),
        "floor_ms": round(1e3 * floor, 4),
        "step_pct_of_floor": round(100 * step_s / floor, 1),
    }


class Bandwidth:
    """Bandwidth samples gathered around a measurement (before and after its decode rounds); the median is
    the figure its rows use, so the roofline comes from the same run as the step times."""

    def __init__(self, device, nbytes: int, reps: int):
        self.device, self.nbytes, self.reps, self.samples = device, nbytes, reps, []

    def sample(self) -> None:
        self.samples += copy_bandwidth(self.nbytes, self.reps, self.device)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def roofline_note() -> str:
    return (
        "Roofline: `floor_ms` = (weights + KV bytes the step reads) / the memory bandwidth measured in the "
        "same run (median of large tensor copies, 1 GiB; 256 MiB with --quick; read + write counted: "
        "`bandwidth_gb_s`); `step_pct_of_floor` = the measured step as a % of that floor. Weights: every "
        "parameter tensor once (tied embedding once); KV: the K and V of every slot attention reads, all "
        "layers, heads and rows (mean over the measured steps); activations and logits are not counted."
    )
