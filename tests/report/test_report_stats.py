"""The report's statistics (evalkit/report/stats.py) against scipy's own functions and hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sps

from evalkit.report.stats import (
    StatSettings,
    bootstrap_ci,
    bootstrap_means,
    compare,
    lattice,
    mcnemar_exact,
    needed_problems,
    no_variation_ci,
    p_value,
    sign_flip_pvalue,
    verdict,
)

S = StatSettings()


def rng(seed=0):
    return np.random.default_rng(seed)


def scipy_paired_ci(c, f, resamples=20_000):
    res = sps.bootstrap(
        (c, f),
        lambda a, b, axis=-1: np.mean(a - b, axis=axis),
        paired=True,
        vectorized=True,
        n_resamples=resamples,
        method="percentile",
        confidence_level=0.95,
        rng=np.random.default_rng(1),
    )
    return res.confidence_interval.low, res.confidence_interval.high


@pytest.mark.parametrize("kind", ["binary", "partial", "continuous"])
def test_bootstrap_ci_matches_scipy_paired_bootstrap(kind):
    g = rng(3)
    n = 60
    if kind == "binary":  # RULER/AIME-like 0/100 outcomes
        f = 100.0 * (g.random(n) < 0.7)
        c = np.where(g.random(n) < 0.85, f, 100 - f)
    elif kind == "partial":  # string_match_all over 4 references: multiples of 25
        f, c = 25.0 * g.integers(0, 5, n), 25.0 * g.integers(0, 5, n)
    else:
        f, c = g.normal(60, 10, n), g.normal(58, 10, n)
    lo, hi, how = bootstrap_ci(c - f, 0.95, 20_000, rng())
    assert how == ("bootstrap (20000 draws)" if kind == "continuous" else "bootstrap (exact)")
    slo, shi = scipy_paired_ci(c, f)
    width = shi - slo
    assert abs(lo - slo) < 0.04 * width and abs(hi - shi) < 0.04 * width, ((lo, hi), (slo, shi))


def test_bootstrap_means_have_the_resampling_distribution_of_problems():
    """Monte Carlo path: drawing counts per distinct value is the same distribution as drawing problems:
    mean d and SE sd(d, ddof=0)/sqrt(n); a bug in the counts (e.g. unweighted values) moves both."""
    d = np.array([-100.0] * 7 + [0.0] * 40 + [100.0] * 3 + [25.0] * 10)
    means = bootstrap_means(d, 200_000, rng())
    assert means.mean() == pytest.approx(d.mean(), abs=0.05)
    assert means.std() == pytest.approx(d.std() / math.sqrt(len(d)), rel=0.01)


def test_exact_bootstrap_equals_monte_carlo_on_the_same_lattice():
    """The FFT convolution is the B = infinity limit of the Monte Carlo bootstrap: same quantiles."""
    g = rng(11)
    d = np.concatenate([g.choice([-100.0, -100 / 3, 0.0, 20.0, 100.0], 300), [-200 / 3] * 7])
    lo, hi, _ = bootstrap_ci(d, 0.95, 1000, rng())
    means = bootstrap_means(d, 400_000, rng())
    mlo, mhi = np.quantile(means, [0.025, 0.975])
    assert lo == pytest.approx(mlo, abs=0.25) and hi == pytest.approx(mhi, abs=0.25)


def test_exact_bootstrap_adds_two_spellings_of_one_value():
    """k = 3 repeats: 0 - 100/3 and 200/3 - 100 are one difference written as two floats (-33.333...36 and
    -33.333...3). The exact bootstrap kept only the last one's count: a CI of [-0.83, +6.67] that missed
    the mean -3.33 and a non-inferior verdict; the Monte Carlo bootstrap's CI and verdict are the truth."""
    third, two_thirds = 100.0 / 3, 200.0 / 3
    pairs = [(0.0, third)] * 7 + [(two_thirds, 100.0)] + [(third, 0.0)] * 4 + [(50.0, 50.0)] * 28
    c, f = np.array(pairs).T
    assert len(np.unique(c - f)) == 4  # the two spellings
    got = compare(c, f, False, StatSettings(), rng())
    means = bootstrap_means(c - f, 400_000, rng())
    mlo, mhi = np.quantile(means, [0.025, 0.975])
    assert got["ci_method"] == "bootstrap (exact)" and got["verdict"] == "inconclusive"
    assert got["ci_low"] == pytest.approx(mlo, abs=0.2) and got["ci_high"] == pytest.approx(mhi, abs=0.2)


