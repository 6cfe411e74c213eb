"""The generation journal: one JSON line per finished generation, keyed by request, the resume point after a
crash.

This module owns everything about a journal line: its key (`request_key`: task/doc/request index/repeat), its
fields (`RECORD_FIELDS`), the hash of the prompt it answers (`prompt_hash`), how an LM writes one
(`journal_record`) and reuses one (`journaled`), and the append-only file itself (`Journal`). Both LMs (in
process, evalkit.lm; served, evalkit.served) write through it and scoring (evalkit.scoring) reads through it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from evalkit.errors import EvalkitError
from evalkit.results import atomic_write

if TYPE_CHECKING:
    from evalkit.team import Team

# evalkit's lm-eval tasks are registered as `evalkit_<task>` so that no name collides with a task or group
# lm-eval ships (its `ruler` group, `aime24`, ...). Runs made before that rename used the bare names.
LM_EVAL_PREFIX = "evalkit_"

# What every journal line must hold (`journal_record` writes it); anything else is set aside on load.
RECORD_FIELDS = {"key": str, "doc_id": int, "repeat": int, "text": str, "prompt_hash": str, "stats": dict}


class JournalError(EvalkitError, RuntimeError):
    """The journal does not hold what the run's samples need (the data or the prompts changed under it)."""


def task_id(lm_eval_task: str) -> str:
    """evalkit's own name for an lm-eval task: the registered name without the `evalkit_` namespace. Journal
    keys, sampling seeds and generation identities use it, so run folders made before the rename (journals
    keyed `ruler/...`, configs with `lm_eval_task: ruler`) are skipped, re-scored and resumed as they were."""
    return lm_eval_task.removeprefix(LM_EVAL_PREFIX)


# --- keys ---------------------------------------------------------------------------------------------------
def request_key(task: str, doc_id: int, idx: int, repeat: int) -> str:
    """The journal key of one lm-eval request (`idx` is lm-eval's request index within a doc: 0 for
    generation). The task part is evalkit's name for it (`task_id`), whatever namespace lm-eval registers it
    under."""
    return f"{task_id(task)}/{doc_id}/{idx}/{repeat}"


def request_keys(task: str, n_docs: int, repeats: int) -> list[str]:
    return [request_key(task, d, 0, r) for d in range(n_docs) for r in range(repeats)]


def keyed(requests) -> list[str]:
    """The journal key of each lm-eval request, in order (lm-eval repeats a request k times: repeat
    0..k-1)."""
    repeat, keys = Counter(), []
    for req in requests:
        base = (req.task_name, req.doc_id, req.idx)
        keys.append(request_key(*base, repeat[base]))
        repeat[base] += 1
    return keys


# --- records ------------------------------------------------------------------------------------------------
def prompt_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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


def journal_record(p, text: str, stats: dict) -> dict:
    """One journal line (RECORD_FIELDS) for a finished request `p` (an evalkit.request.Prompt): what scoring
    needs, keyed by request."""
    task, doc_id, idx, rep = p.key.rsplit("/", 3)
    return {
        "key": p.key,
        "task": task,
        "doc_id": int(doc_id),
        "repeat": int(rep),
        "id": p.sample.id if p.sample else None,
        "prompt_hash": prompt_hash(p.text),
        "text": text,
        "stats": stats,
    }


def journaled(journal, prompt) -> dict | None:
    """The journal's record of this request, if any; one made from another prompt is refused, never reused."""
    done = journal.get(prompt.key) if journal else None
    if done is not None and done["prompt_hash"] != prompt_hash(prompt.text):
        from evalkit.config import ConfigError

        raise ConfigError(
            f"{journal.path}: request {prompt.key} was generated from a different prompt; the task data "
            "changed since this run started. Delete the run folder to start over."
        )
    return done


# --- the file -----------------------------------------------------------------------------------------------
NOT_UTF8, NOT_JSON = "not valid UTF-8", "not valid JSON"


def _parse(line: bytes) -> tuple[dict | None, str | None]:
    """(record, None) for a usable journal line, else (None, why not)."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, NOT_UTF8
    except json.JSONDecodeError:
        return None, NOT_JSON
    problem = record_problem(rec)
    return (rec, None) if problem is None else (None, problem)


# A run folder's journal files: the run's own, and under data parallel one shard per other replica
# (`generations.dp<d>.jsonl`, `shard_path`), folded into the run's own when the run scores (`fold_shards`).
JOURNAL = "generations.jsonl"
SHARD = re.compile(r"generations\.dp(\d+)\.jsonl")


def journal_files(folder: Path) -> list[Path]:
    """The folder's journal files that exist: its own first, then the replica shards in order."""
    shards = [f for f in sorted(folder.glob("generations.dp*.jsonl")) if SHARD.fullmatch(f.name)]
    return [f for f in (folder / JOURNAL, *shards) if f.is_file()]


