"""Reading what runs wrote: `metrics.json` (skipped with a note naming the file when unreadable), the
generation identity (recorded by the runner, or derived from `provenance.config` for older runs, and said
so), `samples.jsonl`, and the run folders a sweep left unfinished (a journal but no metrics)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from evalkit import metrics as metrics_record
from evalkit.errors import EvalkitError
from evalkit.identity import hashes
from evalkit.journal import SHARD, journal_files, read_records, shard_note
from evalkit.metrics import Metrics

IDS = ("generation", "method", "scoring")

log = logging.getLogger(__name__)


class RunError(EvalkitError, ValueError):
    """A run that cannot be used as asked: an unreadable or empty samples.jsonl, a run without identity
    fields. The message names the run folder."""


@dataclass(frozen=True)
class Run:
    folder: Path
    rel: str  # the folder relative to <results_dir>/runs: how messages name a run
    metrics: Metrics

    @property
    def model(self) -> str:
        return self.metrics.model["name"]

    @property
    def task(self) -> str:
        """The task's name; a multi-question run's is its own task (other samples: one row per question), so
        it is grouped, paired and recommended apart from single-question runs."""
        multi = self.config.get("multi_question", False) if self.config else False
        return f"{self.metrics.task}-multi_question" if multi else self.metrics.task

    @property
    def method(self) -> str:
        return self.metrics.method["name"]

    @property
    def headline(self) -> str:
        return self.metrics.headline

    @property
    def budget(self) -> int | None:
        return self.metrics.budget

    @cached_property
    def storage(self) -> str:
        """The KV storage's name (metrics.json `storage.name`: none, fp8_e4m3, int4, ...); a run from before
        the storage axis held the model dtype: `none`. A configuration is (method, budget, storage)."""
        record = self.metrics.to_json().get("storage")  # a Metrics field or, before it is one, an extra
        return str((record or {}).get("name") or "none") if isinstance(record, dict) else "none"

    @property
    def in_model_dtype(self) -> bool:
        """The cache held its entries in the model dtype (`kv=none`): what the bench measures and what the
        deployment's `kv_dtype` describes; any other storage held codes."""
        return self.storage == "none"

    @property
    def is_full(self) -> bool:
        """The reference every run is paired with: the full cache in the model dtype (a full cache held in
        int4 is a compressed configuration like any other)."""
        return self.method == "full" and self.in_model_dtype

    @property
    def config(self) -> dict:
        return self.metrics.config

    @property
    def settings(self) -> str:
        """Method settings changed from the conf defaults (the budget tag without its budget): `recent64`,
        or `default`. Two runs with the same method and budget but other settings are other configurations."""
        # the runner records the budget tag as method.tag (method.conf is the method's conf folder name); the
        # run folder's name is the same tag
        tag = str(self.metrics.method.get("tag") or self.rel.rsplit("/", 1)[-1])
        rest = tag.split("-", 1)[1] if "-" in tag else ""
        return rest or "default"

    @property
    def query_aware(self) -> bool:
        """The run setting `query_aware` (its saved config): False = compressed before the question was seen.
        A run without the key predates the setting and was query-aware."""
        return self.config.get("query_aware", True) is not False

    @cached_property
    def generation(self) -> str | None:
        """The generation identity without the KV storage (`kv`), which like the method is what is compared:
        runs of one problem set in every storage share it (a leaderboard panel, a wide row's `generation`)."""
        if not self.config or "kv" not in self.config:
            return self.identity["generation"]
        config = {k: v for k, v in self.config.items() if k != "kv"}
        m = self.metrics
        return hashes(config, m.task_version, m.data_hash, m.scorer_version)["generation"]

    @cached_property
    def base_generation(self) -> str | None:
        """The generation identity without `query_aware` and the KV storage (`kv`): what a query-agnostic or
        quantized run shares with the full run and with the query-aware run it is compared with (a full cache
        is the same either way; the storage, like the method, is what is compared)."""
        if not self.config or not {"query_aware", "kv"} & set(self.config):
            return self.identity["generation"]
        config = {k: v for k, v in self.config.items() if k not in ("query_aware", "kv")}
        m = self.metrics
        return hashes(config, m.task_version, m.data_hash, m.scorer_version)["generation"]

    @cached_property
    def identity(self) -> dict:
        """{generation, method, scoring, source}: recorded by the runner, or derived here from the resolved
        config (`source: derived`) for a metrics.json written before the runner recorded it."""
        recorded = self.metrics.identity
        has = isinstance(recorded, dict) and bool(recorded.get("generation"))
        if not self.config:
            return {**recorded, "source": "recorded"} if has else {**dict.fromkeys(IDS), "source": "absent"}
        # today's recipe on the recorded config: a setting found later not to change generations (batch_size)
        # stops separating runs recorded before that, and old and new runs compare alike
        m = self.metrics
        derived = hashes(self.config, m.task_version, m.data_hash, m.scorer_version)
        return {**derived, "source": "recorded" if has else "derived"}

    def samples(self) -> dict[str, dict]:
        """samples.jsonl rows by sample id; RunError names the folder and line for anything unusable."""
        path = self.folder / "samples.jsonl"
        if not path.is_file():
            raise RunError(f"{self.rel}: no samples.jsonl (per-sample scores are needed to pair it)")
        rows: dict[str, dict] = {}
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                sid, scores = str(row["id"]), row["scores"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise RunError(
                    f"{self.rel}/samples.jsonl line {i}: unreadable row ({type(e).__name__}: {e})"
                ) from None
            if not isinstance(scores, dict):
                raise RunError(f"{self.rel}/samples.jsonl line {i}: scores is not an object")
            if sid in rows:
                raise RunError(f"{self.rel}/samples.jsonl line {i}: sample id {sid!r} appears twice")
            rows[sid] = row
        if not rows:
            raise RunError(f"{self.rel}: empty run (samples.jsonl holds no samples)")
        return rows


def load_runs(results_dir: str | Path) -> tuple[list[Run], list[str]]:
    """Every readable `<results_dir>/runs/**/metrics.json`, and one note (also logged as a warning) per
    file skipped, naming it and why: one bad file never stops the rest."""
    root = Path(results_dir) / "runs"
    runs, notes = [], []
    for path in sorted(root.glob("**/metrics.json")):
        rel = path.parent.relative_to(root).as_posix()
        try:
            metrics = metrics_record.load(path)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
            note = f"{root / rel}/metrics.json: skipped ({type(e).__name__}: {e})"
            log.warning(note)
            notes.append(note)
            continue
        runs.append(Run(path.parent, rel, metrics))
        notes += left_shards(path.parent)
    return runs, notes


def left_shards(folder: Path) -> list[str]:
    """A note per replica shard left beside a finished run: the runner keeps a shard with a line it cannot
    read (a write cut short) when it folds the others, and says so once; the report keeps saying it."""
    out = []
    for shard in (f for f in journal_files(folder) if SHARD.fullmatch(f.name)):
        note = shard_note(shard, read_records(shard)[1])
        log.warning(note)
        out.append(note)
    return out


def journaled_keys(path: Path) -> set[str]:
    """The request keys a journal file holds so far, read leniently: a run still writing it may have left a
    torn last line, even one cut inside a UTF-8 character."""
    keys = set()
    for line in path.read_bytes().split(b"\n"):
        try:
            rec = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("key"), str):
            keys.add(rec["key"])
    return keys


def unfinished(results_dir: str | Path) -> list[str]:
    """Run folders with a config or a journal but no metrics.json (a sweep still running, or killed),
    with how many generations their journal holds: under data parallel, every replica's shard
    (`generations.dp<d>.jsonl`, folded into `generations.jsonl` only when the run scores)."""
    root = Path(results_dir) / "runs"
    out = []
    for cfg in sorted(root.glob("**/config.yaml")):
        folder = cfg.parent
        if (folder / "metrics.json").exists():
            continue
        files = journal_files(folder)  # under data parallel, the replica shards too
        shards = [f for f in files if SHARD.fullmatch(f.name)]
        # distinct requests: a fold killed midway has a shard's records in generations.jsonl and the shard
        done = len({key for f in files for key in journaled_keys(f)})
        where = (
            f" in {len(files)} files: a data-parallel run whose {len(shards)} replica shard(s) are not "
            "folded into generations.jsonl yet"
            if shards
            else ""
        )
        out.append(
            f"{folder.relative_to(root).as_posix()}: unfinished ({done} generations journaled{where}, no "
            "metrics.json)"
        )
    return out
