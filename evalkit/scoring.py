"""Scoring from the journal: the one path from finished generations to per-sample scores.

A run scores after generating, and a finished run re-scores the same way when its task's scorer version or
grading settings change, without a model. The scores equal lm-eval's `process_results` (the task YAML's hook,
used by `lm_eval --model evalkit`): both call the task module's `score(predictions, sample)` with all k
predictions of a sample (the `keep_all` filter). evalkit also scores each prediction alone (`repeat_scores`),
so paired statistics can match repeat r of one run with repeat r of another.
"""

from __future__ import annotations

from evalkit.journal import JournalError, prompt_hash, request_key
from evalkit.request import sample_prompt
from evalkit.sample import Sample


def score_journal(
    task_module, samples: list[Sample], journal, task: str, repeats: int, tokenizer
) -> list[dict]:
    """samples.jsonl rows: each sample's predictions from the journal, scored by the task's scorer.

    Every prediction must be journaled for this very prompt (same sample id and prompt hash), else this raises
    JournalError instead of scoring something else."""
    preds: list[list[dict]] = []
    for doc_id, sample in enumerate(samples):
        recs = [journal.get(request_key(task, doc_id, 0, r)) for r in range(repeats)]
        if any(r is None for r in recs):
            raise JournalError(
                f"{journal.path}: sample {sample.id} (doc {doc_id}) has no generation for some repeat"
            )
        want = prompt_hash(sample_prompt(tokenizer, sample))
        bad = next((r for r in recs if r.get("id") != sample.id or r["prompt_hash"] != want), None)
        if bad is not None:
            raise JournalError(
                f"{journal.path}: request {bad['key']} was generated for another prompt than sample "
                f"{sample.id}'s; the task data or prompt changed since. Delete the run folder to start over."
            )
        preds.append(recs)
    scored = score_all(task_module, [([r["text"] for r in recs], s) for recs, s in zip(preds, samples)])
    if repeats > 1:
        singles = score_all(task_module, [([r["text"]], s) for recs, s in zip(preds, samples) for r in recs])
        per_repeat = [singles[i * repeats : (i + 1) * repeats] for i in range(len(samples))]
    else:
        per_repeat = [[s] for s in scored]
    return [
        {
            "id": s.id,
            "doc_id": doc_id,
            "subset": s.subset,
            "prompt_hash": recs[0]["prompt_hash"],
            "predictions": [r["text"] for r in recs],
            "scores": sc,
            "repeat_scores": rep,
            "generation": [r["stats"] for r in recs],
        }
        for doc_id, (s, recs, sc, rep) in enumerate(zip(samples, preds, scored, per_repeat))
    ]


def score_all(task_module, items: list[tuple[list[str], Sample]]) -> list[dict]:
    """The task's `score_many(items)` when it has one (e.g. one code sandbox pool across problems), else
    `score(predictions, sample)` per item."""
    many = getattr(task_module, "score_many", None)
    if many is not None:
        return list(many(items))
    return [task_module.score(list(p), s) for p, s in items]
