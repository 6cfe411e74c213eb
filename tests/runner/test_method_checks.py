"""What a decode-time eviction method cannot run with is refused before the model loads, with the reason and
the way out (each of these used to fail only after loading, or crash mid-run)."""

from __future__ import annotations

import pytest

import evalkit.run as runner
from evalkit import checks
from evalkit.config import ConfigError, compose
from evalkit.team import Ranks, Team
from tests.conftest import fresh_run

SMALL = ["limit=1", "model.max_new_tokens=4", "task.load.n=1", "task.load.lengths=[1024]"]


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    monkeypatch.setattr(runner, "get_model", lambda spec: pytest.fail("the model was loaded"))


def checked(tmp_path, *overrides: str, tp: int = 1) -> None:
    """The checks on the model's config (no weights) for the plans `python -m evalkit <overrides>` would
    use, under `tp`-way tensor parallelism."""
    runner.read_model(
        runner.plans_for(compose(overrides=[*overrides, f"results_dir={tmp_path}"])), Team(Ranks(tp=tp))
    )


def test_snapkv_decode_on_an_mla_model_is_refused(tmp_path):
    why = "snapkv_decode re-scores the cached keys, but tiny_deepseek caches MLA's latent"
    with pytest.raises(ConfigError, match=why):
        fresh_run("model=tiny_deepseek", "method=snapkv_decode", *SMALL, results=tmp_path)
    checked(tmp_path, "model=tiny_deepseek", "method=h2o")  # h2o keeps one set per MLA layer: allowed
    checked(tmp_path, "model=tiny_llama", "method=snapkv_decode")


def test_compiled_eviction_under_tp_runs_on_mla_and_gqa(tmp_path):
    """Each step's eviction on replicated attention is the TP root's through an all-gather, which a compiled
    step holds (tests/parallel/test_tp.py::test_compiled_tp2_decodes_what_one_process_does)."""
    for model in ("tiny_deepseek", "tiny_llama"):
        checked(tmp_path, f"model={model}", "method=h2o", "compile=true", tp=2)
        checked(tmp_path, f"model={model}", "method=h2o", tp=2)


@pytest.mark.parametrize("method", ["h2o", "snapkv_decode"])
def test_a_task_with_a_followup_call_is_refused(tmp_path, method):
    why = f"asks a second call on the full cache after each first one, which a {method} slot pool"
    with pytest.raises(ConfigError, match=why):
        fresh_run("task=longbench_v2_cot", f"method={method}", "model=tiny_llama", results=tmp_path)
    checked(tmp_path, "task=longbench_v2", f"method={method}", "model=tiny_llama")  # 0-shot: one call


def test_followups_are_declared_by_the_task_module(tmp_path):
    def followup(task: str) -> bool:
        p = runner.plan(compose(overrides=[f"task={task}", f"results_dir={tmp_path}"]))
        return checks.has_followup(p.cfg, p.task_module)

    assert followup("longbench_v2_cot") and not followup("longbench_v2") and not followup("ruler")


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
        checked(tmp_path, f"model={arch}", "method=knorm")


def test_kvzip_adakv_and_tova_run_under_tp_compiled_or_not(tmp_path):
    """Each rank scores its own KV heads (kvzip's pass runs on every rank in step; AdaKV and TOVA gather the
    layer's heads: tests/parallel/test_tp.py); tova_decode's per-step gather is traced in a compiled step."""
    for method in ("kvzip", "adakv_snapkv", "tova", "tova_decode"):
        checked(tmp_path, "model=tiny_llama", f"method={method}", tp=2)
    checked(tmp_path, "model=tiny_llama", "method=tova_decode", "compile=true", tp=2)
