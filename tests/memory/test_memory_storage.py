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
