"""LiveCodeBench as DeepSeek-R1 and the R1-Distill models are evaluated upstream: `LMStyle.DeepSeekR1`
(LiveCodeBench/LiveCodeBench@28fef95, `lcb_runner/prompts/code_generation.py`; `lm_styles.py` gives the style
to DeepSeek-R1, DeepSeek-R1-0528 and the six R1-Distill models). Its prompt is one raw string with its own
system text, `<｜User｜>` and `<｜Assistant｜>` markers and the BOS token: no chat template is applied (the
Sample is `rendered`), no `<think>\\n` is added. Extraction (the last fenced block, no `</think>` handling)
and grading are the generic task's. The date window (R1: "August 2024 - January 2025") is set in
conf/task/livecodebench_r1.yaml.

A module of its own so that VERSION is per protocol: the runner records the task module's VERSION, and this
protocol's prompt changed while the generic task's did not.
"""

from __future__ import annotations

from evalkit.sample import Sample
from evalkit.task import keep_all, lm_eval_hooks
from tasks.livecodebench import livecodebench as lcb
from tasks.livecodebench.grade import configure

TASK = "livecodebench_r1"
NO_QUESTION_SPLIT = lcb.NO_QUESTION_SPLIT  # query_aware=false is refused, as the generic task
# 2: the DeepSeekR1 raw prompt (was the generic chat style) and the window ending 2025-01-31 (was 02-01)
VERSION = 2
SCORER_VERSION = lcb.SCORER_VERSION  # the generic task's grading

# PromptConstants.SYSTEM_MESSAGE_DEEPSEEK_R1: it opens the whole input, BOS token included.
SYSTEM_R1 = (
    "<｜begin▁of▁sentence｜>A conversation between User and Assistant. The user asks a question, and the "
    "Assistant solves it. The assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process and answer are enclosed within <think> "
    "</think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>.<｜User｜>"
)
INSTRUCTION = (
    "You will be given a question (problem specification) and will generate a correct Python program that "
    "matches the specification and passes all tests."
)


def prompt(question_content: str, starter_code: str) -> str:
    """Upstream `format_prompt_generation(question, LMStyle.DeepSeekR1)`: SYSTEM_R1 followed by
    `get_deepseek_r1_question_template_answer` (the Format lines are the generic ones, without "### ")."""
    text = f"{SYSTEM_R1}{INSTRUCTION}\n\nQuestion: {question_content}\n\n"
    if starter_code:
        text += f"{lcb.FORMAT_STARTER}\n```python\n{starter_code}\n```\n\n"
    else:
        text += f"{lcb.FORMAT_STDIN}\n```python\n# YOUR CODE HERE\n```\n\n"
    return text + "<｜Assistant｜>"


def r1_sample(qid: str, row: dict, meta: dict, max_new_tokens: int) -> Sample:
    text = prompt(row["question_content"], row["starter_code"])
    subset = f"{row['difficulty']}|{row['platform']}"
    return Sample(qid, TASK, text, [], max_new_tokens, subset=subset, meta=meta, rendered=True)


def load(
    source="sample",
    n=None,
    seed=0,
    release="release_v6",
    start_date=None,
    end_date=None,
    max_new_tokens=2000,
    **_,
):
    """The generic loader (same data, window and order), each problem in the DeepSeekR1 prompt style."""
    return lcb.load(source, n, seed, release, start_date, end_date, max_new_tokens, make=r1_sample)


score, score_many, score_keys = lcb.score, lcb.score_many, lcb.score_keys
custom_dataset, process_results = lm_eval_hooks(TASK, load, score, no_split=NO_QUESTION_SPLIT)
__all__ = ["load", "score", "score_many", "configure", "custom_dataset", "process_results", "keep_all"]
