"""The bench package (evalkit.bench): the roofline's arithmetic, throughput at a fixed KV budget (batches, the
replicated prefill, the evalkit.memory prediction), the summary assembled from CSVs, and the CLI. CPU, tiny
random models, seconds; no wall-clock thresholds (the figures themselves are `make bench`'s business)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import evalkit.bench.__main__ as cli
from evalkit.bench import bucketed, compiled, decode_speed, grading, roofline
from evalkit.bench.base import Measurement, read_csv, write_csv
from evalkit.bench.fixed_kv import fixed_kv, predictions, replicated
from evalkit.bench.summary import record_provenance, write_summary
from evalkit.bench.timing import recorded_prefill
from evalkit.kv import Full, KVCache, SnapStream, generate
from evalkit.kv.prefill import populate
from tests.conftest import TINY, tiny_model

ROOT = Path(__file__).resolve().parents[1]
# tiny_llama: K and V x 2 layers x 2 KV heads x head_dim 16 x fp32
SLOT_BYTES = 2 * 2 * 2 * 16 * 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(3))


REAL_COPY_BANDWIDTH = roofline.copy_bandwidth


BANDWIDTH = 10e9  # bytes/s


@pytest.fixture(autouse=True)
def fixed_bandwidth(monkeypatch):
    """The bench copies 1 GiB to measure bandwidth (tested on its own below); elsewhere a fixed figure keeps
    the roofline arithmetic exact."""
    monkeypatch.setattr(roofline, "copy_bandwidth", lambda nbytes, reps, device="cpu": [BANDWIDTH] * reps)


# --- roofline ---------------------------------------------------------------------------------------


def test_copy_bandwidth_counts_the_read_and_the_write():
    ticks = iter([0.0, 0.5, 10.0, 10.25])  # two copies: 0.5 s, then 0.25 s
    nbytes = 3 * 2**20
    out = REAL_COPY_BANDWIDTH(nbytes, 2, "cpu", clock=lambda: next(ticks))
    assert out == [2 * nbytes / 0.5, 2 * nbytes / 0.25]  # read nbytes + write nbytes per copy


def test_weight_bytes_counts_a_tied_embedding_once():
    from evalkit.loading import random_model
    from evalkit.memory import count_parameters
    from evalkit.models import ModelSpec

    untied = tiny_model("llama")
    tied = random_model(ModelSpec(name="tied", random=TINY["llama"] | {"tie_word_embeddings": True}))
    embedding = 256 * 64 * 4  # vocab x hidden x fp32
    assert roofline.weight_bytes(untied) - roofline.weight_bytes(tied) == embedding
    for m in (untied, tied):  # what evalkit.memory counts from the config is what the model holds
        assert roofline.weight_bytes(m) == 4 * count_parameters(m.config)[0]


def test_floor_is_bytes_over_bandwidth_and_the_step_a_percentage_of_it():
    cols = roofline.floor_columns(step_s=0.5, weights=6 * 10**9, kv_read=4 * 10**9, bandwidth=50 * 10**9)
    assert cols["floor_ms"] == 200.0  # (6 + 4) GB / 50 GB/s
    assert cols["step_pct_of_floor"] == 250.0
    assert (cols["weight_bytes"], cols["kv_read_bytes"], cols["bandwidth_gb_s"]) == (
        6 * 10**9,
        4 * 10**9,
        50.0,
    )


def test_decode_speed_rows_carry_the_kv_each_step_reads(model, ids):
    rows = decode_speed(model, ids, [64], steps=4, rounds=2)
    full, snap = rows
    forwards = 2 * 2  # rounds x steps per round (warm-ups included): the full cache grew by one slot each
    assert full["kv_read_bytes"] == (200 + 200 + forwards) / 2 * SLOT_BYTES
    assert snap["kv_read_bytes"] == 64 * SLOT_BYTES  # a fixed-size cache reads its budget every step
    for r in rows:
        assert r["weight_bytes"] == roofline.weight_bytes(model)
        assert r["bandwidth_gb_s"] == BANDWIDTH / 1e9
        assert r["floor_ms"] == round(1e3 * (r["weight_bytes"] + r["kv_read_bytes"]) / BANDWIDTH, 4)
        assert r["step_pct_of_floor"] == pytest.approx(100 * r["step_ms"] / r["floor_ms"], rel=0.01)


# --- throughput at a fixed KV budget -------------------------------------------------------------------


def test_replicated_prefill_decodes_what_generate_decodes(model, ids):
    """B rows populated from one recorded prefill are B real requests: greedy tokens equal
    evalkit.kv.generate's."""
    record, first = recorded_prefill(model, ids)
    for method in (Full(), SnapStream(budget=64)):
        ref, _ = generate(model, ids, method, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        cache = KVCache.for_model(method, model)
        populate(cache, replicated(record, 3))
        token, out = first.repeat(3, 1), [first.repeat(3, 1)]
        with torch.inference_mode():
            for _ in range(5):
                token = model(token, cache=cache).logits[:, -1:].argmax(-1)
                out.append(token)
        assert torch.equal(torch.cat(out, 1), ref[:, 200:].expand(3, -1)), method.name


KV_BUDGET = 350_000  # bytes: 3 full rows of 204 slots (313,344 B), 10 SnapStream-64 rows (327,680 B)


def test_fixed_kv_fills_the_budget_with_the_largest_batch(model, ids):
    rows = fixed_kv(model, ids, KV_BUDGET, [64], steps=4, rounds=2, copy_bytes=2**20)
    full, snap = rows
    assert (full["batch"], snap["batch"]) == (3, 10)
    for r in rows:  # evalkit.memory's batch, checked against the real caches' bytes after decoding
        assert r["max_batch_measured"] == r["batch"]
        assert r["batch"] * r["kv_bytes_per_row"] <= KV_BUDGET < (r["batch"] + 1) * r["kv_bytes_per_row"]
        assert r["kv_bytes_batch"] == r["batch"] * r["kv_bytes_per_row"]
    assert full["kv_slots_per_row"] == 200 + 4 and snap["kv_slots_per_row"] == 64
    assert full["attn_ms"] > 0 and snap["attn_ms"] > 0  # the attention part of a step, timed per cache
    assert full["gain_vs_full"] == 1 and snap["gain_vs_full"] == round(
        snap["decode_tok_s"] / full["decode_tok_s"], 2
    )


def test_prediction_is_the_memory_roofline_at_the_measured_bandwidth(model):
    """evalkit.memory's tok/s for this setting = batch x bandwidth / (weights + batch x KV per row)."""
    bw, weights = 7e9, roofline.weight_bytes(model)
    full, snap = predictions(model, [Full(), SnapStream(budget=64)], 200, 4, KV_BUDGET, bw)
    assert (full["batch"], snap["batch"]) == (3, 10)
    assert full["tok_s"] == pytest.approx(3 * bw / (weights + 3 * 204 * SLOT_BYTES))
    assert snap["tok_s"] == pytest.approx(10 * bw / (weights + 10 * 64 * SLOT_BYTES))


def test_a_budget_below_one_full_row_is_refused_before_the_prefill(model, ids):
    with pytest.raises(ValueError, match="does not fit a KV budget .* even at batch 1"):
        fixed_kv(model, ids, 100_000, [64], steps=4, rounds=2, copy_bytes=2**20)


# --- summary and CLI -----------------------------------------------------------------------------------


def fake(name: str) -> Measurement:
    """A measurement as a later module would add one (no model needed)."""
    return Measurement(
        name,
        f"{name}.csv",
        f"Title of {name}",
        lambda ctx: [{"x": 1, "quick": ctx.quick}],
        note=lambda rows: f"note of {name}: {len(rows)} rows",
    )


def test_summary_is_assembled_from_whatever_csvs_are_there(tmp_path):
    first, second, absent = fake("first"), fake("second"), fake("absent")
    write_csv(tmp_path / first.csv, [{"x": 1}, {"x": 2}])  # an earlier run's, no provenance recorded
    write_csv(tmp_path / second.csv, [{"x": 3}])
    record_provenance(tmp_path, "second", "python -m evalkit.bench --only second", quick=True)
    text = write_summary(
        tmp_path, [first, second, absent], {"second"}, "python -m evalkit.bench --only second"
    )
    assert (tmp_path / "summary.md").read_text() == text
    assert (
        "## Title of first" in text and "note of first: 2 rows" in text and "## Title of absent" not in text
    )
    assert text.index("## Title of first") < text.index("## Title of second")  # registry order
    assert "Kept from an earlier run (no provenance recorded)" in text
    assert (
        "Measured by this command: `python -m evalkit.bench --only second`" in text
        and "torch threads)" in text
        and "--quick sizes" in text
    )
    assert "kept from earlier runs (their CSVs): first" in text


def test_registry_names_its_modules_and_keeps_the_published_file_names():
    records = {name: cli.measurement(name) for name in cli.names()}
    assert all(m.name == name for name, m in records.items())
    csvs = [m.csv for m in records.values()]
    assert len(set(csvs)) == len(csvs)
    published = {
        "prefill_overhead.csv",
        "decode_speed.csv",
        "memory.csv",
        "decode_steps.csv",
        "batch_throughput.csv",
        "sweep_prefill.csv",
        "compiled_decode.csv",
        "grading.csv",
    }
    assert published <= set(csvs)


def test_cli_runs_only_what_is_asked_and_writes_csv_provenance_summary(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    two = Measurement(
        "two",
        "two.csv",
        "Title of two",
        lambda ctx: [{"quick": ctx.quick, "threads": torch.get_num_threads()}],
        note=lambda rows: "note of two",
    )
    monkeypatch.setattr(cli, "MEASUREMENTS", {"one": "one", "two": "two"})
    monkeypatch.setattr(cli, "measurement", {"one": fake("one"), "two": two}.__getitem__)
    try:
        cli.main(["--only", "two", "--quick", "--threads", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert read_csv(tmp_path / "two.csv") == [{"quick": True, "threads": 1}]
    assert not (tmp_path / "one.csv").exists()
    assert "## Title of two" in (tmp_path / "summary.md").read_text()
    assert (
        '"command": "python -m evalkit.bench --only two --quick --threads 1 --out'
        in (tmp_path / "provenance.json").read_text()
    )


def run_bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "evalkit.bench", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def test_unknown_measurement_fails_before_the_model_loads(tmp_path):
    # `--only bogus` once loaded the model, measured nothing, exited 0 and rewrote summary.md
    env = os.environ | {"EVALKIT_CACHE": str(tmp_path / "cache")}  # loading the model would convert into it
    proc = run_bench("--only", "decode,bogus", "--out", str(tmp_path / "out"), env=env)
    assert proc.returncode == 2
    assert "--only: unknown measurement(s) 'bogus'; choose from: prefill, decode, fixed_kv" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_help_lists_the_measurements(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: python -m evalkit.bench")
    assert "measurements, in the order they run: prefill, decode, fixed_kv, memory" in " ".join(out.split())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--only", "decode,decode"], "named twice"),
        (["--only", ""], "unknown measurement(s) ''"),
        (["--memory-child", "16k"], "LENGTH:BUDGET"),
        (["--threads", "0"], "--threads must be a positive integer"),
    ],
)
def test_bad_arguments_are_usage_errors(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*args, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def script(name: str):
    """A module of scripts/, loaded from its file as when it runs as a script."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_bench_script_runs_on_the_bench_functions(model, monkeypatch):
    """scripts/gpu_bench.py imports decode_speed, prefill_overhead and compiled_decode from the package: its
    `run` still works (on CPU here, the compiled part through dynamo's eager backend: inductor takes minutes
    here)."""
    gpu_bench = script("gpu_bench")
    monkeypatch.setattr(
        gpu_bench, "compiled_decode", functools.partial(compiled.compiled_decode, backend="eager")
    )
    eager_backend = functools.partial(bucketed.bucketed_full, backend="eager")
    monkeypatch.setattr(gpu_bench, "bucketed_full", eager_backend)
    res = gpu_bench.run(model, 128, [64], 8, "cpu", compiled=True, max_new=300)
    assert [r["config"] for r in res["decode"]] == ["full", "snapstream_64"]
    assert all(r["step_pct_of_floor"] > 0 for r in res["decode"])
    assert [r["config"] for r in res["prefill"]] == ["dynamic_cache", "evalkit_full", "snapstream_1024"]
    assert [r["config"] for r in res["compiled_decode"]] == ["snapstream_64", "full"]
    assert all(r["tokens_equal"] and r["static_tok_s"] > 0 for r in res["compiled_decode"])
    assert [r["config"] for r in res["eviction"]] == [
        "snapstream_64",
        "h2o_64",
        "snapkv_decode_64",
        "tova_decode_64",
        "expected_attention_ring_64",
    ]
    # the bucketed full cache: a pool of 428 slots attending over the 256-slot bucket, every mode's tokens
    (row,) = res["bucketed_full"]
    assert (row["capacity"], row["visible"], row["tokens_equal"]) == (428, 256, True)
    assert row["graphs"] == 2 and row["bucketed_tok_s"] > 0  # the whole pool's graph and the bucket's


def test_compile_bench_script_writes_every_mode_of_each_method(tmp_path, monkeypatch, capsys):
    """scripts/compile_bench.py, a thin CLI over evalkit.bench.compiled: a model conf, methods, the static
    mode too."""
    compile_bench, out = script("compile_bench"), tmp_path / "c.json"
    argv = [
        "compile_bench.py",
        "--model",
        "tiny_llama",
        "--tokens",
        "100",
        "--steps",
        "4",
        "--rounds",
        "2",
        "--backend",
        "eager",
        "--methods",
        "snapstream:64,full",
        "--out",
        str(out),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    compile_bench.main()
    torch._dynamo.reset()
    report = json.loads(out.read_text())
    assert report["model"] == "tiny_llama" and report["command"] == " ".join(argv)
    assert [(r["config"], r["prompt_tokens"]) for r in report["rows"]] == [
        ("snapstream_64", 100),
        ("full", 100),
    ]
    assert all(r["tokens_equal"] and r[f"{m}_tok_s"] > 0 for r in report["rows"] for m in compiled.ALL_MODES)
    monkeypatch.setattr(sys, "argv", ["compile_bench.py", "--methods", "bogus:3"])
    with pytest.raises(SystemExit) as exit_:
        compile_bench.main()
    assert exit_.value.code == 2 and "unknown method 'bogus'" in capsys.readouterr().err


# --- compiled vs eager decode -------------------------------------------------------------------------------


def test_compiled_decode_rows_per_config_with_their_roofline(model, ids):
    """Full and SnapStream 64 after 200 tokens, 2 rounds of 4 steps; compiled through dynamo's eager backend
    (one graph, as inductor's, without minutes of C++ compilation)."""
    compiled_rows = compiled.compiled_decode(
        model, ids, [Full(), SnapStream(budget=64)], steps=8, rounds=2, backend="eager", copy_bytes=2**20
    )
    torch._dynamo.reset()
    full, snap = compiled_rows
    assert [(r["config"], r["prompt_tokens"]) for r in compiled_rows] == [
        ("full", 200),
        ("snapstream_64", 200),
    ]
    forwards = 2 * 4  # rounds x steps per round, warm-ups included
    for r in compiled_rows:
        assert r["tokens_equal"] and r["graphs"] == 1  # one graph, no recompilation while timed
        assert r["steps"] == 2 * 3  # the first step of each round is a warm-up
        assert r["compile_s"] > 0 and r["weight_bytes"] == roofline.weight_bytes(model)
        assert r["bandwidth_gb_s"] == BANDWIDTH / 1e9
        for mode in ("eager", "compiled"):
            kv = r[f"{mode}_kv_read_bytes"]
            assert r[f"{mode}_floor_ms"] == round(1e3 * (r["weight_bytes"] + kv) / BANDWIDTH, 4)
            assert r[f"{mode}_pct_of_floor"] == pytest.approx(
                100 * r[f"{mode}_step_ms"] / r[f"{mode}_floor_ms"], rel=0.01
            )
            assert r[f"{mode}_tok_s"] == pytest.approx(1e3 / r[f"{mode}_step_ms"], rel=0.01)
            assert r[f"{mode}_flatness"] == pytest.approx(
                r[f"{mode}_last_q_ms"] / r[f"{mode}_first_q_ms"], rel=0.01
            )
        assert r["speedup"] == pytest.approx(r["eager_step_ms"] / r["compiled_step_ms"], rel=0.01)
        assert r["compiled_matmul_pct"] > 0 and r["compiled_attention_pct"] > 0
        assert r["compiled_matmul_pct"] + r["compiled_attention_pct"] <= 100
        kernels_ms = (r["compiled_matmul_pct"] + r["compiled_attention_pct"]) / 100 * r["compiled_step_ms"]
        assert r["ceiling_x"] == pytest.approx(r["eager_step_ms"] / kernels_ms, rel=0.05)
    # the default full cache grew a slot per forward (read: the mean); the static one reads its whole
    # allocation: prompt + the first token + every forward + the profiled steps
    assert full["eager_kv_read_bytes"] == (200 + 200 + forwards) / 2 * SLOT_BYTES
    assert full["compiled_kv_read_bytes"] == (200 + 1 + forwards + compiled.PROFILED_STEPS) * SLOT_BYTES
    assert snap["eager_kv_read_bytes"] == snap["compiled_kv_read_bytes"] == 64 * SLOT_BYTES


def flipped_logits(gm, example_inputs):
    """A torch.compile backend whose graph runs, then reverses the vocabulary axis of the logits: a compiled
    decode that produces other tokens."""

    def run(*args):
        return [o.flip(-1) if o.shape[-1:] == (TINY["llama"]["vocab_size"],) else o for o in gm(*args)]

    return run


def test_tokens_equal_is_false_when_the_compiled_step_decodes_other_tokens(model, ids):
    (row,) = compiled.compiled_decode(
        model, ids, [SnapStream(budget=64)], steps=4, rounds=2, backend=flipped_logits, copy_bytes=2**20
    )
    torch._dynamo.reset()
    assert row["tokens_equal"] is False and row["graphs"] == 1
    assert "Tokens DIFFER from eager in: snapstream_64 at 200." in compiled.note([row])


def decode(eager_ms, compiled_ms, tokens=(1, 2, 3, 4), shares=None, **over) -> compiled.Decode:
    """A measurement with chosen step times (ms, decode order) and tokens."""
    fields = dict(
        times={"eager": [t / 1e3 for t in eager_ms], "compiled": [t / 1e3 for t in compiled_ms]},
        tokens={"eager": [1, 2, 3, 4], "compiled": list(tokens)},
        kv_read={"eager": 1e9, "compiled": 2e9},
        compile_s=12.345,
        cache_hit=False,
        graphs=1,
        shares=shares,
    )
    return compiled.Decode(**(fields | over))


def test_compiled_row_ratios_come_from_the_right_columns():
    """Eager at 10 ms per step; compiled at 5 ms (median), 4 ms in its first quarter and 8 in its last;
    matmuls 40% and attention 10% of the compiled step; weights 3 GB, bandwidth 10 GB/s."""
    res = decode([10] * 8, [4, 4, 5, 5, 5, 5, 8, 8], shares={"matmul": 0.4, "attention": 0.1})
    row = compiled.row_for(4096, SnapStream(budget=512), res, weights=3 * 10**9, bandwidth=10e9)
    assert (row["config"], row["prompt_tokens"], row["steps"]) == ("snapstream_512", 4096, 8)
    assert (row["eager_tok_s"], row["compiled_tok_s"], row["speedup"]) == (100.0, 200.0, 2.0)
    assert (row["compiled_first_q_ms"], row["compiled_last_q_ms"], row["compiled_flatness"]) == (
        4.0,
        8.0,
        2.0,
    )
    assert row["eager_flatness"] == 1.0
    assert (row["eager_floor_ms"], row["compiled_floor_ms"]) == (400.0, 500.0)  # (3 + 1 or 2) GB / 10 GB/s
    assert (row["eager_pct_of_floor"], row["compiled_pct_of_floor"]) == (2.5, 1.0)
    assert (row["compiled_matmul_pct"], row["compiled_attention_pct"]) == (40.0, 10.0)
    assert row["ceiling_x"] == 4.0  # 10 ms / ((0.4 + 0.1) x 5 ms)
    assert (row["compile_s"], row["tokens_equal"], row["compile_cache_hit"]) == (12.35, True, False)
    assert (
        compiled.row_for(4096, Full(), decode([10] * 8, [5] * 8, tokens=(1, 2, 3, 5)), 3 * 10**9, 10e9)[
            "tokens_equal"
        ]
        is False
    )
    off_cpu = compiled.row_for(4096, Full(), decode([10] * 8, [5] * 8, shares=None), 3 * 10**9, 10e9)
    assert off_cpu["compiled_matmul_pct"] is None and off_cpu["ceiling_x"] is None


def target_row(speedup, pct, **over) -> dict:
    return {
        "config": "snapstream_512",
        "prompt_tokens": 4096,
        "speedup": speedup,
        "compiled_pct_of_floor": pct,
        "eager_pct_of_floor": 196.0,
        "compiled_matmul_pct": 77.0,
        "compiled_attention_pct": 8.0,
        "ceiling_x": 1.41,
        "tokens_equal": True,
    } | over


def test_summary_states_the_target_as_measured():
    """The target (compiled SnapStream-512 >= 1.5x eager at 4k, within 2x of the floor) is read off
    the 4096-token SnapStream-512 row: the measured figures, reached or not, and the profile's reason when
    not."""
    other = target_row(3.0, 90.0, prompt_tokens=2048)  # another length: not the target's row
    missed = compiled.note([other, target_row(1.24, 158.3)])
    assert "measured 1.24x (NOT reached); the compiled step is at 158.3% of the floor (reached)" in missed
    assert "matmuls (the weights, streamed once per step) take 77.0% and attention 8.0%" in missed
    assert "shrink the other 15.0%" in missed and "alone would be 1.41x eager" in missed
    assert "already at 196.0% of the floor" in missed
    reached = compiled.note([target_row(1.6, 250.0), other])
    assert "measured 1.6x (reached); the compiled step is at 250.0% of the floor (NOT reached)" in reached
    assert "Why:" not in reached and "compiled equals eager in every row" in reached
    assert "not measured by this run" in compiled.note([other])


# --- LiveCodeBench grading, per problem vs pooled -----------------------------------------------------------


@pytest.fixture
def sandbox_runs(monkeypatch):
    """Every sandboxed program run (grade.grade is what the pool and `score` call per program)."""
    from tasks.livecodebench import grade

    runs, real = [], grade.grade

    def counting(code, tests, settings=None):
        runs.append(code)
        return real(code, tests, settings)

    monkeypatch.setattr(grade, "grade", counting)
    return runs


def test_grading_bench_grades_every_program_in_both_modes(sandbox_runs, monkeypatch):
    """k=2: each problem's reference and its first wrong solution. Both modes run all 20 programs (the memo is
    emptied in between: a second mode served from it would time nothing) with the outcomes solutions.json
    says; per problem grades one problem per call (as lm-eval's `score`), pooled all ten in one."""
    from evalkit import sandbox
    from tasks.livecodebench import grade
    from tasks.livecodebench import livecodebench as lcb

    calls, score_many = [], lcb.score_many  # `score` is score_many on one problem

    def spy(items):
        calls.append(len(items))
        return score_many(items)

    monkeypatch.setattr(lcb, "score_many", spy)

    before = grade._settings
    unisolated = (
        bool(sandbox.missing_isolation(sandbox.isolation()))
        and os.environ.get("EVALKIT_REQUIRE_ISOLATION") != "1"
    )
    row = grading.grading_bench(k=2, workers=2, timeout_s=1.0, memory_mb=1024, allow_unisolated=unisolated)
    assert len(sandbox_runs) == 2 * 20 and calls == [1] * 10 + [10]
    assert (row["problems"], row["k"], row["workers"], row["programs"]) == (10, 2, 2, 20)
    assert row["outcomes_identical"] is True
    solutions = json.loads((ROOT / "tasks" / "livecodebench" / "data" / "solutions.json").read_text())
    want = Counter(["passed"] * 10 + [next(iter(s["wrong"])) for s in solutions.values()])
    assert dict(o.rsplit(" ", 1) for o in row["outcomes"].split(", ")) == {k: str(v) for k, v in want.items()}
    assert row["per_problem_s"] > 0 and row["pooled_s"] > 0
    assert grade._settings == before and not grade._memo  # the bench leaves later grading as it found it


def test_grading_row_ratio_and_agreement():
    scores, outcomes = [{"pass@1": 100.0}, {"pass@1": 0.0}], {"a": "passed", "b": "timeout", "c": "passed"}
    row = grading.grading_row(4, 2, 6.0, (6.0, scores, outcomes), (2.0, scores, dict(outcomes)))
    assert (row["per_problem_s"], row["pooled_s"], row["speedup"]) == (6.0, 2.0, 3.0)
    assert (row["problems"], row["programs"], row["outcomes"]) == (2, 3, "passed 2, timeout 1")
    assert row["outcomes_identical"] is True
    assert not grading.grading_row(
        4, 2, 6.0, (6.0, scores, outcomes), (2.0, scores, outcomes | {"b": "passed"})
    )["outcomes_identical"]
    assert not grading.grading_row(4, 2, 6.0, (6.0, scores, outcomes), (2.0, scores[::-1], outcomes))[
        "outcomes_identical"
    ]
    with pytest.raises(ValueError, match="k must be a positive integer"):
        grading.sample_predictions(0)


# --- continuous vs static batching ------------------------------------------------------------------
def test_aime_like_lengths_are_seeded_skewed_and_bounded():
    from evalkit.bench.continuous import aime_like_lengths

    lengths = aime_like_lengths(200, 256)
    assert lengths == aime_like_lengths(200, 256)  # drawn once: both modes decode the same requests
    assert min(lengths) >= 16 and max(lengths) <= 256
    assert sorted(lengths)[100] < sum(lengths) / len(lengths)  # a long tail above the median


def test_continuous_rows_idle_less_than_static_with_identical_outputs(model):
    from evalkit.bench.continuous import bench_continuous

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (20 + 3 * i,), generator=gen).tolist() for i in range(10)]
    static, cont = bench_continuous(
        model, prompts, longest=48, rows=4, method=SnapStream(budget=32, recent=8, window=4)
    )
    assert (static["mode"], cont["mode"]) == ("static", "continuous")
    assert static["tokens"] == cont["tokens"] > 10 * 3  # forced lengths: every request decodes its own
    assert cont["outputs_identical"] is True and static["outputs_identical"] is True
    # static batches wait for their longest row: more steps, idle rows; continuous idles only at the tail
    assert static["decode_steps"] > cont["decode_steps"]
    assert static["idle_row_fraction"] > cont["idle_row_fraction"]
    assert cont["gain_vs_static"] == round(cont["tokens_per_s"] / static["tokens_per_s"], 2)


# --- the 4-budget sweep ---------------------------------------------------------------------------------
def test_sweep_modes_run_the_right_budgets_batched_or_not_and_compare_texts(tmp_path, monkeypatch):
    import evalkit.config
    import evalkit.run
    from evalkit.bench import sweep
    from evalkit.lm import EvalkitLM

    seen = []

    def fake_run(cfg):  # writes one journal per budget, as the runner does
        budgets = cfg["budget"]
        seen.append((budgets, EvalkitLM.batch_budgets))
        time.sleep(0.01 * len(seen))  # some wall time to divide by
        for b in budgets if isinstance(budgets, list) else [budgets]:
            folder = Path(cfg["results_dir"]) / "runs" / str(b)
            folder.mkdir(parents=True, exist_ok=True)
            text = f"t{b}" + ("!" if differ and len(seen) == 7 else "")  # the last mode decodes otherwise
            (folder / "generations.jsonl").write_text(json.dumps({"key": "k/0", "text": text}) + "\n")

    def fake_compose(overrides):
        cfg = dict(o.split("=", 1) for o in overrides)
        cfg["budget"] = json.loads(cfg["method.budget"])
        return cfg

    monkeypatch.setattr(evalkit.run, "run", fake_run)
    monkeypatch.setattr(evalkit.config, "compose", fake_compose)
    differ = True
    assert all(
        r["outputs_identical"] is False for r in sweep.bench_sweep(tmp_path / "a", [1, 2, 3, 4], [])[1:]
    )
    seen.clear()
    differ = False
    rows = sweep.bench_sweep(tmp_path, [1, 2, 3, 4], [])
    assert seen == [
        (3, True),
        (1, True),
        (2, True),
        (3, True),
        (4, True),
        ([1, 2, 3, 4], False),
        ([1, 2, 3, 4], True),
    ]
    assert EvalkitLM.batch_budgets is True  # restored
    assert [r["budgets"] for r in rows] == [1, 4, 4, 4]
    assert all(r["outputs_identical"] is True for r in rows[1:])
    assert (
        rows[0]["x_one_run"] == 1.0 and rows[1]["x_one_run"] > rows[3]["x_one_run"] > 1
    )  # 2+3+4+5 vs 7, vs 1


# --- decode-time eviction ---------------------------------------------------------------------------------
def test_eviction_rows_time_the_scoring_beside_snapstream(model, ids):
    """h2o and snapkv_decode beside snapstream at one budget, each with and without its scoring from the
    same state; snapkv_decode's re-selections are counted and timed (interval 33 at budget 128: 82 scored
    steps)."""
    from evalkit.bench.eviction import eviction_speed

    rows = eviction_speed(model, ids, 128, 80, rounds=2)
    assert [r["config"] for r in rows] == [
        "snapstream_128",
        "h2o_128",
        "snapkv_decode_128",
        "tova_decode_128",
        "expected_attention_ring_128",
    ]
    snap, h2o, refit, tova, ring = rows
    assert all(r["steps"] == 80 and r["decode_tok_s"] > 0 and r["no_scoring_tok_s"] > 0 for r in rows)
    assert (snap["scoring_ms"], snap["refits"], h2o["refits"], tova["refits"]) == (0.0, 0, 0, 0)
    assert (ring["scoring_ms"], ring["refits"]) == (0.0, 0)  # a ring: nothing scored while decoding
    assert refit["refits"] == 82 // 33 and refit["refit_ms"] > 0
    for r in rows:
        # no_scoring_tok_s is rounded to 0.01 tok/s: 1e3 / it carries up to 1e3 * 0.005 / tok_s**2 ms of
        # rounding (0.02 ms at 15 tok/s on a loaded machine), beside step_ms's and scoring_ms's 0.0005 each
        rounding = max(0.01, 1e3 * 0.005 / r["no_scoring_tok_s"] ** 2 + 0.001)
        assert r["scoring_ms"] == pytest.approx(r["step_ms"] - 1e3 / r["no_scoring_tok_s"], abs=rounding)


def test_the_16k_eviction_bench_is_opt_in():
    assert "eviction" in cli.selected(cli.parser(), None)
    assert "eviction_16k" not in cli.selected(cli.parser(), None)
    assert cli.selected(cli.parser(), "eviction_16k") == ["eviction_16k"]
    assert cli.measurement("eviction_16k").csv == "eviction_speed_16k.csv"


# --- every method beside SnapStream ----------------------------------------------------------------------
def test_rivals_rows_time_each_methods_prefill_and_decode(model, ids):
    """One row per method (SnapStream first): its own prefill (KVzip's passes included) beside a paired full
    prefill, its compression timed, and its decode in a one-row pool; each row's kind."""
    from evalkit.bench.rivals import rivals_speed
    from tests.kv.test_rivals import StubTokenizer

    rows = rivals_speed(model, StubTokenizer(), ids, 64, 8, rounds=2)
    configs = [r["config"] for r in rows]
    assert configs[0] == "snapstream_64" and len(configs) == len(set(configs)) == 16
    assert {"kvzip_64", "kvzip_ring_64", "expected_attention_64", "h2o_64", "tova_decode_64"} <= set(configs)
    assert all(r["steps"] == 8 and r["decode_tok_s"] > 0 and r["compress_ms"] > 0 for r in rows)
    by = {r["config"]: r for r in rows}
    assert by["snapstream_64"]["vs_snapstream"] == 1.0
    assert all(r["prefill_s"] > 0 and r["full_prefill_s"] > 0 for r in rows)  # times, not compared: a test
    assert {by[c]["kind"] for c in ("snapstream_64", "kvzip_ring_64")} == {"ring"}
    assert {by[c]["kind"] for c in ("h2o_64", "snapkv_decode_64", "tova_decode_64")} == {"decode-time"}
    assert {by[c]["kind"] for c in ("snapkv_64", "knorm_64", "kvzip_64", "adakv_snapkv_64")} == {"prefill"}


# --- every KV storage in the engine's decode step --------------------------------------------------------
def test_every_storage_decodes_in_the_pool_and_reports_the_bytes_it_holds(model, ids):
    """Each storage's full cache in a one-row pool: steps timed, bytes as held (int's codes, scales and raw
    windows), fewer than the model dtype's for every quantizing storage at 200 tokens, fewer as bits drop."""
    from evalkit.bench.quantized_engine import storage_decode
    from evalkit.kv.storage import make_storage

    names = ("none", "fp8_e4m3", "int8", "int4", "int2")
    small = {"group": 16, "residual": 32}  # the tiny model's heads are 16 wide
    storages = {n: make_storage(n, **(small if n.startswith("int") else {})) for n in names}
    rows = storage_decode(model, ids, 4, rounds=2, storages=storages)
    assert [r["storage"] for r in rows] == list(names)
    by = {r["storage"]: r for r in rows}
    assert all(r["steps"] == 4 and r["step_ms"] > 0 for r in rows) and by["none"]["vs_none"] == 1.0
    held = [by[n]["kv_bytes"] for n in names]
    assert held[0] > max(held[1:]) and held[2] > held[3] > held[4]  # fewer bits, fewer bytes
    assert by["fp8_e4m3"]["kv_vs_none"] < 0.3  # float32 codes to one byte, plus the scales


def test_a_bucketed_run_of_some_lengths_keeps_the_other_rows_and_says_so(tmp_path):
    """`python -m evalkit.bench.bucketed --lengths 16384 --out <new folder>`: the folder is made (a missing
    one crashed after the measurement, losing it), and a run of some lengths replaces those rows only, its
    provenance naming where the kept rows came from."""
    out = tmp_path / "new" / "bench"
    write_csv(
        out / bucketed.MEASUREMENT.csv, [{"prompt_tokens": n, "eager_tok_s": n / 1000} for n in (2048, 16384)]
    )
    record_provenance(
        out, bucketed.MEASUREMENT.name, "python -m evalkit.bench.bucketed --lengths 2048 16384", False
    )
    rows, command = bucketed.kept_rows(out, {16384}, "python -m evalkit.bench.bucketed --lengths 16384")
    assert [r["prompt_tokens"] for r in rows] == [2048]
    assert command.startswith("python -m evalkit.bench.bucketed --lengths 16384 (16384); 2048 kept from ")
    assert "--lengths 2048 16384" in command
    assert bucketed.kept_rows(tmp_path / "none", {16384}, "c") == ([], "c")
