"""`lm_eval --model evalkit`: lm-eval's warnings about evalkit's own tasks that say nothing wrong are dropped
(the one about group over-weighting read like a correctness problem), the others kept; evalkit's KV figures
reach lm-eval's results JSON."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.lm_eval_plugin import quiet

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "logger, message, kept",
    [
        ("lm_eval.evaluator_utils", "[evalkit_ruler] No aggregation function defined for metric score/vt. "
            "Using mean.", False),
        ("lm_eval.evaluator_utils", "[evalkit_ruler] Metrics were not scored on the same number of documents "
            "(...) "
         "so any metric scored on fewer than 2 documents is over-weighted in the group score.", False),
        ("lm_eval.api.task", "evalkit_ruler: Custom kwargs can be passed to `--metadata` in console", False),
        ("lm_eval.evaluator_utils", "[mmlu] No aggregation function defined for metric x. Using mean.", True),
        ("lm_eval.evaluator_utils", "[gsm8k] Metrics were not scored ... over-weighted in the group score.", True),  # noqa: E501
        ("lm_eval.config.evaluate_config", "--limit SHOULD ONLY BE USED FOR TESTING.", True),
    ],
)  # fmt: skip
def test_only_evalkit_tasks_harmless_warnings_are_dropped(logger, message, kept):
    quiet()
    record = logging.LogRecord(logger, logging.WARNING, __file__, 1, message, None, None)
    assert logging.getLogger(logger).filter(record) == kept


def test_cli_keeps_only_the_limit_warning_and_writes_kv_figures(tmp_path):
    meta = {
        "tokenizer": "smollm2_135m",
        "n": 1,
        "lengths": [1024],
        "tasks": ["niah_single_1", "niah_multikey_2"],
    }
    cmd = [
        sys.executable, "-m", "lm_eval", "run", "--model", "evalkit",
        "--model_args", "model=tiny_llama,method=snapstream,budget=64",
        "--include_path", str(ROOT / "tasks"), "--tasks", "evalkit_ruler", "--metadata", json.dumps(meta),
        "--output_path", str(tmp_path), "--limit", "2",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and "--limit SHOULD ONLY BE USED FOR TESTING" in warnings[0], warnings
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    ek = results["config"]["evalkit"]
    assert ek["method"]["name"] == "snapstream" and ek["method"]["budget"] == 64
    assert ek["kv"]["peak_entries"] == 64 and 0 < ek["kv"]["kept_fraction"] < 0.1
    assert ek["generation"]["requests"] == 2


def test_cli_runs_the_run_settings_it_is_given_or_refuses_them_in_one_line(tmp_path):
    """`query_aware` / `multi_question` in `--model_args` reach the model and the task (they used to load the
    model, then fail as an unknown method setting); in `--metadata` alone they reach the task, which refuses
    what cannot run in one line (multi_question without query_aware=false was silently ignored)."""
    meta = {
        "tokenizer": "smollm2_135m",
        "n": 1,
        "lengths": [1024],
        "tasks": ["niah_single_1", "niah_multikey_2"],
    }
    base = [
        sys.executable, "-m", "lm_eval", "run", "--model", "evalkit", "--include_path", str(ROOT / "tasks"),
        "--tasks", "evalkit_ruler", "--gen_kwargs", "max_gen_toks=4",
    ]  # fmt: skip
    args = "model=tiny_llama,method=snapkv,budget=64,query_aware=false,multi_question=true"
    cmd = [*base, "--model_args", args, "--metadata", json.dumps(meta), "--output_path", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ek = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["config"]["evalkit"]
    assert ek["generation"]["requests"] == 5  # niah_multikey_2's four questions on one compressed context
    cmd = [
        *base,
        "--model_args",
        "model=tiny_llama",
        "--metadata",
        json.dumps(meta | {"multi_question": True}),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "lm_eval --model evalkit: error: multi_question=true asks several questions on one context "
        "compressed before any of them: it needs query_aware=false"
    )
