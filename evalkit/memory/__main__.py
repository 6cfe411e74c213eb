"""`python -m evalkit.memory [KEY=VALUE ...]`: the simulated memory report into `<results_dir>/memory/`
(config: conf/memory.yaml, Hydra overrides).

The command line is checked before Hydra runs the report: an unknown flag, an override Hydra cannot compose
(an unknown key or hardware name) and a bad value all end in `evalkit: error: ...` and exit status 2, with no
traceback and nothing written. `--help` prints the usage and the commented settings."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra._internal.utils import get_args_parser  # Hydra's own flags, so `--cfg job` etc. keep working
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from evalkit.config import CONF_DIR, choices, compose
from evalkit.errors import EvalkitError, OutputError
from evalkit.memory.report import check, write_report
from evalkit.results import check_writable

PROG = "python -m evalkit.memory"
UNSUPPORTED = {  # Hydra flags that would run something other than this one report
    "multirun": "--multirun: the report runs once; list several values in context_lens or budgets instead",
    "config_name": "--config-name: the memory report's config is conf/memory.yaml",
    "config_path": "--config-path: the memory report's config is conf/memory.yaml",
    "config_dir": "--config-dir: the memory report's config is conf/memory.yaml",
    "experimental_rerun": "--experimental-rerun is not supported",
}


def usage() -> str:
    return (
        f"usage: {PROG} [--help] [--cfg {{job,hydra,all}}] [KEY=VALUE ...]\n\n"
        "The simulated accelerator memory report (KV bytes, placement, max batch, decode tok/s, the "
        "SnapStream\nTable 5 check) into <results_dir>/memory/{report.csv,report.md,*.png}.\n"
        "Overrides use Hydra's syntax: hardware=h200 context_lens=[32768,131072] budgets=[8192] batch=16\n\n"
        f"hardware: {', '.join(choices('hardware'))}\n\n"
        "Settings, with their defaults and meaning (conf/memory.yaml):\n\n"
        + (CONF_DIR / "memory.yaml").read_text()
    )


def fail(message: str) -> None:
    print(f"evalkit: error: {message}", file=sys.stderr)
    sys.exit(2)


def check_command_line(argv: list[str]) -> None:
    """Everything that can be wrong on the command line, before Hydra creates an output folder."""
    ap = get_args_parser()
    ap.prog = PROG
    args = ap.parse_args(argv)  # an unknown flag: argparse's usage + error, exit 2
    if args.help:
        print(usage())
        sys.exit(0)
    for key, message in UNSUPPORTED.items():
        if getattr(args, key):
            fail(message)
    if args.hydra_help or args.info or args.shell_completion:
        return  # Hydra's own help and introspection: nothing of ours runs
    try:
        cfg = OmegaConf.to_container(compose("memory", args.overrides), resolve=True)
        check(cfg)
        check_writable(Path(cfg["results_dir"]) / "memory")  # before Hydra makes that folder
    except (HydraException, OmegaConfBaseException) as e:
        # e.g. "Could not override 'nokey'..." or "Could not find 'hardware/nope'" + the available options
        fail(str(e).split("Config search path:")[0].strip())
    except EvalkitError as e:
        fail(str(e))


@hydra.main(config_path="../../conf", config_name="memory", version_base="1.3")
def report(cfg: DictConfig) -> None:
    try:
        paths = write_report(OmegaConf.to_container(cfg, resolve=True))
    except EvalkitError as e:
        # Bad input is the user's to fix: the message names the field; a traceback would only bury it.
        fail(str(e))
    except OSError as e:  # a read-only or full output location
        fail(str(OutputError.of(e)))
    for path in paths.values():
        print(path)


def main() -> None:
    check_command_line(sys.argv[1:])
    report()


if __name__ == "__main__":
    main()
