"""Fabricated run folders for the leaderboard and report tests, in the runner's format: `metrics.json` built
through the runner's record (evalkit.metrics.Metrics) with the runner's identity recipe (evalkit.identity),
and `samples.jsonl` rows with `repeat_scores` (one dict per repeat: the task's score of that prediction
alone). No model runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

from evalkit import identity as run_identity
from evalkit.config import group_config
from evalkit.kv.storage import make_storage
from evalkit.metrics import Metrics
from evalkit.sample import aggregate

SMOL_CONFIG = {  # the fields of SmolLM2-135M's config.json the memory model reads
    "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
    "tie_word_embeddings": True,
}  # fmt: skip


def sample_row(
    sid: str,
    repeat_scores: list[dict],
    subset: str = "",
    prompt_hash: str | None = None,
    *,
    tokens: list[int] | None = None,
    texts: list[str] | None = None,
    limit: int = 256,
) -> dict:
    """A samples.jsonl row whose `scores` is the mean of its repeats (pass@1-style metrics). `tokens`: each
    repeat's output tokens (hit_limit where it reaches `limit`, the run's max_new_tokens); `texts`: each
    repeat's output."""
    keys = repeat_scores[0].keys()
    scores = {k: sum(r[k] for r in repeat_scores) / len(repeat_scores) for k in keys}
    generation = [{"output_tokens": 3} for _ in repeat_scores]
    if tokens is not None:
        generation = [{"output_tokens": t, "hit_limit": t >= limit, "max_new_tokens": limit} for t in tokens]
    return {
        "id": sid,
        "doc_id": int(hashlib.sha256(sid.encode()).hexdigest()[:6], 16),
        "subset": subset,
        "prompt_hash": prompt_hash or f"h-{sid}",
        "predictions": texts or [f"prediction {r}" for r in range(len(repeat_scores))],
        "scores": scores,
        "repeat_scores": repeat_scores,
        "generation": generation,
    }


def binary_rows(outcomes: list[int], metric: str = "score", prefix: str = "s") -> list[dict]:
    """One k=1 sample per outcome (1 = correct = 100 points)."""
    return [sample_row(f"{prefix}{i}", [{metric: 100.0 * o}]) for i, o in enumerate(outcomes)]


def write_run(
    root: Path,
    rows: list[dict],
    *,
    task: str = "ruler",
    model: str = "smollm2_135m",
    method: str = "snapstream",
    budget: int | None = 256,
    settings: dict | None = None,
    headline: str = "score",
    task_version: int = 1,
    scorer_version: int | None = 1,  # None: a metrics.json from before scorer_version existed
    data_hash: str = "d" * 64,
    seed: int = 0,
    repeats: int = 1,
    identity: bool = True,
    compression: float | None = 0.25,
    peak: tuple[int, int] = (2000, 2100),
    query_aware: bool | None = None,  # the run setting; None: a config without the key (older runs)
    multi_question: bool = False,  # the run setting (with query_aware=False): one row per question
    kv: str | None = None,  # KV storage (conf/kv/); None: a run from before the axis (no `kv`, no `storage`)
    peak_bytes: int = 0,
) -> Path:
    """Write `<root>/runs/<task>/<model>/<method>/<tag>/{metrics.json,samples.jsonl,config.yaml}`; the
    generation identity hashes what determines generations (not the method), as the runner does. A
    query-agnostic run lives under `<method>-query_agnostic` (the runs folder only needs distinct paths; the
    report reads the setting from the saved config)."""
    settings = settings or {}
    tag = ("none" if budget is None else str(budget)) + "".join(
        f"-{k}{v}" for k, v in sorted(settings.items())
    )
    kind = method + ("-query_agnostic" if query_aware is False else "") + ("-mq" if multi_question else "")
    kind += "" if kv in (None, "none") else f"+{kv}"  # the runner's folder: <method>+<kv name>
    folder = Path(root) / "runs" / task / model / kind / tag
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model": {"name": model, "max_new_tokens": 256},
        "task": {"name": task, "repeats": repeats, "load": {"n": 2}, "generation": {}},
        "method": {"budget": budget, **settings},
        "limit": None,
        "seed": seed,
    }
    if query_aware is not None:
        cfg["query_aware"] = query_aware
    if multi_question:
        cfg["multi_question"] = True
    extra = {}
    if kv is not None:  # as the runner with the storage axis: the composed `kv` node and its describe()
        cfg["kv"] = OmegaConf.to_container(group_config("kv", kv))
        extra["storage"] = make_storage(kv).describe()
    method_record = {
        "name": method,
        "budget": budget,
        **settings,
        "conf": method,
        "tag": tag,
    }  # as summary.py
    metrics = Metrics(
        schema=1,
        task=task,
        task_version=task_version,
        scorer_version=scorer_version,  # None: a metrics.json from before scorer_version existed
        identity=run_identity.hashes(cfg, task_version, data_hash, scorer_version) if identity else None,
        headline=headline,
        model={"name": model, "source": "fixture", "dtype": "float32", "hf_config": SMOL_CONFIG},
        method=method_record,
        budget=budget,
        n=len(rows),
        data={"source": "sample", "hash": data_hash, "stats": {}},
        scores=aggregate([r["scores"] for r in rows]),
        kv={
            "kept_fraction": 1.0 if method == "full" else compression,
            "peak_bytes": peak_bytes,
            "peak_entries": 0,
            "peak_prompt_tokens": peak[0],
            "peak_seen_tokens": peak[1],
            "cache_layout": "per_head",
        },
        generation={"requests": len(rows) * repeats, "mean_output_tokens": 3.0, "from_journal": 0},
        provenance={"git_sha": "abc", "config": cfg},
        extra=extra,
    )
    (folder / "metrics.json").write_text(json.dumps(metrics.to_json()))
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.yaml").write_text("fixture: true\n")
    return folder
