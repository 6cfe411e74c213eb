"""The deployment report (evalkit/report): pairing and its refusals, one-sided samples, repeats kept together,
the memory join, recommendations, missing cells, bad input, the CLI. Run folders are fabricated in the
runner's format (tests/runs_fixture.py); no model runs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from evalkit.memory.model import count_parameters
from evalkit.report import settings, write_report
from evalkit.report.build import build
from evalkit.report.pairing import PairingError, pair, partner
from evalkit.report.runs import RunError, load_runs
from tests.runs_fixture import SMOL_CONFIG, binary_rows, sample_row, write_run

ROOT = Path(__file__).resolve().parents[2]


def runs_by_rel(root: Path) -> dict:
    return {r.rel: r for r in load_runs(root)[0]}


def the_pair(root: Path):
    runs = runs_by_rel(root)
    comp = next(r for r in runs.values() if not r.is_full)
    return comp, [r for r in runs.values() if r.is_full]


# --- pairing refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, full_kw, comp_kw, says",
    [
        ("task_version", {"task_version": 1}, {"task_version": 2}, "task_version 2 vs 1"),
        ("data hash", {"data_hash": "a" * 64}, {"data_hash": "b" * 64}, "data hash 'bbbb"),
        ("seed", {"seed": 0}, {"seed": 1}, "seed 1 vs 0"),
    ],
)
def test_refuses_runs_that_generated_differently(tmp_path, field, full_kw, comp_kw, says):
    write_run(tmp_path, binary_rows([1] * 30), method="full", budget=None, **full_kw)
    write_run(tmp_path, binary_rows([1] * 30), budget=256, **comp_kw)
    comp, fulls = the_pair(tmp_path)
    with pytest.raises(PairingError) as e:
        partner(comp, fulls)
    msg = str(e.value)
    assert "ruler/smollm2_135m/snapstream/256" in msg and "ruler/smollm2_135m/full/none" in msg
    assert says in msg


def test_refuses_runs_scored_differently(tmp_path):
    write_run(tmp_path, binary_rows([1] * 30), method="full", budget=None, scorer_version=1)
    write_run(tmp_path, binary_rows([1] * 30), budget=256, scorer_version=2)
    comp, fulls = the_pair(tmp_path)
    with pytest.raises(PairingError, match=r"full/none: scored differently \(scorer_version 2 vs 1\)"):
        partner(comp, fulls)


def test_refuses_differing_prompt_hashes(tmp_path):
    full = binary_rows([1] * 30)
    comp = binary_rows([1] * 30)
    comp[4]["prompt_hash"] = "another rendering"
    write_run(tmp_path, full, method="full", budget=None)
    write_run(tmp_path, comp, budget=256)
    c, fulls = the_pair(tmp_path)
    with pytest.raises(
        PairingError,
        match=r"snapstream/256 cannot be paired with .*full/none: prompt hashes differ for 1 of 30 .*'s4'",
    ):
        pair(c, partner(c, fulls), settings())


def test_refuses_when_no_sample_id_is_shared_and_when_no_full_run_exists(tmp_path):
    write_run(tmp_path, binary_rows([1] * 30, prefix="a"), method="full", budget=None)
    write_run(tmp_path, binary_rows([1] * 30, prefix="b"), budget=256)
    c, fulls = the_pair(tmp_path)
    with pytest.raises(PairingError, match="no sample id in common"):
        pair(c, partner(c, fulls), settings())
    with pytest.raises(
        PairingError, match="no `full` run of model smollm2_135m on task ruler: run `make eval"
    ):
        partner(c, [])


def test_pairs_old_runs_without_identity_on_their_config_and_says_so(tmp_path):
    write_run(tmp_path, binary_rows([1] * 30), method="full", budget=None, identity=False)
    write_run(tmp_path, binary_rows([1] * 30), budget=256, identity=False)
    write_run(tmp_path / "other", binary_rows([1] * 30), method="full", budget=None, identity=False, seed=7)
    c, fulls = the_pair(tmp_path)
    p = pair(c, partner(c, fulls), settings())
    assert p.full.rel == "ruler/smollm2_135m/full/none" and "derived from provenance.config" in p.notes[0]
    other = load_runs(tmp_path / "other")[0][0]
    with pytest.raises(PairingError, match="seed 0 vs 7"):
        partner(c, [other])


# --- one-sided samples, repeats ------------------------------------------------------------------------


def test_one_sided_samples_are_counted_and_left_out(tmp_path):
    full = binary_rows([1] * 40)  # s0..s39
    comp = [r for r in binary_rows([0] * 5 + [1] * 35) if r["id"] not in ("s38", "s39")]
    comp.append(sample_row("extra", [{"score": 0.0}]))
    write_run(tmp_path, full, method="full", budget=None)
    write_run(tmp_path, comp, budget=256)
    c, fulls = the_pair(tmp_path)
    p = pair(c, partner(c, fulls), settings())
    assert (p.only_compressed, p.only_full) == (["extra"], ["s38", "s39"])
    cell = p.cells["score"]
    assert cell["n_paired"] == 38 and cell["paired_diff"] == pytest.approx(-500 / 38)
    assert cell["test"] == "mcnemar" and cell["p_value"] == pytest.approx(sps.binomtest(5, 5, 0.5).pvalue)
    md = (Path(write_report(settings(results_dir=str(tmp_path)))["md"])).read_text()
    assert "1 samples only in the compressed run, 2 only in the full run: left out" in md


def test_repeats_of_a_problem_stay_together(tmp_path):
    """k = 4 repeats per problem, perfectly correlated: the CI must be scipy's paired bootstrap over the 40
    problems, not over the 160 repeats (which is half as wide and would call noise a verdict)."""
    g = np.random.default_rng(0)
    fo, co = g.random(40) < 0.6, g.random(40) < 0.5
    full = [sample_row(f"p{i}", [{"pass@1": 100.0 * fo[i]}] * 4) for i in range(40)]
    comp = [sample_row(f"p{i}", [{"pass@1": 100.0 * co[i]}] * 4) for i in range(40)]
    kw = {"task": "aime24", "headline": "pass@1", "repeats": 4}
    write_run(tmp_path, full, method="full", budget=None, **kw)
    write_run(tmp_path, comp, budget=256, **kw)
    c, fulls = the_pair(tmp_path)
    cell = pair(c, partner(c, fulls), settings()).cells["pass@1"]
    assert cell["n_paired"] == 40 and cell["test"] == "sign-flip"  # k > 1: not McNemar

    def ci(a, b):
        r = sps.bootstrap(
            (a, b),
            lambda x, y, axis=-1: np.mean(x - y, axis=axis),
            paired=True,
            vectorized=True,
            n_resamples=20_000,
            method="percentile",
            rng=np.random.default_rng(1),
        )
        return r.confidence_interval.low, r.confidence_interval.high

    lo, hi = ci(100.0 * co, 100.0 * fo)
    assert cell["ci_low"] == pytest.approx(lo, abs=0.05 * (hi - lo))
    assert cell["ci_high"] == pytest.approx(hi, abs=0.05 * (hi - lo))
    rlo, rhi = ci(np.repeat(100.0 * co, 4), np.repeat(100.0 * fo, 4))  # repeats resampled apart
    assert cell["ci_high"] - cell["ci_low"] > 1.6 * (rhi - rlo)


def test_differing_repeat_counts_pair_by_repeat_index(tmp_path):
    """Repeats are paired on their index: a run with 2 repeats against one with 4 compares repeats 0-1;
    cons@k is not a mean over repeats, so those problems are left out of it and counted."""
    full = [
        sample_row(f"p{i}", [{"pass@1": 100.0, "cons@k": 100.0}] * 2 + [{"pass@1": 0.0, "cons@k": 0.0}] * 2)
        for i in range(30)
    ]
    for r in full:
        r["scores"]["cons@k"] = 100.0  # majority over 4 (a tie broken to the first): not the mean, 50
    comp = [sample_row(f"p{i}", [{"pass@1": 100.0, "cons@k": 100.0}] * 2) for i in range(30)]
    kw = {"task": "aime24", "headline": "pass@1", "identity": False}
    write_run(tmp_path, full, method="full", budget=None, repeats=4, **kw)
    write_run(tmp_path, comp, budget=256, repeats=2, **kw)
    runs = runs_by_rel(tmp_path)
    p = pair(runs["aime24/smollm2_135m/snapstream/256"], runs["aime24/smollm2_135m/full/none"], settings())
    assert p.cells["pass@1"]["paired_diff"] == 0.0  # repeats 0-1 on both sides: 100 vs 100, not 100 vs 50
    assert "cons@k" not in p.cells
    assert any("cons@k: 30 problems left out" in n for n in p.notes)


def test_crossed_breakdowns_and_extra_metrics(tmp_path):
    """LongBench-v2 subsets `easy|short` give `accuracy/easy@short`; conf/report.yaml adds AIME's cons@k."""
    rows = [
        sample_row(
            f"q{i}",
            [{"accuracy": 100.0, "accuracy/easy": 100.0, "accuracy/short": 100.0, "no_answer": 0.0}],
            subset="easy|short",
        )
        for i in range(3)
    ]
    write_run(tmp_path, rows, method="full", budget=None, task="longbench_v2", headline="accuracy")
    write_run(tmp_path, rows, budget=256, task="longbench_v2", headline="accuracy")
    c, fulls = the_pair(tmp_path)
    keys = set(pair(c, partner(c, fulls), settings()).cells)
    assert keys == {"accuracy", "accuracy/easy", "accuracy/short", "accuracy/easy@short"}  # no no_answer
    assert settings().extras_for("aime24") == ["cons@k"]


