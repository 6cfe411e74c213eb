"""The report's settings (conf/report.yaml), validated: a bad value is a ReportConfigError naming the key."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from evalkit.config import CONF_DIR
from evalkit.errors import EvalkitError
from evalkit.report.stats import StatSettings


class ReportConfigError(EvalkitError, ValueError):
    """A report setting out of range or of the wrong type; the message names it."""


@dataclass(frozen=True)
class ReportSettings:
    results_dir: Path
    stats: StatSettings
    margins: dict[str, float]
    seed: int
    metrics: dict[str, list[str]]
    hardware: list[str]
    deploy: dict[str, Any]
    expect: dict[str, list]

    def stats_for(self, task: str) -> StatSettings:
        margin = self.margins.get(task)
        return self.stats if margin is None else replace(self.stats, margin=margin)

    def extras_for(self, task: str) -> list[str]:
        return list(self.metrics.get(task) or [])


def _number(cfg: dict, key: str, ok, rule: str, cast=float):
    value = cfg
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
        raise ReportConfigError(f"{key} must be {rule}, got {value!r}")
    if cast is int and value != int(value):
        raise ReportConfigError(f"{key} must be an integer, got {value!r}")
    return cast(value)


def from_dict(cfg: dict) -> ReportSettings:
    positive = (lambda v: v > 0, "a positive number")
    stats = StatSettings(
        margin=_number(cfg, "margin", *positive),
        confidence=_number(cfg, "confidence", lambda v: 0 < v < 1, "in (0, 1)"),
        resamples=_number(cfg, "bootstrap.resamples", lambda v: v >= 100, "an integer >= 100", int),
        power=_number(cfg, "power", lambda v: 0 < v < 1, "in (0, 1)"),
        min_problems=_number(cfg, "min_problems", lambda v: v >= 1, "an integer >= 1", int),
    )
    margins = {}
    for task, value in (cfg.get("margins") or {}).items():
        if value is not None:
            margins[task] = _number({"margins": {task: value}}, f"margins.{task}", *positive)
    metrics = cfg.get("metrics") or {}
    if not all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in metrics.values()):
        raise ReportConfigError(f"metrics must map a task to a list of metric names, got {metrics!r}")
    deploy = dict(cfg.get("deploy") or {})
    hardware = deploy.pop("hardware", None)  # under deploy: a top-level `hardware=` is Hydra's config group
    if not isinstance(hardware, list) or not hardware:
        raise ReportConfigError(
            f"deploy.hardware must be a non-empty list of conf/hardware names, got {hardware!r}"
        )
    if deploy.get("tp") != "auto" and not (isinstance(deploy.get("tp"), int) and deploy["tp"] > 0):
        raise ReportConfigError(f"deploy.tp must be 'auto' or a positive integer, got {deploy.get('tp')!r}")
    return ReportSettings(
        results_dir=Path(cfg.get("results_dir") or "results"),
        stats=stats,
        margins=margins,
        seed=_number(cfg, "bootstrap.seed", lambda v: v >= 0, "a non-negative integer", int),
        metrics={k: list(v) for k, v in metrics.items()},
        hardware=[str(h) for h in hardware],
        deploy=deploy,
        expect={k: list(v or []) for k, v in (cfg.get("expect") or {}).items()},
    )


def default_dict() -> dict:
    """conf/report.yaml as plain data, without its Hydra sections."""
    node = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "report.yaml"))
    return {k: v for k, v in node.items() if k not in ("defaults", "hydra")}


def settings(**overrides) -> ReportSettings:
    """The report's settings from conf/report.yaml, top-level keys overridden (`results_dir=...`)."""
    return from_dict(default_dict() | overrides)
