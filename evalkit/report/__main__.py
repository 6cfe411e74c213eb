"""`python -m evalkit.report [key=value ...]` (conf/report.yaml; `--help` lists the settings): the deployment
report into `<results_dir>/report/`."""

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from evalkit.memory.model import MemoryReportError
from evalkit.report import ReportConfigError, write_report
from evalkit.report.config import from_dict


@hydra.main(config_path="../../conf", config_name="report", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        paths = write_report(from_dict(OmegaConf.to_container(cfg, resolve=True)))
    except (ReportConfigError, MemoryReportError) as e:
        # a bad setting is the user's to fix: the message names it; a traceback would only bury it
        print(f"evalkit.report: error: {e}", file=sys.stderr)
        sys.exit(2)
    for path in paths.values():
        print(path)


if __name__ == "__main__":
    main()
