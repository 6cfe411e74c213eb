"""The report at equal bytes (issue 32.3): a configuration is (method, budget, KV storage), never mixed with
another storage; the frontier of score against modelled KV bytes per sequence; the cheapest safe
configuration recommended with the other kind's runner-up; equal-bytes pairs compared per problem.

Fixture bytes (SmolLM2-135M geometry, bf16 precision, the full run's request of 2100 tokens seen; int in the
slot caches' layout, `kivi_slots`): snapstream 512 11,796,480 B < snapstream 1024 + fp8 11,797,200 B (its
scales) < full int2 12.03 MB < full int4 18.08 MB < snapstream 1024 23.59 MB < full fp8 24.19 MB < full bf16
48.38 MB.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from evalkit import leaderboard
from evalkit.kv.storage import make_storage
from evalkit.report import settings, write_report
from evalkit.report.build import build
from evalkit.report.frontier import sentence
from tests.runs_fixture import binary_rows, write_run

N, WORSE = 200, 12  # 12 of 200 problems lost: worse at the default margin; none lost: non-inferior


def _run(root: Path, method: str, budget, kv: str | None, lost: int, task: str = "ruler") -> None:
    write_run(
        root, binary_rows([0] * lost + [1] * (N - lost)), method=method, budget=budget, kv=kv, task=task
    )


def _frontier_runs(root: Path, fp8_snapstream_lost: int = 0) -> None:
    write_run(root, binary_rows([1] * N), method="full", budget=None)  # the reference (no `kv`: an old run)
    _run(root, "full", None, "int2", WORSE)
    _run(root, "snapstream", 512, "none", WORSE)
    _run(root, "snapstream", 1024, "fp8_e4m3", fp8_snapstream_lost)
    _run(root, "full", None, "int4", 0)
    _run(root, "snapstream", 1024, "none", 0)
    _run(root, "full", None, "fp8_e4m3", 0)


def _rec(rep, task="ruler") -> dict:
    (rec,) = [r for r in rep.by_bytes if r["task"] == task]
    return rec


def test_recommends_the_fewest_bytes_non_inferior_with_the_other_kind_beside_it(tmp_path):
    _frontier_runs(tmp_path)
    rep = build(settings(results_dir=str(tmp_path)))
    rec = _rec(rep)
    # int2 and snapstream 512 are cheaper but worse; snapstream 1024 in fp8 is the cheapest safe one, and of
    # the quantized full caches int4 (cheaper than fp8) is the runner-up
    assert rec["best"]["label"] == "snapstream 1024 + fp8_e4m3" and rec["best"]["kind"] == "eviction"
    assert rec["other"]["label"] == "full + int4" and rec["other"]["kind"] == "quantization"
    assert sentence(rec) == "snapstream 1024 + fp8_e4m3: 11.3 MiB; full + int4: 17.2 MiB"
    md = (tmp_path / "report" / "report.md").read_text() if write_report(rep.settings) else ""
    assert "Recommended: snapstream 1024 + fp8_e4m3: 11.3 MiB; full + int4: 17.2 MiB." in md
    assert (tmp_path / "report" / "pareto_ruler_smollm2_135m.png").is_file()


def test_when_the_eviction_is_worse_the_quantized_full_cache_is_recommended(tmp_path):
    _frontier_runs(tmp_path, fp8_snapstream_lost=WORSE)
    rec = _rec(build(settings(results_dir=str(tmp_path))))
    assert rec["best"]["label"] == "full + int4" and rec["other"]["label"] == "snapstream 1024"


def test_no_safe_configuration_says_so(tmp_path):
    write_run(tmp_path, binary_rows([1] * N), method="full", budget=None)
    _run(tmp_path, "full", None, "int2", WORSE)
    _run(tmp_path, "snapstream", 512, "none", WORSE)
    rec = _rec(build(settings(results_dir=str(tmp_path))))
    assert rec["best"] is None and rec["status"] == "no configuration is non-inferior"


def test_a_cache_no_smaller_than_the_full_one_never_qualifies(tmp_path):
    """SnapStream 4096 at a 2100-token request holds more than the full cache: non-inferior, yet no saving,
    so not the cheapest safe cache (it was recommended, as 'effective gain above 1', when its gain could not
    be computed)."""
    write_run(tmp_path, binary_rows([1] * N), method="full", budget=None)
    _run(tmp_path, "snapstream", 4096, "none", 0)
    rep = build(settings(results_dir=str(tmp_path)))
    rec = _rec(rep)
    assert rec["best"] is None
    assert rec["status"] == "no non-inferior configuration qualifies (no smaller than the full cache)"
    (front,) = rep.frontier.values()
    assert not front.qualifies.any() and front.why.iloc[0] == "no smaller than the full cache"


def test_a_recommendation_whose_gain_was_not_computed_says_why(tmp_path):
    """Every output hit the 256-token limit on both sides: the effective gain is unknown, so the
    recommendation says why instead of claiming a gain above 1."""
    from tests.runs_fixture import sample_row

    def rows():
        return [sample_row(f"s{i}", [{"score": 100.0}], tokens=[256], limit=256) for i in range(N)]

    write_run(tmp_path, rows(), method="full", budget=None)
    write_run(tmp_path, rows(), method="snapstream", budget=1024)
    rec = _rec(build(settings(results_dir=str(tmp_path))))
    assert rec["best"]["label"] == "snapstream 1024"
    assert rec["status"].startswith("non-inferior, effective gain not computed (lengths truncated")


def test_frontier_is_every_configuration_by_its_storage_bytes(tmp_path):
    _frontier_runs(tmp_path)
    rep = build(settings(results_dir=str(tmp_path)))
    rows = rep.frontier[("smollm2_135m", "ruler")]
    order = list(rows.label)
    assert order == [
        "snapstream 512", "snapstream 1024 + fp8_e4m3", "full + int2", "full + int4", "snapstream 1024",
        "full + fp8_e4m3", "full (model dtype)",
    ]  # fmt: skip
    marks = dict(zip(rows.label, rows.qualifies))
    assert not marks["full + int2"] and not marks["snapstream 512"] and marks["full + int4"]
    # the modelled bytes are the storage's own arithmetic (what a run measures): codes, scales, residual
    by = dict(zip(rows.label, rows.kv_bytes_seq))
    int4, fp8 = make_storage("int4"), make_storage("fp8_e4m3")
    assert by["full + int4"] == 30 * int4.layer_bytes(2100, 0, 3, 64, 64, 16)
    assert by["snapstream 1024 + fp8_e4m3"] == 30 * fp8.layer_bytes(1024, 128, 3, 64, 64, 16)
    assert by["snapstream 1024"] == 30 * 3 * 1024 * 128 * 2 and by["full (model dtype)"] == 2100 * 23040


def test_int_storage_keeps_a_ring_in_the_model_dtype(tmp_path):
    """SnapStream's recent ring (budget // 8) is overwritten at decode, so int4 holds it unquantized."""
    write_run(tmp_path, binary_rows([1] * N), method="full", budget=None)
    _run(tmp_path, "snapstream", 1024, "int4", 0)
    rows = build(settings(results_dir=str(tmp_path))).frontier[("smollm2_135m", "ruler")]
    int4 = make_storage("int4")
    assert rows.kv_bytes_seq.iloc[0] == 30 * int4.layer_bytes(1024, 128, 3, 64, 64, 16)
    assert rows.kv_bytes_seq.iloc[0] != 30 * int4.layer_bytes(1024, 0, 3, 64, 64, 16)


