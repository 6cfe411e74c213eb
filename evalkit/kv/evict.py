"""A method's decode-time behaviour in a static cache and the engine's slot pool: its `Evictor`.

`KVMethod.evictor` names the class; every cache makes one (`KVCache.evictor`) and calls its hooks, never
asking what kind it has. The evictor owns the device state its choice needs. In a row's life:
- `prefilled` (each layer of the request's one-row prefill cache): keep what the prompt's scoring hands over;
- `allocate` (the pool, once; `grow` when it grows): its device state for `batch` rows of `capacity` slots;
- `load_row` / `idle_row` (the pool, host): a row takes a prefilled request / holds none;
- each decode step: `advance` (its first layer: this step's slot and position, the counters moved on), then
  `write_index` (every layer: where the new entry goes), then `observe` (after attention, when `observes`);
- `after_step` (host, between steps, no sync): periodic work, such as a re-selection.
`advance`, `write_index` and `observe` are tensor work in place, with no host sync and no Python branch on
data: a compiled step stays one graph.

`Evictor` itself chooses nothing while decoding: a row is its method's ring (the oldest tail entry
overwritten, `layout.ring_slot`) or it appends. `SlotEvictor` is the base of the decode-time ones: a row of
`budget` slots appends at its next free slot (every head alike, so the valid-slot mask stays one per row)
until it is full; then each subclass chooses:
- `H2OEvictor` (`h2o`, every step, inside the decode step): each layer's slot to overwrite is chosen per KV
  head on the device, the lowest accumulated attention among entries older than the last `recent` tokens; the
  new entry's sum starts at zero, and after attention the step's query adds its probabilities over the slots
  to every slot's sum.
- `RefitEvictor` (`snapkv_decode`, every `interval` steps, between decode steps): the step stores its
  post-RoPE query in a ring of the last `window` queries; the host counts each row's steps (no sync) and
  re-selects a due row's cache down to `budget - interval` entries (`refit`), written back in place in
  position order, so the next `interval` tokens append into the slots it frees.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from evalkit.kv import select
from evalkit.kv.layout import ring_slot
from evalkit.kv.static import pin


def kept(pool, scores: torch.Tensor, k: int) -> torch.Tensor:
    """(..., k) slots of the k highest scores: the one place an evictor turns scores into kept (or, negated,
    evicted) slots, agreed across TP ranks where attention is replicated (`select.top_indices`)."""
    return select.top_indices(scores, k, pool.agree)


def _put(per_layer: list, i: int, x) -> None:
    """per_layer[i] = x, growing the list: a prefill cache's layers arrive in order, once each."""
    per_layer.extend([None] * (i + 1 - len(per_layer)))
    per_layer[i] = x


class Evictor:
    """Nothing chosen while decoding: each row is its method's ring or append (the static cache's step)."""

    prompt_scores: ClassVar[bool] = False  # `prefilled` needs each prompt entry's score (h2o's prefill sums)
    observes: ClassVar[bool] = False  # attention hands each decode step's query to `observe`
    chooses_slots: ClassVar[bool] = False  # writes a decode step's entry into a slot chosen per KV head

    def __init__(self):
        self.scoring = True  # False: the step without its scoring (the bench's baseline)

    @classmethod
    def refusal(cls, method, facts) -> str | None:
        """Why `method` cannot run with these run facts (`methods.RunFacts`), before any model loads."""
        return None

    def check_cache(self, cache) -> None:
        """Raise if this evictor cannot decode in `cache` (when the cache starts decoding)."""

    def prefilled(self, layer, query, scaling: float, expanded: bool, scores, to_slots) -> None:
        """One layer of a prefill cache was compressed. query (B, H_q, T_q, D) post-RoPE; expanded: attention
        read keys rebuilt from the cache (MLA); scores (B, H, T) per prompt column, or None unless
        `prompt_scores`; to_slots maps such a (B, H, T) tensor to the layer's slots (B, H, cap), 0 where
        empty."""

    # --- the slot pool (host) -------------------------------------------------------------------------------
    def allocate(self, pool, like, batch: int, capacity: int) -> None:
        """Device state for `pool`, shaped like the prefilled cache `like`."""

    def grow(self, pool, capacity: int) -> None:
        """The pool's rows now have `capacity` slots (contents kept)."""

    def load_row(self, pool, r: int, src) -> None:
        """Row r became a copy of the one-row prefilled cache `src` (its layers and layout are in)."""
        if type(src.evictor) is not type(self):
            raise ValueError(
                f"a slot pool decodes rows of one eviction kind (and window): it holds {pool.method.name} "
                f"rows, got {src.method.name} ({src.method})"
            )

    def idle_row(self, pool, r: int) -> None:
        """Row r holds no request (a ring of one slot at 0)."""

    def after_step(self, pool, active: list[int]) -> None:
        """After a decode step of the rows `active` (host only, no sync)."""

    # --- the decode step (device, in place, one graph) ------------------------------------------------------
    def advance(self, cache) -> None:
        """This step's slot and position per row, the slot marked valid, counters moved on. Ring rows: their
        ring slot (short prompts fill the sinks first); append rows: the next free column."""
        rows, state = cache.rows, cache.state
        p = rows.next_pos  # (B,) this token's position per row
        slot = torch.where(state.ring, ring_slot(p, state.sink, rows.tail), state.next_slot)
        state.slot.copy_(slot)
        state.pos.copy_(p)
        rows.valid[state.row, state.slot] = True
        rows.next_pos.add_(1)
        state.next_slot.add_(1)
        state.seen.add_(1)

    def write_index(self, cache, layer) -> tuple:
        """Where this step's entry goes in a layer's (B, H, cap) buffers: (B,) rows x all heads x (B,)
        slots."""
        return cache.state.row, slice(None), cache.state.slot

    def observe(self, pool, layer, query, key, mask, scaling: float) -> None:
        """After a layer's decode attention (when `observes`): query (B, H_q, 1, D) post-RoPE, key
        (B, H, S, D) every slot, mask (B, 1, 1, S) bool."""


