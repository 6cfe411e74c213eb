"""RULER's task table: templates, answer prefixes, tokens to generate and metric for the 13 tasks.

Templates and answer prefixes are byte-exact copies of upstream `scripts/data/synthetic/constants.py`
(NVIDIA/RULER, current main); per-task parameters follow `scripts/synthetic.yaml`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# --- task templates (user message) and answer prefixes (assistant prefill), upstream verbatim
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# Current upstream spelling. The 2024 code behind the paper's numbers had "assgined" here.
VT_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assigned the value {query}, they are: "
)

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nThe following are given documents.\n\n{context}\n\n"
    "Answer the question based on the given documents. Only give me the answer and do not output any "
    "other words.\n\nQuestion: {query}"
)
QA_PREFIX = " Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"

# RULER's model templates (upstream `scripts/data/template.py` `Templates`, verbatim): prepare.py renders
# `Templates[model_template_type].format(task_template=...) + answer_prefix`; `scripts/config_models.sh`
# runs llama3.1-8b-chat with "meta-llama3". A model conf's `prompt_format` names one.
MODEL_TEMPLATES = {
    "base": "{task_template}",
    "meta-chat": "[INST] {task_template} [/INST]",
    "vicuna-chat": (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
        "helpful, detailed, and polite answers to the user's questions. USER: {task_template} ASSISTANT:"
    ),
    "lwm-chat": "You are a helpful assistant. USER: {task_template} ASSISTANT: ",
    "command-r-chat": (
        "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>{task_template}<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    ),
    "chatglm-chat": "[gMASK]sop<|user|> \n {task_template}<|assistant|> \n ",
    "RWKV": (
        "User: hi\n\nAssistant: Hi. I am your assistant and I will provide expert full response in full "
        "details. Please feel free to ask any question and I will always answer it\n\n"
        "User: {task_template}\n\nAssistant:"
    ),
    "Phi3": "<|user|>\n{task_template}<|end|>\n<|assistant|>\n",
    "meta-llama3": (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "jamba": "<|startoftext|><|bom|><|system|> <|eom|><|bom|><|user|> {task_template}<|eom|><|bom|><|assistant|>",  # noqa: E501
    "nemotron5-instruct": "<SPECIAL_10>System\n\n<SPECIAL_11>User\n{task_template}\n<SPECIAL_11>Assistant\n",
}


@dataclass(frozen=True)
class TaskSpec:
    generator: str  # niah | vt | cwe | fwe | qa
    tokens_to_generate: int
    metric: str  # "all" (fraction of references found) or "part" (any reference found)
    args: dict = field(default_factory=dict)
    data: tuple[str, ...] = ()  # external files the task cannot run without


def _niah(haystack: str, k: str = "words", v: str = "numbers", nk=1, nv=1, nq=1) -> TaskSpec:
    args = dict(type_haystack=haystack, type_needle_k=k, type_needle_v=v, num_needle_k=nk, num_needle_v=nv)
    args["num_needle_q"] = nq
    return TaskSpec("niah", 128, "all", args, ("essay",) if haystack == "essay" else ())


TASKS: dict[str, TaskSpec] = {
    "niah_single_1": _niah("noise"),
    "niah_single_2": _niah("essay"),
    "niah_single_3": _niah("essay", v="uuids"),
    "niah_multikey_1": _niah("essay", nk=4),
    "niah_multikey_2": _niah("needle"),
    "niah_multikey_3": _niah("needle", k="uuids", v="uuids"),
    "niah_multivalue": _niah("essay", nv=4),
    "niah_multiquery": _niah("essay", nq=4),
    "vt": TaskSpec("vt", 30, "all", {"num_chains": 1, "num_hops": 4}),
    "cwe": TaskSpec("cwe", 120, "all", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    "fwe": TaskSpec("fwe", 50, "all", {"alpha": 2.0}),
    "qa_1": TaskSpec("qa", 32, "part", {"dataset": "squad"}, ("squad",)),
    "qa_2": TaskSpec("qa", 32, "part", {"dataset": "hotpotqa"}, ("hotpotqa",)),
}
NO_DATA_TASKS = [name for name, spec in TASKS.items() if not spec.data]
