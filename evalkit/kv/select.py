"""SnapKV scoring as published (Li et al., 2024, arXiv 2404.14469).

The reference is SnapKV's own code (FasterDecoding/SnapKV, `snapkv/monkeypatch/snapkv_utils.py`,
`SnapKVCluster.update_kv`) and kvpress's `SnapKVPress` (`kvpress/presses/snapkv_press.py`), which agree on:
the observation window's queries (the last w prompt positions) attend, softmax in float32, to **all** prompt
keys, causally inside the window; the window's own columns are dropped; the rest is summed over the window's
queries and average-pooled along the sequence (kernel k, stride 1, zero padding k // 2, divided by k). Where
they differ, evalkit follows kvpress on GQA (the query heads sharing a KV head are averaged, so each KV head
keeps one index set and memory really shrinks; SnapKV repeats the KV heads and keeps one set per query head)
and SnapKV on the sum over the window (kvpress's mean is the same ranking). Only after pooling is the choice
restricted to the layout's `candidates`: a token next to a sink is ranked with its neighbours' real attention,
as upstream.

evalkit's own choices: the model's attention scaling (upstream: 1 / sqrt(head_dim), the same for Llama and
Qwen), float32 from the softmax to the scores (upstream rounds the probabilities to the model dtype first),
and left-pad columns masked so a padded batch row ranks exactly as that prompt alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Scores for one head chunk are (B, H, g, w, T) floats; chunk the heads so 128k-token prompts stay bounded.
_MAX_SCORE_ELEMENTS = 1 << 27


def window_mask(pad: torch.Tensor, t: int, w: int) -> torch.Tensor:
    """(B, w, T) bool: key columns each observation-window query may see.

    The window is the last w columns of a left-padded prompt of width T; a query sees the real (non-pad)
    columns up to its own (causal inside the window, as SnapKV's and kvpress's triangular masks). A window
    query that is itself a pad (a prompt shorter than the window) sees nothing.
    """
    cols = torch.arange(t, device=pad.device)
    query_cols = torch.arange(t - w, t, device=pad.device)  # (w,) column of each window query
    real = cols[None, :] >= pad[:, None]  # (B, T)
    return real[:, None, :] & (cols[None, None, :] <= query_cols[None, :, None])


def snapkv_scores(
    query: torch.Tensor,
    keys: torch.Tensor,
    candidates: torch.Tensor,
    pad: torch.Tensor,
    scaling: float,
    pool_kernel: int,
) -> torch.Tensor:
    """Importance of every key position, (B, H_attn, T) float32, -inf outside `candidates`.

    query: (B, H_q, w, D) post-RoPE observation window (the last w prompt columns); keys: (B, H_attn, T, D) as
    attention sees them; candidates: (B, T) bool, the positions eligible for the top-K block (pads and the
    window excluded); pad: (B,) left pad columns per row.
    """
    b, h_q, w, d = query.shape
    h_attn, t = keys.shape[1], keys.shape[2]
    g = h_q // h_attn  # query heads per attention KV head
    out = torch.full((b, h_attn, t), float("-inf"), dtype=torch.float32, device=query.device)
    n = t - w  # columns before the window: the ones SnapKV scores (the window itself is kept anyway)
    if n <= 0:
        return out
    q = query.float().view(b, h_attn, g, w, d)
    seen = window_mask(pad, t, w).view(b, 1, 1, w, t)
    bias = torch.zeros(seen.shape, dtype=torch.float32, device=query.device).masked_fill_(
        ~seen, float("-inf")
    )
    pad_query = ~seen.any(dim=-1, keepdim=True)  # (B, 1, 1, w, 1): its softmax row is all -inf (NaN)
    step = max(1, _MAX_SCORE_ELEMENTS // max(1, b * g * w * t))
    for h0 in range(0, h_attn, step):  # prefill only: bounded memory, not a per-step loop
        k = keys[:, h0 : h0 + step].float().unsqueeze(2)  # (B, h, 1, T, D)
        logits = torch.matmul(q[:, h0 : h0 + step], k.transpose(-1, -2)) * scaling + bias  # (B, h, g, w, T)
        probs = torch.softmax(logits, dim=-1).masked_fill_(pad_query, 0.0)
        summed = probs[..., :n].sum(dim=3)  # (B, h, g, n): the window's columns dropped
        # count_include_pad (the default, as upstream): edge positions are divided by the full kernel
        pooled = F.avg_pool1d(summed.flatten(0, 2).unsqueeze(1), pool_kernel, 1, pool_kernel // 2)
        out[:, h0 : h0 + step, :n] = pooled.view(b, -1, g, n).mean(dim=2)
    return out.masked_fill_(~candidates.unsqueeze(1), float("-inf"))


def group_mean(scores: torch.Tensor, num_cache_heads: int) -> torch.Tensor:
    """(B, H_attn, T) -> (B, H_cache, T): attention heads reading one cached head share its index set.

    H_attn == H_cache for GQA models; for MLA (DeepSeek-V3 caches one latent per token) all heads map to it.
    """
    b, h_attn, t = scores.shape
    return scores.view(b, num_cache_heads, h_attn // num_cache_heads, t).mean(dim=2)


class Own:
    """The default `agree`: this process's choice as it is, over every KV head of a layer (one process).

    A cache's kept sets relate to the other TP ranks' through it (`agree_for` makes the
    others): called on kept indices it returns the ones every rank keeps; `all_heads` / `my_heads` / `heads`
    turn this process's KV heads into the layer's and back, for a choice that compares or averages across
    heads (AdaKV's one top-k per layer, TOVA's mean over heads)."""

    def __call__(self, indices: torch.Tensor) -> torch.Tensor:
        return indices

    def all_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H_here, ...) -> (B, H, ...): every KV head of the layer, in the one-process order."""
        return x

    def my_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, ...) -> (B, H_here, ...): this process's share of a layer-wide tensor."""
        return x

    def heads(self, here: int) -> int:
        """The layer's KV heads when this process holds `here` of them."""
        return here


