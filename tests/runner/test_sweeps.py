"""Sweeps through submitit: the launcher confs say what a cluster needs, and a real submitit sweep (the local
executor: one process per job, pickled and collected as on SLURM) gives exactly the in-process sweep's
results."""

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from evalkit.config import CONF_DIR
from tests.conftest import the_run

ROOT = Path(__file__).resolve().parents[2]
SWEEP = [
    "-m",
    "model=tiny_llama",
    "task.load.n=1",
    "task.load.lengths=[1024]",
    "task.load.tasks=[niah_single_1,vt]",
    "method=snapstream",
    "method.budget=64,128",
]


def launcher(name: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("eval", overrides=[f"hydra/launcher={name}"], return_hydra_config=True).hydra.launcher


def test_submitit_local_conf_lists_every_setting_of_the_plugins_schema():
    """Ours shadows the plugin's `submitit_local`: a setting missing here would be missing from the job."""
    from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf

    conf = launcher("submitit_local")
    assert set(conf) == {f.name for f in fields(LocalQueueConf)}
    assert (
        conf._target_.endswith("LocalLauncher") and conf.timeout_min >= 600
    )  # the plugin's 60 min kills CPU runs


def test_slurm_conf_sets_what_a_cluster_needs_and_requeues():
    conf = launcher("slurm")
    assert conf._target_.endswith("SlurmLauncher")
    assert {"partition", "gpus_per_node", "timeout_min", "array_parallelism"} <= set(conf)
    assert conf.gpus_per_node >= 1 and conf.array_parallelism >= 1
    assert (
        conf.max_num_timeout >= 1 and conf.signal_delay_s > 0
    )  # a timed-out job is requeued, resumes its journal
    text = (CONF_DIR / "hydra" / "launcher" / "slurm.yaml").read_text()
    assert "journal" in text and "requeue" in text


def sweep(results: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "evalkit", *SWEEP, *extra, f"results_dir={results}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def results_of(results: Path, budget: str) -> tuple[dict, list[dict]]:
    """What a run produced, without what depends on when and how fast it ran."""
    out = the_run(results, "snapstream", budget)
    m = json.loads((out / "metrics.json").read_text())
    metrics = {k: m[k] for k in ("scores", "kv", "n", "identity", "budget", "data", "method")}
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    for s in samples:
        s["generation"] = [
            {k: v for k, v in g.items() if k not in ("wall_s", "tokens_per_s")} for g in s["generation"]
        ]
    return metrics, samples


@pytest.mark.slow
def test_a_two_job_sweep_through_submitit_equals_the_in_process_sweep(tmp_path):
    sweep(tmp_path / "inproc")
    sweep(tmp_path / "submitit", "hydra/launcher=submitit_local")
    launched = (tmp_path / "submitit" / "sweeps" / "multirun.yaml").read_text()
    assert "submitit_launcher.LocalLauncher" in launched
    logs = list((tmp_path / "submitit" / "sweeps" / ".submitit").glob("*/*_result.pkl"))
    assert len(logs) == 2  # two submitit jobs ran and returned
    for budget in ("64", "128"):
        a, b = results_of(tmp_path / "inproc", budget), results_of(tmp_path / "submitit", budget)
        assert a == b and a[0]["kv"]["peak_entries"] == int(budget)
