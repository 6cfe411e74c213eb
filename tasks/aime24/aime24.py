"""AIME 2024 (30 problems, integer answers 0-999) under the DeepSeek-R1 protocol (https://arxiv.org/abs/2501.12948).

Dataset `HuggingFaceH4/aime_2024`, split `train` (its only one), parquet pinned at `REVISION`; local files in
that schema or in `Maxwell-Jia/AIME_2024`'s. Prompt and sampling from the DeepSeek-R1 README "Usage
Recommendations" (no system prompt, T=0.6, top_p 0.95, 32768 new tokens, k samples); pass@1 is the mean over
the k samples and cons@k their majority vote, as in the R1 paper. The last box is judged by math-verify
against the gold integer (`tasks/aime24/grade.py`), as lighteval and OpenCompass judge AIME.
Deviations from upstream: docs/deviations.md#aime24.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from evalkit.sample import Sample, Skipped
from evalkit.task import (
    Loaded,
    data_file,
    keep_all,
    lm_eval_hooks,
    parse_rows,
    read_text,
    sha256_bytes,
    subsample,
    unique,
)
from tasks.aime24 import grade

VERSION = 1  # bump when the prompt or data handling changes (the generations change)
# bump when extraction or judging changes (2: math-verify, `\\boxed N`): finished runs re-score
SCORER_VERSION = 4  # 3: lighteval's whole-text reading reported beside the headline; 4: `no_answer`
TASK = "aime24"
# query_aware=false is refused (the runner names this reason): it needs a context before the question
NO_QUESTION_SPLIT = (
    "the problem statement is the whole prompt: there is no context to compress before the question"
)
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

# `\boxed` / `\fbox` as a whole control word (not `\boxedanswer`), then any spaces
BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
# a box without braces (`$\boxed 73$`) ends where its math does: `$`, `\]`, `\)` or the line
BARE_END = re.compile(r"\$|\\\]|\\\)|\n")


def prompt(problem: str) -> str:
    return problem.strip() + "\n" + INSTRUCTION


def _braced(text: str, start: int) -> str | None:
    """Content of the group opening at text[start] == "{", or None when its braces never close."""
    depth = 0
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + 1 : j]
    return None


def _bare(text: str, start: int) -> str | None:
    """Content of a brace-less box (`\\boxed 73`): up to the end of its math, without a sentence's full stop
    (Qwen2.5-Math drops it too); None if empty."""
    end = BARE_END.search(text, start)
    content = text[start : end.start() if end else len(text)].strip()
    return content.removesuffix(".").rstrip() or None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` whose braces close, or of a last `\\boxed N` without
    braces; a cut-off last box, or an empty brace-less one (`\\boxed $`), is passed over for the one before
    it. An empty `\\boxed{}` is a box read as nothing (the spec takes the last `\\boxed{`, brace-matched)."""
    for m in reversed(list(BOX.finditer(text))):
        braced = text.startswith("{", m.end())
        content = _braced(text, m.end()) if braced else _bare(text, m.end())
        if content is not None:
            return content
    return None


class Judged(NamedTuple):  # not a dataclass: lm-eval exec's this file outside sys.modules, which they need
    correct: bool
    outcome: str  # "boxed", "no_box", "thinking_truncated" or "judge_timeout"
    vote: str | None = None  # what it votes for in cons@k (the gold when correct); None: no vote


def judge(prediction: str, answer: str) -> Judged:
    """One response against the gold integer `answer` (a string, as stored in Sample.answers).

    An R1-style response is judged after its last `</think>`. One that opened `<think>` and never closed
    it ran out of tokens while thinking: wrong, and counted apart from "no_box" (the two are disjoint).
    math-verify judges the last box's content; a judging step that runs out of time counts as wrong and as
    "judge_timeout", never silently."""
    if "</think>" in prediction:
        prediction = prediction.rsplit("</think>", 1)[1]
    elif "<think>" in prediction:
        return Judged(False, "thinking_truncated")
    box = last_boxed(prediction)
    if box is None:
        return Judged(False, "no_box")
    verdict = grade.judge_box(box, answer)
    if verdict is None:
        return Judged(False, "judge_timeout")
    correct, vote = verdict
    return Judged(correct, "boxed", answer if correct else vote)


def _rows(path: Path) -> list:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return parse_rows(read_text(path), path, array=path.suffix == ".json")


def _read(source: str) -> tuple[list, str, str]:
    path, tag = data_file(source, SAMPLE, REPO, HUB_FILE, REVISION)
    return _rows(path), tag, sha256_bytes(path.read_bytes())


def _parse(row, i: int) -> Sample | Skipped:
    """A row in either schema -> Sample; only id, problem and answer are required (solution/url are
    unused)."""
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
    """Percent: pass@1 (mean over the k predictions), cons@k (majority vote: correct answers vote for the
    gold, wrong ones for math-verify's reading of their box; a response with nothing readable does not vote;
    a tie goes to the answer seen first, Counter.most_common's order), and the shares of the k predictions
    with no box, cut off while thinking (`no_answer`, the standard key: either), or whose judging ran out of
    time. `lighteval_pass@1` is the second reading, apart from the headline: lighteval's math-verify
    extraction over each whole response (`grade.judge_text`), which also credits `**Final Answer** 73`, `the
    answer is $73$` or a box left inside the thinking; a compressed run that stops boxing shows as the gap
    between the two."""
    if not predictions:
        raise ValueError(f"{sample.id}: no predictions to score")
    answer = sample.answers[0]
    judged = [judge(p, answer) for p in predictions]
    k = len(judged)
    votes = Counter(j.vote for j in judged if j.vote is not None)
    majority = votes.most_common(1)[0][0] if votes else None
    share = lambda outcome: 100 * sum(j.outcome == outcome for j in judged) / k  # noqa: E731
    return {
        "pass@1": 100 * sum(j.correct for j in judged) / k,
        "cons@k": 100.0 * (majority == answer),
        "no_box": share("no_box"),
        "thinking_truncated": share("thinking_truncated"),
        "no_answer": share("no_box") + share("thinking_truncated"),  # the standard key (disjoint outcomes)
        "judge_timeout": share("judge_timeout"),
        "lighteval_pass@1": 100 * sum(whole_text(p, answer) for p in predictions) / k,
    }


def whole_text(prediction: str, answer: str) -> bool:
    """lighteval's reading of one response; a judging step that runs out of time reads as wrong."""
    verdict = grade.judge_text(prediction, answer)
    return verdict is not None and verdict[0]


def score_keys(repeats: int) -> set[str]:
    """The metrics `score` returns."""
    return {"pass@1", "cons@k", "no_box", "thinking_truncated", "judge_timeout", "lighteval_pass@1"}


custom_dataset, process_results = lm_eval_hooks(TASK, load, score, no_split=NO_QUESTION_SPLIT)
__all__ = ["load", "score", "custom_dataset", "process_results", "keep_all"]
