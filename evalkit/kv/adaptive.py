"""Budgets that vary by head and by layer (issue 33 item 3), at the uniform budget's total entries.

Both wrap any prefill method (`inner`: its layout, its scorer, its extra pass) and keep what it keeps always
(its sinks and tail, e.g. SnapKV's window) in every head; they move only its top-K block:

- `AdaKV` (Feng et al., 2024, arXiv 2407.11550; kvpress 0.5.5 `AdaKVPress`): one top-k over all KV heads of
  a layer. Each head first keeps its best `floor` entries (kvpress's `alpha_safeguard`: `int(alpha x budget)`
  kept per head, at least 1, the always-kept entries counted in them), then the layer's remaining
  H_kv x top-K - H_kv x floor entries go to the highest scores of any head. A layer keeps exactly H_kv x
  budget entries, as the uniform budget.
- `PyramidKV` (Cai et al., 2024, arXiv 2406.02069; kvpress 0.5.5 `PyramidKVPress.get_layer_budget`): layer l
  of L keeps `round(max - l (max - min) / (L - 1))` per head, min = budget / beta, max = 2 budget - min (max
  capped at the prompt length minus the always-kept entries, min raised to match); kvpress falls back to the
  uniform budget when the smallest layer would keep fewer than the always-kept entries, and so does this.
  The schedule is symmetric about the budget and rounds half to even, so the layers' total is exactly L x
  budget (kvpress rounds floats the same way).

The cache is fixed-shape: every row gets the slots its largest head and layer may keep (`slots`), a head's
unused slots hold position -1 and are masked for that head alone at decode (`layout.OwnSlots`). The stats
record both the bytes the buffers hold (`bytes`) and those a ragged layout would (`ragged_bytes`). Decode
appends, as `snapkv`. Refused: a ring or decode-time inner method (its decode would have to move a head's
entries across slots). Under tensor parallelism a rank holds its share of the KV heads: AdaKV's top-k reads
every rank's scores (`select.Own.all_heads`, gathered at prefill) and keeps its own heads' counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import ClassVar

import torch

from evalkit.kv import select
from evalkit.kv.evict import Evictor
from evalkit.kv.layout import OwnSlots, Shape
from evalkit.kv.methods import KVMethod, SnapKV, _check_budget


@dataclass
class Adaptive(KVMethod):
    """Base: `inner`'s layout and scorer at `budget`, its top-K block spread by `counts`."""

    budget: int = 256
    inner: KVMethod = field(default_factory=SnapKV)
    ring: ClassVar[bool] = False
    slot_mask: ClassVar[OwnSlots] = OwnSlots()

    def __post_init__(self):
        _check_budget(self.name, self.budget)
        inner = self.inner
        if inner.ring or inner.evictor is not Evictor or not inner.budget_applies:
            raise ValueError(
                f"{self.name}: inner must be a prefill method whose decode appends (snapkv, "
                f"expected_attention, knorm, keydiff, tova, kvzip), got {inner.describe()['name']}: a ring "
                "or a decode-time method would move a head's entries across slots while decoding"
            )
        self.inner = replace(inner, budget=self.budget)  # the inner's own checks, at this budget

    # --- what the inner method answers ---------------------------------------------------------------------
    @property
    def window(self) -> int:
        return self.inner.window

    @property
    def records_score(self) -> bool:
        return self.inner.records_score

    @property
    def target(self) -> int:
        """A prompt up to the budget is kept whole (the slots may hold more: `slots`)."""
        return self.budget

    def blocks(self) -> tuple[int, int, int]:
        return self.inner.blocks()

    def score(self, view):
        return self.inner.score(view)

    def score_key(self) -> str:
        return self.inner.score_key()

    def prefill(self, forward, cache, tokenizer, kwargs: dict):
        return self.inner.prefill(forward, cache, tokenizer, kwargs)

    def refusal(self, facts) -> str | None:
        return self.inner.refusal(facts)

    def describe(self) -> dict:
        inner = self.inner.describe()
        own = {k: v for k, v in super().describe().items() if k not in ("name", "inner")}
        return {**own, "name": f"{self.name}_{inner['name']}", "inner": inner}

    # --- the spread ----------------------------------------------------------------------------------------
    def slots(self, shape: Shape) -> int:
        sink, tail, _ = self.blocks()
        return sink + tail + self.top_slots(shape)

    def counts(self, scores: torch.Tensor, per_head: torch.Tensor, layer: int, shape: Shape, rows):
        """(B, H) top-K entries each of the layer's H KV heads keeps, scores (B, H, T) theirs; per_head (B,)
        the uniform budget's top-K per head."""
        raise NotImplementedError

    def place(self, pos, scores, rows, layer: int, shape: Shape, agree: select.Agree) -> None:
        sink, tail, k = self.blocks()
        per_head = rows.candidates.sum(1).clamp(max=k)  # (B,) the uniform budget's top-K per head
        # a TP rank holds its share of the heads: the layer's counts from every rank's scores, then its own
        counts = agree.my_heads(self.counts(agree.all_heads(scores), per_head, layer, shape, rows))
        select.place_counts(pos, scores, rows, sink + tail, counts, agree)