def test_equal_bytes_pairs_are_compared_per_problem(tmp_path):
    _frontier_runs(tmp_path)
    eq = build(settings(results_dir=str(tmp_path))).equal
    pairs = set(zip(eq.cheaper, eq.dearer))
    assert pairs == {
        ("snapstream 512", "full + int2"),  # 2.0% apart, storages none / int2
        ("snapstream 1024 + fp8_e4m3", "full + int2"),
        ("snapstream 512", "snapstream 1024 + fp8_e4m3"),  # 720 bytes apart: the fp8 scales
        ("snapstream 1024", "full + fp8_e4m3"),
    }  # never two of the same storage (full int2 against snapstream 512 + int2 would be the method table's)
    row = eq[(eq.cheaper == "snapstream 512") & (eq.dearer == "snapstream 1024 + fp8_e4m3")].iloc[0]
    # paired on the same 200 problems: cheaper - dearer = -12 of 200 = -6 points, worse
    assert row.n_paired == N and row.paired_diff == pytest.approx(-100 * WORSE / N)
    assert row.verdict == "worse"
    same = eq[(eq.cheaper == "snapstream 1024") & (eq.dearer == "full + fp8_e4m3")].iloc[0]
    assert same.paired_diff == 0 and same.verdict == "non-inferior"


