"""Paired statistics of per-problem score differences d_i = compressed_i - full_i (points, 0-100 scale).

A problem's value is its score over all k repeats (pass@1 is the mean over the k), so resampling problems
keeps the k repeats of one problem together. Both resampling schemes draw over the distinct values of d
with their counts, which is the same distribution as drawing problems but costs (resamples x distinct
values) instead of (resamples x problems): benchmark scores take few distinct values.

- CI: percentile paired bootstrap of mean(d);
- p-value: exact McNemar (k = 1 and every score 0 or 100), else a two-sided sign-flip permutation test
  (exact up to `exact_max` non-zero differences, Monte Carlo with the (1 + hits) / (1 + B) rule above);
- verdict against a non-inferiority margin delta; sample size: the normal-approximation formula for a
  one-sample (paired) non-inferiority test, Chow, Shao & Wang, Sample Size Calculations in Clinical
  Research (2008), section 3.1: n = (z_{1-a} + z_{1-b})^2 s^2 / (mean + delta)^2, a = (1 - confidence) / 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

SCORE_RANGE = 100.0  # scores are percent: one problem's difference lies in [-100, 100]
CHUNK = 1 << 22  # elements per resampling block: bounds memory for many distinct values


@dataclass(frozen=True)
class StatSettings:
    margin: float = 2.0  # delta, absolute points
    confidence: float = 0.95
    resamples: int = 10_000
    exact_max: int = 16  # sign-flip enumeration up to 2**16 sign vectors
    power: float = 0.8
    min_problems: int = 20  # fewer paired problems: no verdict (percentile bootstrap CIs are too narrow)


def _distinct(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values, counts = np.unique(d, return_counts=True)
    return values, counts


def _blocks(total: int, width: int):
    rows = max(1, CHUNK // max(width, 1))
    for start in range(0, total, rows):
        yield min(rows, total - start)


def bootstrap_means(d: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Means of `resamples` paired-bootstrap resamples of the problems (n drawn with replacement)."""
    values, counts = _distinct(d)
    n, out = len(d), []
    for rows in _blocks(resamples, len(values)):
        draws = rng.multinomial(n, counts / n, size=rows)  # (rows, distinct): problems drawn per value
        out.append(draws @ values / n)
    return np.concatenate(out)


