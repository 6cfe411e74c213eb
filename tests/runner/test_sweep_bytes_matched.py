"""conf/sweep/bytes_matched.yaml (issue 32.4): every job composes to a valid method and KV storage, and its
SnapStream budgets match the bytes of each quantized full cache within the report's equal-bytes tolerance."""

from __future__ import annotations

import itertools

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from evalkit.config import CONF_DIR
from evalkit.kv.storage import make_storage
from evalkit.memory.model import kv_geometry
from evalkit.report.frontier import bytes_match
from tests.runs_fixture import SMOL_CONFIG


def _params() -> dict[str, list[str]]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        params = compose(
            "eval", overrides=["sweep=bytes_matched"], return_hydra_config=True
        ).hydra.sweeper.params
    return {k: [v] if str(v).startswith("[") else str(v).split(",") for k, v in params.items()}


def test_every_job_composes_to_a_method_and_storage():
    params = _params()
    # int4 / int2 run since the slot caches hold KIVI's codes (kivi_slots)
    assert set(params["kv"]) == {"none", "fp8_e4m3", "fp8_e5m2", "int4", "int2"} and set(params["task"]) == {
        "ruler",
        "aime24",
    }
    keys = list(params)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for values in itertools.product(*params.values()):
            job = dict(zip(keys, values))
            kv = job.pop("kv")
            budgets = OmegaConf.create(f"b: {job.pop('method.budget')}").b
            overrides = [f"{k}={v}" for k, v in job.items()] + [f"kv={kv}"]
            cfg = compose("eval", overrides=overrides)
            storage = make_storage(cfg.kv)
            assert storage.name == kv
            storage.check_widths(64, 64)  # SmolLM2-135M's heads: the storage can code them
            if job["method"] == "full":  # the runner gives `full` no budget: the list names its one run
                assert instantiate(cfg.method).budget is None
                continue
            for b in budgets:  # every budget of the list is a valid SnapStream the storage can hold
                method = instantiate(OmegaConf.merge(cfg.method, {"budget": b}))
                assert method.budget == b and storage.refusal(method) is None


def test_snapstream_budgets_match_each_quantized_full_cache_on_ruler():
    """At a 2.1k-token RULER request each quantized full cache has a SnapStream budget in the model dtype,
    and SnapStream + fp8 one in the model dtype, whose bytes match within 10% (the report's equal bytes)."""
    budgets = [int(b) for b in OmegaConf.create(f"b: {_params()['method.budget'][0]}").b]
    seen = 2100
    bf16 = kv_geometry(SMOL_CONFIG, "bfloat16")

    def held(kv: str, entries: int, ring: int = 0) -> int:
        return kv_geometry(SMOL_CONFIG, "bfloat16", storage=make_storage(kv)).sequence_bytes(entries, ring)

    for kv in ("fp8_e4m3", "int4", "int2"):
        full = held(kv, seen)
        assert any(bytes_match(full, bf16.sequence_bytes(b)) for b in budgets), kv
    fp8 = [held("fp8_e4m3", b, b // 8) for b in budgets if b <= seen]
    assert sum(any(bytes_match(f, bf16.sequence_bytes(b)) for b in budgets) for f in fp8) >= 2
