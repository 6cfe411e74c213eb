"""Prefill scorers: how a method ranks the prompt's entries for its top-K block, one small object each.

A scorer reads one layer's prompt through a `PrefillView` (the queries, the keys as attention sees them, the
values, the model's rotary embedding, and what a pass before the prefill computed) and returns the importance
of every prompt position per attention KV head, (B, H_attn, T) float32; the layout (`methods.py`: sinks, a
kept tail, the top-K block at the original positions) is the method's, so one scorer can serve several
layouts (`snapstream` with another scorer, issue 33 item 2). References (kvpress 0.5.5, `kvpress/presses/`):

| scorer                  | kvpress press            | paper                                        |
|-------------------------|--------------------------|----------------------------------------------|
| `KeyNormScore`          | `KnormPress`             | Devoto et al., 2024, arXiv 2406.11430        |
| `KeyDiffScore`          | `KeyDiffPress`           | Park et al., 2025, arXiv 2504.15364          |
| `LastQueryScore`        | `TOVAPress`              | Oren et al., 2024, arXiv 2401.06104          |
| `ExpectedAttentionScore`| `ExpectedAttentionPress` | Devoto et al., 2025, arXiv 2510.00636        |
| `ReconstructionScore`   | `KVzipPress`             | Kim et al., 2025, arXiv 2505.23416           |

Each follows its press's arithmetic; evalkit's own choices, as for SnapKV (`select.py`): float32 throughout,
the model's attention scaling (kvpress: 1 / sqrt(head_dim), the same for Llama and Qwen), left-pad columns
masked so a padded row ranks as its prompt alone. Deviations and their measured effect: docs/deviations.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from evalkit.kv import select


@dataclass
class PrefillView:
    """What a scorer may read of one layer's prompt (a left-padded batch of B rows, T columns)."""

    query: (
        torch.Tensor
    )  # (B, H_q, T_q, D) post-RoPE, the prompt's last T_q columns (T_q: the method's window)
    keys: torch.Tensor  # (B, H_attn, T, D) as attention sees them (post-RoPE; MLA: rebuilt per head)
    values: torch.Tensor  # (B, H_cache, T, D_v) as cached
    candidates: torch.Tensor  # (B, T) bool: the columns the top-K block may hold
    pad: torch.Tensor  # (B,) left pad columns per row
    scaling: float  # the model's attention scaling
    layer: int = 0
    # positions (B, n) -> (cos, sin) (B, n, D): the model's rotary embedding (None: the model has none here)
    rope: Callable | None = None
    hint: torch.Tensor | None = None  # (B, H_cache, T) scores a pass before this prefill computed (KVzip)
    agree: select.Agree = select.own  # this process's heads -> the layer's (a TP rank holds its share)

    def real(self) -> torch.Tensor:
        """(B, T) bool: the columns that hold prompt tokens (not left pads)."""
        t = self.keys.shape[2]
        return torch.arange(t, device=self.pad.device)[None, :] >= self.pad[:, None]


def rope_of(model) -> Callable | None:
    """The model's rotary embedding as positions (B, n) -> (cos, sin) (B, n, D) float32, or None."""
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        return None
    probe = torch.zeros(1, dtype=torch.float32, device=model.device)  # rotary reads only its dtype/device
    return lambda positions: rotary(probe, positions)


@dataclass(frozen=True)
class Scorer:
    """Base: `__call__(view)` ranks the prompt; `prefill` and `refusal` are the hooks a scorer that needs more
    than the prompt's forward (KVzip's pass) overrides, so any layout holding it runs it unchanged."""

    name: ClassVar[str]
    queries: ClassVar[int] = 0  # prompt queries (its last ones) a shared prefill must keep for this scorer
    # True: budget-free and reading every prompt query (expected attention's statistics): a shared prefill
    # keeps the score per entry (`PrefillRecord.hints`), not the queries (`KVMethod.records_score`)
    records_score: ClassVar[bool] = False

    def __call__(self, view: PrefillView) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, forward, cache, tokenizer, kwargs: dict):
        """The prompt's forward into `cache` (`KVMethod.prefill`)."""
        return forward(**kwargs)

    def refusal(self, facts, method: str) -> str | None:
        """Why a method `method` scoring with this cannot run as `facts` (`methods.RunFacts`) say, or None."""
        return None

    def describe(self) -> dict:
        return {"name": self.name, **asdict(self)}


@dataclass(frozen=True)
class SnapKVScore(Scorer):
    """SnapKV (Li et al., 2024, arXiv 2404.14469): the last `window` queries' attention, pooled over
    `pool_kernel` positions (`select.snapkv_scores`); what `snapstream` scores with, as a scorer."""

    window: int = 32
    pool_kernel: int = 7
    name: ClassVar[str] = "snapkv"

    @property
    def queries(self) -> int:
        return self.window

    def __call__(self, view: PrefillView) -> torch.Tensor:
        return select.snapkv_scores(
            view.query[:, :, -self.window :],
            view.keys,
            view.candidates,
            view.pad,
            view.scaling,
            self.pool_kernel,
        )


