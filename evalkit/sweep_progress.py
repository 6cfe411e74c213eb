"""A Hydra callback that shows a sweep's progress: `[sweep 3/16 ####------] method=snapkv
method.budget=[...]`.

The job count is computed once at the start of the multirun, exactly as Hydra's basic sweeper expands the
sweep (the config's `hydra.sweeper.params`, then the command line's overrides), and kept in the sweep folder
so that jobs running in other processes (the joblib launcher) can read it.
"""

from __future__ import annotations

import math
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig


def count_jobs(config: DictConfig) -> int:
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
    sizes: dict[str, int] = {}
    for o in overrides:  # a later override of a key replaces an earlier one, as in the sweeper
        sizes[o.get_key_element()] = len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1
    return max(1, math.prod(sizes.values()))


class SweepProgress(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        sweep = Path(config.hydra.sweep.dir)
        sweep.mkdir(parents=True, exist_ok=True)
        (sweep / ".jobs").write_text(str(count_jobs(config)))

    def on_job_start(self, config: DictConfig, **kwargs) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        counter = Path(config.hydra.sweep.dir) / ".jobs"
        total = int(counter.read_text()) if counter.exists() else 0
        done = config.hydra.job.num
        bar = ("#" * round(10 * done / total)).ljust(10, "-") if total else ""
        print(
            f"\n[sweep {done + 1}/{total or '?'} {bar}] {' '.join(config.hydra.overrides.task)}", flush=True
        )
