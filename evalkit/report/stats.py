"""Paired statistics of per-problem score differences d_i = compressed_i - full_i (points, 0-100 scale).

A problem's value is its score over all k repeats (pass@1 is the mean over the k), so resampling problems
keeps the k repeats of one problem together.

- CI: percentile paired bootstrap of mean(d) over problems;
- p-value: exact McNemar (k = 1 and every score 0 or 100), else a two-sided sign-flip permutation test;
- verdict against a non-inferiority margin delta; sample size: the normal-approximation formula for a
  one-sample (paired) non-inferiority test, Chow, Shao & Wang, Sample Size Calculations in Clinical
  Research (2008), section 3.1: n = (z_{1-a} + z_{1-b})^2 s^2 / (mean + delta)^2, a = (1 - confidence) / 2.

Benchmark scores sit on a lattice (multiples of 100/k for k repeats or references), and so do their
differences. There both resampling distributions are computed exactly, by FFT convolution: the bootstrap
mean is the n-fold convolution of the empirical distribution of d ("B = infinity"), the sign-flip sum the
convolution of one binomial per distinct |d|. That is deterministic and costs milliseconds per cell at any
n, which is what lets hundreds of runs x ~100 breakdown keys report in seconds. Differences off any small
lattice fall back to Monte Carlo (`resamples` draws, seeded), resampling counts per distinct value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from scipy import fft, special

SCORE_RANGE = 100.0  # scores are percent: one problem's difference lies in [-100, 100]
CHUNK = 1 << 22  # elements per Monte Carlo block: bounds memory for many distinct values
MAX_LATTICE = 1 << 22  # points of an exact distribution; wider ones go to Monte Carlo
MAX_DENOMINATOR = 1000  # score steps down to 100/1000 points (k, references up to 1000) count as a lattice


@dataclass(frozen=True)
class StatSettings:
    margin: float = 2.0  # delta, absolute points
    confidence: float = 0.95
    resamples: int = 10_000  # Monte Carlo draws, only for differences off a lattice
    power: float = 0.8
    min_problems: int = 20  # fewer paired problems: no verdict (percentile bootstrap CIs are too narrow)


def lattice(values: np.ndarray) -> tuple[float, np.ndarray] | None:
    """(step, integer multiples) with values = step * multiples, for values like 0, 33.33.., 100; else
    None."""
    fracs = [Fraction(float(v)).limit_denominator(MAX_DENOMINATOR) for v in values]
    if any(abs(float(f) - float(v)) > 1e-9 for f, v in zip(fracs, values)):
        return None
    den = math.lcm(*(f.denominator for f in fracs))
    nums = [int(f * den) for f in fracs]
    step = math.gcd(*nums) or 1
    return step / den, np.array([x // step for x in nums], dtype=np.int64)


def _convolve_power(pmf: np.ndarray, n: int) -> np.ndarray:
    size = n * (len(pmf) - 1) + 1
    nfft = fft.next_fast_len(size, real=True)
    dist = fft.irfft(fft.rfft(pmf, nfft) ** n, nfft)[:size]
    return np.clip(dist, 0, None)


def _quantile_index(dist: np.ndarray, q: float) -> int:
    """Smallest index whose cumulative probability reaches q (the inverse CDF)."""
    cdf = np.cumsum(dist)
    return int(np.searchsorted(cdf / cdf[-1], q - 1e-12))


def exact_bootstrap_ci(d: np.ndarray, confidence: float) -> tuple[float, float] | None:
    """Percentile CI from the exact bootstrap distribution of mean(d); None when d is off a small lattice."""
    values, counts = np.unique(d, return_counts=True)
    lat, n = lattice(values), len(d)
    if lat is None or n * int(lat[1].max() - lat[1].min()) + 1 > MAX_LATTICE:
        return None
    step, k = lat
    base, offsets = int(k.min()), k - k.min()
    pmf = np.zeros(int(offsets.max()) + 1)
    # one problem drawn: its offset on the lattice; two spellings of one value (0 - 100/3 and 200/3 - 100)
    # land on one offset, so their counts add (an assignment would keep the last)
    np.add.at(pmf, offsets, counts / n)
    dist = _convolve_power(pmf, n)  # the sum of n drawn offsets
    alpha = 1 - confidence
    lo, hi = (_quantile_index(dist, q) for q in (alpha / 2, 1 - alpha / 2))
    return (base * n + lo) * step / n, (base * n + hi) * step / n


def _blocks(total: int, width: int):
    rows = max(1, CHUNK // max(width, 1))
    for start in range(0, total, rows):
        yield min(rows, total - start)


def bootstrap_means(d: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Monte Carlo: means of `resamples` paired-bootstrap resamples of the problems (n with replacement)."""
    values, counts = np.unique(d, return_counts=True)
    n, out = len(d), []
    for rows in _blocks(resamples, len(values)):
        draws = rng.multinomial(n, counts / n, size=rows)  # (rows, distinct): problems drawn per value
        out.append(draws @ values / n)
    return np.concatenate(out)


