"""The runner end to end on a tiny random model: results layout, idempotence, resume after SIGKILL, sweeps,
bad input before any model loads, and lm-eval's own CLI on the same task and model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.config import CONF_DIR, choices, compose
from tests.conftest import killed_run, planned_folder

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["model=tiny_llama", "task.load.n=1", "task.load.lengths=[1024]"]


def evalkit(*args, results, check=True, timeout=600):
    cmd = [sys.executable, "-m", "evalkit", *args, f"results_dir={results}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout[-3000:] + proc.stderr[-3000:])
    return proc


def run_folder(results, *overrides):
    return planned_folder(results, *overrides)


@pytest.mark.parametrize(
    "group, name",
    [(g, n) for g in ("model", "task", "method") for n in choices(g)]
    + [("sweep", n) for n in choices("sweep")],
)
def test_every_conf_composes(group, name):
    cfg = compose(overrides=[f"{group}={name}"])
    assert cfg.model.name and cfg.task.module and cfg.method._target_
    if group == "task":
        assert {"name", "module", "headline", "repeats", "load", "generation", "lm_eval_task"} <= set(
            cfg.task
        )
        assert (ROOT / cfg.task.module.replace(".", "/")).with_suffix(".py").exists()


def test_launcher_confs_exist():
    assert {p.stem for p in (CONF_DIR / "hydra" / "launcher").glob("*.yaml")} == {
        "local_parallel",
        "slurm",
        "submitit_local",
    }


def test_run_writes_results_and_is_idempotent(tmp_path):
    evalkit(*SMALL, "method=snapstream", "method.budget=64", results=tmp_path)
    out = run_folder(tmp_path, *SMALL, "method=snapstream", "method.budget=64")
    assert out.relative_to(tmp_path).parts[1:3] == ("ruler-lengths1024-n1", "tiny_llama")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["method"]["name"] == "snapstream" and metrics["budget"] == 64 and metrics["n"] == 6
    assert metrics["kv"]["peak_entries"] == 64
    # kept / seen per generation, averaged: every request keeps 64 entries and has seen its prompt and all
    # but its last output token (6 prompts of 830-985 tokens at 1024: 0.0651)
    gens = [json.loads(x)["stats"] for x in (out / "generations.jsonl").read_text().splitlines()]
    seen = [g["prompt_tokens"] + g["output_tokens"] - 1 for g in gens]
    assert [(g["kv_kept"], g["kv_seen"]) for g in gens] == [(64, n) for n in seen]
    assert metrics["kv"]["kept_fraction"] == pytest.approx(sum(64 / n for n in seen) / 6)
    assert metrics["kv"]["kept_fraction"] == pytest.approx(0.065129, abs=1e-6)
    assert metrics["data"]["source"].startswith("generated:ruler") and len(metrics["data"]["hash"]) == 64
    assert {"git_sha", "versions", "config", "created_at"} <= set(metrics["provenance"])
    assert set(metrics["scores"]) >= {"score", "score/1024", "score/niah_single_1"}
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and all(
        {"id", "prompt_hash", "predictions", "scores", "repeat_scores"} <= set(s) for s in samples
    )
    assert "prompt" not in samples[0] and len(samples[0]["prompt_hash"]) == 16  # no full contexts stored
    again = evalkit(*SMALL, "method=snapstream", "method.budget=64", results=tmp_path)
    assert "is complete; skipping" in again.stdout
    clash = evalkit(
        *SMALL, "method=snapstream", "method.budget=64", "compile=true", results=tmp_path, check=False
    )
    assert clash.returncode == 2 and "different config: compile: False there, True now" in clash.stderr


@pytest.mark.parametrize("after", [5, 18])  # mid-run, and with every generation journaled but no metrics
def test_killed_run_resumes_to_the_same_metrics(tmp_path, after):
    args = [
        "model=tiny_llama",
        "task.load.n=3",
        "task.load.lengths=[1024]",
        "method=streamingllm",
        "method.budget=64",
    ]
    evalkit(*args, results=tmp_path / "clean")
    killed = killed_run(args, tmp_path / "killed", after)  # SIGKILL right after the after-th journal line
    assert killed.returncode == -9
    journal = run_folder(tmp_path / "killed", *args) / "generations.jsonl"
    assert len(journal.read_text().splitlines()) == after and not (journal.parent / "metrics.json").exists()
    done_before = after
    resumed = evalkit(*args, results=tmp_path / "killed")
    assert f"(resuming: {after} of 18 generations journaled)" in resumed.stdout
    keys = [json.loads(x)["key"] for x in journal.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 18  # nothing duplicated, nothing lost
    a, b = (
        json.loads((run_folder(tmp_path / d, *args) / "metrics.json").read_text())
        for d in ("clean", "killed")
    )
    assert a["scores"] == b["scores"] and a["kv"] == b["kv"] and a["n"] == b["n"] == 18
    # resumed, not restarted: what was journaled before the kill was taken from the journal, the rest
    # generated
    assert (
        b["generation"]["from_journal"] == done_before
        and b["generation"]["generated_now"] == 18 - done_before
    )
    assert a["generation"]["from_journal"] == 0 and a["generation"]["generated_now"] == 18
    sa, sb = ((run_folder(tmp_path / d, *args) / "samples.jsonl").read_text() for d in ("clean", "killed"))

    def strip(text):
        return [{k: v for k, v in json.loads(x).items() if k != "generation"} for x in text.splitlines()]

    assert strip(sa) == strip(sb)


def test_two_job_sweep_through_joblib(tmp_path):
    proc = evalkit(
        "-m",
        *SMALL,
        "method=snapstream",
        "method.budget=64,128",
        "hydra/launcher=local_parallel",
        results=tmp_path,
    )
    assert proc.returncode == 0
    launched = (tmp_path / "sweeps" / "multirun.yaml").read_text()  # Hydra records the launcher it used
    assert "JoblibLauncher" in launched and "n_jobs: 2" in launched
    for budget in ("64", "128"):
        m = json.loads((run_folder(tmp_path, *SMALL, f"method.budget={budget}") / "metrics.json").read_text())
        assert m["kv"]["peak_entries"] == int(budget)


@pytest.mark.parametrize(
    "override, message",
    [
        ("task=nope", "Available options in 'task'"),
        ("model=nope", "Available options in 'model'"),
        ("method=nope", "Available options in 'method'"),
        ("method=snapkv_decode method.interval=16", "snapkv_decode: interval must be > window"),
        ("method.budget=abc", "budget must be a positive integer"),
        ("method.budget=0", "budget must be > 0"),
        ("method.recent=500", "sink + recent must be <= budget"),
        ("batch_size=0", "batch_size must be a positive integer"),
        ("task.load.lengths=[16384]", "exceed the model's context of 8192"),
        ("task=aime24 task.load.source=/nonexistent/aime.jsonl", "/nonexistent/aime.jsonl"),
    ],
)
def test_bad_input_fails_before_any_model_loads(override, message, tmp_path):
    proc = evalkit(*override.split(), results=tmp_path, check=False, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and message in out, out[-2000:]
    assert "Traceback" not in out and "Loading weights" not in out
    assert not (tmp_path / "runs").exists()


def test_lm_eval_cli_runs_the_task_on_a_tiny_model(tmp_path):
    cmd = [
        sys.executable, "-m", "lm_eval", "run", "--model", "evalkit",
        "--model_args", "model=tiny_llama,method=snapstream,budget=64",
        "--include_path", str(ROOT / "tasks"), "--tasks", "evalkit_ruler",
        "--metadata",
        json.dumps({"tokenizer": "smollm2_135m", "n": 1, "lengths": [1024], "tasks": ["niah_single_1"]}),
        "--output_path", str(tmp_path), "--limit", "1",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    scores = {k: v for k, v in results["results"]["evalkit_ruler"].items() if k.endswith(",all")}
    # the tiny random model finds no needle: every key evalkit's score() returns, aggregated by lm-eval, is 0
    assert scores == {
        "score,all": 0.0,
        "score_stderr,all": "N/A",
        "score/niah_single_1,all": 0.0,
        "score/niah_single_1_stderr,all": "N/A",
        "score/1024,all": 0.0,
        "score/1024_stderr,all": "N/A",
        "score/niah_single_1@1024,all": 0.0,
        "score/niah_single_1@1024_stderr,all": "N/A",
        "no_answer,all": 0.0,  # the standard key: the continuation has text
        "no_answer_stderr,all": "N/A",
    }
    assert results["n-samples"]["evalkit_ruler"] == {"original": 1, "effective": 1}
    # evalkit's names collide with none lm-eval ships: no "overrides existing task" / "Duplicate task name"
    # warning
    assert "overrides existing" not in proc.stderr and "Duplicate" not in proc.stderr, proc.stderr[-3000:]


def test_longbench_cot_makes_the_second_call_without_the_document(tmp_path):
    evalkit(
        "model=tiny_llama",
        "task=longbench_v2_cot",
        "task.load.n=2",
        "method=snapstream",
        "method.budget=128",
        "model.max_new_tokens=48",
        results=tmp_path,
    )
    out = run_folder(
        tmp_path,
        "model=tiny_llama",
        "task=longbench_v2_cot",
        "task.load.n=2",
        "method.budget=128",
        "model.max_new_tokens=48",
    )
    journal = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert len(journal) == 2
    for rec in journal:
        follow = rec["stats"]["followup"]
        assert "first_output" in rec["stats"] and follow["prompt_tokens"] < rec["stats"]["prompt_tokens"]
        assert follow["output_tokens"] <= 48
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["scores"]["accuracy"]["n"] == 2 and "no_answer" in metrics["scores"]