def test_two_storages_never_share_a_row_cell_or_average(tmp_path):
    """The same method and budget in two storages: two configurations in every table, each its own score."""
    write_run(tmp_path, binary_rows([1] * N), method="full", budget=None)
    _run(tmp_path, "snapstream", 1024, "none", 0)  # 100 points
    _run(tmp_path, "snapstream", 1024, "int2", 100)  # 50 points
    rep = build(settings(results_dir=str(tmp_path)))
    head = rep.headline
    assert sorted(zip(head.storage, head.compressed)) == [("int2", 50.0), ("none", 100.0)]
    by_task = {r["storage"]: r for r in rep.by_task}
    assert by_task["none"]["budget"] == 1024 and by_task["int2"]["budget"] is None  # int2 is worse
    assert {r["storage"] for r in rep.by_model} == {"none", "int2"}
    long, wide, _ = leaderboard.build(tmp_path)
    rows = wide[wide.method == "snapstream"].set_index("storage")
    assert rows.loc["none", "1024"] == 100.0 and rows.loc["int2", "1024"] == 50.0  # never (100 + 50) / 2
    assert set(long[long.headline].storage) == {"none", "int2"}
    csv = (tmp_path / "leaderboard_wide.csv").read_text()
    assert "75.00" not in csv


def test_full_cache_in_a_quantized_storage_is_compared_not_the_reference(tmp_path):
    """A full cache held in int4 is paired with the full cache in the model dtype, never used as it."""
    write_run(tmp_path, binary_rows([1] * N), method="full", budget=None)
    _run(tmp_path, "full", None, "int4", WORSE)
    _run(tmp_path, "snapstream", 1024, "none", 0)
    rep = build(settings(results_dir=str(tmp_path)))
    assert rep.problems == []
    assert set(rep.headline.full_run) == {"ruler/smollm2_135m/full/none"}
    quant = rep.headline[rep.headline.storage == "int4"].iloc[0]
    assert quant.verdict == "worse" and quant.budget != quant.budget  # NaN: no budget
    _, wide, _ = leaderboard.build(tmp_path)
    assert wide.set_index("storage").loc["int4", "all"] == 100.0 * (N - WORSE) / N


def test_old_and_new_runs_of_every_storage_share_one_problem_set(tmp_path):
    """A full run from before the storage axis (no `kv`), runs recording `kv: none` and `kv: int4`: one
    problem set (paired, one leaderboard panel, one `generation`), the storages its lines."""
    write_run(tmp_path, binary_rows([1] * N), method="full", budget=None)  # no `kv`: an old run
    _run(tmp_path, "snapstream", 1024, "none", 0)  # a new run in the model dtype records `kv: none`
    _run(tmp_path, "snapstream", 1024, "int4", 0)
    rep = build(settings(results_dir=str(tmp_path)))
    assert rep.problems == [] and len(rep.headline) == 2
    assert len({r.generation for r in rep.runs}) == 1
    (panel,) = leaderboard.panels(rep.runs)[("ruler", "smollm2_135m")]
    assert set(panel["lines"]) == {"snapstream", "snapstream + int4"}


def test_runs_of_other_generation_settings_never_share_a_section(tmp_path):
    """SnapStream 256 paired with its own full run at seed 0 (12 of 200 lost: worse) and at seed 1 (none
    lost): two sections, `ruler (seed=0)` and `ruler (seed=1)`, each with its own frontier and
    recommendation; the per-model recommendation sees the worse one (both shared one `ruler` before, the
    model's recommendation kept only the seed-1 verdict and the frontier listed `snapstream 256` twice)."""
    import shutil

    for seed, lost in ((0, WORSE), (1, 0)):
        alone = tmp_path / f"seed{seed}"
        write_run(alone, binary_rows([1] * N), method="full", budget=None, seed=seed)
        write_run(
            alone, binary_rows([0] * lost + [1] * (N - lost)), method="snapstream", budget=256, seed=seed
        )
        shutil.copytree(alone / "runs" / "ruler", tmp_path / "both" / "runs" / f"ruler-seed{seed}")
    rep = build(settings(results_dir=str(tmp_path / "both")))
    assert not rep.problems
    verdicts = dict(zip(rep.headline.task, rep.headline.verdict))
    assert verdicts == {"ruler (seed=0)": "worse", "ruler (seed=1)": "non-inferior"}
    assert sorted(rep.frontier) == [("smollm2_135m", "ruler (seed=0)"), ("smollm2_135m", "ruler (seed=1)")]
    assert all(len(front) == 2 for front in rep.frontier.values())  # the configuration and the full cache
    (model,) = [r for r in rep.by_model if r["method"] == "snapstream"]
    assert model["budget"] is None and "non-inferior on every task" in model["status"]
    assert write_report(rep.settings)
    assert (tmp_path / "both" / "report" / "pareto_ruler_seed_0_smollm2_135m.png").is_file()
