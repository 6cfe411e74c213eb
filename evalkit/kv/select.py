"""SnapKV scoring (Li et al., 2024, arXiv 2404.14469) as the spec defines it.

scores = softmax over the candidate (middle) keys of Q_obs K^T * scaling, summed over the observation window,
1-D average pooling along the sequence (stride 1, zero padding kernel // 2, divided by the kernel), then the mean
over the query heads that share a KV head (GQA), so each KV head keeps one index set and memory really shrinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Scores for one head chunk are (B, H, g, w, T) floats; chunk the heads so 128k-token prompts stay bounded.
_MAX_SCORE_ELEMENTS = 1 << 27


def snapkv_scores(
    query: torch.Tensor, keys: torch.Tensor, candidates: torch.Tensor, scaling: float, pool_kernel: int
) -> torch.Tensor:
    """Importance of every key position, (B, H_attn, T) float32, -inf outside `candidates`.

    query: (B, H_q, w, D) post-RoPE observation window; keys: (B, H_attn, T, D) as attention sees them;
    candidates: (B, T) bool, the middle positions eligible for the top-K block (pads excluded).
    """
    b, h_q, w, d = query.shape
    h_attn, t = keys.shape[1], keys.shape[2]
    g = h_q // h_attn  # query heads per attention KV head
    q = query.float().view(b, h_attn, g, w, d)
    step = max(1, _MAX_SCORE_ELEMENTS // max(1, b * g * w * t))
    out = torch.empty(b, h_attn, t, dtype=torch.float32, device=query.device)
    bias = torch.zeros(b, 1, 1, 1, t, dtype=torch.float32, device=query.device)
    bias.masked_fill_(~candidates.view(b, 1, 1, 1, t), float("-inf"))
    for h0 in range(0, h_attn, step):  # prefill only: bounded memory, not a per-step loop
        k = keys[:, h0 : h0 + step].float().unsqueeze(2)  # (B, h, 1, T, D)
        logits = torch.matmul(q[:, h0 : h0 + step], k.transpose(-1, -2)) * scaling + bias  # (B, h, g, w, T)
        probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # rows with no candidate are all -inf
        summed = probs.sum(dim=3)  # (B, h, g, T)
        pooled = F.avg_pool1d(summed.flatten(0, 2).unsqueeze(1), pool_kernel, 1, pool_kernel // 2)
        out[:, h0 : h0 + step] = pooled.view(b, -1, g, t).mean(dim=2)
    return out.masked_fill_(~candidates.unsqueeze(1), float("-inf"))


def group_mean(scores: torch.Tensor, num_cache_heads: int) -> torch.Tensor:
    """(B, H_attn, T) -> (B, H_cache, T): attention heads reading one cached head share its index set.

    H_attn == H_cache for GQA models; for MLA (DeepSeek-V3 caches one latent per token) all heads map to it.
    """
    b, h_attn, t = scores.shape
    return scores.view(b, num_cache_heads, h_attn // num_cache_heads, t).mean(dim=2)
