"""What a decode-time eviction method cannot run with is refused before the model loads, with the reason and
the way out (each of these used to fail only after loading, or crash mid-run)."""

from __future__ import annotations

import pytest

import evalkit.run as runner
from evalkit import parallel
from evalkit.config import ConfigError, compose
from evalkit.models import model_config, resolve_source
from tests.conftest import fresh_run

SMALL = ["limit=1", "model.max_new_tokens=4", "task.load.n=1", "task.load.lengths=[1024]"]


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    monkeypatch.setattr(runner, "get_model", lambda spec: pytest.fail("the model was loaded"))


def checked(tmp_path, *overrides: str) -> None:
    """check_decode_eviction on the plans and model config `python -m evalkit <overrides>` would use."""
    plans = runner.plans_for(compose(overrides=[*overrides, f"results_dir={tmp_path}"]))
    spec = plans[0].spec
    runner.check_decode_eviction(plans, model_config(spec, resolve_source(spec)))


def test_snapkv_decode_on_an_mla_model_is_refused(tmp_path):
    why = "snapkv_decode re-scores the cached keys, but tiny_deepseek caches MLA's latent"
    with pytest.raises(ConfigError, match=why):
        fresh_run("model=tiny_deepseek", "method=snapkv_decode", *SMALL, results=tmp_path)
    checked(tmp_path, "model=tiny_deepseek", "method=h2o")  # h2o keeps one set per MLA layer: allowed
    checked(tmp_path, "model=tiny_llama", "method=snapkv_decode")


def test_compiled_eviction_under_tp_on_mla_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel, "LAYOUT", parallel.Layout(tp=2))
    with pytest.raises(ConfigError, match="compile=true under tensor parallelism on an MLA model"):
        checked(tmp_path, "model=tiny_deepseek", "method=h2o", "compile=true")
    checked(tmp_path, "model=tiny_llama", "method=h2o", "compile=true")  # GQA: no broadcast in the step
    checked(tmp_path, "model=tiny_deepseek", "method=h2o")  # eager: the broadcast runs outside a graph


@pytest.mark.parametrize("method", ["h2o", "snapkv_decode"])
def test_a_task_with_a_followup_call_is_refused(tmp_path, method):
    why = f"asks a second call on the full cache after each first one, which a {method} slot pool"
    with pytest.raises(ConfigError, match=why):
        fresh_run("task=longbench_v2_cot", f"method={method}", "model=tiny_llama", results=tmp_path)
    checked(tmp_path, "task=longbench_v2", f"method={method}", "model=tiny_llama")  # 0-shot: one call


def test_followups_are_read_from_the_task_yaml(tmp_path):
    assert runner.has_followup(compose(overrides=["task=longbench_v2_cot"]))
    assert not runner.has_followup(compose(overrides=["task=longbench_v2"]))


@pytest.mark.parametrize(
    "method, why",
    [
        ("expected_attention", "expected_attention undoes RoPE on the full query head, but tiny_deepseek"),
        ("kvzip", "kvzip scores the prompt's keys in a second pass, but tiny_deepseek caches MLA's latent"),
    ],
)
def test_rivals_that_need_per_head_keys_are_refused_on_mla(tmp_path, method, why):
    with pytest.raises(ConfigError, match=why):
        fresh_run("model=tiny_deepseek", f"method={method}", *SMALL, results=tmp_path)
    for arch in ("tiny_llama", "tiny_deepseek"):  # the rest take MLA's per-head keys as attention reads them
        plans = runner.plans_for(
            compose(overrides=[f"model={arch}", "method=knorm", f"results_dir={tmp_path}"])
        )
        runner.check_refusals(plans, model_config(plans[0].spec, resolve_source(plans[0].spec)))


def test_kvzip_under_tp_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel, "LAYOUT", parallel.Layout(tp=2))
    plans = runner.plans_for(
        compose(overrides=["model=tiny_llama", "method=kvzip", f"results_dir={tmp_path}"])
    )
    with pytest.raises(ConfigError, match="reconstruction pass is not yet run under tensor parallelism"):
        runner.check_refusals(plans, model_config(plans[0].spec, resolve_source(plans[0].spec)))
