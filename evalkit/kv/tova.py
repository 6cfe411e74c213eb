"""TOVA while decoding (Oren et al., 2024, arXiv 2401.06104; schwartz-lab-NLP/TOVA `TOVACache.reduce`): at
every step the token that the current query attends to least, averaged over all the layer's query heads, is
evicted, so every KV head of a layer keeps the same positions.

The reference attends over its `cache_size` kept entries plus the new one, then drops the lowest of them (the
new one included) back to `cache_size`; the prompt is reduced the same way by its last query. In the slot pool
a row holds `budget` slots: the prefill keeps the top `budget - 1` of the prompt by its last query's attention
(the last token competes, as in the reference; kvpress's prefill TOVAPress protects it), the first decode step
appends into the free slot, and each step's query chooses, after attention, the slot the next step overwrites.
That is the reference with `cache_size = budget - 1`, attending over `budget` entries (h2o's convention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from evalkit.kv import scorers
from evalkit.kv.evict import Evictor, SlotEvictor, kept
from evalkit.kv.methods import KVMethod, _check_budget
from evalkit.kv.static import pin


class TOVAEvictor(SlotEvictor):
    """A full row overwrites, in every KV head, the slot the previous step's query attended to least (mean
    over all query heads). victim[i]: (B,) per layer i."""

    observes = True

    def allocate(self, pool, like, batch, capacity) -> None:
        super().allocate(pool, like, batch, capacity)
        dev = pool.rows.valid.device
        self.victim = [torch.zeros(batch, dtype=torch.long, device=dev) for _ in pool.layers]
        pin(*self.victim)

    def write_index(self, cache, layer) -> tuple:
        """A full row's victim slot (every KV head alike), else its next free one."""
        row, head = cache.state.row[:, None], self.head[None, :]
        slot = torch.where(self.full, self.victim[layer.layer_idx], cache.state.slot)  # (B,)
        return row, head, slot[:, None].expand(-1, self.head.shape[0])

    def observe(self, pool, layer, query, key, mask, scaling) -> None:
        """query (B, H_q, 1, D) post-RoPE; key (B, H, S, D); mask (B, 1, 1, S) bool: the valid slot of least
        attention, averaged over every query head (TOVA's `attn_weights[:, :, -1, :].mean(1)`)."""
        if not self.scoring:
            return
        b, h_q, _, d = query.shape
        h = key.shape[1]
        q = query.float().reshape(b, h, h_q // h, d)  # (B, H, g, D)
        logits = torch.matmul(q, key.float().transpose(-1, -2)) * scaling  # (B, H, g, S)
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        # every KV head's query-head mean, then the layer's: under TP a rank gathers the others' heads
        score = pool.agree.all_heads(probs.mean(dim=2)).mean(dim=1)  # (B, S)
        score = score.masked_fill(~mask[:, 0, 0], float("inf"))
        self.victim[layer.layer_idx].copy_(kept(pool, -score, 1)[:, 0])


@dataclass
class TOVADecode(KVMethod):
    """TOVA as it evicts, every decode step, in `budget` slots per layer and KV head (`TOVAEvictor`)."""

    budget: int = 256
    name: ClassVar[str] = "tova_decode"
    ring: ClassVar[bool] = True
    evictor: ClassVar[type[Evictor]] = TOVAEvictor
    window: ClassVar[int] = 1  # the prefill scores with the prompt's last query

    def __post_init__(self):
        _check_budget(self.name, self.budget)
        if self.budget < 2:
            raise ValueError(
                f"{self.name}: budget must be >= 2 (the kept entries plus the new one), got {self.budget}"
            )

    @property
    def target(self) -> int:
        """Prompt entries the prefill keeps (the reference's `cache_size`): one slot is the new token's."""
        return self.budget - 1

    def blocks(self) -> tuple[int, int, int]:
        return 0, 0, self.target

    def score(self, view):
        return scorers.LastQueryScore()(view)
