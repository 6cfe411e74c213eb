"""Where results go and how they are written: pure-function run paths, atomic files, a crash-safe journal.

<results_dir>/runs/<task>/<model>/<method>/<budget>/
    config.yaml         the resolved config, written first: a rerun with another config is refused
    generations.jsonl   one line per finished generation, flushed and fsynced (the resume journal)
    samples.jsonl       per sample: id, prompt hash, predictions, scores, generation stats (no contexts)
    metrics.json        scores with breakdowns and stderr, KV and generation stats, provenance
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

PACKAGES = ("evalkit", "torch", "transformers", "lm_eval", "datasets", "hydra-core", "pandas", "accelerate")


def budget_tag(method_cfg: DictConfig, defaults: DictConfig) -> str:
    """`<budget>` plus `-<key><value>` for every method setting changed from its conf default."""
    tag = "none" if method_cfg.get("budget") is None else str(method_cfg.budget)
    for key in sorted(k for k in method_cfg if k not in ("_target_", "budget")):
        if method_cfg[key] != defaults.get(key):
            tag += f"-{key}{method_cfg[key]}"
    return tag


def run_dir(cfg: DictConfig, method_name: str, method_defaults: DictConfig) -> Path:
    """The output path: a pure function of the config (no timestamps, no de-duplication suffixes)."""
    tag = budget_tag(cfg.method, method_defaults)
    return Path(cfg.results_dir) / "runs" / cfg.task.name / cfg.model.name / method_name / tag


def atomic_write(path: Path, text: str) -> None:
    """Write via a temp file in the same folder and rename: readers never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, default=str) + "\n")


class Journal:
    """Append-only JSONL of finished generations keyed by request; the resume point after a crash."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.records: dict[str, dict] = {}
        if self.path.exists():
            self._load()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the run, closed in close())

    def _load(self) -> None:
        raw = self.path.read_text(encoding="utf-8")
        good = []
        for line in raw.split("\n"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # the torn last line of a killed run: that generation is simply redone
            if isinstance(rec, dict) and "key" in rec and rec["key"] not in self.records:
                self.records[rec["key"]] = rec
                good.append(line)
        clean = "".join(g + "\n" for g in good)
        if clean != raw:  # drop torn or foreign lines and end on a newline before appending again
            atomic_write(self.path, clean)

    def get(self, key: str) -> dict | None:
        return self.records.get(key)

    def append(self, record: dict) -> None:
        if record["key"] in self.records:
            return
        self.records[record["key"]] = record
        self._file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def git_sha() -> str | None:
    try:
        root = Path(__file__).resolve().parents[1]
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if sha.returncode != 0:
        return None
    return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def config_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True)