own = Own()  # stateless: one instance serves every one-process cache
Agree = Own  # kept indices -> the indices every TP rank keeps; this process's heads -> the layer's


class Broadcast(Own):
    """Replicated attention under TP (MLA): every rank holds every head; a kept set is the TP root's
    (`team`: an `evalkit.team.Team`)."""

    def __init__(self, team):
        self.team = team

    def __call__(self, indices: torch.Tensor) -> torch.Tensor:
        # the root's row of an all-gather, not a broadcast: torch.compile traces an all-gather (a functional
        # collective, one graph), so a compiled decode step's eviction agrees too; kept indices are small
        return self.team.gather_heads(indices.unsqueeze(1))[:, 0]  # (B, ...): TP rank 0 is the root


class Sharded(Own):
    """Per-rank KV heads under TP (q/k/v colwise): each rank keeps its own heads' sets; a choice across a
    layer's heads reads every rank's, gathered in rank order (the one-process head order, as transformers
    shards them), and takes back its own contiguous share (`team`: an `evalkit.team.Team`)."""

    def __init__(self, team):
        self.team = team

    def all_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self.team.gather_heads(x)  # a collective: at prefill, and each tova_decode step

    def my_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.chunk(self.team.tp, dim=1)[self.team.ranks.tp_rank]

    def heads(self, here: int) -> int:
        return here * self.team.tp


def agree_for(team, model) -> Own:
    """The `agree` a KV cache of `model` gets on `team` (an `evalkit.team.Team`): one process, its own;
    under TP with replicated attention (MLA: one kept set per layer on every rank) the TP root's choice;
    with per-rank KV heads each rank's own, the layer's heads gathered where a choice spans them."""
    if team.tp == 1:
        return own
    return Broadcast(team) if team.replicated(model) else Sharded(team)


