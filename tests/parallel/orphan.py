"""One rank under torchrun that joins its team as `python -m evalkit` does, takes the run folder's lock (rank
0), says its pid (`<folder>/rank<r>.pid`) and waits: what a `kill -9` of the launcher must not leave behind
(tests/parallel/test_runs.py)."""

import os
import sys
import time
from pathlib import Path

from evalkit.results import RunLock
from evalkit.team import Ranks, Team

folder = Path(sys.argv[1])
team = Team.start(Ranks.from_config({"parallel": {"tp_size": None, "dp_size": 1, "backend": None}}))
if team.writer:
    RunLock(folder).acquire()
pid = folder / f"rank{team.ranks.rank}.pid"
pid.with_suffix(".tmp").write_text(str(os.getpid()))
pid.with_suffix(".tmp").rename(pid)
time.sleep(300)
