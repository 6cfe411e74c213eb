"""`python -m evalkit.demo`'s command line: usage, and every bad value refused before the model loads.
The needle retrieval itself is tests/kv/test_kv_needle.py's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.demo import parse_args

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_build_the_four_methods():
    args, methods = parse_args([])
    assert (args.model, args.length, args.budget, args.n) == ("smollm2_135m", 1500, 256, 3)
    assert [m.name for m in methods] == ["full", "streamingllm", "snapkv", "snapstream"]
    assert [getattr(m, "budget", None) for m in methods] == [None, 256, 256, 256]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--length", "abc"], "invalid int value: 'abc'"),
        (["--model", "nope"], "unknown model 'nope'; valid choices: "),
        (["--budget", "0"], "budget must be > 0"),
        (["--budget", "8"], "window must be in [1, budget]"),  # SnapKV keeps its 32-token window
        (["-n", "0"], "-n must be at least 1"),
        (["--length", "200"], "--length (200) must exceed --budget (256)"),
    ],
)
def test_bad_values_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.startswith("usage: python -m evalkit.demo")


def demo(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "evalkit.demo", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nope"], "unknown model 'nope'"),  # a ConfigError traceback before
        # weights that cannot be loaded (offline hub): the loader's advice, not a ModelLoadError traceback
        (["--model", "llama31_8b_instruct"], "cannot fetch 'meta-llama/Llama-3.1-8B-Instruct'"),
        # refused before the weights load (a prompt the model cannot take would fail after minutes)
        (
            ["--model", "tiny_llama", "--length", "100000"],
            "--length (100000) exceeds tiny_llama's context of 8192",
        ),
    ],
)
def test_entry_point_errors_exit_2_without_traceback(args, message):
    proc = demo(*args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
