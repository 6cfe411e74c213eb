"""Where results go and how they are written: pure-function run paths, atomic files, a crash-safe journal.

<results_dir>/runs/<task>/<model>/<method>/<budget>/
    config.yaml         the resolved config, written first: a rerun with another config is refused
    generations.jsonl   one line per finished generation, flushed and fsynced (the resume journal)
    samples.jsonl       per sample: id, prompt hash, predictions, scores, generation stats (no contexts)
    metrics.json        scores with breakdowns and stderr, KV and generation stats, provenance
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


# What every journal line must hold (evalkit.lm writes it); anything else is set aside on load.
RECORD_FIELDS = {"key": str, "doc_id": int, "repeat": int, "text": str, "prompt_hash": str, "stats": dict}


def record_problem(rec) -> str | None:
    """Why a parsed journal line is not a usable generation record (None when it is)."""
    if not isinstance(rec, dict):
        return f"not a JSON object ({type(rec).__name__})"
    for name, kind in RECORD_FIELDS.items():
        if name not in rec:
            return f"missing {name!r}"
        if not isinstance(rec[name], kind) or isinstance(rec[name], bool):
            return f"{name!r} is {type(rec[name]).__name__}, not {kind.__name__}"
    return None


class Journal:
    """Append-only JSONL of finished generations keyed by request; the resume point after a crash.

    On load, the torn last line of a killed run is dropped (that generation is simply redone); any other line
    that is not a valid record (bad JSON, a foreign object, a field missing or of the wrong type) is moved to
    `<name>.rejected` and named by its line number in `self.rejected`, so nothing is lost and nothing crashes
    later. A repeated key keeps its first record.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.records: dict[str, dict] = {}
        self.rejected: list[tuple[int, str]] = []  # (line number, reason)
        if self.path.exists():
            self._load()
        self.loaded_keys = frozenset(self.records)  # finished before this process started (a resume)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the run, closed in close())

    def _load(self) -> None:
        raw = self.path.read_text(encoding="utf-8")
        lines = raw.split("\n")
        good, bad = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # no newline after it: the torn write of a killed run
                    continue
                rec = None
            problem = "not valid JSON" if rec is None else record_problem(rec)
            if problem is None and rec["key"] in self.records:
                continue  # a duplicate of a finished request: the first one stands
            if problem is not None:
                self.rejected.append((number, problem))
                bad.append(line)
                continue
            self.records[rec["key"]] = rec
            good.append(line)
        if bad:
            with open(self.path.with_name(self.path.name + ".rejected"), "a", encoding="utf-8") as f:
                f.write("".join(b + "\n" for b in bad))
        clean = "".join(g + "\n" for g in good)
        if clean != raw:  # torn, foreign or duplicate lines dropped; end on a newline before appending again
            atomic_write(self.path, clean)

    def get(self, key: str) -> dict | None:
        return self.records.get(key)

    def append(self, record: dict) -> None:
        if record["key"] in self.records:
            return
        problem = record_problem(record)
        if problem is not None:  # a bug in the writer: never journal what could not be read back
            raise ValueError(f"journal record {record.get('key')!r}: {problem}")
        self.records[record["key"]] = record
        self._file.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


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


class RunInUse(RuntimeError):
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


# Settings that never change a generation: where results live, how a task grades (the code sandbox's limits),
# which score a table shows first, and how a served model is reached (its address, concurrency, retries: the
# server's own identity is checked separately, evalkit.served). A change of the grading ones re-scores a finished
# run from its journal.
NOT_GENERATION = ("results_dir", "task.setup", "task.headline", "model.base_url", "model.num_concurrent",
                  "model.max_retries", "model.timeout_s")  # fmt: skip

# evalkit's lm-eval tasks are registered as `evalkit_<task>` so that no name collides with a task or group lm-eval
# ships (its `ruler` group, `aime24`, ...). Runs made before that rename used the bare names.
LM_EVAL_PREFIX = "evalkit_"


def task_id(lm_eval_task: str) -> str:
    """evalkit's own name for an lm-eval task: the registered name without the `evalkit_` namespace. Journal keys,
    sampling seeds and generation identities use it, so run folders made before the rename (journals keyed
    `ruler/...`, configs with `lm_eval_task: ruler`) are skipped, re-scored and resumed as they were."""
    return lm_eval_task.removeprefix(LM_EVAL_PREFIX)


# Settings added after runs already existed, with the value that does what those runs did: a saved config that
# lacks one is read with it, so upgrading evalkit never orphans a finished or half-done run folder.
ADDED_SETTINGS = {"compile": False}


def saved_config(text: str) -> DictConfig:
    """A run folder's config.yaml, completed with ADDED_SETTINGS it predates."""
    cfg = OmegaConf.create(text)
    for key, value in ADDED_SETTINGS.items():
        if OmegaConf.select(cfg, key, default="<missing>") == "<missing>":
            OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def generation_settings(cfg: DictConfig) -> dict:
    """The resolved config without the keys in NOT_GENERATION: what two runs must share to share a journal."""
    out = OmegaConf.to_container(cfg, resolve=True)
    for key in NOT_GENERATION:
        *parents, leaf = key.split(".")
        node = out
        for name in parents:
            node = node.get(name) or {}
        node.pop(leaf, None)
    task = out.get("task")
    if isinstance(task, dict) and isinstance(task.get("lm_eval_task"), str):
        task["lm_eval_task"] = task_id(task["lm_eval_task"])  # the namespace is no generation setting
    return out


def generation_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(generation_settings(cfg)), sort_keys=True)


def short_hash(obj) -> str:
    """16 hex digits of sha256 over canonical JSON: identities of configurations in metrics.json."""
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save_figure(fig, path: Path, dpi: int = 120) -> Path:
    """A matplotlib figure written atomically (rendered in memory, then renamed into place)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", dpi=dpi)
    atomic_write(Path(path), buf.getvalue())
    return Path(path)
