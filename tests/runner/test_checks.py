"""Refused before the model loads, in one line (evalkit.checks), and the printed next step runs as printed:
issue 31 items 9 (a TP size that does not divide the heads), 11 (`lm_eval --model evalkit`'s own settings
and the task's) and 13 (the `next:` line's make commands)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

import evalkit.loading
import evalkit.run as runner
import tasks.aime24.aime24 as aime24
import tasks.ruler.ruler as ruler
from evalkit import summary
from evalkit.config import ConfigError
from evalkit.lm import EvalkitLM
from evalkit.team import Ranks, Team
from tests.conftest import fresh_run

ROOT = Path(__file__).resolve().parents[2]
RULER = ["task.load.n=1", "task.load.lengths=[1024]", "task.load.tasks=[niah_single_1,niah_multikey_2]"]


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(runner, "get_model", refuse)
    monkeypatch.setattr(evalkit.loading, "load_model", refuse)


# --- 9: tensor parallelism shards heads --------------------------------------------------------------------
@pytest.mark.parametrize(
    "model, heads", [("tiny_llama", "4 attention and 2 KV heads"), ("tiny_deepseek", "4 attention and 4 KV")]
)
def test_a_tp_size_that_does_not_divide_the_heads_is_refused_before_the_model_loads(
    model, heads, tmp_path, monkeypatch, no_model
):
    team = Team(Ranks(tp=3))  # NPROC=3, rank 0 (the refusal comes before any collective)
    with pytest.raises(ConfigError, match=f"parallel.tp_size=3: {model} has {heads}") as e:
        fresh_run(f"model={model}", *RULER, results=tmp_path, team=team)
    assert "use a TP size that divides both (1, 2" in str(e.value) and "\n" not in str(e.value)
    assert not list(tmp_path.rglob("config.yaml"))  # nothing written


# --- 11: lm_eval --model evalkit ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, message",
    [
        (dict(query_aware="no"), "query_aware must be true or false, got 'no'"),
        (dict(multi_question=True), "multi_question=true asks several questions on one context compressed"),
        (
            dict(model="tiny_deepseek", method="snapkv_decode", budget=128),
            "snapkv_decode re-scores the cached keys, but tiny_deepseek caches MLA's latent",
        ),
    ],
)
def test_lm_eval_settings_are_refused_before_the_weights_load(args, message, no_model):
    """What `--model_args` hands the evalkit model is checked as `python -m evalkit` checks it, before any
    weight loads (query_aware used to reach the method as an unknown setting after loading; snapkv_decode on
    MLA failed after generation had started)."""
    with pytest.raises(ConfigError, match=message):
        EvalkitLM(**{"model": "tiny_llama", "method": "snapstream", "budget": 64, **args})


def test_the_tasks_metadata_settings_reach_the_docs_or_are_refused(monkeypatch):
    """`--metadata` reaches only the task: its hooks put where each question starts on its docs (the LM
    splits there), and refuse what the task cannot run, instead of ignoring it."""
    meta = dict(model="tiny_llama", n=1, lengths=[1024], tasks=["niah_single_1"])
    with pytest.raises(ConfigError, match="multi_question=true asks several questions on one context"):
        ruler.custom_dataset(**meta, multi_question=True)
    with pytest.raises(ConfigError, match="task aime24 cannot compress its context before the question"):
        aime24.custom_dataset(query_aware=False)
    (doc,) = ruler.custom_dataset(**meta, query_aware=False)["test"]
    (aware,) = ruler.custom_dataset(**meta)["test"]
    from evalkit.task import get_tokenizer

    lm = SimpleNamespace(tokenizer=get_tokenizer("smollm2_135m"), max_gen_toks=256, _cap=lambda n: n)
    prompt = EvalkitLM._prompt(lm, SimpleNamespace(args=("", {}), doc=doc), "k")
    assert prompt.question_at is not None and prompt.text[prompt.question_at :].startswith("What is the ")
    assert EvalkitLM._prompt(lm, SimpleNamespace(args=("", {}), doc=aware), "k").question_at is None
    assert prompt.text == EvalkitLM._prompt(lm, SimpleNamespace(args=("", {}), doc=aware), "k").text


def test_a_method_a_tasks_second_call_cannot_run_beside_is_refused_before_generating(monkeypatch):
    """Through lm-eval's CLI the task is known only when its requests come: h2o on LongBench-v2 CoT (a
    second, full-cache call per request) is refused then, before anything is generated."""
    import tasks.longbench_v2.longbench_v2 as lb
    from evalkit.config import model_spec
    from evalkit.engine import Engine
    from evalkit.loading import load_model

    model, tokenizer = load_model(model_spec("tiny_llama"))
    monkeypatch.setattr(Engine, "_prefill", lambda *a, **k: pytest.fail("generation started"))
    lm = EvalkitLM(model="tiny_llama", method="h2o", budget=128, hf_model=model, tokenizer=tokenizer)
    doc = lb.custom_dataset(mode="cot", n=1)["test"][0]
    req = SimpleNamespace(args=("", {"max_gen_toks": 4}), doc=doc, task_name="t", doc_id=0, idx=0)
    with pytest.raises(ConfigError, match="second call on the full cache after each first one, which a h2o"):
        lm.generate_until([req], disable_tqdm=True)


# --- 13: the printed next step ------------------------------------------------------------------------------
def printed(monkeypatch, capsys, tmp_path, overrides: list[str], method="snapstream") -> list[str]:
    """The `make` commands `next_step` prints after a run given these command-line overrides."""
    from hydra.core.hydra_config import HydraConfig

    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(
        HydraConfig, "get", staticmethod(lambda: SimpleNamespace(overrides=SimpleNamespace(task=overrides)))
    )
    out = tmp_path / "runs" / "ruler" / "tiny_llama" / method / "64"
    cfg = SimpleNamespace(results_dir=str(tmp_path / "my results"))
    summary.next_step([SimpleNamespace(cfg=cfg, method=SimpleNamespace(name=method), out=out)])
    said = capsys.readouterr().out
    return ["make " + line.split(" make ", 1)[1] for line in said.splitlines() if " make " in line]


def recipe(line: str, cwd: Path) -> list[str]:
    """The command make runs for a printed line pasted into a shell (`make -n`: printed, not run), as argv."""
    dry = line.replace("make ", "make -n -s -o .venv/.stamp ", 1)
    done = subprocess.run(["bash", "-c", dry], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout.strip().splitlines()[-1])


def test_the_printed_next_commands_run_as_printed(tmp_path, monkeypatch, capsys):
    """`make report results_dir=...` never reached the report (the Makefile forwards only ARGS), and an
    override's `$(...)` ran when the line was pasted: each printed command now hands every value over as
    given, quoted for the shell and for make."""
    canary = tmp_path / "ran"
    odd = [f"task.load.source=$(touch {canary})", "task.load.lengths=[1024]", "seed=1"]
    full, report = printed(monkeypatch, capsys, tmp_path, odd)
    assert full.startswith("make eval METHOD=full ARGS=") and report.startswith("make report ARGS=")
    argv = recipe(full, ROOT)
    assert argv[argv.index("evalkit") + 1 :] == ["method=full", *odd] and not canary.exists()
    assert recipe(report, ROOT)[-1] == f"results_dir={tmp_path / 'my results'}"
    (report,) = printed(monkeypatch, capsys, tmp_path, ["model=tiny_llama"], method="full")
    assert recipe(report, ROOT)[-1] == f"results_dir={tmp_path / 'my results'}"