def bootstrap_ci(d: np.ndarray, confidence: float, resamples: int, rng: np.random.Generator):
    """Percentile CI of mean(d); None when every difference is equal (the bootstrap collapses to a point)."""
    if len(np.unique(d)) < 2:
        return None
    alpha = 1 - confidence
    lo, hi = np.quantile(bootstrap_means(d, resamples, rng), [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def no_variation_ci(value: float, n: int, confidence: float) -> tuple[float, float]:
    """CI when all n differences equal `value`: the exact (Clopper-Pearson) upper bound on the share of
    problems that could differ from it, none seen in n, times the most one problem can differ. A bootstrap
    would answer [value, value] and call 20 identical problems proof of equality."""
    share = 1 - ((1 - confidence) / 2) ** (1 / n)
    half = share * (SCORE_RANGE + abs(value))
    return max(value - half, -SCORE_RANGE), min(value + half, SCORE_RANGE)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar: b, c the discordant pairs, tested against Binomial(b + c, 1/2)."""
    if b + c == 0:
        return 1.0
    return float(min(1.0, 2 * stats.binom.cdf(min(b, c), b + c, 0.5)))


def sign_flip_pvalue(d: np.ndarray, resamples: int, exact_max: int, rng: np.random.Generator) -> float:
    """Two-sided paired permutation test of mean(d) = 0: each problem's difference keeps or flips its sign."""
    nz = d[d != 0]
    if len(nz) == 0:
        return 1.0
    observed = abs(nz.sum())
    tol = 1e-9 * max(1.0, observed)  # sums of the same floats in another order
    if len(nz) <= exact_max:
        bits = (np.arange(2 ** len(nz))[:, None] >> np.arange(len(nz))) & 1  # (2^m, m) every sign vector
        sums = (2 * bits - 1) @ nz
        return float(np.mean(np.abs(sums) >= observed - tol))
    values, counts = _distinct(np.abs(nz))
    hits = 0
    for rows in _blocks(resamples, len(values)):
        kept = rng.binomial(counts, 0.5, size=(rows, len(values)))  # (rows, distinct) signs kept positive
        hits += int(np.sum(np.abs((2 * kept - counts) @ values) >= observed - tol))
    return (1 + hits) / (1 + resamples)


def p_value(c: np.ndarray, f: np.ndarray, binary: bool, s: StatSettings, rng) -> tuple[float, str]:
    if binary:
        b, cc = int(np.sum((f == 100) & (c == 0))), int(np.sum((f == 0) & (c == 100)))
        return mcnemar_exact(b, cc), "mcnemar"
    return sign_flip_pvalue(c - f, s.resamples, s.exact_max, rng), "sign-flip"


def needed_problems(mean: float, sd: float, n: int, s: StatSettings) -> int | None:
    """Problems needed to decide, at the observed mean and paired SD: non-inferiority when mean > -delta,
    else "worse" (upper bound below 0). With no variation seen: the n at which `no_variation_ci` decides.
    None when the observed mean sits exactly on the boundary (no n decides it)."""
    alpha = (1 - s.confidence) / 2
    target = mean + s.margin if mean > -s.margin else -mean  # distance to the boundary to clear
    if target <= 0:
        return None
    if sd == 0:  # smallest n with share * (range + |mean|) < target
        share = target / (SCORE_RANGE + abs(mean))
        return n if share >= 1 else math.floor(math.log(alpha) / math.log1p(-share)) + 1
    z = stats.norm.ppf(1 - alpha) + stats.norm.ppf(s.power)
    return math.ceil((z * sd / target) ** 2)


def verdict(lo: float, hi: float, p: float, n: int, s: StatSettings) -> tuple[str, str]:
    """(verdict, why). non-inferior: lower bound > -delta; worse: upper bound < 0; else inconclusive.
    Below `min_problems` the bootstrap CI is too narrow to vouch for anything: no non-inferior verdict, and
    `worse` only when the exact test (McNemar / sign-flip, valid at any n) also rejects."""
    if n < s.min_problems:
        if hi < 0 and p < 1 - s.confidence:
            return "worse", f"{n} paired problems < min_problems={s.min_problems}; the exact test agrees"
        return "inconclusive", f"{n} paired problems < min_problems={s.min_problems}"
    if lo > -s.margin:
        return "non-inferior", "significantly lower, within the margin" if hi < 0 else ""
    if hi < 0:
        return "worse", ""
    return "inconclusive", "the CI spans -delta or 0"


def compare(c: np.ndarray, f: np.ndarray, binary: bool, s: StatSettings, rng: np.random.Generator) -> dict:
    """Everything a report cell shows for paired per-problem scores c (compressed) and f (full)."""
    d = c - f
    n = len(d)
    mean = float(d.mean())
    sd = float(d.std(ddof=1)) if n > 1 else 0.0
    ci = bootstrap_ci(d, s.confidence, s.resamples, rng)
    lo, hi = ci if ci is not None else no_variation_ci(mean, n, s.confidence)
    p, test = p_value(c, f, binary, s, rng)
    v, why = verdict(lo, hi, p, n, s)
    needed = needed_problems(mean, sd, n, s) if v == "inconclusive" else None
    if needed is not None:
        needed = max(needed, s.min_problems)
    return {
        "n_paired": n, "full": float(f.mean()), "compressed": float(c.mean()), "paired_diff": mean,
        "sd_diff": sd, "ci_low": lo, "ci_high": hi, "ci_method": "bootstrap" if ci else "no-variation bound",
        "p_value": p, "test": test, "margin": s.margin, "verdict": v, "why": why, "n_needed": needed,
        "n_more": None if needed is None else max(needed - n, 0),
    }  # fmt: skip