class SlotEvictor(Evictor):
    """A decode-time evictor: `budget` slots per row and KV head, appended into until full, then each KV
    head's slot is chosen by the subclass (`write_index`). Rows decode in the engine's slot pool only."""

    chooses_slots = True

    def __init__(self):
        super().__init__()
        self.methods: list = []  # each row's method (rows may differ in budget and settings)

    @classmethod
    def refusal(cls, method, facts) -> str | None:
        if facts.followup:
            task = f"task {facts.task}" if facts.task else "the task"
            return (
                f"{task} asks a second call on the full cache after each first one, which a "
                f"{method.name} slot pool cannot hold beside its rows: use method snapkv or snapstream, or "
                "task=longbench_v2"
            )
        return None

    def check_cache(self, cache) -> None:
        if not cache.pooled:
            other = "a static cache" if cache.static else "the dynamic cache (model.generate with a KVCache)"
            raise ValueError(
                f"{cache.method.name} chooses what to evict while decoding, which only the engine's slot "
                f"pool does ({other} does not): decode through evalkit.kv.generate or evalkit.engine.Engine"
            )

    def allocate(self, pool, like, batch: int, capacity: int) -> None:
        dev = pool.rows.valid.device
        self.head = torch.arange(pool.layers[0].keys.shape[1], device=dev)  # (H,)
        self.full = torch.zeros(batch, dtype=torch.bool, device=dev)  # (B,) row holds its budget
        self.methods = [None] * batch
        pin(self.head, self.full)

    def load_row(self, pool, r: int, src) -> None:
        super().load_row(pool, r, src)
        self.methods[r] = src.method
        pool.state.next_slot[r] = src.rows.filled[0]  # valid slots are a prefix: the next free one

    def idle_row(self, pool, r: int) -> None:
        pool.state.next_slot[r] = 1  # full at one slot: writes slot 0 in place

    def advance(self, cache) -> None:
        """Append at the next free slot until full (a full row's slot 0 is valid already; `write_index`
        chooses per head)."""
        rows, state = cache.rows, cache.state
        p = rows.next_pos  # (B,) this token's position per row
        full = state.next_slot >= state.slots  # (B,)
        self.full.copy_(full)
        slot = torch.where(full, 0, state.next_slot)
        state.slot.copy_(slot)
        state.pos.copy_(p)
        rows.valid[state.row, slot] = True
        rows.next_pos.add_(1)
        state.next_slot.add_((~full).long())
        state.seen.add_(1)

    def write_index(self, cache, layer) -> tuple:
        """Per KV head: (B, 1) rows x (1, H) heads x (B, H) slots, here each row's next free slot."""
        slot = cache.state.slot[:, None].expand(-1, self.head.shape[0])  # (B, H)
        return cache.state.row[:, None], self.head[None, :], slot


