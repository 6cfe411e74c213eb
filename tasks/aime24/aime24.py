"""AIME 2024 (30 problems, integer answers 0-999) under the DeepSeek-R1 protocol (https://arxiv.org/abs/2501.12948).

Dataset `HuggingFaceH4/aime_2024`, split `train` (its only one), parquet pinned at `REVISION`; local files in
that schema or in `Maxwell-Jia/AIME_2024`'s. Prompt and sampling from the DeepSeek-R1 README "Usage
Recommendations" (no system prompt, T=0.6, top_p 0.95, 32768 new tokens, k samples); pass@1 is the mean over
the k samples and cons@k their majority vote, as in the R1 paper.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from evalkit.sample import Sample, Skipped
from evalkit.task import (
    Loaded,
    data_file,
    keep_all,
    lm_eval_hooks,
    parse_rows,
    sha256_bytes,
    subsample,
    unique,
)

VERSION = 1  # bump when the prompt or data handling changes (the generations change)
SCORER_VERSION = 1  # bump when extraction or scoring changes: finished runs re-score from their journals
TASK = "aime24"
REPO = "HuggingFaceH4/aime_2024"
# Not checked against the hub from here (unreachable): the revision several public pins use for this file.
REVISION = "2fe88a2f1091d5048c0f36abc874fb997b3dd99a"
HUB_FILE = "data/train-00000-of-00001.parquet"
SAMPLE = Path(__file__).parent / "data" / "sample.jsonl"
MAX_NEW_TOKENS = 32768  # R1 "maximum generation length"; the evalkit model caps it by the model context
# The R1 README gives the sentence, not how it joins the problem: evalkit uses OpenCompass's
# `{question}\nPlease reason ...` with the problem text stripped.
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# (id, problem, answer) keys per schema: HuggingFaceH4/aime_2024 and Maxwell-Jia/AIME_2024.
SCHEMAS = {"problem": ("id", "problem", "answer"), "Problem": ("ID", "Problem", "Answer")}

BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
TEXT = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")


def prompt(problem: str) -> str:
    return problem.strip() + "\n" + INSTRUCTION


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` whose braces close (a cut-off last box is passed over)."""
    for m in reversed(list(BOX.finditer(text))):
        depth = 1
        for j in range(m.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[m.end() : j]
    return None


def to_int(boxed: str) -> int | None:
    """Strip formatting that never changes the number (evalkit adds \\textbf/\\mathrm/\\mathbf, `\\,`, `\\$` and
    stray braces to the spec's list), then parse; leading zeros go with int()."""
    s = TEXT.sub(r"\1", boxed)
    for junk in ("^{\\circ}", "^\\circ", "\\!", "\\,", "\\$", "$", ",", "{", "}"):
        s = s.replace(junk, "")
    s = re.sub(r"\s+", "", s)
    return int(s) if re.fullmatch(r"-?\d+", s) else None


def judge(prediction: str) -> tuple[int | None, str]:
    """(extracted integer or None, outcome): outcome is "boxed", "no_box" or "thinking_truncated".

    An R1-style response is judged after its last `</think>`. One that opened `<think>` and never closed
    it ran out of tokens while thinking: wrong, and counted apart from "no_box" (the two are disjoint)."""
    if "</think>" in prediction:
        prediction = prediction.rsplit("</think>", 1)[1]
    elif "<think>" in prediction:
        return None, "thinking_truncated"
    box = last_boxed(prediction)
    return (None, "no_box") if box is None else (to_int(box), "boxed")


def _rows(path: Path) -> list:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return parse_rows(path.read_text(encoding="utf-8"), path, array=path.suffix == ".json")


def _read(source: str) -> tuple[list, str, str]:
    path, tag = data_file(source, SAMPLE, REPO, HUB_FILE, REVISION)
    return _rows(path), tag, sha256_bytes(path.read_bytes())


def _parse(row, i: int) -> Sample | Skipped:
    """A row in either schema -> Sample; only id, problem and answer are required (solution/url are unused)."""
    if isinstance(row, Skipped):  # a JSON-lines row that did not parse
        return row
    if not isinstance(row, dict):
        return Skipped(f"row {i}", "row is not a JSON object")
    id_key, problem_key, answer_key = SCHEMAS["Problem" if "Problem" in row else "problem"]
    rid = str(row[id_key]) if row.get(id_key) not in (None, "") else f"row {i}"
    missing = [k for k in (id_key, problem_key, answer_key) if row.get(k) in (None, "")]
    if missing:
        return Skipped(rid, f"missing field(s): {', '.join(missing)}")
    if not isinstance(row[problem_key], str):
        return Skipped(rid, f"{problem_key} is not a string")
    answer = str(row[answer_key]).strip()  # H4 stores a string, Maxwell-Jia an int64
    if isinstance(row[answer_key], bool) or not re.fullmatch(r"\d{1,3}", answer):
        return Skipped(rid, f"answer {row[answer_key]!r} is not an integer 0-999")
    meta = {"url": row.get("url") or "", "schema": "Maxwell-Jia" if id_key == "ID" else "H4"}
    return Sample(rid, TASK, prompt(row[problem_key]), [str(int(answer))], MAX_NEW_TOKENS, meta=meta)


def load(source="sample", n=None, seed=0, **_) -> Loaded:
    """AIME samples (no system prompt, no prefill: R1 chat templates add `<think>\\n` themselves).
    With n, a seeded random subset is kept in file order."""
    rows, tag, digest = _read(source)
    samples, skipped = unique(_parse(row, i) for i, row in enumerate(rows))
    return Loaded(subsample(samples, n, seed), tag, digest, skipped)


def score(predictions: list[str], sample: Sample) -> dict[str, float]:
    """Percent: pass@1 (mean over the k predictions), cons@k (majority vote over the extracted integers;
    predictions without one do not vote; a tie goes to the answer seen first, Counter.most_common's order),
    no_box and thinking_truncated (shares of the k predictions)."""
    if not predictions:
        raise ValueError(f"{sample.id}: no predictions to score")
    answer = int(sample.answers[0])
    judged = [judge(p) for p in predictions]
    k = len(judged)
    votes = Counter(v for v, _ in judged if v is not None)
    majority = votes.most_common(1)[0][0] if votes else None
    return {
        "pass@1": 100 * sum(v == answer for v, _ in judged) / k,
        "cons@k": 100.0 * (majority == answer),
        "no_box": 100 * sum(o == "no_box" for _, o in judged) / k,
        "thinking_truncated": 100 * sum(o == "thinking_truncated" for _, o in judged) / k,
    }


custom_dataset, process_results = lm_eval_hooks(TASK, load, score)
__all__ = ["load", "score", "custom_dataset", "process_results", "keep_all"]
