"""Length and failure in the report (evalkit/report/lengths.py): the median token ratio and its CI against
scipy, the failure shares per task, the repeating-tail detector, the effective decode gain and the
recommendation that refuses a budget whose longer outputs erase it, the length plot, and query-agnostic runs
paired with query-aware ones. Run folders are fabricated (tests/runs_fixture.py); no model runs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from evalkit import leaderboard
from evalkit.report import settings, write_report
from evalkit.report.build import build
from evalkit.report.lengths import median_ci, no_answer, repeating_tail
from evalkit.report.pairing import pair
from evalkit.report.runs import load_runs
from evalkit.report.stats import StatSettings, compare
from evalkit.sample import Sample
from tests.runs_fixture import sample_row, write_run


def _aime(predictions):
    from tasks.aime24 import aime24

    return aime24.score(predictions, Sample("a", "aime24", "p", ["7"], 8))


def _longbench(predictions):
    from tasks.longbench_v2 import longbench_v2 as lb

    return lb.score(predictions, Sample("l", lb.TASK, "p", ["A"], 8, subset="easy|short"))


def _ruler(predictions):
    from tasks.ruler import ruler

    meta = {"task": "niah_single_1", "length": 1024, "metric": "all"}
    return ruler.score(predictions, Sample("r", "ruler", "p", ["42"], 8, meta=meta))


TASK_SCORERS = {"aime24": _aime, "longbench_v2": _longbench, "ruler": _ruler}

G = np.random.default_rng(7)
N = 30
FULL_TOKENS = G.integers(20, 200, N)  # (N,) known output lengths per problem
COMP_TOKENS = np.minimum(FULL_TOKENS * G.uniform(0.8, 2.5, N), 255).astype(int)
COMP_TOKENS[:4] = 256  # four compressed outputs hit the limit (256)


def _rows(tokens, outcomes=None, texts=None) -> list[dict]:
    outcomes = [1] * len(tokens) if outcomes is None else outcomes
    return [
        sample_row(
            f"s{i}",
            [{"score": 100.0 * o}],
            tokens=[int(t)],
            texts=None if texts is None else [texts[i]],
        )
        for i, (t, o) in enumerate(zip(tokens, outcomes))
    ]


def _cell(root: Path, **kw):
    write_run(root, _rows(FULL_TOKENS), method="full", budget=None, **kw)
    write_run(root, _rows(COMP_TOKENS), budget=256, **kw)
    return build(settings(results_dir=str(root))).headline.iloc[0]


# --- the statistics against scipy -------------------------------------------------------------------------


def test_length_statistics_equal_scipy_on_known_lengths(tmp_path):
    cell = _cell(tmp_path)
    ratio = COMP_TOKENS / FULL_TOKENS
    ci = sps.quantile_test(ratio, q=1, p=0.5).confidence_interval(0.95)
    assert cell.n_length == N and cell.length_ratio == pytest.approx(np.median(ratio))
    assert (cell.length_ratio_ci_low, cell.length_ratio_ci_high) == pytest.approx((ci.low, ci.high))
    assert cell.token_gain == pytest.approx(FULL_TOKENS.sum() / COMP_TOKENS.sum())
    assert cell.tokens_full == pytest.approx(FULL_TOKENS.mean())
    assert cell.tokens_compressed == pytest.approx(COMP_TOKENS.mean())
    assert cell.hit_limit_compressed == pytest.approx(100 * 4 / N) and cell.hit_limit_full == 0.0
    assert cell.repeating_full == 0.0 and pd.isna(cell.no_answer_full)  # RULER: no notion of no answer


@pytest.mark.parametrize("n", [1, 5, 6, 7, 20, 51, 200])
@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_median_ci_is_scipys_quantile_test_interval(n, confidence):
    x = np.exp(np.random.default_rng(n).normal(0.2, 0.5, n))
    ci = sps.quantile_test(x, q=1, p=0.5).confidence_interval(confidence)
    lo, hi = median_ci(x, confidence)
    np.testing.assert_allclose([lo, hi], [ci.low, ci.high])  # NaN (unbounded) where scipy's is


def test_lengths_pair_repeats_by_index_and_a_zero_token_side_counts_as_one(tmp_path):
    """k = 4 against k = 2: repeats 0-1 of each; 0 tokens on both sides is a ratio of 1, not 0/0."""
    full = [sample_row("p0", [{"score": 100.0}] * 4, tokens=[10, 30, 500, 500], limit=512)]
    full.append(sample_row("p1", [{"score": 100.0}] * 4, tokens=[0, 0, 0, 0], limit=512))
    comp = [sample_row("p0", [{"score": 100.0}] * 2, tokens=[40, 40], limit=512)]
    comp.append(sample_row("p1", [{"score": 100.0}] * 2, tokens=[0, 0], limit=512))
    f = load_runs(write_run(tmp_path / "f", full, method="full", budget=None, repeats=4).parents[4])[0][0]
    c = load_runs(write_run(tmp_path / "c", comp, budget=256, repeats=2).parents[4])[0][0]
    cell = pair(c, f, settings()).lengths
    assert cell["n_length"] == 2 and cell["tokens_full"] == pytest.approx((20 + 0) / 2)  # not 260 (all 4)
    assert cell["length_ratio"] == pytest.approx(np.median([40 / 20, 1.0]))
    assert cell["token_limit"] == 512


# --- no answer and the repeating tail ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "predictions, task, expected",
    [
        (["no box here"], "aime24", 1.0),  # AIME: no box
        (["<think>cut off"], "aime24", 1.0),  # AIME: never closed </think>
        (["\\boxed{5}"], "aime24", 0.0),  # AIME: boxed, wrong
        (["The correct answer is (B)"], "longbench_v2", 0.0),
        (["I cannot tell."], "longbench_v2", 1.0),  # LongBench-v2: no "The correct answer is (X)"
        (["wrong"], "ruler", 0.0),  # RULER: any text is an answer ...
        ([""], "ruler", 1.0),  # ... an empty continuation is none
    ],
)
def test_no_answer_is_each_tasks_own_notion_through_the_standard_key(predictions, task, expected):
    """Each task reports its notion as `no_answer`; the report reads that key and no task's private ones."""
    score = TASK_SCORERS[task]
    assert no_answer(score(predictions)) == expected
    assert no_answer({"no_box": 100.0, "thinking_truncated": 0.0}) is None  # private keys: not read


