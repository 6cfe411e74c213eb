"""Unknown settings on the command line get evalkit's message with the valid settings, never Hydra's
`+key` hint (following that hint only leads to evalkit refusing the added key)."""

import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.config import ConfigError
from evalkit.overrides import check_overrides

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["method=streamingllm", "method.window=16"],
            "method streamingllm: unknown setting 'window'; settings: budget, sink "
            "(conf/method/streamingllm.yaml)",
        ),
        (
            ["method.recnet=3"],
            "method snapstream: unknown setting 'recnet'; settings: budget, pool_kernel, recent, sink, "
            "spare_slots, window (conf/method/snapstream.yaml)",
        ),
        (
            ["task.load.m=1"],
            "task ruler: unknown setting 'load.m'; settings: generation, headline, lm_eval_task, "
            "load.essay_path, load.hotpotqa_path, load.lengths, load.n, load.seed, load.source, "
            "load.squad_path, load.tasks, module, name, repeats (conf/task/ruler.yaml)",
        ),
        (
            ["batchsize=4"],
            "unknown setting 'batchsize'; run settings: batch_size, compile, limit, multi_question, "
            "parallel, query_aware, results_dir, seed; config groups: model, task, method, kv, sweep",
        ),
    ],
)
def test_unknown_setting_lists_the_valid_ones(overrides, message):
    with pytest.raises(ConfigError) as e:
        check_overrides(overrides)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        ["method=snapkv", "method.window=16", "task.load.n=1", "task.load.lengths=[1024]"],
        ["task=ruler_paper", "task.load.n=3", "method.budget=[128,256]", "batch_size=2"],
        ["task=nope", "task.x=1"],  # Hydra names the valid task choices
        ["-m", "method=full,snapstream", "method.sink=3"],  # each job's method is checked by the runner
        ["+method.recnet=3", "hydra.job.chdir=false"],  # added keys: the runner refuses those itself
        ["-m", "sweep=ruler_budgets", "hydra/launcher=local_parallel", "hydra.launcher.n_jobs=2"],
    ],
)
def test_known_settings_and_others_checks_pass(overrides):
    check_overrides(overrides)


def test_the_cli_prints_evalkit_message_not_hydras_hint(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "evalkit",
        "method=streamingllm",
        "method.window=16",
        f"results_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "evalkit: error: method streamingllm: unknown setting 'window'; settings: budget, sink "
        "(conf/method/streamingllm.yaml)"
    )
    assert "+method" not in proc.stdout + proc.stderr and not (tmp_path / "runs").exists()
