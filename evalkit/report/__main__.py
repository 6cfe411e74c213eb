"""`python -m evalkit.report [key=value ...]` (conf/report.yaml; `--help` lists the settings): the deployment
report into `<results_dir>/report/`."""

import hydra
from omegaconf import DictConfig, OmegaConf

from evalkit.errors import EvalkitError, OutputError, exit_with
from evalkit.report import write_report
from evalkit.report.config import from_dict


@hydra.main(config_path="../../conf", config_name="report", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        paths = write_report(from_dict(OmegaConf.to_container(cfg, resolve=True)))
    except EvalkitError as e:
        # a bad setting is the user's to fix: the message names it; a traceback would only bury it
        exit_with("evalkit.report", e)
    except OSError as e:  # inputs are read leniently (a bad file is a note): this is the report's own output
        exit_with("evalkit.report", OutputError.of(e))
    for path in paths.values():
        print(path)


if __name__ == "__main__":
    main()