def _masked(scores: torch.Tensor, view: PrefillView) -> torch.Tensor:
    return scores.masked_fill(~view.real()[:, None, :], float("-inf"))


@dataclass(frozen=True)
class KeyNormScore(Scorer):
    """KnormPress: a low key norm predicts high attention, so the score is minus the L2 norm of the key."""

    name: ClassVar[str] = "knorm"

    def __call__(self, view: PrefillView) -> torch.Tensor:
        return _masked(-torch.linalg.vector_norm(view.keys.float(), dim=-1), view)


@dataclass(frozen=True)
class KeyDiffScore(Scorer):
    """KeyDiffPress: minus each key's cosine similarity to the mean of the prompt's unit keys (distinctive
    keys are kept); the mean runs over a row's real columns only."""

    name: ClassVar[str] = "keydiff"

    def __call__(self, view: PrefillView) -> torch.Tensor:
        k = view.keys.float()  # (B, H, T, D)
        real = view.real()[:, None, :, None]  # (B, 1, T, 1)
        unit = F.normalize(k, p=2, dim=-1) * real
        anchor = unit.sum(dim=2, keepdim=True) / real.sum(dim=2, keepdim=True)  # (B, H, 1, D)
        return _masked(-F.cosine_similarity(k, anchor, dim=-1), view)


@dataclass(frozen=True)
class LastQueryScore(Scorer):
    """TOVAPress at prefill: the last prompt query's attention (softmax over every prompt key, itself
    included), averaged over all query heads as TOVA does, so every KV head of a layer ranks alike."""

    name: ClassVar[str] = "tova"
    queries: ClassVar[int] = 1

    def __call__(self, view: PrefillView) -> torch.Tensor:
        k = view.keys.float()  # (B, H_attn, T, D)
        b, h_attn = k.shape[:2]
        q = view.query[:, :, -1].float().view(b, h_attn, -1, k.shape[-1])  # (B, H_attn, g, D) the last query
        logits = torch.matmul(q, k.transpose(-1, -2)) * view.scaling  # (B, H_attn, g, T), keys never repeated
        probs = torch.softmax(logits.masked_fill(~view.real()[:, None, None, :], float("-inf")), dim=-1)
        # every KV head's query-head mean, then the layer's: under TP a rank holds its share of the heads
        mean = view.agree.all_heads(probs.mean(dim=2)).mean(dim=1)  # (B, T)
        return _masked(mean[:, None].expand(-1, h_attn, -1), view)


