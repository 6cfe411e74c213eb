"""The rival prefill methods (issue 33): kvpress's strongest presses as evalkit layouts with one scorer each.

Each keeps, per layer and KV head, the entries its press protects (the first `sink` tokens, or the prompt's
last token) plus the top-(budget - protected) of the rest of the prompt by its scorer (`scorers.py`), at their
original positions; decode appends, as `snapkv`. `budget` means what it means for every method: KV entries
kept per layer and KV head (kvpress's `compression_ratio` is measured, never an input). A prompt no longer
than the budget is kept whole.

| method             | protected         | top-K scorer                          | query-aware |
|--------------------|-------------------|---------------------------------------|-------------|
| knorm              | -                 | minus the key norm                    | no          |
| keydiff            | -                 | minus cosine to the mean unit key     | no          |
| tova               | the last token    | the last query's attention, all heads | yes         |
| expected_attention | `sink` first      | expected attention x value norm       | no          |
| kvzip              | `sink` first      | max attention while repeating context | no          |

"query-aware" is whether the score reads the prompt's queries at its end (with `query_aware=true` the question
is there). KVzip runs an extra pass before compressing (`reconstruct.py`): the model is asked to repeat the
prompt and each entry is scored by the attention it receives.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar

from evalkit.kv import scorers
from evalkit.kv.methods import KVMethod, _check_budget, _check_ring


@dataclass
class Scored(KVMethod):
    """Base: `protect` leading (sink) and trailing (tail) entries, the top of the rest by `scorer()`."""

    budget: int = 256
    ring: ClassVar[bool] = False
    tail: ClassVar[int] = 0  # trailing prompt entries always kept

    @property
    def sinks(self) -> int:
        return getattr(self, "sink", 0)

    @property
    def window(self) -> int:  # the prompt queries a shared prefill keeps for the scorer
        return self.scorer().queries

    @property
    def records_score(self) -> bool:  # a shared prefill keeps the scorer's score, not the queries
        return self.scorer().records_score

    def scorer(self):
        raise NotImplementedError

    def score_key(self) -> str:
        return repr(self.scorer())  # the scorer's settings (a frozen dataclass)

    def __post_init__(self):
        _check_budget(self.name, self.budget)
        if self.sinks < 0:
            raise ValueError(f"{self.name}: sink must be >= 0, got {self.sinks}")
        if self.sinks + self.tail >= self.budget:
            raise ValueError(
                f"{self.name}: budget must exceed the entries always kept (sink {self.sinks} + last "
                f"{self.tail}) so the top-K block keeps >= 1, got budget={self.budget}"
            )

    def blocks(self) -> tuple[int, int, int]:
        return self.sinks, self.tail, self.budget - self.sinks - self.tail

    def score(self, view):
        return self.scorer()(view)

    def prefill(self, forward, cache, tokenizer, kwargs: dict):
        return self.scorer().prefill(forward, cache, tokenizer, kwargs)

    def refusal(self, facts) -> str | None:
        return self.scorer().refusal(facts, self.name) or super().refusal(facts)


@dataclass
class KNorm(Scored):
    """KnormPress: the `budget` prompt entries of lowest key norm."""

    name: ClassVar[str] = "knorm"

    def scorer(self):
        return scorers.KeyNormScore()


@dataclass
class KeyDiff(Scored):
    """KeyDiffPress: the `budget` prompt entries whose keys differ most from the mean key direction."""

    name: ClassVar[str] = "keydiff"

    def scorer(self):
        return scorers.KeyDiffScore()


@dataclass
class TOVA(Scored):
    """TOVAPress at prefill: the prompt's last token plus the top-(budget - 1) by its attention."""

    name: ClassVar[str] = "tova"
    tail: ClassVar[int] = 1

    def scorer(self):
        return scorers.LastQueryScore()


@dataclass
class ExpectedAttention(Scored):
    """ExpectedAttentionPress: the first `sink` tokens plus the top-(budget - sink) by expected attention of
    future queries times the value norm (`future` positions ahead; `covariance`, `value_norm`, `epsilon` as
    kvpress's `use_covariance`, `use_vnorm`, `epsilon`)."""

    sink: int = 4
    future: int = 512
    covariance: bool = True
    value_norm: bool = True
    epsilon: float = 0.0
    name: ClassVar[str] = "expected_attention"

    def __post_init__(self):
        super().__post_init__()
        if self.future < 1:
            raise ValueError(f"{self.name}: future must be >= 1 (positions averaged), got {self.future}")

    def scorer(self):
        return scorers.ExpectedAttentionScore(
            self.sink, self.future, self.covariance, self.value_norm, self.epsilon
        )


@dataclass
class KVzip(Scored):
    """KVzipPress: the first `sink` tokens plus the top-(budget - sink) by the attention each entry receives
    when the model is asked to repeat the prompt (in chunks of `chunk` tokens), one top-K per KV head."""

    sink: int = 4
    chunk: int = 2048
    name: ClassVar[str] = "kvzip"

    def __post_init__(self):
        super().__post_init__()
        if self.chunk < 1:
            raise ValueError(f"{self.name}: chunk must be >= 1 (tokens repeated per pass), got {self.chunk}")

    def scorer(self):
        return scorers.ReconstructionScore(self.sink, self.chunk)


@dataclass
class Ringed(KVMethod):
    """Any scorer in SnapStream's fixed-size layout (issue 33 item 2): the first `sink` tokens, the
    top-(budget - sink - recent) of the prompt's middle by `scorer`, and a ring of the last `recent` tokens
    that decode overwrites in place. With `SnapKVScore` it is `snapstream` (tests/kv/test_ringed.py); its name
    in results is the scorer's plus `_ring` (`expected_attention_ring`). The scorer's own pass (KVzip's) and
    refusals come with it."""

    budget: int = 256
    sink: int = 4
    recent: int | None = None  # None: budget // 8, at least 32 (snapstream's default at its default window)
    spare_slots: str = "pad"  # as snapstream's: "pad" (spec) or "ring"
    scorer: scorers.Scorer = field(default_factory=scorers.SnapKVScore)
    name: ClassVar[str] = "ring"
    ring: ClassVar[bool] = True

    def __post_init__(self):
        _check_budget(self.name, self.budget)
        _check_ring(self, 32)

    @property
    def window(self) -> int:  # the prompt queries a shared prefill keeps for the scorer
        return self.scorer.queries

    @property
    def records_score(self) -> bool:  # a shared prefill keeps the scorer's score, not the queries
        return self.scorer.records_score

    def score_key(self) -> str:
        return repr(self.scorer)  # `recent` follows the budget; the scores are the scorer's

    def blocks(self) -> tuple[int, int, int]:
        return self.sink, self.recent, self.budget - self.sink - self.recent

    def score(self, view):
        return self.scorer(view)

    def prefill(self, forward, cache, tokenizer, kwargs: dict):
        return self.scorer.prefill(forward, cache, tokenizer, kwargs)

    def refusal(self, facts) -> str | None:
        return self.scorer.refusal(facts, self.describe()["name"]) or super().refusal(facts)

    def describe(self) -> dict:
        return {"name": f"{self.scorer.name}_ring", **asdict(self), "scorer": self.scorer.describe()}
