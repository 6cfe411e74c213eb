"""Decode-time eviction in the engine's slot pool: `h2o` and `snapkv_decode` (`methods.py`).

Both keep a fixed-size row of `budget` slots per layer and KV head. A row that is not yet full appends at its
next free slot (every head alike, so the valid-slot mask stays one per row). Then:
- `h2o` (every step, inside the decode step): each layer's slot to overwrite is chosen per KV head on the
  device, the lowest accumulated attention among entries older than the last `recent` tokens; the new entry's
  sum starts at zero, and after attention the step's query adds its probabilities over the slots to every
  slot's sum (`observe`). No host sync: the compiled step stays one graph.
- `snapkv_decode` (every `interval` steps, between decode steps): the step stores its post-RoPE query in a
  ring of the last `window` queries; the host counts each row's steps (no sync) and re-selects a due row's
  cache down to `budget - interval` entries (`refit_row`), written back in place in position order, so the
  next `interval` tokens append into the slots it frees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evalkit.kv import select


def evicted_slot(layer, pool) -> torch.Tensor:
    """(B, H) the slot each KV head of a full row overwrites: the lowest accumulated score among its entries
    older than the row's last `recent` tokens (slots past the row's budget never compete)."""
    cap = layer.pos.shape[-1]
    older = layer.pos < (pool._slot_pos - pool._recent)[:, None, None]  # (B, H, cap)
    mine = pool.rows.valid & (torch.arange(cap, device=layer.pos.device) < pool._slots[:, None])  # (B, cap)
    score = layer.acc.masked_fill(~(older & mine[:, None, :]), float("inf"))
    return select.top_indices(-score, 1, pool.agree)[..., 0]


def add_attention(layer, query, key, mask, scaling: float) -> None:
    """H2O's per-step update: this step's query's attention probabilities over the slots (float32, under the
    slot mask), averaged over the query heads sharing a KV head, added to each slot's accumulated score.

    query (B, H_q, 1, D) post-RoPE; key (B, H_kv, S, D) every slot; mask (B, 1, 1, S) bool."""
    b, h_q, _, d = query.shape
    h_kv = key.shape[1]
    q = query.float().reshape(b, h_kv, h_q // h_kv, d)  # (B, H_kv, g, D)
    logits = torch.matmul(q, key.float().transpose(-1, -2)) * scaling  # (B, H_kv, g, S)
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    layer.acc += select.group_mean(probs.mean(dim=2), layer.acc.shape[1])


def window_scores(queries, keys, pos, valid, qpos, scaling: float, pool_kernel: int) -> torch.Tensor:
    """SnapKV's score of one row's slots from its last w decode queries, (H, S) float32 in slot order.

    queries (H_q, w, D) post-RoPE at positions qpos (w,); keys (H, S, D) every slot; pos (H, S) each slot's
    position; valid (S,) bool. Each query attends (softmax, causal by position) to the valid slots; the sum
    over the queries is average-pooled along the entries older than the window taken in position order (zero
    padding, as SnapKV pools the prompt). The window's own entries score +inf (always kept), empty slots -inf.
    """
    h_q, w, d = queries.shape
    h, s = pos.shape
    g = h_q // h
    logits = torch.matmul(queries.float().view(h, g, w, d), keys.float().transpose(-1, -2).unsqueeze(1))
    seen = valid & (pos[:, None, None, :] <= qpos[None, None, :, None])  # (H, 1, w, S)
    probs = torch.softmax((logits * scaling).masked_fill(~seen, float("-inf")), dim=-1)
    summed = probs.sum(dim=2)  # (H, g, S)
    window = valid & (pos >= qpos.min())  # (H, S): the last w tokens
    older = valid & ~window
    order = torch.where(older, pos, torch.iinfo(pos.dtype).max).argsort(dim=-1)  # (H, S) older first, by pos
    ordered = summed.gather(-1, order[:, None, :].expand(h, g, s))
    beyond = torch.arange(s, device=pos.device) >= older.sum(-1, keepdim=True)  # (H, S) past the older ones
    ordered = ordered.masked_fill(beyond[:, None, :], 0.0)
    pooled = F.avg_pool1d(ordered.reshape(h * g, 1, s), pool_kernel, 1, pool_kernel // 2).view(h, g, s)
    scores = torch.empty(h, s, dtype=torch.float32, device=pos.device).scatter_(-1, order, pooled.mean(1))
    return scores.masked_fill(~older, float("-inf")).masked_fill(window, float("inf"))


def refit_row(pool, r: int) -> None:
    """Re-select row r of every layer down to its method's `target` entries (the window and the top of the
    rest by `window_scores`), written in position order into slots [0, target); the rest are freed."""
    method = pool._methods[r]
    target, valid, qpos = method.target, pool.rows.valid[r], pool._qpos[r]
    for layer in pool.layers:
        pos = layer.pos[r]  # (H, S)
        scores = window_scores(
            layer.queries[r], layer.keys[r], pos, valid, qpos, layer.scaling, method.pool_kernel
        )
        keep = select.top_indices(scores, target, pool.agree)  # (H, target) slots
        keep = keep.gather(-1, pos.gather(-1, keep).argsort(dim=-1))  # in position order
        for buf in (layer.keys, layer.values):
            buf[r, :, :target] = buf[r].gather(1, keep[..., None].expand(-1, -1, buf.shape[-1]))
        layer.pos[r, :, :target] = pos.gather(-1, keep)
        layer.pos[r, :, target:] = -1
    valid[target:] = False
    pool._next_slot[r] = target