def test_livecodebench_reports_no_code_as_no_answer():
    from tasks.livecodebench import livecodebench as lcb

    m = lcb.metrics(["no_code", "passed"], "easy")
    assert m["no_answer"] == m["outcome/no_code"] == 50.0 and no_answer(m) == 1.0


W = [f"w{i}" for i in range(200)]  # distinct words: no period but the one built


@pytest.mark.parametrize(
    "text, loops",
    [
        (" ".join(["wait"] * 64), True),  # period 1, 64 words: the shortest loop
        (" ".join(["wait"] * 63), False),  # 63 words: too short
        ("Let me think. " + " ".join(["wait"] * 64), True),  # only the tail counts
        (" ".join(["wait"] * 64) + " so the answer is 42.", False),  # the loop ended: no longer at the end
        (" ".join(W[:30] * 3), True),  # period 30, exactly 3 copies (90 words >= 64)
        (" ".join((W[:30] * 3)[1:]), False),  # 89 words: 2.97 copies of 30
        (" ".join(W[:40] * 2), False),  # two copies of 40 words (80 >= 64 but < 3 copies)
        (" ".join(W[:128] * 3), True),  # period 128 = MAX_LOOP_PERIOD
        (" ".join(W * 50 + W[:128] * 3), True),  # the same after 10,000 words
        (" ".join(W[:128] * 3 + ["end"]), True),  # ... and cut mid-word at the limit
        (" ".join(W[:129] * 3), False),  # period 129 > MAX_LOOP_PERIOD
        (" ".join(W[:50]) + " " + " ".join(["1 + 1 = 2"] * 16) + " 1 + 1", True),  # period 5, mid-period
        ((" ".join(["so the answer is 5."] * 20))[:-3], True),  # cut at the token limit mid-word
        (" ".join(f"step {i}: add {i} to the total." for i in range(40)), False),  # numbers change
    ],
)
def test_repeating_tail(text, loops):
    assert repeating_tail(text) is loops


