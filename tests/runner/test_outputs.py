"""An output location that cannot be written (read-only, full, or in the way) ends each command line with one
line naming the file and the reason, exit status 2, never a traceback. Root writes anywhere, so the outputs
are blocked by a folder standing where a file must go, or by a place no one can write (/proc)."""

import subprocess
import sys
from pathlib import Path

from tests.runs_fixture import binary_rows, write_run

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _runs(tmp_path) -> Path:
    write_run(tmp_path, binary_rows([1] * 30), method="full", budget=None)
    write_run(tmp_path, binary_rows([1] * 27 + [0] * 3), budget=256)
    return tmp_path


def test_the_leaderboard_names_an_output_it_cannot_write(tmp_path):
    (_runs(tmp_path) / "leaderboard.csv").mkdir()  # a folder where the CSV goes
    proc = cli("-m", "evalkit.leaderboard", f"results_dir={tmp_path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"error: cannot write {tmp_path}/leaderboard.csv" in proc.stderr


def test_the_report_names_an_output_it_cannot_write(tmp_path):
    (_runs(tmp_path) / "report").write_text("")  # a file where the report's folder goes
    proc = cli("-m", "evalkit.report", f"results_dir={tmp_path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error: cannot write" in proc.stderr and f"{tmp_path}/report" in proc.stderr


def test_the_memory_report_names_an_output_it_cannot_write():
    proc = cli("-m", "evalkit.memory", "results_dir=/proc/evalkit-out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "results_dir: cannot write into /proc/evalkit-out/memory" in proc.stderr
