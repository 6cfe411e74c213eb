"""KV compression methods: small dataclasses that turn one `budget` into a cache layout, plus one scoring
hook.

Every method keeps, per layer and KV head, `[sink | tail | top-K]` entries of the prompt (spec:
`../shared/spec/snapstream.md`). The methods differ only in the sizes of those blocks, in whether the tail is
a ring that new tokens overwrite (fixed size) or new tokens are appended (unbounded), and in `score`, the hook
that ranks the middle of the prompt for the top-K block:

| method        | sink | tail              | top-K                | decode |
|---------------|------|-------------------|----------------------|--------|
| full          | -    | whole prompt      | -                    | append |
| streamingllm  | S    | B - S             | -                    | ring   |
| snapkv        | -    | window (L_obs)    | B - L_obs, SnapKV    | append |
| snapstream    | S    | recent (R)        | B - S - R, SnapKV    | ring   |
| h2o           | -    | recent (R)        | B - R, accumulated   | evict  |
| snapkv_decode | -    | window (L_obs)    | B - I - L_obs, SnapKV| refit  |

The two decode-time methods choose what to evict while decoding, in a cache that never grows past `budget`
slots: `h2o` (Zhang et al., 2023, arXiv 2306.14048) adds each new token's attention to every kept entry's
accumulated score and overwrites the lowest-scored entry older than the last R tokens; `snapkv_decode`
(kvpress's `DecodingPress` around SnapKV) appends for `interval` steps into the I free slots, then re-selects
the cache down to `budget - interval` entries by the last `window` decode queries' attention.

`budget` is absolute: KV entries kept per layer and KV head. Invalid settings raise `ValueError` here, at
construction, naming the setting and the rule.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

from evalkit.kv import select
from evalkit.kv.evict import Evictor, H2OEvictor, RefitEvictor
from evalkit.kv.layout import SHARED, Shape, SharedSlots
from evalkit.kv.scorers import PrefillView


@dataclass(frozen=True)
class RunFacts:
    """What a run is, as far as a method may refuse it before any model loads (`KVMethod.refusal`)."""

    model_name: str
    mla: bool  # the model caches a latent (MLA): attention reads keys rebuilt from it
    followup: bool  # the task makes a second call after the first
    compile: bool
    tp: int  # tensor-parallel processes
    task: str = ""  # the task's name, for the message


@dataclass
class KVMethod:
    """Base: a budget and the block sizes it implies; `score` is the one hook (None = nothing to rank)."""

    name: ClassVar[str]
    ring: ClassVar[bool]  # True: fixed-size cache, decode overwrites the oldest tail entry in place
    # False for `full`: sweeps may list it with budgets, which all name its one run
    budget_applies: ClassVar[bool] = True
    # What callers read of any method; a method that has one declares it as a setting (a dataclass field).
    budget: ClassVar[int | None] = None  # KV entries kept per layer and KV head; None: uncompressed
    window: ClassVar[int] = 0  # observation window (last prompt queries) a shared prefill must keep
    # True: `score` is budget-free and reads more queries than a window (h2o's sum over every prompt query): a
    # shared prefill records the score per entry (`PrefillRecord.hints`), not the queries, and replays it
    records_score: ClassVar[bool] = False
    spare_slots: ClassVar[str] = "ring"  # what a ring's slots beyond the prompt hold ("pad": the spec's)
    # Its decode in a static cache and the slot pool (`evalkit.kv.evict`): `Evictor` chooses nothing (the ring
    # or append); a decode-time method names its own (h2o: `H2OEvictor`, snapkv_decode: `RefitEvictor`).
    evictor: ClassVar[type[Evictor]] = Evictor
    # Which slots each KV head reads at decode (`layout`): one mask per row (every head keeps alike), or per
    # head where heads or layers keep different counts (`evalkit.kv.adaptive`)
    slot_mask: ClassVar[SharedSlots] = SHARED

    def blocks(self) -> tuple[int, int, int]:
        """(sink, tail, top-K) used when a prompt does not fit in the budget."""
        raise NotImplementedError

    def slots(self, shape: Shape) -> int:
        """Slots per row a long prompt takes: the budget, or (adaptive budgets) what the largest head of the
        largest layer may keep."""
        return self.budget

    def top_slots(self, shape: Shape) -> int:
        """Top-K slots per row: the top-K block, or (adaptive budgets) the most one head of a layer keeps."""
        return self.blocks()[2]

    def place(self, pos, scores, rows, layer: int, shape: Shape, agree: select.Agree) -> None:
        """Write each KV head's kept top-K positions into pos (B, H, n) in place; scores (B, H, T) per KV
        head, -inf outside a row's candidates. Every head keeps the top-K block (`select.place_topk`)."""
        select.place_topk(pos, scores, rows, self.blocks(), agree)

    def score(self, view: PrefillView) -> torch.Tensor | None:
        """Importance of each prompt position for the top-K block, (B, H_attn, T); None when not ranking.

        `view` (`scorers.PrefillView`): the prompt's last `window` queries post-RoPE, the keys as attention
        sees them, the values, the candidates (B, T) the top-K block may hold, the left pads, the scaling."""
        return None

    def prefill(self, forward, cache, tokenizer, kwargs: dict):
        """Run the prompt's forward into `cache` (which compresses as attention hands it the queries); a
        method whose score needs more than the prompt's own forward (KVzip's reconstruction pass) runs it
        here. Called once per prefill by `prefill.shared_prefill`, where the engine prefills."""
        return forward(**kwargs)

    def refusal(self, facts: RunFacts) -> str | None:
        """Why this method cannot run as `facts` describe (checked before any model loads), or None. Its
        evictor's refusals by default (a decode-time slot pool's)."""
        return self.evictor.refusal(self, facts)

    def describe(self) -> dict:
        return {"name": self.name, **asdict(self)}

    def score_key(self) -> str:
        """What this method's prompt scores depend on (a shared prefill replays recorded scores only to a
        method of the same key, `PrefillRecord.hints_for`): by default every setting but the budget."""
        settings = {k: v for k, v in self.describe().items() if k != "budget"}
        return json.dumps(settings, sort_keys=True, default=str)