def test_failure_shares_reach_the_report(tmp_path):
    loop = " ".join(["wait"] * 100)
    comp_texts = [loop] * 6 + ["fine answer"] * (N - 6)
    kw = {"task": "longbench_v2", "headline": "accuracy"}

    def rows(tokens, texts, missing):
        out = []
        for i, t in enumerate(tokens):
            scores = {"accuracy": 0.0 if i < missing else 100.0, "no_answer": 100.0 if i < missing else 0.0}
            out.append(sample_row(f"s{i}", [scores], tokens=[int(t)], texts=[texts[i]]))
        return out

    write_run(tmp_path, rows(FULL_TOKENS, ["fine answer"] * N, 1), method="full", budget=None, **kw)
    write_run(tmp_path, rows(COMP_TOKENS, comp_texts, 9), budget=256, **kw)
    paths = write_report(settings(results_dir=str(tmp_path)))
    cell = build(settings(results_dir=str(tmp_path))).headline.iloc[0]
    assert cell.no_answer_compressed == pytest.approx(100 * 9 / N)
    assert cell.no_answer_full == pytest.approx(100 / N)
    assert cell.repeating_compressed == pytest.approx(20.0) and cell.repeating_full == 0.0
    md = Path(paths["md"]).read_text()
    assert "### Length and failure (compressed vs full, paired)" in md
    assert "| 13.3% (0.0%) | 30.0% (3.3%) | 20.0% (0.0%) |" in md  # hit limit, no answer, repeating
    csv = pd.read_csv(paths["csv"])
    assert {"length_ratio", "length_ratio_ci_low", "hit_limit_compressed", "effective_gain_h200"} <= set(csv)
    png = paths["lengths_smollm2_135m_longbench_v2"]
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"![lengths]({Path(png).name})" in md


# --- the effective gain and the recommendation ------------------------------------------------------------


def _sweep(root: Path, inflate: dict[int, float]) -> None:
    """200 problems all solved by full and by every budget (non-inferior), full outputs of 100 tokens; budget
    b generates `inflate[b]` times as many."""
    full = [sample_row(f"s{i}", [{"score": 100.0}], tokens=[100], limit=4096) for i in range(200)]
    write_run(root, full, method="full", budget=None)
    for budget, factor in inflate.items():
        rows = [
            sample_row(f"s{i}", [{"score": 100.0}], tokens=[int(100 * factor)], limit=4096)
            for i in range(200)
        ]
        write_run(root, rows, budget=budget)


def test_effective_gain_is_the_memory_bound_gain_times_full_over_compressed_tokens(tmp_path):
    _sweep(tmp_path, {256: 1.25})
    cell = build(settings(results_dir=str(tmp_path))).headline.iloc[0]
    for hw in ("sn40l", "h200"):
        assert cell[f"effective_gain_{hw}"] == pytest.approx(cell[f"tok_s_gain_{hw}"] / 1.25)


def test_recommendation_refuses_a_non_inferior_budget_whose_effective_gain_is_below_1(tmp_path):
    """256 keeps every answer but writes 20 times as long: its memory-bound gain (< 2100/256 = 8.2x) times
    1/20 is below 1, so it buys nothing; 512 keeps the length and is the recommendation."""
    _sweep(tmp_path, {256: 20.0, 512: 1.0})
    rep = build(settings(results_dir=str(tmp_path)))
    cells = rep.headline.set_index("budget")
    assert (cells.verdict == "non-inferior").all()
    assert cells.loc[256, "effective_gain_h200"] < 1 < cells.loc[256, "tok_s_gain_h200"]
    (rec,) = rep.by_task
    assert rec["budget"] == 512 and rec["effective_gain_h200"] > 1
    assert "256: length inflation erases the gain (effective gain 0." in rec["status"]
    (model,) = rep.by_model
    assert model["budget"] == 512 and model["blockers"][256] == {"ruler": "effective gain <= 1"}
    md = Path(write_report(settings(results_dir=str(tmp_path)))["md"]).read_text()
    assert "| effective gain h200 |" in md and "length inflation erases the gain" in md


def test_no_budget_is_named_when_length_inflation_erases_every_gain(tmp_path):
    _sweep(tmp_path, {256: 20.0})
    (rec,) = build(settings(results_dir=str(tmp_path))).by_task
    assert rec["budget"] is None
    assert rec["status"].startswith("non-inferior but 256: length inflation erases the gain (effective gain")
    assert "x full/compressed tokens 0.05)" in rec["status"]


def test_a_budget_without_a_memory_gain_is_not_recommended_and_the_status_says_why(tmp_path):
    """snapkv at 4096 keeps the whole 2100-token request: no memory gain, and no length change to blame."""
    full = [sample_row(f"s{i}", [{"score": 100.0}], tokens=[100], limit=4096) for i in range(200)]
    write_run(tmp_path, full, method="full", budget=None)
    write_run(tmp_path, full, method="snapkv", budget=4096)
    (rec,) = build(settings(results_dir=str(tmp_path))).by_task
    assert rec["budget"] is None
    assert rec["status"].startswith("non-inferior but 4096: the budget buys no decode gain (effective gain")


