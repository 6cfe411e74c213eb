"""The memory report takes the KV storage (`model.kv`, conf/kv/): bytes per sequence, max batch and the
per-GPU layout count the storage's codes and scales, the arithmetic a run's measured bytes come from."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from evalkit.config import compose
from evalkit.kv.storage import make_storage
from evalkit.memory import MemoryReportError
from evalkit.memory.report import check, deployment, row


def _cfg(tmp_path, *overrides: str) -> dict:
    base = [f"results_dir={tmp_path}", "hardware=h200"]
    return OmegaConf.to_container(compose("memory", [*base, *overrides]), resolve=True)


def test_fp8_storage_halves_the_latent_and_counts_its_scales(tmp_path):
    bf16, fp8 = _cfg(tmp_path), _cfg(tmp_path, "model.kv=fp8_e4m3")
    plain = row(deployment(bf16), bf16, 32768, "full", None)
    held = row(deployment(fp8), fp8, 32768, "full", None)
    # DeepSeek-R1's latent: 61 layers of one 512 + 64 wide head; fp8: a byte each, a float32 scale per K, V
    per_layer = make_storage("fp8_e4m3").layer_bytes(32768, 0, 1, 512, 64, 16)
    assert held["kv_bytes_per_seq"] == 61 * per_layer == 61 * (32768 * 576 + 2 * 4)
    assert plain["kv_bytes_per_seq"] == 61 * 32768 * 576 * 2
    assert held["max_batch"] > plain["max_batch"]


def test_the_gpu_layout_holds_the_storage_bytes(tmp_path):
    cfg = _cfg(tmp_path, "model.kv=fp8_e4m3", "parallel.tp_size=8")
    dep, rows, _, sharding = check(cfg)
    r = next(x for x in rows if x["method"] == "full")
    assert sharding.kv_bytes_gpu(r["kv_entries"]) == 61 * (r["kv_entries"] * 576 + 2 * 4)


def test_an_unknown_storage_is_one_clear_error(tmp_path):
    with pytest.raises(MemoryReportError, match="model.kv"):
        deployment(_cfg(tmp_path, "model.kv={_target_: evalkit.kv.storage.IntStorage, bits: 3}"))


@pytest.mark.parametrize("method, budget", [("snapstream", 1024), ("streamingllm", 1024)])
def test_a_ring_method_keeps_its_ring_raw_in_an_int_storage(tmp_path, method, budget):
    """KIVI in a ring method's cache keeps the ring (its recent block) in the model dtype, as a run holds it
    (tests/kv/test_storage_slots.py: measured = modelled with the ring); the memory report modelled every
    ring method with KIVI's appending residual before (StreamingLLM 1024 about 3x too small)."""
    from evalkit.memory.sim import method_of

    cfg = _cfg(tmp_path, "model.kv=int4")
    got = row(deployment(cfg), cfg, 32768, method, budget)
    ring = method_of(method, budget).blocks()[1]
    per_layer = make_storage("int4").layer_bytes(budget, ring, 1, 512, 64, 16)  # R1's latent, bf16
    assert ring > 0 and got["kv_bytes_per_seq"] == 61 * per_layer
    assert got["kv_bytes_per_seq"] != 61 * make_storage("int4").layer_bytes(budget, 0, 1, 512, 64, 16)


@pytest.mark.parametrize("kv", [["kv=fp8_e4m3"], ["kv=int4", "kv.group=8", "kv.residual=16"]])
@pytest.mark.parametrize("method", ["full", "snapstream"])
def test_the_measured_rows_predict_a_runs_bytes_in_its_storage(tmp_path, kv, method):
    """`measured_rows` models a run's bytes in the storage it ran with (its saved `kv` node: int4's group
    and residual), the ring kept raw: it equals the run's measured bytes (before: the model dtype's, 3-4x)."""
    from evalkit.memory.report import measured_rows
    from tests.conftest import fresh_run

    run = ["model=tiny_llama", "model.max_new_tokens=6", "task.load.n=1", "task.load.lengths=[1024]"]
    budget = [] if method == "full" else ["method.budget=64"]
    fresh_run(*run, f"method={method}", *budget, *kv, results=tmp_path)
    rows, notes = measured_rows(tmp_path)
    assert not notes and [r["match"] for r in rows] == [True], rows
