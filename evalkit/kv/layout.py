"""Where each token lives in a compressed cache: the `[sink | tail | top-K]` slots of a row, planned at
prefill.

One formula places a position in the tail: `ring_slot`. The prefill plan uses it to lay out the prompt's tail,
and every decode path (the dynamic cache, the static cache, the slot pool) uses it for the token it writes, so
the layout after prefill and the ring at decode can never disagree. How many slots a request needs is
`slots_needed`, the one answer the cache, the static cache and the engine's pool all size to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rows:
    """Per batch row bookkeeping shared by all layers (same prompt, same layout, different contents)."""

    lengths: list[int]  # real prompt tokens per row (left pads excluded)
    pad: torch.Tensor  # (B,) left pad columns
    tail: torch.Tensor  # (B,) tail (ring) slots per row
    topk: torch.Tensor  # (B,) valid top-K slots per row
    n: int  # slots per row after prefill (the static size for ring methods)
    base_pos: torch.Tensor  # (B, n) positions of sink/tail slots, -1 = empty or top-K (filled per layer)
    candidates: torch.Tensor  # (B, T) bool: prompt columns eligible for the top-K block
    valid: torch.Tensor  # (B, capacity) bool: slot holds a token (identical in every layer and head)
    next_pos: torch.Tensor  # (B,) absolute position of the next token per row
    filled: list[int]  # ring methods: valid slots per row, always a prefix [0, filled) of the row's slots


def ring_slot(p, sink, tail):
    """The slot of position `p`: itself below the sinks, else `sink + (p - sink) mod tail` (the oldest tail
    entry is overwritten). Python ints, or tensors that broadcast (elementwise, no host sync)."""
    if isinstance(p, int):
        return p if p < sink else sink + (p - sink) % tail
    # a row without a tail (an append method keeping only sinks and top-K) has no ring: any slot will do,
    # its caller picks the next free one
    tail = tail.clamp(min=1) if isinstance(tail, torch.Tensor) else max(tail, 1)
    return torch.where(p < sink, p, sink + (p - sink) % tail)


@dataclass(frozen=True)
class Shape:
    """What a cache's slot count may depend on besides the prompt: the KV heads one layer caches and the
    layers (a head- or layer-adaptive budget's largest head or layer, `KVMethod.slots`)."""

    heads: int
    layers: int


def prompt_slots(method, width: int, shape: Shape) -> int:
    """Slots a prompt `width` columns wide takes per row: a ring's budget, else the kept prompt (all of it, or
    the slots its largest head and layer may keep: the budget for a uniform method)."""
    if method.ring:
        return method.budget
    return width if method.budget is None else min(width, method.slots(shape))


def slots_needed(method, prompt_len: int, max_new: int, shape: Shape) -> int:
    """Slots one request needs for its whole decode: a ring stays its budget, an append cache adds a slot per
    generated token."""
    return prompt_slots(method, prompt_len, shape) + (0 if method.ring else max_new)


def plan_rows(method, valid_cols: torch.Tensor, shape: Shape) -> Rows:
    """Block sizes and the sink/tail slot positions for a left-padded prompt batch, valid_cols (B, T)."""
    b, t = valid_cols.shape
    dev = valid_cols.device
    lengths = valid_cols.sum(1)  # (B,)
    pad = t - lengths
    if not torch.equal(valid_cols, torch.arange(t, device=dev)[None, :] >= pad[:, None]):
        raise ValueError("evalkit KV caches need left padding (tokenizer.padding_side = 'left')")
    sink, tail_long, _ = method.blocks()
    topk = method.top_slots(shape)  # a head's most top-K slots (its uniform top-K, or an adaptive bound)
    n = prompt_slots(method, t, shape)
    sink = min(sink, n)
    # Whole prompt kept when it fits, except under the spec's fixed ring (`spare_slots="pad"`), whose short
    # prompts keep their middle in the top-K block and leave the unused slots as padding.
    # (`snapkv_decode` keeps at most `budget - interval` of the prompt: its decode appends into the rest)
    whole = lengths <= getattr(method, "target", n)
    if method.ring and getattr(method, "spare_slots", "ring") == "pad":
        whole = torch.zeros_like(whole)
    tail = torch.where(whole, n - sink, tail_long)  # (B,)
    # --- sink and tail slot positions: each prompt position goes to its ring slot, the last one there stays
    # (as if the prompt had been decoded through the ring; also used, harmlessly, to order append methods'
    # tail)
    p = torch.arange(t, device=dev)[None, :].expand(b, t)  # (B, T) positions, real or not
    slot = ring_slot(p, sink, tail[:, None])  # (B, T), all < sink + max(tail, 1) <= n
    # positions past a row's prompt land nowhere, nor do those after the sinks when there is no tail (a
    # method that keeps only sinks and its top-K: knorm, keydiff, expected_attention, kvzip)
    held = torch.where((p < lengths[:, None]) & ((p < sink) | (tail[:, None] > 0)), p, -1)
    base_pos = torch.full((b, n), -1, dtype=p.dtype, device=dev).scatter_reduce(1, slot, held, "amax")
    j = torch.arange(n, device=dev)[None, :]  # (1, n)
    cols = torch.arange(t, device=dev)[None, :] - pad[:, None]  # (B, T) position of each column
    candidates = (cols >= sink) & (cols < lengths[:, None] - tail[:, None])
    k_rows = candidates.sum(1).clamp(max=topk)  # valid_topk per row
    valid = (base_pos >= 0) | ((j >= sink + tail_long) & (j < sink + tail_long + k_rows[:, None]))
    return Rows(
        lengths=lengths.tolist(),
        pad=pad,
        tail=tail,
        topk=k_rows,
        n=n,
        base_pos=base_pos,
        candidates=candidates,
        valid=valid,
        next_pos=lengths.clone(),
        filled=valid.sum(1).tolist(),
    )


def valid_columns(attention_mask, b: int, t: int, device) -> torch.Tensor:
    """(B, T) bool: prompt columns that are real tokens, read off the last query row of the prefill mask."""
    if attention_mask is None:  # transformers skips the mask when there is no padding (sdpa is_causal path)
        return torch.ones(b, t, dtype=torch.bool, device=device)
    last = attention_mask[:, 0, -1, -t:]  # (B, T)
    return last if last.dtype == torch.bool else last == 0


class SharedSlots:
    """Every KV head of a row holds its entries in the same slots (a uniform budget): attention reads the
    row's slot mask as it is, (B, 1, q, S) or None (the hot path, unchanged)."""

    def mask(self, layer, shared: torch.Tensor | None, width: int) -> torch.Tensor | None:
        return shared

    def kept(self, cache, valid: list[int], used: int) -> list[int]:
        """Entries kept per row, layer and head: the valid slots (every head holds one in each)."""
        return valid

    def admits(self, other) -> bool:
        """Whether a pool reading slots this way may hold a row whose heads keep slots `other`'s way: a
        shared mask would read a head's empty slots as zero keys."""
        return isinstance(other, SharedSlots)


class OwnSlots:
    """Heads or layers keep different counts (head- and layer-adaptive budgets) in fixed-shape buffers sized
    for the largest: a slot a head left empty (position -1) is masked for that head alone, (B, H, 1, S)."""

    def mask(self, layer, shared: torch.Tensor | None, width: int) -> torch.Tensor:
        own = layer.pos[:, :, None, :width] >= 0  # (B, H, 1, S): a decode step's slot is written before
        return own if shared is None else own & shared

    def kept(self, cache, valid: list[int], used: int) -> list[int]:
        """Entries kept per row, as the mean over layers and heads (the uniform budget's count: a layer of
        AdaKV keeps H x budget, PyramidKV's layers L x budget), not the slots any head uses."""
        held = sum((lay.pos[:, :, :used] >= 0).sum((1, 2)) for lay in cache.layers)  # (B,)
        heads = cache.layers[0].pos.shape[1] * len(cache.layers)
        return (held // heads).tolist()

    def admits(self, other) -> bool:
        """Any row: a uniform one's slots are its heads' own too."""
        return True


SHARED = SharedSlots()  # frozen: no state, one for every uniform method
