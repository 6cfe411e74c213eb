"""LongBench-v2 (Bai et al., 2024, https://arxiv.org/abs/2412.15204): 503 long-context A-D questions.

Dataset `THUDM/LongBench-v2` (now also `zai-org/LongBench-v2`), file `data.json`, its only split (`train`),
pinned at `REVISION`. Protocol from THUDM/LongBench@2e00731: prompts `prompts/0shot.txt`, `0shot_cot.txt`,
`0shot_cot_ans.txt`; middle truncation, generation settings and `extract_answer` from `pred.py`; the
easy/hard/short/medium/long table and the 0.25 "compensated" credit from `result.py`.
Deviations from upstream: docs/deviations.md#longbench-v2.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from evalkit.sample import Sample, Skipped
from evalkit.task import (
    Loaded,
    data_file,
    decode,
    keep_all,
    lm_eval_hooks,
    parse_rows,
    sha256_bytes,
    subsample,
    unique,
)

VERSION = 1  # bump when the prompt or data handling changes (the generations change)
SCORER_VERSION = 2  # bump when extraction or scoring changes: finished runs re-score from their journals
# (2: compensated per easy/hard/short/medium/long bucket, as result.py)
TASK = "longbench_v2"
REPO = "THUDM/LongBench-v2"
# Not checked against the hub from here (unreachable): this revision and the sha256/size of its data.json
# (465,490,535 bytes) agree across several independent public pins of THUDM/ and zai-org/LongBench-v2.
REVISION = "2b48e494f2c7a2f0af81aae178e05c7e1dde0fe9"
DATA_SHA256 = "15d61c22d92c96900b3c4948b6aeea218d3214b676a65df48e7b8555604c7fe2"
SAMPLE = Path(__file__).parent / "data" / "sample.json"
FIELDS = ("_id", "domain", "sub_domain", "difficulty", "length", "question")
FIELDS += tuple(f"choice_{c}" for c in "ABCD") + ("answer", "context")
MAX_LEN = 120000  # config/model2maxlen.json: every 128k open model
ANSWER_TOKENS, COT_TOKENS = 128, 1024  # pred.py max_tokens: the answer call, the CoT reasoning call
TEMPLATE_MARGIN = 64  # tokens the chat template adds around the truncated prompt (evalkit choice)

# The upstream files `0shot.txt`, `0shot_cot.txt`, `0shot_cot_ans.txt`, byte for byte (none ends with a
# newline; the apostrophe is U+2019; tests pin each one's sha256). They share the question block.
QUESTION = """\
What is the correct answer to this question: $Q$
Choices:
(A) $C_A$
(B) $C_B$
(C) $C_C$
(D) $C_D$