def test_without_recorded_lengths_the_budget_is_named_and_the_gain_said_unknown(tmp_path):
    """Runs from before per-request generation records: the recommendation stands on accuracy and memory as
    before, and says the effective gain was not computed."""
    full = [sample_row(f"s{i}", [{"score": 100.0}]) for i in range(200)]
    for r in full:
        r["generation"] = [{}]
    write_run(tmp_path, full, method="full", budget=None)
    write_run(tmp_path, full, budget=256)
    (rec,) = build(settings(results_dir=str(tmp_path))).by_task
    assert rec["budget"] == 256
    assert rec["status"] == "non-inferior; effective gain not computed (no output lengths recorded)"


# --- query-agnostic vs query-aware ------------------------------------------------------------------------


def _query_runs(root: Path, aware_key: bool | None = None) -> None:
    outcomes = G.random(N) < 0.9
    full = _rows(FULL_TOKENS)
    write_run(root, full, method="full", budget=None)
    write_run(root, _rows(FULL_TOKENS, [1] * N), budget=256, query_aware=aware_key)
    write_run(root, _rows(COMP_TOKENS, outcomes), budget=256, query_aware=False)


@pytest.mark.parametrize("aware_key", [None, True])  # a run without the key is query-aware
def test_query_agnostic_is_paired_with_query_aware_and_each_with_full(tmp_path, aware_key):
    _query_runs(tmp_path, aware_key)
    rep = build(settings(results_dir=str(tmp_path)))
    head = rep.headline.set_index("query_aware")
    assert set(head.full_run) == {"ruler/smollm2_135m/full/none"}  # both against the one full run
    q = rep.query[rep.query.is_headline].iloc[0]
    assert q.run == "ruler/smollm2_135m/snapstream-query_agnostic/256"
    assert q.aware_run == "ruler/smollm2_135m/snapstream/256"
    # the same statistics as the report's cells: agnostic - aware on the same problems
    c = np.array([r["scores"]["score"] for r in _read(tmp_path, q.run)])
    a = np.array([r["scores"]["score"] for r in _read(tmp_path, q.aware_run)])
    expect = compare(c, a, True, StatSettings(), np.random.default_rng(0))
    for key in ("n_paired", "paired_diff", "ci_low", "ci_high", "p_value"):
        assert q[key] == pytest.approx(expect[key])
    assert q.verdict == expect["verdict"]
    assert q.paired_diff == pytest.approx(head.loc[False, "paired_diff"] - head.loc[True, "paired_diff"])
    assert q.length_ratio == pytest.approx(np.median(COMP_TOKENS / FULL_TOKENS))
    assert {r["query_aware"] for r in rep.by_task} == {True, False}  # separate recommendations
    md = Path(write_report(settings(results_dir=str(tmp_path)))["md"]).read_text()
    assert "### Query-agnostic vs query-aware" in md and "| snapstream (query-agnostic) | 256 |" in md


