"""Generated RULER samples frozen to JSONL, so a (task, length) is generated once per tokenizer and reused.

The file name carries the key: task, length, seed, generator version, a fingerprint of the tokenizer (its
vocabulary, merges, added tokens and chat template), RULER's model template when one is used, and the files
the task read. Sample i does not
depend on n, so a file with at least n rows serves any smaller n.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path

from evalkit.identity import short_hash
from evalkit.results import atomic_write
from evalkit.sample import Sample
from tasks.ruler.generate import GENERATOR_VERSION


def cache_root(cache_dir: str | None = None) -> Path:
    """`<cache_dir or evalkit's cache ($EVALKIT_CACHE, ~/.cache/evalkit)>/ruler`."""
    from evalkit.sources import cache_dir as evalkit_cache

    return (Path(cache_dir).expanduser() if cache_dir else evalkit_cache()) / "ruler"


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of everything that changes token counts or the rendered prompt."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    template = json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True)
    return hashlib.sha256(f"{type(tokenizer).__name__}\0{body}\0{template}".encode()).hexdigest()


def frozen_path(
    root: Path,
    task: str,
    length: int,
    seed: int,
    tokenizer,
    fingerprint: str,
    files: dict[str, str],
    template: str | None = None,
) -> Path:
    """`fingerprint` is `tokenizer_fingerprint(tokenizer)`, computed once per load (it hashes the whole
    vocabulary). `template` (RULER's model template) enters the key only when set: chat-template files keep
    their names."""
    name = re.sub(r"[^\w.-]+", "_", str(getattr(tokenizer, "name_or_path", "") or "tokenizer"))[-40:]
    key = {"tokenizer": fingerprint, "files": files, "version": GENERATOR_VERSION}
    if template is not None:
        key["template"] = template
    digest = short_hash(key)  # the identities' hash: the same 16 digits the key always had
    return root / f"{task}-{length}-seed{seed}-{GENERATOR_VERSION}-{name}-{digest}.jsonl"


def read(path: Path, n: int) -> list[Sample] | None:
    """The first n frozen samples, or None when the file is missing or holds fewer."""
    if not path.is_file():
        return None
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        samples = [Sample(**r) for r in rows[:n]]
    except (json.JSONDecodeError, TypeError):  # a damaged cache file: generated again, never half-read
        return None
    return samples if len(rows) >= n else None


def write(path: Path, samples: list[Sample]) -> None:
    atomic_write(path, "".join(json.dumps(asdict(s), ensure_ascii=False) + "\n" for s in samples))
