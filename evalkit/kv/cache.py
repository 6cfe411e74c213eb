"""A transformers `Cache` that holds a compressed, per-KV-head selection of the prompt and decodes in place.

Layout per layer, KV head and batch row: `[sink | tail | top-K]` slots (see `methods.py`). Prefill runs full
attention over the prompt; right after it, `evalkit.kv.attention` hands this layer the post-RoPE queries, the
layer scores the middle of the prompt, gathers the kept entries into buffers allocated once, and drops the rest.
Decode writes one slot per step in place: ring methods (`streamingllm`, `snapstream`) overwrite the oldest tail
entry at `sink + (p - sink) mod tail` (no growth, no reallocation, no concatenation); append methods (`full`,
`snapkv`) write the next free column of a buffer that grows geometrically.

Short prompts follow the spec: `valid_topk = min(max(L - sink - recent, 0), K)` top-K slots hold the middle of
the prompt, the rest of the block is masked padding, and the ring stays `recent` slots. SnapStream's
`spare_slots="ring"` is evalkit's option where the spec is strict: a prompt no longer than the budget is kept
whole and the slots it leaves free extend the ring, so a budget of at least prompt + generated tokens
reproduces the full cache exactly. Keys keep the RoPE of their original positions; empty slots are masked.

`static=True` (what `compile: true` uses) makes a decode step capturable as one graph: the buffers' shapes never
change after prefill (append methods allocate prompt + `max_new_tokens` slots up front), the per-step state lives
in device tensors updated in place by the first layer of each forward (this step's slot per row, the next
position, the valid-slot mask), and attention reads every slot under that mask. No host sync, no Python branch
on data, no Python counter inside the step: `torch.compile(fullgraph=True)` captures it once per (batch, slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from evalkit.kv.attention import hand_off
from evalkit.kv.select import group_mean


@dataclass
class Rows:
    """Per batch row bookkeeping shared by all layers (same prompt, same layout, different contents)."""

    lengths: list[int]  # real prompt tokens per row (left pads excluded)
    pad: torch.Tensor  # (B,) left pad columns
    tail: torch.Tensor  # (B,) tail (ring) slots per row
    topk: torch.Tensor  # (B,) valid top-K slots per row
    n: int  # slots per row after prefill (the static size for ring methods)
    base_pos: torch.Tensor  # (B, n) positions of sink/tail slots, -1 = empty or top-K (filled per layer)
    candidates: torch.Tensor  # (B, T) bool: prompt columns eligible for the top-K block
    valid: torch.Tensor  # (B, capacity) bool: slot holds a token (identical in every layer and head)
    next_pos: torch.Tensor  # (B,) absolute position of the next token per row
    filled: list[int]  # ring methods: valid slots per row, always a prefix [0, filled) of the row's slots


def prompt_slots(method, width: int) -> int:
    """Slots a prompt `width` columns wide takes per row: a ring's budget, else the kept prompt (all of it, or
    the budget)."""
    budget = getattr(method, "budget", None)
    return budget if method.ring else (width if budget is None else min(width, budget))


def slots_needed(method, prompt_len: int, max_new: int) -> int:
    """Slots one request needs for its whole decode: a ring stays its budget, an append cache adds a slot per
    generated token."""
    return prompt_slots(method, prompt_len) + (0 if method.ring else max_new)


def plan_rows(method, valid_cols: torch.Tensor) -> Rows:
    """Block sizes and the sink/tail slot positions for a left-padded prompt batch, valid_cols (B, T)."""
    b, t = valid_cols.shape
    dev = valid_cols.device
    lengths = valid_cols.sum(1)  # (B,)
    pad = t - lengths
    if not torch.equal(valid_cols, torch.arange(t, device=dev)[None, :] >= pad[:, None]):
        raise ValueError("evalkit KV caches need left padding (tokenizer.padding_side = 'left')")
    sink, tail_long, topk = method.blocks()
    n = prompt_slots(method, t)
    sink = min(sink, n)
    # Whole prompt kept when it fits, except under the spec's fixed ring (`spare_slots="pad"`), whose short
    # prompts keep their middle in the top-K block and leave the unused slots as padding.
    whole = lengths <= n
    if method.ring and getattr(method, "spare_slots", "ring") == "pad":
        whole = torch.zeros_like(whole)
    tail = torch.where(whole, n - sink, tail_long)  # (B,)
    # --- sink and tail slot positions; tail slot of position p: sink + (p - sink) mod tail (the ring formula,
    # also used, harmlessly, to order the tail of append methods)
    j = torch.arange(n, device=dev)[None, :]  # (1, n)
    L = lengths[:, None]
    o = j - sink
    q = L - 1 - sink - o  # >= 0 iff some position p <= L - 1 maps to this tail slot
    p_tail = sink + o + tail[:, None] * torch.div(q, tail[:, None], rounding_mode="floor")
    in_tail = (o >= 0) & (o < tail[:, None]) & (q >= 0)
    base_pos = torch.where((j < sink) & (j < L), j, torch.where(in_tail, p_tail, -1))
    cols = torch.arange(t, device=dev)[None, :] - pad[:, None]  # (B, T) position of each column
    candidates = (cols >= sink) & (cols < L - tail[:, None])
    k_rows = candidates.sum(1).clamp(max=topk)  # valid_topk per row
    valid = (base_pos >= 0) | ((j >= sink + tail_long) & (j < sink + tail_long + k_rows[:, None]))
    return Rows(
        lengths=lengths.tolist(),
        pad=pad,
        tail=tail,
        topk=k_rows,
        n=n,
        base_pos=base_pos,
        candidates=candidates,
        valid=valid,
        next_pos=lengths.clone(),
        filled=valid.sum(1).tolist(),
    )


class KVLayer(CacheLayerMixin):
    """One model layer's compressed cache. Buffers: keys (B, H, cap, D_k), values (B, H, cap, D_v)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, cache: KVCache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # full prompt K/V awaiting compression
        self.pos: torch.Tensor | None = None  # (B, H, cap) int32 original position per slot, -1 = empty
        self.steps = 0  # decode steps written by this layer

    @property
    def is_compileable(self) -> bool:
        """transformers compiles the decode forward (`generate`'s own path) only for static caches."""
        return self.cache.static

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    # --- transformers Cache API -------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        hand_off(self)
        if not self.is_initialized:  # prefill: attend over everything, compress once attention hands us Q
            self.lazy_initialization(key_states, value_states)
            self.pending = (key_states, value_states)
            return key_states, value_states
        if self.pending is not None:
            raise RuntimeError(
                "evalkit cache: the prompt was never compressed because the model does not run evalkit's attention "
                f"(attn_implementation={self.cache.attn_name!r}). Call evalkit.kv.attach(model) once after loading."
            )
        return self.cache.write(self, key_states, value_states)

    def get_seq_length(self) -> int | torch.Tensor:
        return self.cache.seq_length()  # columns seen, pads included: transformers derives positions from it

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # After prefill evalkit's attention builds its own mask from the slots; this keeps transformers' mask
        # (which it then ignores) at q x q instead of growing with the sequence. A static cache reports no offset:
        # a Python int that changes every step would be a guard, hence a recompilation, per step.
        return query_length, 0 if self.cache.static else self.cache.seen

    def get_max_length(self) -> int:
        return self.cache.method.budget if self.cache.method.ring else -1

    # --- compression -------------------------------------------------------------------------------------
    def compress(self, query: torch.Tensor, attn_keys: torch.Tensor, attention_mask, scaling: float) -> None:
        """Keep the method's selection of the prompt. query (B, H_q, T, D) post-RoPE; attn_keys as attention saw them."""
        keys, values = self.pending
        self.pending = None
        if self.cache.record is not None:
            self.cache.record.add(self.layer_idx, keys, values, query, attn_keys, attention_mask, scaling)
        rows = self.cache.prefill_rows(attention_mask, keys.shape[0], keys.shape[2], keys.device)
        b, h = keys.shape[:2]
        pos = rows.base_pos[:, None, :].expand(b, h, rows.n).clone()  # (B, H, n)
        sink, tail_long, topk = self.cache.method.blocks()
        if self.cache.has_topk:
            # (B, H_attn, T); pads are masked out of the window's softmax
            scores = self.cache.method.score(query, attn_keys, rows.candidates, rows.pad, scaling)
            t = keys.shape[2]
            best = group_mean(scores, h).topk(min(topk, t), dim=-1)  # -inf past a row's valid_topk
            picked = torch.full((b, h, topk), t, dtype=best.indices.dtype, device=keys.device)  # (B, H, K)
            picked[..., : best.indices.shape[-1]] = torch.where(
                best.values > float("-inf"), best.indices - rows.pad[:, None, None], t
            )
            picked = picked.sort(dim=-1).values  # kept positions in order, then the padding (t)
            block = slice(sink + tail_long, sink + tail_long + topk)
            picked = torch.where(picked < t, picked, -1)
            selecting = (rows.topk > 0)[:, None, None]  # rows kept whole use these slots for their tail
            pos[:, :, block] = torch.where(selecting, picked, pos[:, :, block])
        src = (pos.clamp(min=0) + rows.pad[:, None, None]).unsqueeze(-1)  # (B, H, n, 1) prompt columns
        empty = (pos < 0).unsqueeze(-1)
        cap = rows.valid.shape[1]
        self.keys = keys.new_zeros(b, h, cap, keys.shape[-1])
        self.values = values.new_zeros(b, h, cap, values.shape[-1])
        self.keys[:, :, : rows.n] = keys.gather(2, src.expand(-1, -1, -1, keys.shape[-1])).masked_fill_(
            empty, 0
        )
        self.values[:, :, : rows.n] = values.gather(2, src.expand(-1, -1, -1, values.shape[-1])).masked_fill_(
            empty, 0
        )
        self.pos = pos.new_full((b, h, cap), -1, dtype=torch.int32)
        self.pos[:, :, : rows.n] = pos
        if self.cache.static:
            pin(self.keys, self.values, self.pos)

    def grow(self, capacity: int) -> None:
        """Append methods only: move to larger buffers (amortised: capacity grows by half each time)."""
        extra = capacity - self.keys.shape[2]
        self.keys = torch.cat(
            [self.keys, self.keys.new_zeros(*self.keys.shape[:2], extra, self.keys.shape[3])], 2
        )
        self.values = torch.cat(
            [self.values, self.values.new_zeros(*self.values.shape[:2], extra, self.values.shape[3])], 2
        )
        self.pos = torch.cat([self.pos, self.pos.new_full((*self.pos.shape[:2], extra), -1)], 2)

    def entry_bytes(self) -> int:
        """Bytes of one slot across batch rows and heads (K and V)."""
        b, h = self.keys.shape[:2]
        return (
            b
            * h
            * (
                self.keys.shape[-1] * self.keys.element_size()
                + self.values.shape[-1] * self.values.element_size()
            )
        )