# --- the memory join ------------------------------------------------------------------------------------


def test_memory_join_by_hand(tmp_path):
    """SmolLM2-135M in bf16: 2 (K, V) x 30 layers x 3 KV heads x 64 x 2 bytes = 23,040 B per cached token.
    H200: 8 sockets; tp = gcd(8, 9 heads) = 1; each socket holds the whole model and its own sequences."""
    write_run(tmp_path, binary_rows([1] * 30), method="full", budget=None, peak=(2000, 2100))
    write_run(tmp_path, binary_rows([1] * 30), budget=256)
    write_run(tmp_path, binary_rows([1] * 30), method="snapkv", budget=512)
    cells = build(settings(results_dir=str(tmp_path))).headline.set_index("method")
    snap, snapkv = cells.loc["snapstream"], cells.loc["snapkv"]
    assert snap.kv_bytes_seq == 23_040 * 256 and snap.kv_bytes_seq_full == 23_040 * 2100
    assert snapkv.kv_entries == 512 + 100  # min(prompt, budget) + the 100 generated tokens
    assert snap.memory_saving == pytest.approx(1 - 256 / 2100)
    room = math.floor(140.4 * 2**30) - count_parameters(SMOL_CONFIG)[0] * 2
    assert snap.max_batch_h200 == 8 * (room // (23_040 * 256))
    assert snap.max_batch_full_h200 == 8 * (room // (23_040 * 2100))
    assert snap.tp_h200 == 1 and snap.tp_sn40l == 1
    # memory-bound decode: tok/s = batch / (bytes read / bandwidth); at max batch the KV fills the same room
    assert 1 < snap.tok_s_gain_h200 < 2100 / 256 + 0.1
    assert snap.kv_kept_fraction == 0.25


# --- recommendations, missing cells, bad input ---------------------------------------------------------


def _sweep(root: Path, task: str, outcomes: dict) -> None:
    write_run(root, binary_rows([1] * 200), method="full", budget=None, task=task)
    for budget, lost in outcomes.items():
        write_run(root, binary_rows([0] * lost + [1] * (200 - lost)), budget=budget, task=task)


def test_recommendation_per_task_and_per_model(tmp_path):
    _sweep(tmp_path, "ruler", {128: 12, 256: 0, 512: 0})  # 128 worse, 256 and 512 non-inferior
    _sweep(tmp_path, "longbench_v2", {128: 12, 256: 3, 512: 0})  # 256 inconclusive here (-1.5, CI to 0)
    rep = build(settings(results_dir=str(tmp_path)))
    verdicts = {(r.task, r.budget): r.verdict for r in rep.headline.itertuples()}
    assert verdicts[("ruler", 128)] == "worse" and verdicts[("ruler", 256)] == "non-inferior"
    assert verdicts[("longbench_v2", 256)] == "inconclusive"
    by_task = {r["task"]: r for r in rep.by_task}
    assert by_task["ruler"]["budget"] == 256 and by_task["longbench_v2"]["budget"] == 512
    assert by_task["ruler"]["memory_saving"] == pytest.approx(1 - 256 / 2100)
    (model,) = rep.by_model
    assert model["budget"] == 512 and model["blockers"][256] == {"longbench_v2": "inconclusive"}


def test_no_budget_qualifies_says_how_many_problems_would_decide(tmp_path):
    _sweep(tmp_path, "ruler", {256: 3})
    (rec,) = build(settings(results_dir=str(tmp_path))).by_task
    assert rec["budget"] is None
    assert rec["status"].startswith("inconclusive; paired problems that would decide: 256: ~")


def test_partial_sweep_lists_missing_cells_and_unfinished_runs(tmp_path):
    _sweep(tmp_path, "ruler", {128: 0, 256: 0})
    _sweep(tmp_path, "longbench_v2", {128: 0})
    killed = tmp_path / "runs" / "longbench_v2" / "smollm2_135m" / "snapstream" / "512"
    killed.mkdir(parents=True)
    (killed / "config.yaml").write_text("x: 1\n")
    (killed / "generations.jsonl").write_text('{"key": "a"}\n{"key": "b"}\n')
    s = settings(results_dir=str(tmp_path), expect={"tasks": ["aime24"], "methods": [], "budgets": []})
    missing = build(s).missing
    assert "longbench_v2/smollm2_135m/snapstream/256: missing" in missing
    assert "aime24/smollm2_135m/full: missing (no full run: nothing on this task can be paired)" in missing
    assert "aime24/smollm2_135m/snapstream/128: missing" in missing
    assert (
        "longbench_v2/smollm2_135m/snapstream/512: unfinished (2 generations journaled, no metrics.json)"
        in missing
    )
    assert not any(m.startswith("ruler/") for m in missing)


def test_a_data_parallel_run_in_progress_is_unfinished_with_its_shards_counted(tmp_path):
    """Replicas 1 and 2 journal into their own shards until the run scores: their generations count, and
    the note says why the run has no metrics yet."""
    _sweep(tmp_path, "ruler", {128: 0})
    running = tmp_path / "runs" / "ruler" / "smollm2_135m" / "snapstream" / "512"
    running.mkdir(parents=True)
    (running / "config.yaml").write_text("x: 1\n")
    (running / "generations.jsonl").write_text('{"key": "a"}\n')
    (running / "generations.dp1.jsonl").write_text('{"key": "b"}\n{"key": "d"}\n')
    (running / "generations.dp2.jsonl").write_text('{"key": "c"}\n')
    missing = build(settings(results_dir=str(tmp_path))).missing
    assert (
        "ruler/smollm2_135m/snapstream/512: unfinished (4 generations journaled in 3 files: a data-parallel "
        "run whose 2 replica shard(s) are not folded into generations.jsonl yet, no metrics.json)"
    ) in missing


def test_an_unfinished_run_cut_inside_a_utf8_character_is_counted_not_a_crash(tmp_path):
    """`make report` while a run is killed mid-write (its journal ends inside a UTF-8 character) or mid-fold
    (a record in its shard and in generations.jsonl): each request counts once, a torn line or a shard's
    stamp counts none."""
    _sweep(tmp_path, "ruler", {128: 0})
    running = tmp_path / "runs" / "ruler" / "smollm2_135m" / "snapstream" / "512"
    running.mkdir(parents=True)
    (running / "config.yaml").write_text("x: 1\n")
    (running / "generations.jsonl").write_bytes('{"key": "a"}\n{"key": "b", "text": "é'.encode()[:-1])
    (running / "generations.dp1.jsonl").write_text('{"run": "0123"}\n{"key": "c"}\n{"key": "a"}\n')
    missing = build(settings(results_dir=str(tmp_path))).missing
    assert (
        "ruler/smollm2_135m/snapstream/512: unfinished (2 generations journaled in 2 files: a data-parallel "
        "run whose 1 replica shard(s) are not folded into generations.jsonl yet, no metrics.json)"
    ) in missing


def test_a_shard_left_beside_a_finished_run_is_reported(tmp_path):
    """The runner keeps a shard it could not read whole when it scores; the report names it and its line."""
    folder = write_run(tmp_path, binary_rows([1] * 3))
    (folder / "generations.dp1.jsonl").write_text('{"run": "0123"}\n{"key": "a"}\n{"key": "b", "te')
    _, notes = load_runs(tmp_path)
    assert notes == [
        f"{folder}/generations.dp1.jsonl is left beside a scored run (line 2: missing 'doc_id'; line 3: not "
        "valid JSON (a write cut short)): its readable records are in generations.jsonl and every request "
        "the run scored was generated; delete the file once you have looked"
    ]


def test_bad_input_is_named_and_the_rest_of_the_report_is_written(tmp_path):
    _sweep(tmp_path, "ruler", {256: 0})  # the good pair
    write_run(tmp_path, binary_rows([1] * 30), budget=256, task="aime24", headline="pass@1")  # no full run
    write_run(
        tmp_path, binary_rows([1] * 30), method="full", budget=None, task="longbench_v2", task_version=1
    )
    write_run(tmp_path, binary_rows([1] * 30), budget=256, task="longbench_v2", task_version=2)  # mismatched
    write_run(tmp_path, binary_rows([1] * 30), method="full", budget=None, task="livecodebench")
    empty = write_run(tmp_path, [], budget=256, task="livecodebench")  # an empty run
    bad = tmp_path / "runs" / "ruler" / "smollm2_135m" / "streamingllm" / "64"
    bad.mkdir(parents=True)
    (bad / "metrics.json").write_text('{"task": "ruler", "mod')
    paths = write_report(settings(results_dir=str(tmp_path)))
    md = Path(paths["md"]).read_text()
    problems = md.split("## Problems")[1].split("## Missing")[0]
    assert (
        "aime24/smollm2_135m/snapstream/256: no `full` run of model smollm2_135m on task aime24" in problems
    )
    assert (
        "longbench_v2/smollm2_135m/snapstream/256 cannot be paired with longbench_v2/smollm2_135m/full/none: "
        "task_version 2 vs 1"
    ) in problems
    assert f"{empty.relative_to(tmp_path / 'runs').as_posix()}: empty run" in problems
    assert "streamingllm/64/metrics.json: skipped (JSONDecodeError" in problems
    assert "## ruler / smollm2_135m" in md and "| snapstream | 256 |" in md  # the good pair is still there
    csv = pd.read_csv(paths["csv"])
    assert set(csv.task) == {"ruler"} and set(csv.verdict) == {"non-inferior"}
    for key in ("forest_smollm2_135m_ruler", "pareto_smollm2_135m_ruler"):
        assert Path(paths[key]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unreadable_samples_file_names_the_line(tmp_path):
    folder = write_run(tmp_path, binary_rows([1] * 3), budget=256)
    (folder / "samples.jsonl").write_text(json.dumps(binary_rows([1])[0]) + "\n{broken\n")
    (run,) = load_runs(tmp_path)[0]
    with pytest.raises(RunError, match="snapstream/256/samples.jsonl line 2: unreadable row"):
        run.samples()


# --- the CLI --------------------------------------------------------------------------------------------


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "evalkit.report", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        env={"PYTHONPATH": str(ROOT), "HOME": str(cwd)},
    )


def test_cli_help_and_bad_settings(tmp_path):
    out = _cli("--help", cwd=tmp_path)
    assert out.returncode == 0 and "margin" in out.stdout and list(tmp_path.iterdir()) == []
    out = _cli(f"results_dir={tmp_path}", "margin=-1", cwd=tmp_path)
    assert out.returncode == 2 and "margin must be a positive number, got -1" in out.stderr
    assert "Traceback" not in out.stderr
    out = _cli("--bogus", cwd=tmp_path)
    assert out.returncode != 0 and "unrecognized arguments: --bogus" in out.stderr


def test_tensor_parallel_auto_is_the_largest_degree_dividing_sockets_and_heads():
    from evalkit.memory.model import model_spec
    from evalkit.report.budget import deployment, load_hardware

    hw = load_hardware(["sn40l", "h200", "h100"])
    deploy = settings().deploy
    llama8b = dict(SMOL_CONFIG, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096)
    spec = model_spec("llama", llama8b, "bf16", "bf16")
    assert {n: deployment(spec, h, deploy).tp for n, h in hw.items()} == {"sn40l": 16, "h200": 8, "h100": 8}
    assert hw["h100"].hbm_bytes == round(79.6 * 2**30) and hw["h100"].hbm_bw == hw["h200"].hbm_bw * 3.35 / 4.8
    assert deployment(spec, hw["h200"], deploy | {"tp": 2}).tp == 2


def test_no_runs_folder_is_a_clear_error(tmp_path):
    from evalkit.report import ReportConfigError

    with pytest.raises(
        ReportConfigError, match=r"no runs under .*/runs: run `make eval` \(full and a budget\)"
    ):
        build(settings(results_dir=str(tmp_path)))


@pytest.mark.parametrize(
    "override, says",
    [
        ({"deploy": {"tp": "auto"}}, "deploy.hardware must be a non-empty list"),
        ({"margins": {"ruler": 0}}, "margins.ruler must be a positive number, got 0"),
        ({"confidence": 1.0}, "confidence must be in (0, 1), got 1.0"),
        (
            {"bootstrap": {"resamples": 10, "seed": 0}},
            "bootstrap.resamples must be an integer >= 100, got 10",
        ),
        ({"min_problems": 2.5}, "min_problems must be an integer, got 2.5"),
    ],
)
def test_bad_settings_name_the_key(override, says):
    from evalkit.report import ReportConfigError

    with pytest.raises(ReportConfigError) as e:
        settings(**override)
    assert says in str(e.value)


def test_per_task_margin_overrides_the_default():
    s = settings(margins={"aime24": 5.0, "ruler": None})
    assert s.stats_for("aime24").margin == 5.0 and s.stats_for("ruler").margin == 2.0


def test_missing_cells_keep_query_agnostic_configurations_apart(tmp_path):
    """A query-agnostic 128 on ruler once stood in for the query-aware 128 a longbench run makes expected."""
    _sweep(tmp_path, "ruler", {})
    write_run(tmp_path, binary_rows([1] * 30), budget=128, query_aware=False)
    _sweep(tmp_path, "longbench_v2", {128: 0})
    missing = build(settings(results_dir=str(tmp_path))).missing
    assert "ruler/smollm2_135m/snapstream/128: missing" in missing
    assert "longbench_v2/smollm2_135m/snapstream/128 (query-agnostic): missing" in missing


def test_a_fold_killed_midway_counts_each_request_once(tmp_path):
    """Rank 0 killed while folding a shard: its records are in generations.jsonl and still in the shard (a
    6-request run once read '8 generations journaled'); a journal cut inside a UTF-8 character is read too."""
    _sweep(tmp_path, "ruler", {128: 0})
    folder = tmp_path / "runs" / "ruler" / "smollm2_135m" / "snapstream" / "512"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("x: 1\n")
    lines = [json.dumps({"key": k}) for k in "abcdef"]
    torn = '{"key": "\u00e9'.encode()[:-1]  # cut inside the 2-byte UTF-8 character
    (folder / "generations.jsonl").write_bytes(("\n".join(lines) + "\n").encode() + torn)
    (folder / "generations.dp1.jsonl").write_text("\n".join(lines[3:]) + "\n")
    (unfinished,) = [m for m in build(settings(results_dir=str(tmp_path))).missing if "unfinished" in m]
    assert "(6 generations journaled in 2 files" in unfinished


def test_a_deploy_tp_the_model_cannot_take_is_named_as_deploy_tp(tmp_path):
    """The report's own setting, never the memory report's `parallel.tp` the user did not give."""
    _sweep(tmp_path, "ruler", {128: 0})
    base = settings(results_dir=str(tmp_path))
    rep = build(replace(base, deploy=base.deploy | {"tp": 8}))
    (problem,) = rep.problems
    assert problem.endswith(
        "memory model not joined (MemoryReportError: deploy.tp=8 does not divide both sn40l's 16 sockets and "
        "the 9 attention heads of smollm2_135m: set deploy.tp=auto (the largest that does))"
    )
