"""The bench package (evalkit.bench): the roofline's arithmetic, throughput at a fixed KV budget (batches, the
replicated prefill, the evalkit.memory prediction), the summary assembled from CSVs, and the CLI. CPU, tiny
random models, seconds; no wall-clock thresholds (the figures themselves are `make bench`'s business)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evalkit.bench.__main__ as cli
from evalkit.bench import decode_speed, roofline
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
    from evalkit.memory import count_parameters
    from evalkit.models import ModelSpec, random_model

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
    """B rows populated from one recorded prefill are B real requests: greedy tokens equal evalkit.kv.generate's."""
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
    return Measurement(name, f"{name}.csv", f"Title of {name}", lambda ctx: [{"x": 1, "quick": ctx.quick}],
                       note=lambda rows: f"note of {name}: {len(rows)} rows")  # fmt: skip


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
    published = {"prefill_overhead.csv", "decode_speed.csv", "memory.csv", "decode_steps.csv",
                 "batch_throughput.csv", "sweep_prefill.csv"}  # fmt: skip
    assert published <= set(csvs)


def test_cli_runs_only_what_is_asked_and_writes_csv_provenance_summary(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    two = Measurement("two", "two.csv", "Title of two", lambda ctx: [{"quick": ctx.quick, "threads": torch.get_num_threads()}],
                      note=lambda rows: "note of two")  # fmt: skip
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
    # issue 15 item 8: `--only bogus` loaded the model, measured nothing, exited 0 and rewrote summary.md
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
    [(["--bogus"], "unrecognized arguments: --bogus"), (["--only", "decode,decode"], "named twice"),
     (["--only", ""], "unknown measurement(s) ''"), (["--memory-child", "16k"], "LENGTH:BUDGET"),
     (["--threads", "0"], "--threads must be a positive integer")],
)  # fmt: skip
def test_bad_arguments_are_usage_errors(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*args, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_gpu_bench_script_runs_on_the_bench_functions(model, monkeypatch):
    """scripts/gpu_bench.py imports decode_speed and prefill_overhead from the package: its `run` still works
    (on CPU here) and its decode rows carry the roofline."""
    monkeypatch.syspath_prepend(
        str(ROOT / "scripts")
    )  # as when it runs as a script (it imports compile_bench)
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "scripts" / "gpu_bench.py")
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    res = gpu_bench.run(model, 128, [64], 8, "cpu", compiled=False)
    assert [r["config"] for r in res["decode"]] == ["full", "snapstream_64"]
    assert all(r["step_pct_of_floor"] > 0 for r in res["decode"])
    assert [r["config"] for r in res["prefill"]] == ["dynamic_cache", "evalkit_full", "snapstream_1024"]