"""
ANSWER_FORMAT = 'Format your response as follows: "The correct answer is (insert answer here)".'
DOCUMENT = "<text>\n$DOC$\n</text>\n\n"
PROMPT_0SHOT = (
    f"Please read the following text and answer the question below.\n\n{DOCUMENT}{QUESTION}{ANSWER_FORMAT}"
)
PROMPT_COT = (
    "Please read the following text and answer the questions below.\n\n"
    f"{DOCUMENT}{QUESTION}Let\u2019s think step by step:"
)
PROMPT_COT_ANS = (
    "Please read the following text and answer the questions below.\n\n"
    "The text is too long and omitted here.\n\n"
    f"{QUESTION}Let\u2019s think step by step: $COT$\n\n"
    f"Based on the above, what is the single, most likely answer choice? {ANSWER_FORMAT}"
)

PROMPTS = {"0shot": PROMPT_0SHOT, "cot": PROMPT_COT}
DOCUMENT_END = "</text>\n\n"
QUESTION_MARK = DOCUMENT_END + QUESTION[: QUESTION.index("$Q$")]  # where query_aware=false splits


def fill(template: str, row: dict, cot: str | None = None) -> str:
    """pred.py's replace chain in its order, so a placeholder that occurs inside the document is replaced
    too."""
    out = template.replace("$DOC$", row["context"].strip()).replace("$Q$", row["question"].strip())
    for c in "ABCD":
        out = out.replace(f"$C_{c}$", row[f"choice_{c}"].strip())
    return out if cot is None else out.replace("$COT$", cot)


def truncate_middle(prompt: str, tokenizer, max_len: int) -> tuple[str, bool]:
    """Keep the first and last max_len/2 tokens of the whole prompt (question and choices sit at the end)."""
    ids = tokenizer.encode(prompt)  # HF default adds special tokens (BOS), as pred.py
    if len(ids) <= max_len:
        return prompt, False  # upstream leaves an untruncated prompt as the original string
    # `-max_len // 2` is `(-max_len) // 2`: for odd max_len the tail keeps one token more, as upstream.
    ids = ids[: max_len // 2] + ids[-max_len // 2 :]
    return tokenizer.decode(ids, skip_special_tokens=True), True


def extract_answer(response: str) -> str | None:
    """pred.py: drop `*`, then the first (case-sensitive) "The correct answer is (X)", else "... is X"."""
    response = response.replace("*", "")
    match = re.search(r"The correct answer is \(([A-D])\)", response)
    match = match or re.search(r"The correct answer is ([A-D])", response)
    return match.group(1) if match else None


def _parse(row, i: int) -> Sample | Skipped:
    """Row i -> a Sample without its prompt yet (`meta["row"]` = i), or Skipped with the reason."""
    if isinstance(row, Skipped):  # a JSON-lines row that did not parse
        return row
    rid = row.get("_id") if isinstance(row, dict) and isinstance(row.get("_id"), str) else f"row {i}"
    if not isinstance(row, dict):
        return Skipped(rid, "row is not a JSON object")
    bad = [f for f in FIELDS if not isinstance(row.get(f), str)]
    if bad:
        return Skipped(rid, f"missing or non-string field(s): {', '.join(bad)}")
    if row["answer"] not in ("A", "B", "C", "D"):
        return Skipped(rid, f"answer {row['answer']!r} is not one of A-D")
    # result.py buckets: anything not "easy" is hard, anything not short/medium is long.
    difficulty = "easy" if row["difficulty"] == "easy" else "hard"
    length = row["length"] if row["length"] in ("short", "medium") else "long"
    meta = {k: row[k] for k in ("domain", "sub_domain", "difficulty", "length", "question")}
    meta |= {"choices": [row[f"choice_{c}"] for c in "ABCD"], "row": i}
    return Sample(rid, TASK, "", [row["answer"]], ANSWER_TOKENS, subset=f"{difficulty}|{length}", meta=meta)


def _read(source: str) -> tuple[list, str, str]:
    path, tag = data_file(source, SAMPLE, REPO, "data.json", REVISION)
    raw = path.read_bytes()
    digest = sha256_bytes(raw)
    if source == "hub" and digest != DATA_SHA256:
        raise ValueError(f"{path}: sha256 {digest} is not the pinned data.json's {DATA_SHA256}")
    text = decode(raw, path)  # data.json is one JSON array; a JSON-lines dump is accepted too
    rows = parse_rows(text, path, array=text.lstrip().startswith("["))
    return rows, tag, digest


def _prompted(sample: Sample, rows: list, mode: str, tokenizer, max_len: int) -> Sample:
    """The sample with its row's prompt in `mode`, truncated in the middle when a tokenizer is given."""
    meta = dict(sample.meta)
    prompt, truncated = fill(PROMPTS[mode], rows[meta.pop("row")]), False
    if tokenizer is not None:
        prompt, truncated = truncate_middle(prompt, tokenizer, max_len)
    n_new = COT_TOKENS if mode == "cot" else ANSWER_TOKENS
    return replace(
        sample, prompt=prompt, max_new_tokens=n_new, meta={**meta, "mode": mode, "truncated": truncated}
    )