# A replica shard's first line names the run that writes it, `{"run": "<identity>"}` (evalkit.identity,
# `run_identity`): a shard another configuration left in the folder is refused, never adopted. The run's own
# `generations.jsonl` is bound to its folder's config.yaml instead and has no such line; a shard written
# before shards were stamped has none either, and is read as it always was.
RUN = "run"


def stamp(line: bytes) -> str | None:
    """The run identity a journal line names when it is a shard's first line (`{"run": ...}`), else None."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return obj[RUN] if isinstance(obj, dict) and list(obj) == [RUN] and isinstance(obj[RUN], str) else None


def check_stamp(path: Path, found: str | None, run: str | None) -> None:
    """A shard stamped by another run than `run` is refused by name (nothing checked without either)."""
    if found is not None and run is not None and found != run:
        raise JournalError(
            f"{path} holds generations of another configuration (run {found}; this run is {run}): move it "
            f"out of {path.parent}, or delete it, and run again"
        )


def read_records(path: Path, run: str | None = None) -> tuple[dict[str, dict], list[tuple[int, str]]]:
    """(the usable records of a journal file, (line number, why) of each line that is not one), read only:
    another process may be appending to it, and its torn or foreign lines are that process's to set aside. A
    shard stamped by another run than `run` is refused (JournalError)."""
    out: dict[str, dict] = {}
    problems = []
    lines = path.read_bytes().split(b"\n")
    first = next((n for n, line in enumerate(lines, 1) if line.strip()), None)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if number == first and (found := stamp(line)) is not None:
            check_stamp(path, found, run)
            continue
        rec, problem = _parse(line)
        if problem is None:
            out.setdefault(rec["key"], rec)
        else:
            torn = number == len(lines)  # no newline after it: a write cut short
            problems.append((number, f"{problem} (a write cut short)" if torn else problem))
    return out, problems


class Journal:
    """Append-only JSONL of finished generations keyed by request; the resume point after a crash.

    On load, the torn last line of a killed run is dropped (that generation is simply redone); any other line
    that is not a valid record (bad JSON, a foreign object, a field missing or of the wrong type) is moved to
    `<name>.rejected` and named by its line number in `self.rejected`, so nothing is lost and nothing crashes
    later. A repeated key keeps its first record. With `run` (the run's identity), a replica shard is stamped
    with it when created, and one stamped by another run is refused (JournalError).
    """

    def __init__(self, path: Path, run: str | None = None):
        self.path, self.run = Path(path), run
        self.records: dict[str, dict] = {}
        self.rejected: list[tuple[int, str]] = []  # (line number, reason)
        if self.path.exists():
            self._load()
        self.loaded_keys = frozenset(self.records)  # finished before this process started (a resume)
        # generated by this process, duplicates of journaled keys included: a resume that regenerated what the
        # journal held shows here, even though the journal keeps the first record
        self.generated_keys: set[str] = set()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (held open for the run, closed in close())
        if run is not None and SHARD.fullmatch(self.path.name) and self._file.tell() == 0:
            self._write_line(json.dumps({RUN: run}))  # a new shard names the run that writes it

    def _load(self) -> None:
        raw = self.path.read_bytes()  # bytes: a kill can cut a line inside a multi-byte character
        lines = raw.split(b"\n")
        good, bad = [], []
        first = next((n for n, line in enumerate(lines, 1) if line.strip()), None)
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            if number == first and (found := stamp(line)) is not None:
                check_stamp(self.path, found, self.run)
                good.append(line)
                continue
            rec, problem = _parse(line)
            if problem in (NOT_JSON, NOT_UTF8) and number == len(lines):  # no newline after it: a torn write
                continue
            if problem is None and rec["key"] in self.records:
                continue  # a duplicate of a finished request: the first one stands
            if problem is not None:
                self.rejected.append((number, problem))
                bad.append(line)
                continue
            self.records[rec["key"]] = rec
            good.append(line)
        if bad:
            with open(self.path.with_name(self.path.name + ".rejected"), "ab") as f:
                f.write(b"".join(b + b"\n" for b in bad))
        clean = b"".join(g + b"\n" for g in good)
        if clean != raw:  # torn, foreign or duplicate lines dropped; end on a newline before appending again
            atomic_write(self.path, clean)

    def get(self, key: str) -> dict | None:
        return self.records.get(key)

    def append(self, record: dict) -> None:
        self.generated_keys.add(record["key"])
        if record["key"] in self.records:
            return
        problem = record_problem(record)
        if problem is not None:  # a bug in the writer: never journal what could not be read back
            raise ValueError(f"journal record {record.get('key')!r}: {problem}")
        self.records[record["key"]] = record
        self._write_line(json.dumps(record, ensure_ascii=False, default=str))

    def _write_line(self, text: str) -> None:
        self._file.write(text + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


# --- data parallel: one shard per replica -------------------------------------------------------------------
def shard_path(out: Path, replica: int) -> Path:
    """The journal replica `replica` appends to: replica 0 the run's own `generations.jsonl`."""
    return out / (JOURNAL if replica == 0 else f"generations.dp{replica}.jsonl")


def sibling_shards(out: Path, own: Path) -> list[Path]:
    """Every journal file of the run folder but `own`, in a fixed order."""
    return [f for f in journal_files(out) if f != own]


def open_journals(plans: list, open_journal, team: Team) -> None:
    """Each unfinished plan's journal on this rank: a TP root opens its replica's shard (`open_journal(p,
    path)`) and counts every other shard's records as done; a TP peer gets its root's records (`PeerJournal`).
    Every replica sees the same done set at the start, so the replicas split the rest the same way on each."""
    todo = [p for p in plans if p.state != "done"]
    replica = team.ranks.dp_rank
    if team.journals:
        for p in todo:
            p.journal = open_journal(p, shard_path(p.out, replica))
    team.barrier()  # every shard's torn or foreign lines are set aside before the others read it
    if team.journals:
        for p in todo:
            adopt_shards(p.journal)
    records = team.share([p.journal.records if team.journals else None for p in todo])
    if not team.journals:
        for p, recs in zip(todo, records):
            p.journal = PeerJournal(shard_path(p.out, replica), recs)


def adopt_shards(journal) -> None:
    """Count the other shards' records as done in `journal` (in memory: they stay in their files); a shard
    stamped by another run is refused (JournalError)."""
    journal.adopted = set()
    for path in sibling_shards(journal.path.parent, journal.path):
        for key, rec in read_records(path, journal.run)[0].items():
            if key not in journal.records:
                journal.records[key] = rec
                journal.adopted.add(key)


def fold_shards(journal) -> None:
    """Rank 0 before scoring (every replica has finished): the other shards' records appended to its
    `generations.jsonl`, and each shard file whose every line was usable removed, so a finished run folder
    holds one journal whatever layout made it; a shard with a line it cannot read is kept, and said so. What
    another replica generated in this run counts as generated now."""
    known = journal.loaded_keys | getattr(journal, "adopted", set())
    written = set(read_records(journal.path)[0]) if journal.path.exists() else set()
    for path in sibling_shards(journal.path.parent, journal.path):
        records, problems = read_records(path, journal.run)
        for key, rec in records.items():
            if key not in written:
                journal.records.pop(key, None)  # adopted in memory only: now into the file
                journal.append(rec)
                written.add(key)
                if key in known:
                    journal.generated_keys.discard(key)
        if problems:
            print(f"evalkit: {shard_note(path, problems)}", file=sys.stderr)
        else:
            path.unlink()


def shard_note(path: Path, problems: list[tuple[int, str]]) -> str:
    """What to say of a replica shard left beside a run that scored (kept because some of its lines cannot be
    read)."""
    lines = "; ".join(f"line {n}: {why}" for n, why in problems[:3]) + (" ..." if len(problems) > 3 else "")
    return (
        f"{path} is left beside a scored run{f' ({lines})' if lines else ''}: its readable records are in "
        f"{JOURNAL} and every request the run scored was generated; delete the file once you have looked"
    )


class PeerJournal:
    """A TP peer's view of its root's journal: what is done, in memory; the root writes the file."""

    def __init__(self, path: Path, records: dict):
        self.path, self.records, self.rejected = path, dict(records), []
        self.loaded_keys, self.generated_keys = frozenset(records), set()

    def get(self, key: str) -> dict | None:
        return self.records.get(key)

    def append(self, record: dict) -> None:
        self.generated_keys.add(record["key"])
        self.records.setdefault(record["key"], record)

    def close(self) -> None:
        pass