def test_bootstrap_hand_cases():
    # d = [0, 100]: resampled means 0, 50, 100 with probabilities 1/4, 1/2, 1/4 -> 95% interval [0, 100]
    assert bootstrap_ci(np.array([0.0, 100.0]), 0.95, 20_000, rng())[:2] == (0.0, 100.0)
    # d = [-100, 0, 0, 0]: K ~ Binomial(4, 1/4) draws of -100, mean -25 K. P(K >= 3) = 0.0508 >= 0.025 >
    # P(K = 4) = 0.0039 -> lower -75; P(K = 0) = 0.316 > 0.025 -> upper 0
    assert bootstrap_ci(np.array([-100.0, 0.0, 0.0, 0.0]), 0.95, 10, rng())[:2] == pytest.approx((-75.0, 0.0))
    assert bootstrap_ci(np.zeros(50), 0.95, 1000, rng()) is None  # collapsed: the exact bound takes over


@pytest.mark.parametrize(
    "values, step",
    [
        ([0.0, 100.0], 100.0),
        ([0.0, 100 / 3, 100.0], 100 / 3),
        ([-20.0, 10.0, 100 / 3], 10 / 3),
        ([1.5625, 0.0], 1.5625),
    ],
)
def test_lattice_steps(values, step):
    got = lattice(np.array(values))
    assert got[0] == pytest.approx(step) and np.allclose(got[0] * got[1], values)


def test_off_lattice_values_are_not_forced_onto_one():
    assert lattice(np.array([0.0, math.pi, 1.0])) is None  # 311/99 is 1.8e-5 off: no lattice


def test_no_variation_bound_by_hand():
    # 20 problems, all equal: share that could differ = 1 - exp(ln(0.025) / 20) = 0.168433; one moves <= 100
    lo, hi = no_variation_ci(0.0, 20, 0.95)
    assert (lo, hi) == pytest.approx((-16.8433, 16.8433), abs=1e-4)
    lo, hi = no_variation_ci(-100.0, 5, 0.95)  # every problem lost: the interval stays inside [-100, 100]
    assert lo == -100.0 and hi == pytest.approx(-100 + 200 * (1 - 0.025**0.2))


def test_mcnemar_equals_scipy_binomtest_everywhere_small():
    for b in range(16):
        for c in range(16):
            want = 1.0 if b + c == 0 else sps.binomtest(b, b + c, 0.5).pvalue
            assert mcnemar_exact(b, c) == pytest.approx(want, rel=1e-12), (b, c)
    assert mcnemar_exact(0, 5) == pytest.approx(2 * 0.5**5)  # by hand


@pytest.mark.parametrize("m", [2, 3, 9, 14])
def test_sign_flip_exact_equals_scipy_permutation_test(m):
    g = rng(m)
    c, f = g.choice([0.0, 25.0, 100 / 3, 50.0, 100.0], m), g.choice([0.0, 25.0, 50.0, 100.0], m)
    want = sps.permutation_test(
        (c, f),
        lambda a, b, axis=-1: np.mean(a - b, axis=axis),
        vectorized=True,
        permutation_type="samples",
        n_resamples=np.inf,
    ).pvalue
    assert sign_flip_pvalue(c - f, 10_000, rng()) == pytest.approx(want, rel=1e-9)


def test_sign_flip_exact_agrees_with_scipy_monte_carlo_at_n120():
    g = rng(5)
    f = g.choice([0.0, 50.0, 100.0], 120)
    c = np.where(g.random(120) < 0.8, f, g.choice([0.0, 50.0, 100.0], 120))
    c[:6] = 0.0  # a real drop
    want = sps.permutation_test(
        (c, f),
        lambda a, b, axis=-1: np.mean(a - b, axis=axis),
        vectorized=True,
        permutation_type="samples",
        n_resamples=50_000,
        rng=np.random.default_rng(2),
    ).pvalue
    got = sign_flip_pvalue(c - f, 50_000, rng())  # exact (a lattice of 50 points)
    assert got == pytest.approx(want, abs=0.006)


def test_sign_flip_monte_carlo_fallback_agrees_with_scipy():
    g = rng(6)
    c, f = g.normal(60, 10, 80), g.normal(57, 10, 80)  # continuous: off any lattice
    want = sps.permutation_test(
        (c, f),
        lambda a, b, axis=-1: np.mean(a - b, axis=axis),
        vectorized=True,
        permutation_type="samples",
        n_resamples=50_000,
        rng=np.random.default_rng(2),
    ).pvalue
    assert sign_flip_pvalue(c - f, 50_000, rng()) == pytest.approx(want, abs=0.004)