# --- h2o ----------------------------------------------------------------------------------------------------
def add_attention(acc, query, key, mask, scaling: float) -> None:
    """H2O's per-step update of acc (B, H_kv, S) float32: this step's query's attention probabilities over the
    slots (float32, under the slot mask), averaged over the query heads sharing a KV head, added in place.

    query (B, H_q, 1, D) post-RoPE; key (B, H_kv, S, D) every slot; mask (B, 1, 1, S) bool."""
    b, h_q, _, d = query.shape
    h_kv = key.shape[1]
    q = query.float().reshape(b, h_kv, h_q // h_kv, d)  # (B, H_kv, g, D)
    logits = torch.matmul(q, key.float().transpose(-1, -2)) * scaling  # (B, H_kv, g, S)
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    acc += select.group_mean(probs.mean(dim=2), acc.shape[1])


class H2OEvictor(SlotEvictor):
    """H2O: a full row overwrites, per KV head, its lowest accumulated score older than its last `recent`
    tokens; every step's attention is added to the sums. acc[i]: (B, H, cap) float32 per layer i."""

    prompt_scores = True  # each kept prompt entry carries its prefill sum into decode
    observes = True

    def __init__(self):
        super().__init__()
        self.acc: list[torch.Tensor] = []

    def prefilled(self, layer, query, scaling, expanded, scores, to_slots) -> None:
        _put(self.acc, layer.layer_idx, to_slots(scores))  # (1, H, cap), 0 where empty

    def allocate(self, pool, like, batch, capacity) -> None:
        super().allocate(pool, like, batch, capacity)
        dev = pool.rows.valid.device
        self.recent = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,) protected last tokens
        self.acc = [torch.zeros(batch, *layer.keys.shape[1:3], device=dev) for layer in pool.layers]
        pin(self.recent, *self.acc)

    def grow(self, pool, capacity) -> None:
        self.acc = [F.pad(acc, (0, capacity - acc.shape[-1])) for acc in self.acc]
        pin(*self.acc)

    def load_row(self, pool, r, src) -> None:
        super().load_row(pool, r, src)
        self.recent[r] = src.method.recent
        n = src.rows.n
        for mine, theirs in zip(self.acc, src.evictor.acc):
            mine[r].zero_()
            mine[r, :, :n].copy_(theirs[0, :, :n])

    def idle_row(self, pool, r) -> None:
        super().idle_row(pool, r)
        self.recent[r] = 0

    def write_index(self, cache, layer) -> tuple:
        """A full row's evicted slot per KV head, else its next free one (`SlotEvictor.write_index`)."""
        row, head = cache.state.row[:, None], self.head[None, :]
        slot = torch.where(
            self.full[:, None], self.evicted(cache, layer), cache.state.slot[:, None]
        )  # (B, H)
        self.acc[layer.layer_idx][row, head, slot] = 0.0  # the new entry's own sum
        return row, head, slot

    def evicted(self, pool, layer) -> torch.Tensor:
        """(B, H) the slot each KV head of a full row overwrites: the lowest accumulated score among its
        entries older than the row's last `recent` tokens (slots past the row's budget never compete)."""
        cap = layer.pos.shape[-1]
        older = layer.pos < (pool.state.pos - self.recent)[:, None, None]  # (B, H, cap)
        mine = pool.rows.valid & (torch.arange(cap, device=layer.pos.device) < pool.state.slots[:, None])
        score = self.acc[layer.layer_idx].masked_fill(~(older & mine[:, None, :]), float("inf"))
        return kept(pool, -score, 1)[..., 0]

    def observe(self, pool, layer, query, key, mask, scaling) -> None:
        if self.scoring:
            add_attention(self.acc[layer.layer_idx], query, key, mask, scaling)