def _read(root: Path, rel: str) -> list[dict]:
    lines = (root / "runs" / rel / "samples.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_query_agnostic_without_a_query_aware_partner_is_noted(tmp_path):
    write_run(tmp_path, _rows(FULL_TOKENS), method="full", budget=None)
    write_run(tmp_path, _rows(COMP_TOKENS), budget=256, query_aware=False)
    rep = build(settings(results_dir=str(tmp_path)))
    assert rep.query.empty and not rep.headline.iloc[0].query_aware
    assert any(
        "snapstream-query_agnostic/256: query-agnostic, no query-aware run(s) of the same budget" in n
        for n in rep.notes
    )


def test_multi_question_runs_are_their_own_task(tmp_path):
    """A multi-question run asks other samples (one row per question): it is grouped, paired and recommended
    apart from single-question query-agnostic runs of the same method and budget, against its own full run,
    and its missing query-aware partner is explained, not asked for."""
    write_run(tmp_path, _rows(FULL_TOKENS), method="full", budget=None)
    write_run(tmp_path, _rows(COMP_TOKENS), budget=256, query_aware=False)
    mq = dict(query_aware=False, multi_question=True, data_hash="e" * 64)
    write_run(tmp_path, _rows(FULL_TOKENS), method="full", budget=None, **mq)
    write_run(tmp_path, _rows(COMP_TOKENS), budget=256, **mq)
    rep = build(settings(results_dir=str(tmp_path)))
    head = rep.headline.set_index("task")
    assert sorted(head.index) == ["ruler", "ruler-multi_question"]
    assert head.loc["ruler-multi_question", "full_run"] == "ruler/smollm2_135m/full-query_agnostic-mq/none"
    assert head.loc["ruler", "full_run"] == "ruler/smollm2_135m/full/none"
    assert any("-mq/256: query-agnostic" in n and "(multi-question runs have none)" in n for n in rep.notes)


def test_leaderboard_carries_the_length_columns_and_query_setting(tmp_path):
    _query_runs(tmp_path)
    leaderboard.build(tmp_path)
    long = pd.read_csv(tmp_path / "leaderboard.csv")
    wide = pd.read_csv(tmp_path / "leaderboard_wide.csv")
    head = long[long.headline].set_index(["method", "query_aware"])
    cols = list(long.columns)
    assert cols.index("length_ratio") == cols.index("n") + 1  # beside the score
    agn = head.loc[("snapstream", False)]
    assert agn.length_ratio == pytest.approx(np.median(COMP_TOKENS / FULL_TOKENS), abs=0.005)
    assert agn.token_gain == pytest.approx(FULL_TOKENS.sum() / COMP_TOKENS.sum(), abs=0.005)
    assert agn.hit_limit == pytest.approx(100 * 4 / N, abs=0.005)
    assert head.loc[("full", True)].hit_limit == 0.0 and pd.isna(head.loc[("full", True)].length_ratio)
    assert agn.effective_gain_h200 == pytest.approx(agn.tok_s_gain_h200 * agn.token_gain, rel=1e-3)
    snap = wide[wide.method == "snapstream"].set_index("query_aware")
    assert len(snap) == 2  # separate rows, never averaged
    assert snap.loc[False, "256_length_ratio"] == pytest.approx(agn.length_ratio)
    assert "256_effective_gain_h200" in wide


# --- lengths that measure nothing, and runs whose lengths cannot be compared (issue 31, item 4) -----------


def _pair_runs(root: Path, full_tokens, comp_tokens, full_limit=4096, comp_limit=4096) -> None:
    """200 problems solved by both (non-inferior), with the given output tokens and token limits."""
    full = [
        sample_row(f"s{i}", [{"score": 100.0}], tokens=[t], limit=full_limit)
        for i, t in enumerate(full_tokens)
    ]
    comp = [
        sample_row(f"s{i}", [{"score": 100.0}], tokens=[t], limit=comp_limit)
        for i, t in enumerate(comp_tokens)
    ]
    write_run(root, full, method="full", budget=None)
    write_run(root, comp, budget=256)


def test_empty_outputs_are_no_token_gain(tmp_path):
    """0-token compressed outputs once gave a token gain of 200 and an effective gain of thousands: a problem
    with an empty output is left out of the gain, and said; with every output empty there is none."""
    _pair_runs(tmp_path / "some", [100] * 200, [0] * 50 + [100] * 150)
    (rec,) = build(settings(results_dir=str(tmp_path / "some"))).by_task
    assert rec["token_gain"] == pytest.approx(1.0) and rec["budget"] == 256
    assert rec["status"].endswith(
        "50 of 200 problems with an empty (0-token) output left out of the token gain"
    )
    _pair_runs(tmp_path / "all", [200] * 200, [0] * 200)
    rep = build(settings(results_dir=str(tmp_path / "all")))
    cell, (rec,) = rep.headline.iloc[0], rep.by_task
    assert pd.isna(cell.token_gain) and pd.isna(cell.effective_gain_h200)
    assert rec["status"] == (
        "non-inferior; effective gain not computed (every paired problem has an empty (0-token) output: no "
        "length to compare)"
    )


def test_lengths_truncated_on_both_sides_give_no_ratio_to_deploy_on(tmp_path):
    """Every output at the 256-token limit on both sides: the ratio 1.00 measures the limit, not the lengths;
    the budget is named on accuracy alone and the status and the length table say why."""
    _pair_runs(tmp_path, [256] * 200, [256] * 200, 256, 256)
    paths = write_report(settings(results_dir=str(tmp_path)))
    (rec,) = build(settings(results_dir=str(tmp_path))).by_task
    why = "lengths truncated: every output hit the 256-token limit on both sides, so their ratio "
    why += "measures the limit"
    assert rec["budget"] == 256 and rec["status"] == f"non-inferior; effective gain not computed ({why})"
    assert f"- snapstream 256: {why}" in Path(paths["md"]).read_text()


def test_runs_with_other_token_limits_are_not_paired(tmp_path):
    """A full run whose generations had another max_new_tokens compares other caps: refused, never a ratio."""
    _pair_runs(tmp_path, [300] * 200, [200] * 200, full_limit=512, comp_limit=256)
    rep = build(settings(results_dir=str(tmp_path)))
    assert rep.cells.empty
    (problem,) = rep.problems
    assert (
        "cannot be paired with ruler/smollm2_135m/full/none: per-generation token limits differ on 200 of "
        in problem
    )
    assert "(first: ['s0 (256 vs 512)'" in problem