def bootstrap_ci(d: np.ndarray, confidence: float, resamples: int, rng: np.random.Generator):
    """(low, high, how): percentile CI of mean(d), exact on a lattice, else Monte Carlo; None when every
    difference is equal (the bootstrap collapses to a point)."""
    if len(np.unique(d)) < 2:
        return None
    exact = exact_bootstrap_ci(d, confidence)
    if exact is not None:
        return *exact, "bootstrap (exact)"
    alpha = 1 - confidence
    lo, hi = np.quantile(bootstrap_means(d, resamples, rng), [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi), f"bootstrap ({resamples} draws)"


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
    return float(min(1.0, 2 * special.bdtr(min(b, c), b + c, 0.5)))


def _half_binomial_pmf(c: int) -> np.ndarray:
    """Binomial(c, 1/2) probabilities of 0..c, in logs (c reaches tens of thousands; scipy.special ufuncs
    because scipy.stats' per-call overhead dominated the report's run time)."""
    k = np.arange(c + 1)
    return np.exp(
        special.gammaln(c + 1) - special.gammaln(k + 1) - special.gammaln(c - k + 1) - c * math.log(2)
    )


def exact_sign_flip_pvalue(nz: np.ndarray) -> float | None:
    """P(|sum of randomly signed |d_i|| >= |observed sum|), exactly, for non-zero d on a small lattice.
    Each distinct |d| = a * step with count c contributes a * (2 * Binomial(c, 1/2) - c) steps."""
    values, counts = np.unique(np.abs(nz), return_counts=True)
    lat = lattice(values)
    if lat is None:
        return None
    step, a = lat
    top = int(np.sum(a * counts))  # the sum of all |d| in steps: the statistic spans [-top, top]
    if 2 * top + 1 > MAX_LATTICE:
        return None
    nfft = fft.next_fast_len(2 * top + 1, real=True)
    spectrum = np.ones(nfft // 2 + 1, dtype=complex)
    for ai, ci in zip(a, counts):  # shifted by +ai*ci: 2*ai*B with B ~ Binomial(ci, 1/2)
        comp = np.zeros(2 * int(ai) * int(ci) + 1)
        comp[:: 2 * int(ai)] = _half_binomial_pmf(int(ci))
        spectrum *= fft.rfft(comp, nfft)
    dist = np.clip(fft.irfft(spectrum, nfft)[: 2 * top + 1], 0, None)  # of (sum + top) in steps
    observed = abs(round(float(nz.sum()) / step))
    far = np.abs(np.arange(2 * top + 1) - top) >= observed
    return float(min(1.0, dist[far].sum() / dist.sum()))


def sign_flip_pvalue(d: np.ndarray, resamples: int, rng: np.random.Generator) -> float:
    """Two-sided paired permutation test of mean(d) = 0: each problem's difference keeps or flips its sign.
    Exact on a lattice; else Monte Carlo with the (1 + hits) / (1 + resamples) rule."""
    nz = d[d != 0]
    if len(nz) == 0:
        return 1.0
    exact = exact_sign_flip_pvalue(nz)
    if exact is not None:
        return exact
    observed = abs(nz.sum())
    tol = 1e-9 * max(1.0, observed)  # sums of the same floats in another order
    values, counts = np.unique(np.abs(nz), return_counts=True)
    hits = 0
    for rows in _blocks(resamples, len(values)):
        kept = rng.binomial(counts, 0.5, size=(rows, len(values)))  # (rows, distinct) signs kept positive
        hits += int(np.sum(np.abs((2 * kept - counts) @ values) >= observed - tol))
    return (1 + hits) / (1 + resamples)


def p_value(c: np.ndarray, f: np.ndarray, binary: bool, s: StatSettings, rng) -> tuple[float, str]:
    if binary:
        b, cc = int(np.sum((f == 100) & (c == 0))), int(np.sum((f == 0) & (c == 100)))
        return mcnemar_exact(b, cc), "mcnemar"
    return sign_flip_pvalue(c - f, s.resamples, rng), "sign-flip"


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
    z = special.ndtri(1 - alpha) + special.ndtri(s.power)  # normal quantiles
    return math.ceil((z * sd / target) ** 2)


def verdict(lo: float, hi: float, p: float, n: int, s: StatSettings) -> tuple[str, str]:
    """(verdict, why). non-inferior: lower bound > -delta; worse: upper bound < 0; else inconclusive.
    Below `min_problems` the bootstrap CI is too narrow to vouch for anything: no non-inferior verdict, and
    `worse` only when the exact test (McNemar / sign-flip, valid at any n) also rejects."""
    if n < s.min_problems:
        few = f"{n} paired problems < min_problems={s.min_problems}"
        if hi < 0 and p < 1 - s.confidence:
            return "worse", f"{few}; the exact test agrees"
        if hi < 0:  # the case a reader quotes wrongly: a CI below 0 beside "inconclusive"
            return "inconclusive", (
                f"{few}: the CI excludes 0 but the exact test does not reject (p = {p:.2g} >= "
                f"{1 - s.confidence:.2g}), and at this n the bootstrap CI is too narrow to decide alone"
            )
        return "inconclusive", few
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
    lo, hi, how = ci if ci is not None else (*no_variation_ci(mean, n, s.confidence), "no-variation bound")
    p, test = p_value(c, f, binary, s, rng)
    v, why = verdict(lo, hi, p, n, s)
    needed = needed_problems(mean, sd, n, s) if v == "inconclusive" else None
    if needed is not None:
        needed = max(needed, s.min_problems)
    return {
        "n_paired": n, "full": float(f.mean()), "compressed": float(c.mean()), "paired_diff": mean,
        "sd_diff": sd, "ci_low": lo, "ci_high": hi, "ci_method": how,
        "p_value": p, "test": test, "margin": s.margin, "verdict": v, "why": why, "n_needed": needed,
        "n_more": None if needed is None else max(needed - n, 0),
    }  # fmt: skip
