"""The KV storage is part of a run's configuration (issue 32.1): two runs that differ only by `kv` never share
a folder, a journal or a leaderboard cell, `kv=none` keeps the folder and identities runs had before the
storage axis, and what a storage cannot hold is refused before the model loads."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

import evalkit.run as runner
from evalkit.config import ConfigError, compose
from evalkit.identity import check_folder, hashes, run_identity
from evalkit.team import Ranks, Team

RULER = ["model=tiny_llama", "task=ruler", "method=snapstream", "method.budget=64"]


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    monkeypatch.setattr(runner, "get_model", lambda spec: pytest.fail("the model was loaded"))


def planned(tmp_path, *overrides):
    return runner.plan(compose(overrides=[*RULER, *overrides, f"results_dir={tmp_path}"]))


def test_two_storages_never_share_a_folder_and_none_keeps_the_old_path(tmp_path):
    none, fp8, int4 = (planned(tmp_path, f"kv={k}") for k in ("none", "fp8_e4m3", "int4"))
    assert none.out == planned(tmp_path).out and none.out.parent.name == "snapstream"
    assert fp8.out.parent.name == "snapstream+fp8_e4m3" and int4.out.parent.name == "snapstream+int4"
    assert fp8.out.name == int4.out.name == none.out.name == "64"
    assert planned(tmp_path, "kv=int4", "kv.residual=64").out.name == "64-residual64"  # a changed setting
    assert type(fp8.storage).__name__ == "Fp8Storage" and none.storage.name == "none"


def test_a_folder_of_another_storage_is_refused(tmp_path):
    fp8 = planned(tmp_path, "kv=fp8_e4m3")
    fp8.out.mkdir(parents=True)
    (fp8.out / "config.yaml").write_text(OmegaConf.to_yaml(fp8.cfg))
    check_folder(fp8.out, fp8.cfg)  # its own config: resumed
    other = planned(tmp_path, "kv=fp8_e5m2").cfg
    with pytest.raises(ConfigError, match="holds a run with a different config: kv.format: 'e4m3' there"):
        check_folder(fp8.out, other)


def test_storage_joins_the_configuration_identity_and_none_keeps_todays():
    def ids(*overrides):
        cfg = compose(overrides=[*RULER, *overrides])
        return hashes(cfg, 1, "d" * 64, 1), run_identity(cfg)

    (base, journal), (none, none_journal), (fp8, fp8_journal) = ids(), ids("kv=none"), ids("kv=fp8_e4m3")
    # a config written before `kv` existed (no kv key) has today's identities
    old = OmegaConf.to_container(compose(overrides=RULER), resolve=True)
    old.pop("kv")
    assert hashes(old, 1, "d" * 64, 1) == base == none and run_identity(old) == journal == none_journal
    assert fp8["method"] != base["method"] and fp8_journal != journal  # never one cell, never one journal
    assert fp8["generation"] == base["generation"]  # same data and model: paired as two configurations


@pytest.mark.parametrize(
    "overrides, tp, why",
    [
        (["method=h2o", "kv=int4"], 1, "kv int4: h2o overwrites single cache entries chosen per KV head"),
        (["model=tiny_deepseek", "kv=int2"], 1, "kv int2: this model caches one latent per token"),
        (["kv=fp8_e4m3", "kv.scale=tensor"], 2, "scale=tensor takes one amax over every KV head"),
        (["kv=int4"], 1, "kv int4: group=32 must divide the value head width 16 .*: set kv.group"),
        (["kv=int4", "kv.group=8", "kv.residual=16", "method.budget=60"], 1, "budget 60 must be a multiple"),
    ],
)
def test_what_a_storage_cannot_hold_is_refused_before_loading(tmp_path, overrides, tp, why):
    plans = runner.plans_for(compose(overrides=[*RULER, *overrides, f"results_dir={tmp_path}"]))
    with pytest.raises(ConfigError, match=why):
        runner.read_model(plans, Team(Ranks(tp=tp)))


def test_an_unknown_storage_setting_is_refused_at_planning(tmp_path):
    with pytest.raises(ConfigError, match="unknown setting 'bogus'; settings: bits, group, residual"):
        planned(tmp_path, "kv=int4", "+kv.bogus=1")


def test_a_run_in_fp8_records_its_storage_and_the_bytes_it_held(tmp_path, monkeypatch):
    """`kv=fp8_e4m3` reaches the run's caches: metrics.json records the storage, and `kv.peak_bytes` (codes +
    scales, measured) equals evalkit.memory's model for the peak request's entries under that storage; the
    run lands in `snapstream+fp8_e4m3/`."""
    import json

    from transformers import AutoConfig

    from evalkit.kv.storage import make_storage
    from evalkit.memory.model import kv_geometry
    from tests.conftest import fresh_run, the_run

    monkeypatch.undo()  # this one loads the tiny model
    small = ["task.load.n=1", "task.load.lengths=[1024]", "task.load.tasks=[niah_single_1]"]
    fresh_run(*RULER, *small, "model.max_new_tokens=4", "kv=fp8_e4m3", results=tmp_path)
    metrics = json.loads((the_run(tmp_path, "snapstream+fp8_e4m3", "64") / "metrics.json").read_text())
    assert metrics["storage"] == {"name": "fp8_e4m3", "format": "e4m3", "scale": "head", "headroom": 1.0}
    assert metrics["method"]["conf"] == "snapstream"
    config = AutoConfig.for_model(**OmegaConf.to_container(compose(overrides=RULER).model.random))
    geometry = kv_geometry(config, "float32", storage=make_storage("fp8_e4m3"))
    assert metrics["kv"]["peak_bytes"] == geometry.sequence_bytes(metrics["kv"]["peak_entries"])


def test_a_run_in_int4_records_its_storage_and_the_bytes_it_held(tmp_path, monkeypatch):
    """`kv=int4` runs (KIVI in the slot pool): metrics.json's `kv.peak_bytes` (codes, parameters and the raw
    ring, measured) equals evalkit.memory's model for the peak request's entries and SnapStream's ring."""
    import json

    from transformers import AutoConfig

    from evalkit.kv.config import make_method
    from evalkit.kv.storage import make_storage
    from evalkit.memory.model import kv_geometry
    from tests.conftest import fresh_run

    monkeypatch.undo()  # this one loads the tiny model
    small = ["task.load.n=1", "task.load.lengths=[1024]", "task.load.tasks=[niah_single_1]"]
    int4 = ["kv=int4", "kv.group=8", "kv.residual=16"]  # tiny_llama's heads are 16 wide
    fresh_run(*RULER, *small, "model.max_new_tokens=4", *int4, results=tmp_path)
    (found,) = tmp_path.glob("runs/*/*/snapstream+int4*/*/metrics.json")
    metrics = json.loads(found.read_text())
    assert metrics["storage"] == {"name": "int4", "bits": 4, "group": 8, "residual": 16}
    config = AutoConfig.for_model(**OmegaConf.to_container(compose(overrides=RULER).model.random))
    geometry = kv_geometry(config, "float32", storage=make_storage("int4", group=8, residual=16))
    ring = make_method("snapstream", budget=64).blocks()[1]
    assert metrics["kv"]["peak_bytes"] == geometry.sequence_bytes(metrics["kv"]["peak_entries"], ring)
