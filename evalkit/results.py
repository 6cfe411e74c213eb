"""The run folder: its lock, atomic writes, and the provenance a run records (its path, a pure function of the
config, is part of what a run is: evalkit.identity.run_dir).

<results_dir>/runs/<task>/<model>/<method>/<budget>/
    config.yaml         the resolved config, written first: a rerun with another config is refused
    generations.jsonl   one line per finished generation, flushed and fsynced (the resume journal,
                        evalkit.journal)
    samples.jsonl       per sample: id, prompt hash, predictions, scores, generation stats (no contexts)
    metrics.json        scores with breakdowns and stderr, KV and generation stats, provenance
                        (evalkit.metrics)
    server.json         a served model's server as it reported itself (evalkit.served; served runs only)
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from importlib import metadata
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from evalkit.errors import EvalkitError

PACKAGES = ("evalkit", "torch", "transformers", "lm_eval", "datasets", "hydra-core", "pandas", "accelerate")


def check_writable(folder: Path, tries: int = 3) -> None:
    """Fail now, not after the model and data loaded, when results cannot be written; leaves nothing behind
    but what a concurrent run (a sweep's parallel jobs share parent folders) put there meanwhile."""
    path = Path(folder).absolute()
    for attempt in range(tries):
        made = []
        try:
            for parent in reversed([path, *path.parents]):
                try:
                    parent.mkdir()
                    made.append(parent)
                except FileExistsError:  # there already, or a concurrent run made it just now
                    pass
            with tempfile.TemporaryFile(dir=path):
                return
        except FileNotFoundError as e:  # a concurrent check removed a parent between two steps: again
            if attempt == tries - 1:
                raise _unwritable(path, e) from None
        except OSError as e:
            raise _unwritable(path, e) from None
        finally:
            for d in reversed(made):
                try:
                    d.rmdir()
                except OSError:  # a concurrent run's folder is inside now: it stays (its run needs it)
                    break


def _unwritable(path: Path, e: OSError):
    from evalkit.config import ConfigError

    return ConfigError(f"results_dir: cannot write into {path} ({e.strerror or e})")


def atomic_write(path: Path, text: str | bytes) -> None:
    """Write via a temp file in the same folder and rename: readers never see a half-written file, a failed
    write leaves no temp file behind, and every output gets the same mode (0644 under the usual umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; other outputs (and readers) expect the umask's
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False, default=str) + "\n")


class RunLock:
    """An exclusive lock on a run folder for the whole run: a second process on the same folder is refused
    with the holder's pid, instead of generating everything twice into one journal."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / ".lock"
        self._file = None

    def acquire(self) -> None:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held for the run, closed in release())
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise RunInUse(f"{self.path.parent} is being run by {holder}; wait for it or stop it") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock; the file stays (harmless, reused next time)
            self._file = None


class RunInUse(EvalkitError, RuntimeError):
    """Another live process holds the run folder's lock."""


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


def hardware() -> str:
    """Where this process computes: the GPUs torch sees, else the CPU and its cores (plot titles name it)."""
    import platform

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"CPU ({os.cpu_count()} cores, {platform.machine()})"


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


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """A matplotlib figure written atomically (rendered in memory, then renamed into place)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", dpi=dpi)
    atomic_write(Path(path), buf.getvalue())
    return Path(path)
