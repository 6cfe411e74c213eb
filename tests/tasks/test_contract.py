"""The task contract (tasks/README.md): every task conf's module keeps it, and the contract names every hook
the runner and the evalkit LMs read from a task module."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from evalkit import checks
from evalkit.config import choices, compose

ROOT = Path(__file__).resolve().parents[2]
READ = [  # how evalkit reads a task module's attributes
    re.compile(r'getattr\(\s*[\w.]*module\s*,\s*"(\w+)"'),
    re.compile(r"\btask_module\.([A-Za-z_]\w*)"),
]


@pytest.mark.parametrize("task", choices("task"))
def test_every_task_conf_keeps_the_contract(task):
    cfg = compose(overrides=[f"task={task}"])
    checks.check_task(cfg, importlib.import_module(cfg.task.module))  # versions, score keys, headline


def test_the_contract_names_every_hook_the_runner_reads():
    files = [f for f in (ROOT / "evalkit").rglob("*.py") if "kv" not in f.parts]  # kv: torch modules
    read = {name for f in files for r in READ for name in r.findall(f.read_text())}
    assert {"VERSION", "SCORER_VERSION", "question_start", "followup", "configure", "score_many"} <= read
    contract = (ROOT / "tasks" / "README.md").read_text()
    assert sorted(name for name in read if not re.search(rf"\b{name}\b", contract)) == []