@dataclass
class Full(KVMethod):
    """No compression: the whole prompt is kept and every new token appended (the `full` baseline)."""

    budget: int | None = None  # accepted for a uniform interface; must stay None
    name: ClassVar[str] = "full"
    ring: ClassVar[bool] = False
    budget_applies: ClassVar[bool] = False

    def __post_init__(self):
        if self.budget is not None:
            raise ValueError(
                f"full: budget must be null (the full cache keeps everything), got {self.budget}"
            )

    def blocks(self) -> tuple[int, int, int]:
        return 0, 0, 0  # never used: a full cache always "fits"


def _check_budget(name: str, budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise ValueError(
            f"{name}: budget must be a positive integer (KV entries per layer and head), got {budget!r}"
        )
    if budget <= 0:
        raise ValueError(f"{name}: budget must be > 0 (KV entries per layer and head), got {budget}")
    return budget


def _check_ring(method, least_recent: int) -> None:
    """A sink + recent ring's settings (snapstream, and any scorer with its ring): `spare_slots`, `recent`'s
    default (budget // 8, at least `least_recent`), and a ring that fits the budget."""
    name = method.name
    if method.spare_slots not in ("pad", "ring"):
        raise ValueError(f"{name}: spare_slots must be 'pad' (spec) or 'ring', got {method.spare_slots!r}")
    if method.recent is None:
        method.recent = max(method.budget // 8, least_recent)
    if method.sink < 0 or method.recent < 1:
        raise ValueError(
            f"{name}: need sink >= 0 and recent >= 1, got sink={method.sink}, recent={method.recent}"
        )
    if method.sink + method.recent > method.budget:
        raise ValueError(
            f"{name}: sink + recent must be <= budget, got {method.sink} + {method.recent} > {method.budget}"
        )


def _check_kernel(name: str, kernel: int) -> None:
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"{name}: pool_kernel must be odd and >= 1 (centred pooling), got {kernel}")


@dataclass
class StreamingLLM(KVMethod):
    """StreamingLLM: `sink` first tokens plus a ring of the last `budget - sink` tokens."""

    budget: int = 256
    sink: int = 4
    name: ClassVar[str] = "streamingllm"
    ring: ClassVar[bool] = True

    def __post_init__(self):
        _check_budget(self.name, self.budget)
        if self.sink < 0 or self.sink >= self.budget:
            raise ValueError(
                f"{self.name}: sink must be in [0, budget) so the recent ring keeps >= 1 entry "
                f"(sink={self.sink}, budget={self.budget})"
            )

    def blocks(self) -> tuple[int, int, int]:
        return self.sink, self.budget - self.sink, 0


@dataclass
class SnapKV(KVMethod):
    """SnapKV: top-(budget - window) of the prompt by observation-window attention, plus the window itself."""

    budget: int = 256
    window: int = 32
    pool_kernel: int = 7
    name: ClassVar[str] = "snapkv"
    ring: ClassVar[bool] = False

    def __post_init__(self):
        _check_budget(self.name, self.budget)
        _check_kernel(self.name, self.pool_kernel)
        if self.window < 1 or self.window > self.budget:
            raise ValueError(
                f"{self.name}: window must be in [1, budget] (the observation window is kept), "
                f"got window={self.window}, budget={self.budget}"
            )

    def blocks(self) -> tuple[int, int, int]:
        return 0, self.window, self.budget - self.window

    def score(self, view):
        window = view.query[:, :, -self.window :]
        return select.snapkv_scores(
            window, view.keys, view.candidates, view.pad, view.scaling, self.pool_kernel
        )


@dataclass
class SnapStream(SnapKV):
    """SnapStream: sinks + SnapKV top-K of the prompt's middle + a ring of recent tokens, fixed size
    `budget`."""

    sink: int = 4
    recent: int | None = None  # None: budget // 8, at least `window` (spec defaults)
    # Top-K slots a prompt shorter than the budget cannot fill: "pad" (the spec: masked padding, the ring
    # stays `recent`) or "ring" (evalkit's option: the prompt is kept whole and the ring grows into them).
    spare_slots: str = "pad"
    name: ClassVar[str] = "snapstream"
    ring: ClassVar[bool] = True

    def __post_init__(self):
        _check_budget(self.name, self.budget)
        _check_kernel(self.name, self.pool_kernel)
        _check_ring(self, self.window)
        # The observation window is the last `window` queries; they must lie in the recent block, which is
        # kept anyway, so that every scored candidate is older than every observing query.
        if self.window < 1 or self.window > self.recent:
            raise ValueError(
                f"{self.name}: window must be in [1, recent] (the observation window lies in the recent "
                f"ring), got window={self.window}, recent={self.recent}"
            )

    def blocks(self) -> tuple[int, int, int]:
        return self.sink, self.recent, self.budget - self.sink - self.recent


@dataclass
class H2O(KVMethod):
    """H2O: heavy hitters (accumulated attention) plus the last `recent` tokens, fixed size `budget`.

    Prefill keeps the last `recent` prompt tokens and the top-(budget - recent) of the rest by attention
    summed over every prompt query; each decode step adds the new query's attention to every kept entry's
    score and, once the cache is full, overwrites the lowest-scored entry older than the last `recent`
    tokens. This is the reference's eviction with `recent_size = recent`, `hh_size = budget - recent - 1`,
    attending over `budget` entries (the reference evicts after attending over one more than it keeps)."""

    budget: int = 256
    recent: int | None = None  # None: budget // 2 (the reference's equal heavy and recent ratios)
    name: ClassVar[str] = "h2o"
    ring: ClassVar[bool] = True
    evictor: ClassVar[type[Evictor]] = H2OEvictor
    # its prefill score sums attention over every prompt query, whatever the budget: a shared prefill keeps
    # that sum per entry (B, H, T) float32, not the prompt's queries (B, H_q, T, D)
    records_score: ClassVar[bool] = True

    def __post_init__(self):
        _check_budget(self.name, self.budget)
        if self.budget < 2:  # named as given: with `recent` unset, its derived 0 is no setting of the user's
            raise ValueError(
                f"{self.name}: budget must be >= 2 (at least one recent entry and one to evict), got "
                f"budget={self.budget}"
            )
        if self.recent is None:
            self.recent = self.budget // 2
        if not 1 <= self.recent <= self.budget - 1:
            raise ValueError(
                f"{self.name}: recent must be in [1, budget - 1] so a full cache has an entry to evict, "
                f"got recent={self.recent}, budget={self.budget}"
            )

    def blocks(self) -> tuple[int, int, int]:
        return 0, self.recent, self.budget - self.recent

    def score_key(self) -> str:
        return self.name  # attention sums: no setting of its own (`recent` follows the budget)

    def score(self, view):
        """Attention each prompt position receives, summed over every prompt query (not restricted to
        `candidates`: the kept recent entries carry their sums into decode); a replayed prefill's are the
        recording prefill's sums (`view.hint`)."""
        if view.hint is not None:
            return view.hint
        return select.accumulated_attention(view.query, view.keys, view.pad, view.scaling)


@dataclass
class SnapKVDecode(SnapKV):
    """SnapKV during decode (kvpress `DecodingPress(SnapKVPress)`): `budget` slots, re-selected every
    `interval` decode steps down to `budget - interval` entries (the last `window` tokens plus the top of the
    rest by those tokens' queries); the prompt is compressed by SnapKV to the same size at prefill."""

    interval: int | None = None  # None: budget // 4, at least window + 1
    name: ClassVar[str] = "snapkv_decode"
    ring: ClassVar[bool] = True
    evictor: ClassVar[type[Evictor]] = RefitEvictor

    def __post_init__(self):
        _check_budget(self.name, self.budget)
        _check_kernel(self.name, self.pool_kernel)
        if self.window < 1:
            raise ValueError(f"{self.name}: window must be >= 1, got {self.window}")
        if self.interval is None:
            self.interval = max(self.budget // 4, self.window + 1)
        # kvpress scores with more buffered decode queries than the window (its assert): interval > window
        if self.interval <= self.window:
            raise ValueError(
                f"{self.name}: interval must be > window (the window's queries are decode steps since the "
                f"last re-selection), got interval={self.interval}, window={self.window}"
            )
        if self.budget - self.interval < self.window:
            raise ValueError(
                f"{self.name}: budget - interval (entries kept at each re-selection) must be >= window, got "
                f"budget={self.budget}, interval={self.interval}, window={self.window}: raise the budget or "
                "lower the interval"
            )

    @property
    def target(self) -> int:
        """Entries kept after each re-selection (and after prefill): kvpress's `target_size`."""
        return self.budget - self.interval

    def blocks(self) -> tuple[int, int, int]:
        return 0, self.window, self.target - self.window