@dataclass
class AdaKV(Adaptive):
    """AdaKVPress: one top-(H_kv x top-K) over all KV heads of a layer, each head keeping at least its
    `alpha` share of the budget (kvpress's `alpha_safeguard`)."""

    alpha: float = 0.2
    name: ClassVar[str] = "adakv"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(
                f"{self.name}: alpha must be in [0, 1] (the share each head keeps), got {self.alpha}"
            )

    def floor(self) -> int:
        """Top-K entries every head keeps: kvpress's `n_safe` (at least 1 when alpha > 0) less the entries
        it keeps always (kvpress's SnapKV and Expected Attention score those above every other)."""
        safe = int(self.budget * self.alpha)
        safe = max(1, safe) if self.alpha > 0 else 0
        sink, tail, k = self.blocks()
        return min(max(safe - sink - tail, 0), k)

    def top_slots(self, shape: Shape) -> int:
        """The most one head may keep: all of its layer's top-K but the other heads' floors."""
        k, f = self.blocks()[2], self.floor()
        return shape.heads * k - (shape.heads - 1) * f

    def counts(self, scores, per_head, layer, shape, rows):
        b, h, t = scores.shape
        floor = per_head.clamp(max=self.floor())  # (B,)
        ranked = scores.sort(dim=-1, descending=True).values  # (B, H, T) each head best first
        rank = torch.arange(t, device=scores.device)
        boosted = torch.where(rank < floor[:, None, None], float("inf"), ranked)  # each head's floor first
        total = per_head * h  # (B,) the layer's top-K entries, as the uniform budget keeps
        most = int(total.max())  # one sync per layer, at prefill
        counts = torch.zeros(b, h, dtype=torch.long, device=scores.device)
        if most == 0:
            return counts
        top = boosted.flatten(1).topk(most, dim=-1).indices  # (B, most) over every head's entries
        chosen = torch.arange(most, device=scores.device)[None] < total[:, None]
        # each head's chosen entries are a prefix of its own ranking: a count per head says which
        return counts.scatter_add_(1, top // t, chosen.long())


def pyramid_budget(budget: int, protected: int, beta: int, layer: int, layers: int, length: int) -> int:
    """Entries layer `layer` of `layers` keeps per head of a `length`-token prompt: kvpress's
    `PyramidKVPress.get_layer_budget` with n_kept = `budget` and window_size = `protected`, in exact
    arithmetic (Fraction; Python's round is half to even, as kvpress's)."""
    if layers == 1:
        return budget  # kvpress's one layer keeps `max` (2 x budget - min): more than the uniform total
    least = Fraction(budget, beta)
    most = 2 * budget - least
    if most >= length - protected:
        most = Fraction(length - protected)
        least = 2 * budget - most
    if not length >= most >= least >= protected:
        return budget  # kvpress's fallback to the uniform budget (SnapKV)
    return round(most - layer * (most - least) / (layers - 1))


@dataclass
class PyramidKV(Adaptive):
    """PyramidKVPress: each layer's budget per head on a line from 2 x budget - budget / beta (the first
    layer) down to budget / beta (the last), every head of a layer keeping alike."""

    beta: int = 20
    name: ClassVar[str] = "pyramidkv"

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"{self.name}: beta must be >= 1 (the pyramid's steepness), got {self.beta}")

    def layer_budget(self, layer: int, layers: int, length: int) -> int:
        sink, tail, _ = self.blocks()
        return pyramid_budget(self.budget, sink + tail, self.beta, layer, layers, length)

    def top_slots(self, shape: Shape) -> int:
        """The first layer's top-K at any prompt length (a capped `max` is below the uncapped one)."""
        sink, tail, _ = self.blocks()
        first = round(2 * self.budget - Fraction(self.budget, self.beta))
        return max(self.budget, first) - sink - tail

    def counts(self, scores, per_head, layer, shape, rows):
        sink, tail, _ = self.blocks()
        own = [self.layer_budget(layer, shape.layers, n) - sink - tail for n in rows.lengths]
        own = torch.tensor(own, device=scores.device)
        counts = torch.minimum(own, rows.candidates.sum(1))  # (B,): rows kept whole have no candidates
        return counts[:, None].expand(-1, scores.shape[1])
