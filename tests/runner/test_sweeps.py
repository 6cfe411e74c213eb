"""Sweeps through submitit: the launcher confs say what a cluster needs, and a real submitit sweep (the local
executor: one process per job, pickled and collected as on SLURM) gives exactly the in-process sweep's
results."""

import json
import os
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


# --- multi-GPU layouts: DeepSeek-R1 on one 8 x H200 node (TP8), on two through SLURM (the paper's TP16) ---


def sweep_job(name: str, *extra: str):
    """The config one job of a sweep conf runs: its single-valued sweep parameters applied as overrides."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        params = compose("eval", overrides=[f"sweep={name}"], return_hydra_config=True).hydra.sweeper.params
        fixed = [f"{k}={v}" for k, v in params.items() if "," not in str(v)]
        return compose("eval", overrides=[f"sweep={name}", *fixed, *extra], return_hydra_config=True)


@pytest.mark.parametrize(
    "name, tp, nodes",
    [("paper_deepseek", 8, 1), ("paper_deepseek_longbench", 8, 1), ("paper_deepseek_tp16", 16, 2)],
)
def test_deepseek_sweeps_set_the_layout_of_the_nodes_they_name(name, tp, nodes):
    cfg = sweep_job(name)
    assert cfg.model.name == "deepseek_r1" and cfg.model.id == "deepseek-ai/DeepSeek-R1-0528"
    assert (cfg.parallel.tp_size, cfg.parallel.dp_size) == (tp, 1)
    if nodes > 1:  # one process per GPU: the SLURM tasks are exactly the layout's ranks
        launcher = cfg.hydra.launcher
        assert launcher._target_.endswith("SlurmLauncher")
        assert (launcher.nodes, launcher.gpus_per_node) == (nodes, 8)
        assert launcher.nodes * launcher.tasks_per_node == tp * cfg.parallel.dp_size


def test_the_deepseek_model_conf_loads_the_published_fp8_checkpoint_and_states_how():
    text = (CONF_DIR / "model" / "deepseek_r1.yaml").read_text()
    cfg = sweep_job("paper_deepseek").model
    assert cfg.dtype == "bfloat16" and "quantization" not in cfg  # the checkpoint's own fp8 config applies
    assert "fp8" in text and "device_map" in text and "parallel.tp_size" in text


def test_a_two_node_slurm_job_starts_one_task_per_gpu_and_exports_the_rendezvous(tmp_path, monkeypatch):
    """The sbatch script submitit writes for a TP16 sweep point (Hydra's launcher maps its settings the same
    way), and the address and port its setup lines export on a node list of two hosts."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    (tmp_path / "srun").write_text("#!/bin/sh\n")  # submitit looks for srun before writing a script
    (tmp_path / "srun").chmod(0o755)
    (tmp_path / "scontrol").write_text(
        "#!/bin/sh\necho gpu03\necho gpu04\n"
    )  # `show hostnames` of gpu[03-04]
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    conf = OmegaConf.to_container(sweep_job("paper_deepseek_tp16", f"results_dir={tmp_path}").hydra.launcher)
    conf.pop("_target_"), conf.pop("submitit_folder")
    executor = submitit.AutoExecutor(
        cluster="slurm", folder=tmp_path / "jobs", slurm_max_num_timeout=conf.pop("max_num_timeout")
    )
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in conf.items()})
    script = executor._executor._make_submission_file_text("true", "uid")
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"):
        assert line in script
    assert "export SLURM_KILL_BAD_EXIT=1" in script  # a failed rank ends every task, not only itself
    setup = script.split("# setup\n")[1].split("\n\n")[0]
    env = {
        "PATH": __import__("os").environ["PATH"],
        "SLURM_JOB_NODELIST": "gpu[03-04]",
        "SLURM_JOB_ID": "123456",
    }
    out = subprocess.run(
        ["bash", "-c", setup + '\necho "$MASTER_ADDR:$MASTER_PORT"'], env=env, capture_output=True, text=True
    )
    assert out.stdout.strip() == "gpu03:23456"  # the job's first node; 20000 + job id % 20000


@pytest.mark.slow  # 28 plans against the model config (~30 s); sweep=rivals composes in test_cli
def test_the_rivals_sweep_lists_every_method_and_each_job_plans(tmp_path):
    """conf/sweep/rivals.yaml: every conf of conf/method, two budgets, RULER query-aware and query-agnostic;
    each of its jobs (a budget list) plans and passes every check made before weights load, against the
    embedded model's config (what each method refuses included)."""
    import evalkit.run as runner
    from evalkit.config import choices
    from evalkit.config import compose as evalkit_compose

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        params = compose("eval", overrides=["sweep=rivals"], return_hydra_config=True).hydra.sweeper.params
    methods = params.method.split(",")
    assert sorted(methods) == sorted(choices("method")) and params["method.budget"] == "[128,256]"
    assert params.query_aware == "true,false"
    for method in methods:
        for aware in ("true", "false"):
            cfg = evalkit_compose(
                overrides=[
                    f"method={method}",
                    "method.budget=[128,256]",
                    f"query_aware={aware}",
                    f"results_dir={tmp_path}",
                ]
            )
            plans = runner.plans_for(cfg)
            assert cfg.task.name == "ruler" and len(plans) == (1 if method == "full" else 2)
            runner.read_model(plans)