def valid_columns(attention_mask, b: int, t: int, device) -> torch.Tensor:
    """(B, T) bool: prompt columns that are real tokens, read off the last query row of the prefill mask."""
    if attention_mask is None:  # transformers skips the mask when there is no padding (sdpa is_causal path)
        return torch.ones(b, t, dtype=torch.bool, device=device)
    last = attention_mask[:, 0, -1, -t:]  # (B, T)
    return last if last.dtype == torch.bool else last == 0


def check_static(method, static: bool, max_new_tokens):
    """A static append cache allocates its decode slots at prefill: it must know how many."""
    if not static or method.ring:
        return max_new_tokens
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(
            f"{method.name}: a static cache (compile) appends every new token into a slot allocated at prefill, so "
            f"it needs max_new_tokens (a positive integer), got {max_new_tokens!r}"
        )
    return max_new_tokens


def pin(*tensors: torch.Tensor) -> None:
    """Buffers that keep their address for the whole decode: CUDA graphs then update them in place instead of
    copying them at every replay (transformers' StaticCache does the same). No effect on eager runs."""
    if not torch.compiler.is_compiling():  # marking is refused while tracing; prefill is never compiled
        for t in tensors:
            torch._dynamo.mark_static_address(t)


class KVCache(Cache):
    """Compressed KV cache for any transformers decoder: `model.generate(ids, past_key_values=KVCache(...))`.

    The model must run evalkit's attention (`evalkit.kv.attach(model)`), which hands each layer the queries it
    needs for scoring. `stats()` reports, per layer, tokens seen, kept and evicted and the bytes held.
    """

    def __init__(
        self,
        method,
        num_layers: int,
        attn_name: str = "evalkit",
        record=None,
        replay=None,
        static: bool = False,
        max_new_tokens: int | None = None,
    ):
        self.method, self.attn_name = method, attn_name
        self.record, self.replay = record, replay  # evalkit.kv.prefill: share one prefill across budgets
        self.static, self.max_new_tokens = bool(static), check_static(method, static, max_new_tokens)
        self.rows: Rows | None = None
        self.seen = 0  # columns seen, pads included (static caches: frozen at the prompt width, see `_seen`)
        self.step = 0  # decode forwards
        self.used = 0  # slots in use per row (static `budget` for ring methods)
        self.visible = 0  # slots attention reads this step (a prefix of `used`)
        # (B, 1, q, visible) bool for this step, None = attend to all
        self.step_mask: torch.Tensor | None = None
        self.has_topk = False  # some row keeps a SnapKV selection (scoring runs at prefill)
        self._has_pad = False  # append methods: left-pad holes in the prompt block need a mask
        super().__init__(layers=[KVLayer(self, i) for i in range(num_layers)])

    @classmethod
    def for_model(
        cls, method, model, record=None, replay=None, static: bool = False, max_new_tokens: int | None = None
    ) -> KVCache:
        config = model.config.get_text_config()
        return cls(
            method,
            config.num_hidden_layers,
            model.config._attn_implementation,
            record,
            replay,
            static,
            max_new_tokens,
        )

    # --- prefill --------------------------------------------------------------------------------------------
    def prefill_rows(self, attention_mask, b: int, t: int, device) -> Rows:
        """Plan the layout once, at the first layer's prefill; every later layer shares it."""
        if self.rows is None:
            rows = plan_rows(self.method, valid_columns(attention_mask, b, t, device))
            if not self.method.ring:  # room to append (static: one slot per new token)
                extra = self.max_new_tokens if self.static else max(64, rows.n // 4)
                # dynamic caches only ever read up to `used`, so their spare columns are marked valid up front;
                # a static cache reads them all, so each becomes valid when its token is written
                rows.valid = torch.cat([rows.valid, rows.valid.new_full((b, extra), not self.static)], 1)
            self.rows, self.seen, self.used = rows, t, rows.n
            self.has_topk = bool(rows.topk.max() > 0)  # one sync per prefill
            self._tails, self._prompt_width = rows.tail.tolist(), t
            self._has_pad = not self.method.ring and not bool(rows.valid[:, : rows.n].all())
            if self.static:
                self._init_step_state(rows, t)
        return self.rows

    def _init_step_state(self, rows: Rows, t: int) -> None:
        """Static caches: the per-step state as device tensors that every decode step updates in place. Each
        row carries its own layout (sink, ring or append, next free column), so rows of different methods and
        budgets can share one static cache (`evalkit.engine`'s slot pool)."""
        b, dev = rows.valid.shape[0], rows.valid.device
        sink = min(self.method.blocks()[0], rows.n)
        self._sink = torch.full((b,), sink, dtype=torch.long, device=dev)  # (B,) sink slots per row
        self._ring = torch.full((b,), self.method.ring, dtype=torch.bool, device=dev)  # (B,) ring or append
        self._slots = torch.full((b,), rows.n, dtype=torch.long, device=dev)  # (B,) slots after prefill
        self._row = torch.arange(b, device=dev)  # (B,) row index, for the writes' advanced indexing
        self._slot = torch.zeros(b, dtype=torch.long, device=dev)  # (B,) slot this step writes, per row
        self._slot_pos = torch.zeros(b, dtype=torch.int32, device=dev)  # (B,) position of this step's token
        self._next_slot = torch.full(
            (b,), rows.n, dtype=torch.long, device=dev
        )  # (B,) append: next free column
        self._seen = torch.tensor(t, device=dev)  # () columns seen, pads included
        pin(
            rows.valid,
            rows.next_pos,
            rows.tail,
            self._sink,
            self._ring,
            self._slots,
            self._row,
            self._slot,
            self._slot_pos,
            self._next_slot,
            self._seen,
        )

    def seq_length(self) -> int | torch.Tensor:
        """Columns seen, pads included. A static cache answers with a device tensor (as transformers'
        StaticCache does): a Python int that grows each step would recompile a compiled step each step."""
        return self._seen if self.static and self.rows is not None else self.seen

    # --- decode ---------------------------------------------------------------------------------------------
    def write(self, layer: KVLayer, k: torch.Tensor, v: torch.Tensor):
        """Write this step's q new entries of one layer in place; returns the K/V attention should read."""
        if self.static:
            return self._write_static(layer, k, v)
        if layer.steps == self.step:  # the first layer to reach a new step advances the shared bookkeeping
            self._advance(k.shape[2])
        layer.steps += 1
        if layer.keys.shape[2] < self.rows.valid.shape[1]:
            layer.grow(self.rows.valid.shape[1])
        slot, p = self._slot, self._pos
        if isinstance(slot, int):  # every row writes the same columns: a plain in-place slice copy
            q = k.shape[2]
            layer.keys[:, :, slot : slot + q].copy_(k)
            layer.values[:, :, slot : slot + q].copy_(v)
            layer.pos[:, :, slot : slot + q] = p
        else:  # per-row ring slots (left-padded batch): one scatter per K, V and positions
            b, h = k.shape[:2]
            layer.keys.scatter_(2, slot.view(b, 1, 1, 1).expand(b, h, 1, k.shape[3]), k)
            layer.values.scatter_(2, slot.view(b, 1, 1, 1).expand(b, h, 1, v.shape[3]), v)
            layer.pos.scatter_(2, slot.view(b, 1, 1).expand(b, h, 1), p.expand(b, h, 1))
        return layer.keys[:, :, : self.visible], layer.values[:, :, : self.visible]

    def _advance(self, q: int) -> None:
        """Once per decode step: this step's slots and positions (host arithmetic, no device sync)."""
        rows, b, dev = self.rows, len(self.rows.lengths), self.rows.valid.device
        decoded = self.seen - self._prompt_width  # tokens written since prefill (same for every row)
        host = [length + decoded for length in rows.lengths]  # this token's position per row
        if self.method.ring:
            if q != 1:
                raise ValueError(
                    f"{self.method.name}: a ring cache decodes one token per forward after prefill (got {q}); "
                    "chunked prefill and multi-token continuation are not supported"
                )
            sink = min(self.method.blocks()[0], rows.n)
            slots = [p if p < sink else sink + (p - sink) % t for p, t in zip(host, self._tails)]
            for r, slot in enumerate(slots):  # valid slots stay a prefix: the first empty one is filled next
                rows.filled[r] += slot == rows.filled[r]
        else:
            if q != 1 and self.method.budget is not None:
                raise ValueError(
                    f"{self.method.name}: compressed at prefill, so it decodes one token per forward (got {q}); "
                    "chunked prefill and multi-token continuation are only supported by `full`"
                )
            if self.used + q > rows.valid.shape[1]:
                rows.valid = torch.cat(
                    [rows.valid, rows.valid.new_ones(b, max(q, rows.valid.shape[1] // 2))], 1
                )
            slots = [self.used] * b
            self.used += q
        if b == 1 and q == 1:
            self._slot, self._pos = slots[0], host[0]
        elif len(set(slots)) == 1:
            self._slot, self._pos = slots[0], self._positions(q)
        else:  # ring rows at different slots (only ring methods get here)
            p = rows.next_pos
            self._slot = torch.where(p < sink, p, sink + (p - sink) % rows.tail)  # (B,) on the device
            self._pos = self._positions(1)
        rows.next_pos += q
        self.seen += q
        self.step += 1
        self.step_mask = self._mask(q, dev)

    def _write_static(self, layer: KVLayer, k: torch.Tensor, v: torch.Tensor):
        """One token per row into this step's slot, written with tensor indices; returns the whole buffers."""
        if k.shape[2] != 1:  # a shape, so decided when the graph is traced
            raise ValueError(
                f"{self.method.name}: a static cache (compile) decodes one token per forward after prefill (got "
                f"{k.shape[2]}); chunked prefill and multi-token continuation need compile off"
            )
        if layer.layer_idx == 0:  # the step's first layer advances the state every layer shares
            self._advance_static()
        # index_put_ (not scatter_): inductor writes it in place into the buffers; a scatter it would apply to
        # a copy of each buffer and copy back, moving the whole cache twice per layer and step
        index = (self._row, slice(None), self._slot)  # (B,) rows x all heads x (B,) slots
        layer.keys[index] = k[:, :, 0]  # (B, H, D_k)
        layer.values[index] = v[:, :, 0]
        layer.pos[index] = self._slot_pos[:, None]  # (B, 1) -> (B, H)
        return layer.keys, layer.values

    def _advance_static(self) -> None:
        """This step's slot and position per row, the slot marked valid, counters moved on: all in place."""
        rows = self.rows
        p = rows.next_pos  # (B,) this token's position per row
        # ring rows: sink + (p - sink) mod tail, sinks below it (short prompts fill them first); append rows: the
        # row's next free column
        ring = torch.where(p < self._sink, p, self._sink + (p - self._sink) % rows.tail)
        slot = torch.where(self._ring, ring, self._next_slot)
        self._slot.copy_(slot)
        self._slot_pos.copy_(p)
        rows.valid[self._row, self._slot] = True
        rows.next_pos.add_(1)
        self._next_slot.add_(1)
        self._seen.add_(1)

    def decode_mask(self) -> torch.Tensor | None:
        """The mask attention applies this step: (B, 1, 1, slots) valid slots for a static cache (every slot is
        read), else the step mask `_advance` built (None = attend to all `visible` slots)."""
        return self.rows.valid[:, None, None, :] if self.static else self.step_mask

    def _positions(self, q: int) -> torch.Tensor:
        p = self.rows.next_pos[:, None] + torch.arange(q, device=self.rows.next_pos.device)
        return p.to(torch.int32).view(-1, 1, q)  # (B, 1, q)

    def _mask(self, q: int, dev) -> torch.Tensor | None:
        """This step's attention mask over the first `visible` slots; sets `visible`."""
        rows = self.rows
        self.visible = self.used
        if q > 1:  # multi-token continuation (`full`): new tokens are causal among themselves
            col = torch.arange(self.used, device=dev)
            causal = col[None, :] <= (self.used - q + torch.arange(q, device=dev))[:, None]  # (q, used)
            return rows.valid[:, None, None, : self.used] & causal[None, None]
        if not self.method.ring:
            return rows.valid[:, None, None, : self.used] if self._has_pad else None
        # Ring caches: every row's valid slots are a prefix [0, filled). Attend to the longest prefix; mask
        # only when rows differ (a left-padded batch of short prompts). Unmasked, the keys are the full
        # cache's, in the same order: the short-prompt equivalence is exact.
        self.visible = max(rows.filled)
        if min(rows.filled) == self.visible:
            return None
        filled = torch.tensor(rows.filled, device=dev)
        return (torch.arange(self.visible, device=dev)[None, :] < filled[:, None])[:, None, None, :]

    # --- a slot pool: rows filled one request at a time (continuous batching, evalkit.engine) ------------------
    @classmethod
    def pool(cls, like: KVCache, batch: int, capacity: int) -> KVCache:
        """An empty static cache of `batch` rows and `capacity` slots, shaped like the prefilled one-row cache
        `like` (layers, heads, head dims, dtype, device). Rows are filled by `load_row`; until then they are idle
        (one valid slot, ring of one: they decode harmlessly in place)."""
        pool = cls(like.method, len(like.layers), like.attn_name, static=True, max_new_tokens=1)
        dev = like.rows.valid.device
        rows = Rows(
            lengths=[0] * batch,
            pad=torch.zeros(batch, dtype=torch.long, device=dev),
            tail=torch.ones(batch, dtype=torch.long, device=dev),
            topk=torch.zeros(batch, dtype=torch.long, device=dev),
            n=capacity,
            base_pos=torch.full((batch, 1), -1, device=dev),
            candidates=torch.zeros(batch, 1, dtype=torch.bool, device=dev),
            valid=torch.zeros(batch, capacity, dtype=torch.bool, device=dev),
            next_pos=torch.zeros(batch, dtype=torch.long, device=dev),
            filled=[0] * batch,
        )
        pool.rows, pool.seen, pool.used, pool._prompt_width, pool._tails = rows, 0, capacity, 0, [1] * batch
        pool._init_step_state(rows, 0)
        for src, layer in zip(like.layers, pool.layers):
            layer.lazy_initialization(src.keys, src.values)
            h, dk, dv = src.keys.shape[1], src.keys.shape[3], src.values.shape[3]
            layer.keys = src.keys.new_zeros(batch, h, capacity, dk)
            layer.values = src.values.new_zeros(batch, h, capacity, dv)
            layer.pos = src.pos.new_full((batch, h, capacity), -1)
            pin(layer.keys, layer.values, layer.pos)
        for r in range(batch):
            pool.idle_row(r)
        return pool

    @property
    def capacity(self) -> int:
        return self.rows.valid.shape[1]

    def load_row(self, r: int, src: KVCache) -> None:
        """Row r becomes a copy of the one-row prefilled cache `src` (any method and budget that fits), in place:
        buffer addresses never change, so a compiled (CUDA-graph) step keeps running on the new row."""
        n, cap = src.rows.n, self.capacity
        need = n + (0 if src.method.ring else (src.max_new_tokens or 0))
        if need > cap:
            raise ValueError(f"a request needs {need} slots, the pool has {cap} (grow it first)")
        for mine, theirs in zip(self.layers, src.layers):
            # slots from n on keep the last occupant's (finite) K/V: masked until written, never read
            mine.pos[r, :, n:].fill_(-1)
            mine.keys[r, :, :n].copy_(theirs.keys[0, :, :n])
            mine.values[r, :, :n].copy_(theirs.values[0, :, :n])
            mine.pos[r, :, :n].copy_(theirs.pos[0, :, :n])
        rows = self.rows
        rows.valid[r].fill_(False)
        rows.valid[r, :n].copy_(src.rows.valid[0, :n])
        rows.next_pos[r] = src.rows.next_pos[0]
        rows.tail[r] = src.rows.tail[0]
        rows.lengths[r] = src.rows.lengths[0]
        self._sink[r] = min(src.method.blocks()[0], n)
        self._ring[r] = src.method.ring
        self._slots[r] = n
        self._next_slot[r] = n

    def idle_row(self, r: int) -> None:
        """Row r holds no request: a ring of one slot at 0 (valid, so its softmax stays finite), never read."""
        self.rows.valid[r].fill_(False)
        self.rows.valid[r, 0] = True
        self.rows.tail[r], self._sink[r], self._ring[r], self._slots[r] = 1, 0, True, 1
        self.rows.next_pos[r] = 0  # its positions never reach another row's rotary scaling (dynamic RoPE)

    def grow_pool(self, capacity: int) -> None:
        """More slots per row (a longer request arrived): new buffers, contents kept. A compiled step sees a new
        shape and compiles once more."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        for layer in self.layers:
            layer.grow(capacity)
            pin(layer.keys, layer.values, layer.pos)
        self.rows.valid = torch.cat(
            [self.rows.valid, self.rows.valid.new_zeros(self.rows.valid.shape[0], extra)], 1
        )
        self.used = capacity
        pin(self.rows.valid)

    def row_report(self, r: int) -> dict:
        """Row r's KV figures, as `row_stats` reports a one-row cache: seen, kept, evicted (of them generated),
        slots held (a ring's whole budget, an append row's written slots) and their bytes."""
        kept = int(self.rows.valid[r].sum())
        seen, length = int(self.rows.next_pos[r]), self.rows.lengths[r]
        kept_generated = int(((self.layers[0].pos[r, 0] >= length) & self.rows.valid[r]).sum())
        slots = int(self._slots[r]) if bool(self._ring[r]) else kept
        per_slot = sum(lay.entry_bytes() for lay in self.layers) // self.rows.valid.shape[0]
        return {
            "seen": seen,
            "kept": kept,
            "evicted": seen - kept,
            "evicted_generated": seen - length - kept_generated,
            "slots": slots,
            "bytes": per_slot * slots,
        }

    # --- reporting ------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Tokens seen, kept and evicted and bytes held: totals over batch rows, per layer and per row.

        `slots` is the slot count per row, layer and KV head (= budget for ring methods); bytes count those
        slots (for a static cache, its whole allocation); `reserved_bytes` adds an append cache's spare room.
        In a batch, a row that finished early keeps receiving pad tokens until the longest row ends.
        """
        rows = self.row_stats()
        total = {
            k: sum(r[k] for r in rows) for k in ("seen", "kept", "evicted", "evicted_generated", "bytes")
        }
        used = self._in_use()
        per_layer = [
            {
                **{k: total[k] for k in ("seen", "kept", "evicted")},
                "layer": i,
                "bytes": lay.entry_bytes() * used,
            }
            for i, lay in enumerate(self.layers)
            if lay.keys is not None
        ]
        reserved = sum(lay.entry_bytes() * lay.keys.shape[2] for lay in self.layers if lay.keys is not None)
        return {**total, "slots": used, "reserved_bytes": reserved, "per_layer": per_layer, "rows": rows}

    def _in_use(self) -> int:
        """Slots in use per row: `budget` for ring methods; for an append cache, the prompt's and those written
        since (a static one counts them on the device: one sync, at report time)."""
        if self.static and not self.method.ring and self.rows is not None:
            return self.rows.n + int(self._seen) - self._prompt_width
        return self.used

    def row_stats(self) -> list[dict]:
        """Per batch row; `slots` is the row's own footprint (a static ring is `budget` whatever it holds)."""
        if self.rows is None or self.layers[0].keys is None:
            return []
        rows, used = self.rows, self._in_use()
        if self.method.ring and not self.static:
            kept = list(rows.filled)
        else:  # a static cache marks each slot valid as it writes it
            kept = rows.valid[:, :used].sum(1).tolist()
        lengths = torch.tensor(rows.lengths, dtype=torch.int32, device=rows.valid.device)
        kept_generated = (self.layers[0].pos[:, 0, :used] >= lengths[:, None]).sum(1).tolist()
        per_slot = sum(lay.entry_bytes() for lay in self.layers) // len(kept)  # one row, all layers, K and V
        out = []
        for r, (seen, length) in enumerate(zip(rows.next_pos.tolist(), rows.lengths)):
            slots = used if self.method.ring else kept[r]
            out.append(
                {
                    "seen": seen,
                    "kept": kept[r],
                    "evicted": seen - kept[r],
                    "evicted_generated": seen - length - kept_generated[r],
                    "slots": slots,
                    "bytes": per_slot * slots,
                }
            )
        return out

    def positions(self, layer_idx: int) -> torch.Tensor:
        """(B, H, slots) original position held by each slot of a layer, -1 = empty."""
        return self.layers[layer_idx].pos[:, :, : self._in_use()]

    # --- unsupported generate paths fail loudly ---------------------------------------------------------------
    def reorder_cache(self, beam_idx):
        raise NotImplementedError("evalkit KV caches do not support beam search")

    def batch_repeat_interleave(self, repeats: int):
        if self.rows is not None:
            raise NotImplementedError("evalkit KV caches cannot be expanded after prefill")

    def batch_select_indices(self, indices):
        raise NotImplementedError("evalkit KV caches do not support batch selection")

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("evalkit KV caches cannot be cropped (assisted decoding is not supported)")