@dataclass(frozen=True)
class ExpectedAttentionScore(Scorer):
    """ExpectedAttentionPress: the attention future queries are expected to pay each key, times its value's
    norm. The queries' mean and covariance (before RoPE, over the prompt after the first `sink` tokens) are
    rotated by RoPE averaged over the next `future` positions; with A = exp(q.k s), E[A] ~ exp(mu.k s +
    k^T cov k s^2 / 2) (a Gaussian query), softmaxed over the non-sink keys per query head, averaged over the
    heads sharing a KV head, then (score + epsilon) * ||v||."""

    name: ClassVar[str] = "expected_attention"
    sink: int = 4
    future: int = 512
    covariance: bool = True
    value_norm: bool = True
    epsilon: float = 0.0
    # every prompt query: a shared prefill keeps this score per entry (B, H, T) float32 instead of the
    # prompt's queries (B, H_q, T, D), and a replayed prefill reads it back as `view.hint`
    records_score: ClassVar[bool] = True

    def refusal(self, facts, method: str) -> str | None:
        if facts.mla:
            return (
                f"method {method} undoes RoPE on the full query head, but {facts.model_name} rotates only "
                "part of an MLA head: use snapkv, snapstream or h2o"
            )
        return None

    def __call__(self, view: PrefillView) -> torch.Tensor:
        if view.hint is not None:  # a replayed prefill: the recording prefill's score
            return view.hint
        if view.rope is None:
            raise ValueError("expected_attention needs the model's rotary embedding (RoPE positions)")
        b, h_q, t, d = view.query.shape
        if t != view.keys.shape[2]:
            raise ValueError(f"expected_attention reads every prompt query, got {t} of {view.keys.shape[2]}")
        mu, cov = self.statistics(view)  # (B, H_q, D), (B, H_q, D, D) at the future positions
        k = view.keys.float()  # (B, H_attn, T, D): the query heads of a group read their KV head's keys
        h_attn = k.shape[1]
        g = h_q // h_attn
        mu, cov = mu.view(b, h_attn, g, d), cov.view(b, h_attn, g, d, d)
        logits = torch.einsum("bhtd,bhgd->bhgt", k, mu) * view.scaling
        if self.covariance:
            logits += torch.einsum("bhtd,bhgde,bhte->bhgt", k, cov, k) * (view.scaling**2 / 2)
        cols = torch.arange(t, device=k.device)[None, :]
        scored = view.real() & (cols >= view.pad[:, None] + self.sink)  # (B, T) the non-sink keys
        probs = torch.softmax(logits.masked_fill(~scored[:, None, None], float("-inf")), dim=-1)
        scores = probs.mean(dim=2)  # (B, H_attn, T)
        if self.value_norm:
            scores = (scores + self.epsilon) * view.values.float().norm(dim=-1)
        return scores.masked_fill(~scored[:, None], float("-inf"))

    def statistics(self, view: PrefillView) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-RoPE queries' mean and covariance (biased, as kvpress), rotated by the mean RoPE of the
        `future` positions after each row's prompt."""
        q = view.query.float()  # (B, H_q, T, D) post-RoPE
        b, _, t, d = q.shape
        positions = (torch.arange(t, device=q.device)[None, :] - view.pad[:, None]).clamp(min=0)  # (B, T)
        cos, sin = (x.float().to(q.device)[:, None] for x in view.rope(positions))  # (B, 1, T, D)
        # undo RoPE: q = (q' cos - rotate_half(q') sin) / (cos^2 + sin^2) (the rope may carry a scale)
        pre = (q * cos - _rotate_half(q) * sin) / (cos**2 + sin**2)
        used = view.real() & (torch.arange(t, device=q.device)[None, :] >= view.pad[:, None] + self.sink)
        w = used[:, None, :, None].float()  # (B, 1, T, 1)
        n = w.sum(dim=2, keepdim=True).clamp(min=1)
        mu = (pre * w).sum(dim=2, keepdim=True) / n  # (B, H_q, 1, D)
        centred = (pre - mu) * w
        cov = torch.einsum("bhti,bhtj->bhij", centred, centred) / n  # (B, H_q, D, D)
        length = t - view.pad  # (B,) each row's prompt length: its future starts there
        ahead = length[:, None] + torch.arange(self.future, device=q.device)[None, :]  # (B, n)
        cos_f, sin_f = (x.float().to(q.device).mean(dim=1) for x in view.rope(ahead))  # (B, D): future mean
        rot = torch.diag_embed(cos_f) + sin_f[:, :, None] * _half_swap(d, q.device)  # (B, D, D): mean R
        mu = torch.einsum("bij,bhj->bhi", rot, mu[:, :, 0])
        cov = rot[:, None] @ cov @ rot[:, None].transpose(-1, -2)
        return mu, cov


@dataclass(frozen=True)
class ReconstructionScore(Scorer):
    """KVzipPress: the attention each prompt entry receives while the model repeats the prompt, computed by
    the reconstruction pass before this prefill compresses (`evalkit.kv.reconstruct`) and handed in as
    `view.hint`. `sink` and `chunk` are the pass's (`KVzip`)."""

    sink: int = 4
    chunk: int = 2048
    name: ClassVar[str] = "kvzip"
    queries: ClassVar[int] = 1

    def prefill(self, forward, cache, tokenizer, kwargs: dict):
        from evalkit.kv.reconstruct import prefill_with_reconstruction

        return prefill_with_reconstruction(self, forward, cache, tokenizer, kwargs)

    def refusal(self, facts, method: str) -> str | None:
        if facts.mla:
            return (
                f"method {method} scores the prompt's keys in a second pass, but {facts.model_name} "
                "caches MLA's latent (keys are rebuilt inside attention): use snapkv, snapstream or h2o"
            )
        return None  # under TP every rank runs the pass's forwards in step and scores its own heads

    def __call__(self, view: PrefillView) -> torch.Tensor:
        if view.hint is None:
            raise ValueError(
                "kvzip scores the prompt by a reconstruction pass that the engine's prefill runs first: "
                "decode through evalkit.kv.generate(..., tokenizer=...) or the runner, not model.generate "
                "with a KVCache"
            )
        return view.hint.float().masked_fill(~view.real()[:, None, :], float("-inf"))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _half_swap(d: int, device) -> torch.Tensor:
    """(D, D) P with P x = rotate_half(x): RoPE at angle a is cos(a) I + sin(a) P, per dimension."""
    p = torch.zeros(d, d, device=device)
    half = d // 2
    p[:half, half:] = -torch.eye(half, device=device)
    p[half:, :half] = torch.eye(half, device=device)
    return p