def test_sign_flip_hand_cases():
    assert sign_flip_pvalue(np.array([2.0, 1.0]), 100, rng()) == pytest.approx(0.5)  # |sum| >= 3: 2 of 4
    assert sign_flip_pvalue(np.array([3.0, 1.0, 1.0]), 100, rng()) == pytest.approx(
        0.25
    )  # |sum| >= 5: 2 of 8
    assert sign_flip_pvalue(np.array([5.0]), 100, rng()) == pytest.approx(1.0)
    assert sign_flip_pvalue(np.zeros(7), 100, rng()) == 1.0


def test_on_binary_data_sign_flip_is_mcnemar():
    d = np.array([100.0] * 3 + [-100.0] * 9 + [0.0] * 30)
    assert sign_flip_pvalue(d, 100, rng()) == pytest.approx(mcnemar_exact(9, 3))
    big = np.array([100.0] * 480 + [-100.0] * 530 + [0.0] * 38_000)  # RULER-sized: still exact
    assert sign_flip_pvalue(big, 100, rng()) == pytest.approx(sps.binomtest(480, 1010, 0.5).pvalue, rel=1e-6)


@pytest.mark.parametrize(
    "lo, hi, p, n, want",
    [
        (-2.0, 1.0, 0.5, 100, "inconclusive"),  # lower bound exactly -delta: not above it
        (-1.999, 1.0, 0.5, 100, "non-inferior"),
        (-5.0, 0.0, 0.05, 100, "inconclusive"),  # upper bound exactly 0: not below it
        (-5.0, -0.001, 0.04, 100, "worse"),
        (-1.5, -0.5, 0.01, 100, "non-inferior"),  # significantly lower, but within the margin
        (-0.5, 0.5, 0.9, 19, "inconclusive"),  # below min_problems: never non-inferior
        (-0.5, 0.5, 0.9, 20, "non-inferior"),
        (-60.0, -20.0, 0.0078, 12, "worse"),  # few problems, but the exact test rejects too
        (-60.0, -20.0, 0.06, 12, "inconclusive"),  # ... and here it does not
    ],
)
def test_verdict_boundaries(lo, hi, p, n, want):
    assert verdict(lo, hi, p, n, S)[0] == want


def test_sample_size_by_hand():
    # Chow, Shao & Wang 3.1: n = (z_.975 + z_.8)^2 sd^2 / (mean + delta)^2 = (2.801585 * 10 / 2)^2 = 196.2
    assert needed_problems(0.0, 10.0, 50, S) == 197
    assert needed_problems(-1.0, 10.0, 50, S) == math.ceil((2.801585 * 10 / 1) ** 2)  # 785
    assert needed_problems(-3.0, 10.0, 50, S) == math.ceil((2.801585 * 10 / 3) ** 2)  # to show "worse"
    # no variation seen: the n at which the exact bound clears delta (ln .025 / ln .98 = 182.6)
    assert needed_problems(0.0, 0.0, 20, S) == 183
    assert no_variation_ci(0.0, 183, 0.95)[0] > -2 >= no_variation_ci(0.0, 182, 0.95)[0]


@pytest.mark.parametrize("seed", range(5))
def test_p_value_counts_the_discordant_pairs_of_binary_data(seed):
    # all four cell kinds (both right, both wrong, only full right, only compressed right), in a shuffled
    # order: the McNemar p-value is scipy's binomtest on the two discordant counts and nothing else
    g = np.random.default_rng(seed)
    kinds = {(100, 100): 7, (0, 0): 5, (100, 0): 9 + seed, (0, 100): 2}  # (full, compressed): count
    pairs = [k for k, n in kinds.items() for _ in range(n)]
    g.shuffle(pairs)
    f, c = (np.array([p[i] for p in pairs], dtype=float) for i in (0, 1))
    got, test = p_value(c, f, True, S, rng())
    want = sps.binomtest(2, 2 + 9 + seed, 0.5, alternative="two-sided").pvalue
    assert test == "mcnemar" and got == pytest.approx(want, rel=1e-12)
    flipped, _ = p_value(f, c, True, S, rng())  # the direction of the difference does not change a 2-sided p
    assert flipped == pytest.approx(want, rel=1e-12)


def test_compare_picks_the_test_and_widens_degenerate_cells():
    f = np.array([100.0] * 30)
    cell = compare(f.copy(), f, True, S, rng())
    assert cell["test"] == "mcnemar" and cell["p_value"] == 1.0
    assert cell["ci_method"] == "no-variation bound" and cell["verdict"] == "inconclusive"
    assert cell["n_needed"] == 183 and cell["n_more"] == 153
    c = np.array([50.0] * 15 + [100.0] * 15)
    cell = compare(c, f, False, S, rng())
    assert cell["test"] == "sign-flip" and cell["paired_diff"] == -25.0 and cell["verdict"] == "worse"
