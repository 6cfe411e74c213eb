"""`python -m evalkit.memory [hardware=h200 context_lens=[...] budgets=[...] results_dir=...]`: the
simulated memory report into `<results_dir>/memory/` (config: conf/memory.yaml)."""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from evalkit.memory.model import MemoryReportError
from evalkit.memory.report import write_report


@hydra.main(config_path="../../conf", config_name="memory", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        paths = write_report(OmegaConf.to_container(cfg, resolve=True))
    except MemoryReportError as e:
        # Bad input is the user's to fix: the message names the field; a traceback would only bury it.
        print(f"evalkit.memory: error: {e}", file=sys.stderr)
        sys.exit(2)
    for path in paths.values():
        print(path)


if __name__ == "__main__":
    main()