def load(
    source="sample",
    n=None,
    seed=0,
    tokenizer=None,
    max_len=MAX_LEN,
    mode="0shot",
    model_context=None,
    multi_question=False,
    **_,
) -> Loaded:
    """LongBench-v2 samples. The runner passes the evaluated model's tokenizer and context; max_len is
    capped at model context - generation tokens - TEMPLATE_MARGIN (evalkit choice: upstream's 120000 for
    128k models leaves that room implicitly). Without a tokenizer nothing is truncated (stats["max_len"] is
    then None). With n, a seeded random subset is kept in file order."""
    if mode not in PROMPTS:
        raise ValueError(f"mode must be one of {sorted(PROMPTS)}, got {mode!r}")
    if model_context:
        max_len = min(
            max_len, model_context - (COT_TOKENS if mode == "cot" else ANSWER_TOKENS) - TEMPLATE_MARGIN
        )
    rows, tag, digest = _read(source)
    samples, skipped = unique((_parse(row, i) for i, row in enumerate(rows)), "_id")
    # prompts are filled and tokenised only for the samples kept
    samples = [_prompted(s, rows, mode, tokenizer, max_len) for s in subsample(samples, n, seed)]
    if multi_question:
        if mode == "cot":
            raise ValueError(
                "multi_question asks each question in one call on the shared document; mode=cot makes a "
                "second call without it: use mode=0shot"
            )
        samples = conversations(samples)
    stats = {"truncated": sum(s.meta["truncated"] for s in samples), "mode": mode}
    stats["max_len"] = max_len if tokenizer is not None else None
    return Loaded(samples, tag, digest, skipped, stats)


def cot_followup(sample: Sample, first_output: str) -> Sample:
    """The CoT answer call: `0shot_cot_ans.txt` (no document) with $COT$ = the stripped first output.
    Its prompt is a few thousand tokens at most, so upstream's truncation never applies to it."""
    row = {"context": "", "question": sample.meta["question"]}
    row |= {f"choice_{c}": x for c, x in zip("ABCD", sample.meta["choices"], strict=True)}
    cot = first_output.strip()
    prompt = fill(PROMPT_COT_ANS, row, cot=cot)
    return replace(sample, prompt=prompt, max_new_tokens=ANSWER_TOKENS, meta={**sample.meta, "cot": cot})


def followup(mode: str = "0shot", **_) -> str | None:
    """The second call these load settings make after each first one: CoT's answer call (`cot_followup`,
    "module:function", run by the evalkit LMs on a full cache), none in 0-shot."""
    return "tasks.longbench_v2.longbench_v2:cot_followup" if mode == "cot" else None


def question_start(sample: Sample) -> int:
    """query_aware=false: the question block starts right after the document (`</text>\n\n` closes it, on
    the context side); the question, its choices and the answer-format line (0shot) or "Let's think step by
    step:" (cot) are the question. The last match counts: a document may quote the question block."""
    at = sample.prompt.rfind(QUESTION_MARK)
    if at < 0:
        raise ValueError(f"{sample.id}: no question block found after the document")
    return at + len(DOCUMENT_END)


def conversations(samples: list[Sample]) -> list[Sample]:
    """multi_question: the items whose prompts share one context (the same document, the same cut) become
    one conversation (`conversation` = its first item's id), asked in file order; each item keeps its id."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.prompt[: question_start(s)], []).append(s)
    return [
        replace(s, meta={**s.meta, "conversation": group[0].id, "turn": turn})
        for group in groups.values()
        for turn, s in enumerate(group)
    ]


def score(predictions: list[str], sample: Sample) -> dict[str, float]:
    """Percent correct over the k predictions, under the overall key and the sample's two buckets.
    `compensated` gives 25 for an unanswered prediction (result.py's compensated=True, paper Table 5), in the
    overall figure and in each bucket, as result.py adds that `acc = 0.25` to every column it counts in."""
    if not predictions:
        raise ValueError(f"{sample.id}: no predictions to score")
    preds = [extract_answer(p) for p in predictions]
    k = len(preds)
    acc = 100 * sum(p == sample.answers[0] for p in preds) / k
    no_answer = 100 * sum(p is None for p in preds) / k
    difficulty, length = sample.subset.split("|")
    return {
        "accuracy": acc,
        f"accuracy/{difficulty}": acc,
        f"accuracy/{length}": acc,
        "compensated": acc + no_answer / 4,
        f"compensated/{difficulty}": acc + no_answer / 4,
        f"compensated/{length}": acc + no_answer / 4,
        "no_answer": no_answer,
    }


def score_keys(repeats: int) -> set[str]:
    """The metrics `score` returns (breakdowns: `<metric>/<easy|hard|short|medium|long>`)."""
    return {"accuracy", "compensated", "no_answer"}


custom_dataset, process_results = lm_eval_hooks(
    TASK, load, score, question_start=question_start, followup=followup
)
__all__ = ["load", "score", "custom_dataset", "process_results", "keep_all"]