# --- snapkv_decode ------------------------------------------------------------------------------------------
def window_scores(queries, keys, pos, valid, qpos, scaling: float, pool_kernel: int) -> torch.Tensor:
    """SnapKV's score of one row's slots from its last w decode queries, (H, S) float32 in slot order.

    queries (H_q, w, D) post-RoPE at positions qpos (w,); keys (H, S, D) every slot; pos (H, S) each slot's
    position; valid (S,) bool. Each query attends (softmax, causal by position) to the valid slots; the sum
    over the queries is average-pooled along the entries older than the window taken in position order (zero
    padding, as SnapKV pools the prompt). The window's own entries score +inf (always kept), empty slots -inf.
    """
    h_q, w, d = queries.shape
    h, s = pos.shape
    g = h_q // h
    logits = torch.matmul(queries.float().view(h, g, w, d), keys.float().transpose(-1, -2).unsqueeze(1))
    seen = valid & (pos[:, None, None, :] <= qpos[None, None, :, None])  # (H, 1, w, S)
    probs = torch.softmax((logits * scaling).masked_fill(~seen, float("-inf")), dim=-1)
    summed = probs.sum(dim=2)  # (H, g, S)
    window = valid & (pos >= qpos.min())  # (H, S): the last w tokens
    older = valid & ~window
    order = torch.where(older, pos, torch.iinfo(pos.dtype).max).argsort(dim=-1)  # (H, S) older first, by pos
    ordered = summed.gather(-1, order[:, None, :].expand(h, g, s))
    beyond = torch.arange(s, device=pos.device) >= older.sum(-1, keepdim=True)  # (H, S) past the older ones
    ordered = ordered.masked_fill(beyond[:, None, :], 0.0)
    pooled = F.avg_pool1d(ordered.reshape(h * g, 1, s), pool_kernel, 1, pool_kernel // 2).view(h, g, s)
    scores = torch.empty(h, s, dtype=torch.float32, device=pos.device).scatter_(-1, order, pooled.mean(1))
    return scores.masked_fill(~older, float("-inf")).masked_fill(window, float("inf"))


class RefitEvictor(SlotEvictor):
    """kvpress's DecodingPress around SnapKV: every `interval` steps a row is re-selected down to its method's
    `target` entries by its last `window` decode queries. queries[i]: (B, H_q, w, D) per layer i."""

    observes = True

    def __init__(self):
        super().__init__()
        self.scaling: list[float] = []  # per layer, the model's attention scaling (from the prefill)
        self.query_shape: list[tuple[int, int]] = []  # per layer (H_q, D)
        self.expanded = False  # MLA: attention reads keys rebuilt from a cached latent

    @classmethod
    def refusal(cls, method, facts) -> str | None:
        if facts.mla:
            return (
                f"method {method.name} re-scores the cached keys, but {facts.model_name} caches MLA's latent "
                "(keys are rebuilt from it inside attention): use h2o, snapkv or snapstream"
            )
        return super().refusal(method, facts)

    def prefilled(self, layer, query, scaling, expanded, scores, to_slots) -> None:
        _put(self.scaling, layer.layer_idx, scaling)
        _put(self.query_shape, layer.layer_idx, (query.shape[1], query.shape[-1]))
        self.expanded = self.expanded or expanded

    def allocate(self, pool, like, batch, capacity) -> None:
        if like.evictor.expanded:
            raise ValueError(
                f"{like.method.name} re-scores the cached keys, but this model's attention reads keys "
                "rebuilt from a cached latent (MLA, e.g. DeepSeek-V3): use h2o, snapkv or snapstream"
            )
        super().allocate(pool, like, batch, capacity)
        dev, window = pool.rows.valid.device, like.method.window
        self.scaling = list(like.evictor.scaling)
        self.qpos = torch.zeros(batch, window, dtype=torch.long, device=dev)  # (B, w) stored queries' pos
        self.queries = [
            layer.keys.new_zeros(batch, h_q, window, d, dtype=layer.dtype)  # (B, H_q, w, D)
            for layer, (h_q, d) in zip(pool.layers, like.evictor.query_shape)
        ]
        self.since, self.count = [0] * batch, [0] * batch
        pin(self.qpos, *self.queries)

    def load_row(self, pool, r, src) -> None:
        if src.method.window != self.qpos.shape[1]:
            raise ValueError(
                f"a slot pool decodes rows of one eviction kind (and window): it holds {pool.method.name} "
                f"rows, got {src.method.name} ({src.method})"
            )
        super().load_row(pool, r, src)
        self.since[r], self.count[r] = 0, src.rows.filled[0]

    def advance(self, cache) -> None:
        p = cache.rows.next_pos  # (B,) this token's position: its query's place in the window
        self.qpos[cache.state.row, p % self.qpos.shape[1]] = p
        super().advance(cache)

    def observe(self, pool, layer, query, key, mask, scaling) -> None:
        if self.scoring:  # this query joins the row's window of the last w
            queries = self.queries[layer.layer_idx]
            queries[pool.state.row, :, pool.state.pos % queries.shape[2]] = query[:, :, 0]

    def after_step(self, pool, active) -> None:
        """Due rows re-select every `interval` steps, as kvpress's DecodingPress (a cache no larger than its
        target is left alone)."""
        if not self.scoring:
            return
        for r in active:
            method = self.methods[r]
            self.since[r] += 1
            self.count[r] += 1
            if self.since[r] == method.interval:
                self.since[r] = 0
                if self.count[r] > method.target:
                    self.refit(pool, r)
                    self.count[r] = method.target

    def refit(self, pool, r: int) -> None:
        """Re-select row r of every layer down to its method's `target` entries (the window and the top of
        the rest by `window_scores`), written in position order into slots [0, target); the rest are freed."""
        method = self.methods[r]
        target, valid, qpos = method.target, pool.rows.valid[r], self.qpos[r]
        for layer, queries, scaling in zip(pool.layers, self.queries, self.scaling):
            pos = layer.pos[r]  # (H, S)
            keys = layer.held()[0][r]  # (H, S, D) in the model dtype
            scores = window_scores(queries[r], keys, pos, valid, qpos, scaling, method.pool_kernel)
            keep = kept(pool, scores, target)  # (H, target) slots
            pool.keep_slots(layer, r, keep.gather(-1, pos.gather(-1, keep).argsort(dim=-1)))  # position order
        valid[target:] = False
        pool.state.next_slot[r] = target
