"""Length and failure, paired: what a compressed cache does to how much the model generates and how it ends.

Eviction at low budgets can make reasoning traces longer, loop, or stop without an answer; a budget that keeps
accuracy but doubles the output gives back half the throughput its smaller cache bought. Per paired problem
(the same sample id in both runs; repeats paired by index, the first min(k_compressed, k_full) of each):

- tokens: the mean generated tokens over the problem's repeats (samples.jsonl `generation[r].output_tokens`);
  the ratio compressed / full per problem, a 0-token side counted as 1 token;
- length ratio: the median of the per-problem ratios, with the distribution-free CI of a median from order
  statistics (the sign-test interval: [x_(l), x_(h)], l and h from Binomial(n, 1/2); the interval of
  scipy.stats.quantile_test(ratios, p=0.5).confidence_interval). It needs no assumption about the ratios'
  distribution and is the same on the ratio or its log; at 95% it is unbounded below n = 6 problems;
- token gain: full tokens / compressed tokens summed over the paired problems (the tokens a deployer must
  generate for the same work): what the effective decode gain multiplies the memory-bound gain by. Problems
  with an empty (0-token) output on either side are left out (nothing generated is no work saved), and none is
  computed where every output hit the limit on both sides (lengths truncated); `length_caveat` says which;
- hit limit: the share of outputs that ended at the token limit (`generation[r].hit_limit`); empty: of
  outputs with no token at all;
- no answer: the share of outputs with nothing the task's scorer could read, by the task's own standard
  `no_answer` score (AIME no box, or cut off while thinking; LiveCodeBench no code block; LongBench-v2 no
  choice; RULER an empty continuation); `-` for runs scored before a task reported it;
- repetition: the share of outputs that end in a loop (`repeating_tail`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as sps

MIN_LOOP_WORDS = 64  # a repeating tail spans at least this many words ...
MIN_LOOP_REPEATS = 3  # ... and at least this many copies of its period
MAX_LOOP_PERIOD = 128  # longest period (in words) looked for


def _tail_run(ids: np.ndarray, p: int) -> int:
    """How many trailing positions i have ids[i] == ids[i - p]: the tail's length with period p, minus p.
    Compares a growing window from the end, so a non-repeating output costs a few comparisons per period."""
    a, b = ids[p:], ids[:-p]  # (n,) each: position i against position i - p
    n, w = len(a), 64
    while True:
        w = min(w, n)
        bad = np.flatnonzero(a[n - w :] != b[n - w :])
        if len(bad):
            return w - 1 - int(bad[-1])
        if w == n:
            return n
        w *= 4


def _periodic_tail(words: list[str]) -> bool:
    if len(words) < MIN_LOOP_WORDS:
        return False
    ids = np.unique(np.array(words), return_inverse=True)[1]  # (m,) one integer per distinct word
    for p in range(1, min(MAX_LOOP_PERIOD, len(words) // MIN_LOOP_REPEATS) + 1):
        if _tail_run(ids, p) + p >= max(MIN_LOOP_REPEATS * p, MIN_LOOP_WORDS):
            return True
    return False


def repeating_tail(text: str) -> bool:
    """True when the output ends in a loop: among its whitespace-separated words, the last L words repeat
    with some period p (word i equals word i - p throughout them) where 1 <= p <= MAX_LOOP_PERIOD,
    L >= MIN_LOOP_WORDS and L >= MIN_LOOP_REPEATS * p: a p-word n-gram repeated back to back at the end.
    The last word is also tried dropped: an output cut at the token limit may end mid-word."""
    # the longest tail that can decide is MIN_LOOP_REPEATS * MAX_LOOP_PERIOD words (+1 for the dropped word):
    # split only that much off a 32k-token output
    tail = MIN_LOOP_REPEATS * MAX_LOOP_PERIOD + 1
    words = text.rsplit(None, tail)[-tail:]
    return _periodic_tail(words) or _periodic_tail(words[:-1])


def no_answer(scores: dict) -> float | None:
    """1.0 / 0.0: this output has no answer the task's scorer could read (its `no_answer` score, the standard
    key every task with the notion reports); None: the task reports none."""
    value = scores.get("no_answer")
    return None if value is None else float(value > 0)


def _outputs(row: dict, k: int) -> list[dict] | None:
    """The first k outputs of a samples.jsonl row: {tokens, hit_limit, limit, no_answer, repeating}; None when
    the row lacks the per-repeat generation records."""
    gens = row.get("generation") or []
    preds = row.get("predictions") or []
    reps = row.get("repeat_scores") or ([row["scores"]] if k == 1 else [])
    if len(gens) < k or any(not isinstance(g, dict) or g.get("output_tokens") is None for g in gens[:k]):
        return None
    return [
        {
            "tokens": int(gens[r]["output_tokens"]),
            "hit_limit": float(bool(gens[r].get("hit_limit"))),
            "empty": float(int(gens[r]["output_tokens"]) == 0),
            "limit": gens[r].get("max_new_tokens"),
            "no_answer": no_answer(reps[r]) if r < len(reps) else None,
            "repeating": float(repeating_tail(preds[r])) if r < len(preds) else None,
        }
        for r in range(k)
    ]


def _repeats(row: dict) -> int:
    return len(row.get("generation") or [None])


def per_problem(comp: dict, full: dict, ids: list[str]) -> dict[str, np.ndarray]:
    """Per paired problem (rows with generation records on both sides): mean tokens and the shares of hit
    limit, no answer and repetition over its repeats, compressed (`c_`) and full (`f_`); NaN where a share is
    not defined (no answer on RULER)."""
    cols: dict[str, list] = {"id": [], "limit": []}
    for sid in ids:
        k = min(_repeats(comp[sid]), _repeats(full[sid]))
        c, f = _outputs(comp[sid], k), _outputs(full[sid], k)
        if c is None or f is None:
            continue
        cols["id"].append(sid)
        cols["limit"].append(max((o["limit"] or 0) for o in c + f) or np.nan)
        for side, outs in (("c", c), ("f", f)):
            for key in ("tokens", "hit_limit", "empty", "no_answer", "repeating"):
                vals = [o[key] for o in outs]
                cols.setdefault(f"{side}_{key}", []).append(
                    np.nan if any(v is None for v in vals) else float(np.mean(vals))
                )
    return {k: np.array(v, dtype=object if k == "id" else float) for k, v in cols.items()}


def median_ci(x: np.ndarray, confidence: float) -> tuple[float, float]:
    """Distribution-free CI of the median: order statistics [x_(l), x_(h)] with l = F^-1(a) - 1 and
    h = S^-1(a) of Binomial(n, 1/2), a = (1 - confidence) / 2 (0-based; scipy.stats.quantile_test's rule).
    A bound beyond the sample (too few problems) is NaN: unbounded."""
    x = np.sort(np.asarray(x, dtype=float))
    n, a = len(x), (1 - confidence) / 2
    lo, hi = int(sps.binom.ppf(a, n, 0.5)) - 1, int(sps.binom.isf(a, n, 0.5))
    return (float(x[lo]) if lo >= 0 else math.nan, float(x[hi]) if hi < n else math.nan)


def _share(v: np.ndarray) -> float | None:
    return None if len(v) == 0 or np.isnan(v).any() else float(100 * v.mean())


def length_stats(per: dict[str, np.ndarray], confidence: float) -> dict:
    """The report's length and failure columns from `per_problem`; {} when no problem has lengths. The token
    gain leaves out problems with an empty (0-token) output on either side (nothing generated is no work
    saved), and is not computed where every output hit the token limit on both sides (lengths truncated:
    their ratio measures the limit); `length_caveat` says which."""
    n = len(per["id"])
    if n == 0:
        return {}
    c, f = per["c_tokens"], per["f_tokens"]
    ratio = np.maximum(c, 1) / np.maximum(f, 1)  # (n,) compressed / full per problem
    lo, hi = median_ci(ratio, confidence)
    limit = float(np.nanmax(per["limit"])) if not np.isnan(per["limit"]).all() else None
    gain, caveat = token_gain(per, limit)
    out = {
        "n_length": n,
        "tokens_full": float(f.mean()),
        "tokens_compressed": float(c.mean()),
        "length_ratio": float(np.median(ratio)),
        "length_ratio_ci_low": lo,
        "length_ratio_ci_high": hi,
        "token_gain": gain,
        "token_limit": limit,
        "length_caveat": caveat,
    }
    for key in ("hit_limit", "empty", "no_answer", "repeating"):
        out[f"{key}_full"], out[f"{key}_compressed"] = _share(per[f"f_{key}"]), _share(per[f"c_{key}"])
    return out


def token_gain(per: dict[str, np.ndarray], limit: float | None) -> tuple[float | None, str | None]:
    """(full / compressed tokens over the problems that measure it, the caveat or None)."""
    n = len(per["id"])
    if (per["c_hit_limit"] == 1).all() and (per["f_hit_limit"] == 1).all():
        at = f"the {limit:g}-token limit" if limit else "the token limit"
        return (
            None,
            f"lengths truncated: every output hit {at} on both sides, so their ratio measures the limit",
        )
    empty = (per["c_empty"] > 0) | (per["f_empty"] > 0)  # (n,) a problem with a 0-token output
    if empty.all():
        return None, "every paired problem has an empty (0-token) output: no length to compare"
    c, f = per["c_tokens"][~empty], per["f_tokens"][~empty]
    gain = float(max(f.sum(), 1) / max(c.sum(), 1))
    if not empty.any():
        return gain, None
    return (
        gain,
        f"{int(empty.sum())} of {n} problems with an empty (0-token) output left out of the token gain",
    )


def limit_mismatch(comp: dict, full: dict, ids: list[str]) -> str | None:
    """Where the two runs' per-generation token limits (`max_new_tokens`) differ on a paired problem: their
    lengths, hit-limit shares and token ratio would compare different caps. None when they agree (or were not
    recorded)."""
    bad = []
    for sid in ids:
        k = min(_repeats(comp[sid]), _repeats(full[sid]))
        for r in range(k):
            a, b = (_limit(rows[sid], r) for rows in (comp, full))
            if None not in (a, b) and a != b:
                bad.append(f"{sid} ({a} vs {b})")
                break
    if not bad:
        return None
    return (
        f"per-generation token limits differ on {len(bad)} of {len(ids)} paired problems (first: {bad[:3]})"
    )


def _limit(row: dict, r: int):
    gens = row.get("generation") or []
    return gens[r].get("max_new_tokens") if r < len(gens) and isinstance(gens[r], dict) else None


def run_shares(rows: dict[str, dict]) -> dict:
    """A run's own failure shares over all its outputs (samples.jsonl rows by id): hit limit, no answer and
    repeating tail in percent; None where not recorded or not defined for the task."""
    outs = [o for row in rows.values() for o in (_outputs(row, _repeats(row)) or [])]
    out = {}
    for key in ("hit_limit", "no_answer", "repeating"):
        vals = [o[key] for o in outs]
        out[key] = None if not vals or None in vals else float(100 * np.mean(vals))
    return out