def place_topk(
    pos: torch.Tensor, scores: torch.Tensor, rows, blocks: tuple[int, int, int], agree: Agree = own
) -> None:
    """Each KV head's top-K prompt positions, in order, into the top-K block of pos (B, H, n), in place.

    scores (B, H, T) per KV head, -inf outside a row's candidates; a row's slots past its valid top-K stay -1
    (empty), and rows kept whole (no top-K) keep their tail in those slots. `agree` makes the kept positions
    one choice across processes that must keep alike (the cache's: TP ranks of replicated attention, MLA)."""
    b, h, t = scores.shape
    sink, tail_long, topk = blocks
    best = scores.topk(min(topk, t), dim=-1)  # -inf past a row's valid_topk
    picked = torch.full((b, h, topk), t, dtype=best.indices.dtype, device=pos.device)  # (B, H, K)
    picked[..., : best.indices.shape[-1]] = torch.where(
        best.values > float("-inf"), best.indices - rows.pad[:, None, None], t
    )
    picked = agree(picked.sort(dim=-1).values)  # kept positions in order, then the padding (t)
    block = slice(sink + tail_long, sink + tail_long + topk)
    picked = torch.where(picked < t, picked, -1)
    selecting = (rows.topk > 0)[:, None, None]  # rows kept whole use these slots for their tail
    pos[:, :, block] = torch.where(selecting, picked, pos[:, :, block])


def top_indices(scores: torch.Tensor, k: int, agree: Agree = own) -> torch.Tensor:
    """(..., k) indices of the k highest scores along the last axis: the one place where the decode-time
    methods turn scores into kept (or, negated, evicted) entries, agreed (`agree`) like `place_topk`."""
    return agree(scores.topk(k, dim=-1).indices)


def accumulated_attention(query, keys, pad: torch.Tensor, scaling: float) -> torch.Tensor:
    """H2O's prefill score: the causal attention each key column receives, summed over every prompt query,
    (B, H_attn, T) float32 (the query heads sharing a KV head averaged, as in `snapkv_scores`).

    query (B, H_q, T, D) post-RoPE; keys (B, H_attn, T, D); pad (B,) left pad columns (masked as keys; a pad
    query adds nothing). Computed in query chunks: memory stays bounded at long prompts."""
    b, h_q, t, d = query.shape
    h_attn = keys.shape[1]
    g = h_q // h_attn
    out = torch.zeros(b, h_attn, g, t, dtype=torch.float32, device=query.device)
    cols = torch.arange(t, device=query.device)
    real = cols[None, :] >= pad[:, None]  # (B, T)
    k = keys.float().unsqueeze(2)  # (B, H, 1, T, D)
    q = query.float().view(b, h_attn, g, t, d)
    step = max(1, _MAX_SCORE_ELEMENTS // max(1, b * h_q * t))
    for r0 in range(0, t, step):  # prefill only: bounded memory, not a per-step loop
        rows = cols[r0 : r0 + step]  # (c,) query columns of this chunk
        e = r0 + rows.numel()  # causal: this chunk's queries see keys [0, e) only, the rest is never computed
        seen = real[:, None, :e] & (cols[None, None, :e] <= rows[None, :, None])  # (B, c, e)
        logits = torch.matmul(q[:, :, :, r0:e], k[..., :e, :].transpose(-1, -2)) * scaling  # (B, H, g, c, e)
        logits = logits.masked_fill_(~seen[:, None, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a pad query's row is all -inf: adds 0
        out[..., :e] += probs.sum(dim=3)
    return out.mean(dim=2)


def place_counts(
    pos: torch.Tensor, scores: torch.Tensor, rows, start: int, counts: torch.Tensor, agree: Agree = own
) -> None:
    """Each KV head's top-`counts` prompt positions, in order, into pos[:, :, start:] (B, H, n), in place;
    the slots past a head's count stay -1 (empty, masked for that head). scores (B, H, T) per KV head, -inf
    outside a row's candidates; counts (B, H) at most the block's width and each row's candidates (the
    adaptive budgets' `place_topk`), agreed (`agree`) like `place_topk`."""
    b, h, t = scores.shape
    width = pos.shape[-1] - start
    best = scores.topk(min(width, t), dim=-1)  # (B, H, w) best first
    rank = torch.arange(best.indices.shape[-1], device=pos.device)
    take = (rank < counts[..., None]) & (best.values > float("-inf"))
    picked = torch.full((b, h, width), t, dtype=best.indices.dtype, device=pos.device)
    picked[..., : rank.shape[0]] = torch.where(take, best.indices - rows.pad[:, None, None], t)
    picked = agree(picked.sort(dim=-1).values)  # kept positions in order, then the empty slots (t)
    picked = torch.where(picked < t, picked, -1)
    selecting = (rows.topk > 0)[:, None, None]  # rows kept whole use these slots for their tail
    pos[:, :, start:] = torch.where(selecting, picked, pos[:, :, start:])
