"""query_aware=false splits each rendered prompt at its question: the two parts reassemble the query-aware
prompt byte for byte and token for token, for every task and template, and the split falls where
docs/query-agnostic.md says (the context side holds no query)."""

from __future__ import annotations

import pytest

import tasks.longbench_v2.longbench_v2 as lb
import tasks.ruler.ruler as ruler
from evalkit.request import Prompt, question_offset, question_tokens, sample_prompt
from tests.tasks.test_ruler import files  # noqa: F401  (the essay and QA files in upstream's schema)

# what the question side of each RULER generator starts with (the line that asks)
RULER_QUESTIONS = {
    "niah_single_1": "What is the special magic number for ",
    "niah_multikey_2": "What is the special magic number for ",
    "niah_multikey_3": "What is the special magic uuid for ",
    "niah_multivalue": "What are all the special magic numbers for ",
    "niah_multiquery": "What are all the special magic numbers for ",
    "vt": "Question: Find all variables that are assigned the value ",
    "cwe": "Question: What are the 10 most common words in the above list?",
    "fwe": "Question: Do not provide any explanation.",
    "qa_1": "Question: ",
}


@pytest.fixture(scope="module")
def tok():
    from evalkit.config import model_spec
    from evalkit.sources import tokenizer_path
    from evalkit.task import get_tokenizer

    return get_tokenizer(tokenizer_path(model_spec("smollm2_135m")))


def split(tok, sample):
    """(rendered text, char boundary, ids, context token count) as the evalkit LM splits the sample."""
    text = sample_prompt(tok, sample)
    p = Prompt("k", text, 8, {}, sample, question_at=question_offset(text, sample, ruler_or_lb(sample)))
    ids = tok(text, add_special_tokens=False)["input_ids"]  # what fit_prompt gives an untruncated prompt
    return text, p.question_at, ids, len(ids) - question_tokens(tok, p, ids)


def ruler_or_lb(sample):
    return (lb if sample.task == lb.TASK else ruler).question_start(sample)


def check_exact(tok, sample, asks: str) -> tuple[str, str]:
    """The split is exact at the boundary: the query-aware ids, cut in two, decode to the text before the
    question and to the rest. (Tokenizing the two texts alone would not always give those ids: BPE merges
    across the boundary, e.g. QA's "\n\nQuestion", which is why the whole prompt is tokenized once.)"""
    text, at, ids, n = split(tok, sample)
    before, after = text[:at], text[at:]
    assert after.startswith(asks), after[:80]
    assert tok.decode(ids[:n]) == before and tok.decode(ids[n:]) == after
    return before, after


@pytest.mark.parametrize("prompt_format", [None, "base", "meta-llama3", "Phi3"])
def test_ruler_splits_every_task_at_its_question(tok, tmp_path, files, prompt_format):  # noqa: F811
    loaded = ruler.load(
        tokenizer=tok, lengths=[2048], n=1, tasks=list(RULER_QUESTIONS), cache_dir=str(tmp_path),
        prompt_format=prompt_format, essay_path=files["essay"], squad_path=files["squad"],
    )  # fmt: skip
    assert sorted(s.meta["task"] for s in loaded.samples) == sorted(RULER_QUESTIONS)
    for s in loaded.samples:
        before, after = check_exact(tok, s, RULER_QUESTIONS[s.meta["task"]])
        assert after.endswith(s.answer_prefix)  # the model template's turn end and the prefix: question side
        if s.meta["task"].startswith("niah"):  # the instructions and the haystack are context
            assert before.rstrip("\n").split("\n")[-1] and "special magic" in before
        if prompt_format == "meta-llama3":
            assert before.startswith("<|begin_of_text|><|start_header_id|>user")
            assert "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n" in after


def test_ruler_vt_and_cwe_split_at_the_tasks_question_not_the_examples(tok, tmp_path):
    loaded = ruler.load(tokenizer=tok, lengths=[1024], n=1, tasks=["vt", "cwe"], cache_dir=str(tmp_path))
    for s in loaded.samples:
        before, after = check_exact(tok, s, RULER_QUESTIONS[s.meta["task"]])
        assert "Question:" in before  # the in-context example asks its own question earlier: context side
        assert after.count("Question:") == 1


def test_ruler_qa_keeps_the_repeated_instruction_on_the_context_side():
    from evalkit.sample import Sample
    from tasks.ruler.constants import QA_TEMPLATE

    prompt = QA_TEMPLATE.format(context="Document 1:\nParis is in France.", query="Where is Paris?")
    s = Sample("q", "ruler", prompt, ["France"], 32, meta={"task": "qa_1"})
    at = ruler.question_start(s)
    assert prompt[at:] == "Question: Where is Paris?"
    assert prompt[:at].endswith("Only give me the answer and do not output any other words.\n\n")


@pytest.mark.parametrize(
    "mode, asks_end", [("0shot", lb.ANSWER_FORMAT), ("cot", "Let\u2019s think step by step:")]
)
def test_longbench_splits_after_the_document(tok, mode, asks_end):
    loaded = lb.load(tokenizer=tok, mode=mode, model_context=8192)
    assert loaded.samples
    for s in loaded.samples:
        before, after = check_exact(tok, s, "What is the correct answer to this question: ")
        assert before.endswith("</text>\n\n") and s.meta["question"].strip() in after
        assert after.split("<|im_end|>")[0].endswith(asks_end)


def test_a_truncated_prompt_keeps_its_question_tokens(tok):
    """A prompt cut in the middle keeps its tail: the question's tokens are the fitted ids' last ones."""
    from evalkit.request import fit_prompt

    s = lb.load(tokenizer=tok, model_context=8192).samples[0]
    text = sample_prompt(tok, s)
    p = Prompt("k", text, 8, {}, s, question_at=question_offset(text, s, lb.question_start(s)))
    whole = tok(text, add_special_tokens=False)["input_ids"]
    ids, truncated, _ = fit_prompt(tok, p, context=len(whole) // 2)
    n = question_tokens(tok, p, ids)
    assert truncated and n == question_tokens(tok, p, whole)
    assert tok.decode(ids[-n:]) == text[p.question_at :]


def test_a_template_that_alters_the_user_message_is_refused_by_name(tok):
    from evalkit.sample import Sample

    s = Sample("x", "ruler", "  padded  ", [], 8)
    with pytest.raises(ValueError, match="x: cannot split the prompt at its question"):
        question_offset("<user>padded</user>", s, 3)
