"""A transformers `Cache` that holds a compressed, per-KV-head selection of the prompt and decodes in place.

Layout per layer, KV head and batch row: `[sink | tail | top-K]` slots (`evalkit.kv.layout`, the block sizes
in `methods.py`). Prefill runs full attention over the prompt; right after it, `evalkit.kv.attention` hands
this layer the post-RoPE queries, the layer scores the middle of the prompt, gathers the kept entries into
buffers allocated once, and drops the rest. Decode writes one slot per step in place: ring methods
(`streamingllm`, `snapstream`) overwrite the oldest tail entry at `layout.ring_slot` (no growth, no
reallocation, no concatenation); append methods (`full`, `snapkv`) write the next free column of a buffer that
grows geometrically.

Short prompts follow the spec: `valid_topk = min(max(L - sink - recent, 0), K)` top-K slots hold the middle of
the prompt, the rest of the block is masked padding, and the ring stays `recent` slots. SnapStream's
`spare_slots="ring"` is evalkit's option where the spec is strict: a prompt no longer than the budget is kept
whole and the slots it leaves free extend the ring, so a budget of at least prompt + generated tokens
reproduces the full cache exactly. Keys keep the RoPE of their original positions; empty slots are masked.

This is the dynamic cache (host bookkeeping, growing buffers; a batch decodes only rows of one prompt length,
a left-padded batch goes through `evalkit.kv.generate`, i.e. the engine), as transformers splits DynamicCache
and StaticCache: `static.StaticKVCache` (`compile: true`) fixes shapes and per-step state, `pool.SlotPool` is
the engine's static cache whose rows are filled one request at a time. Each cache holds its method's evictor
(`evalkit.kv.evict`): it keeps what the prefill hands a decode-time method (h2o's sums), and such a method
decodes in that pool only.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from evalkit.kv.attention import hand_off
from evalkit.kv.figures import summed
from evalkit.kv.layout import Rows, Shape, plan_rows, ring_slot, valid_columns
from evalkit.kv.scorers import PrefillView, rope_of
from evalkit.kv.select import Agree, group_mean, own
from evalkit.kv.storage.base import KVStorage, NoStorage

NONE = NoStorage()  # the model dtype: every cache's storage unless a run chooses one (frozen: no state)


class KVLayer(CacheLayerMixin):
    """One model layer's compressed cache. Buffers: keys (B, H, cap, D_k), values (B, H, cap, D_v), as the
    cache's storage holds them (the model dtype, or codes: `evalkit.kv.storage`); `scales`: its per-row
    tensors beside them (none for `kv=none`)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, cache: KVCache, layer_idx: int):
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # full prompt K/V awaiting compression
        self.pos: torch.Tensor | None = None  # (B, H, cap) int32 original position per slot, -1 = empty
        self.steps = 0  # decode steps written by this layer
        self.scales: tuple[torch.Tensor, ...] = ()  # the storage's per-row state, (B, ...) each

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
                "evalkit cache: the prompt was never compressed because the model does not run evalkit's "
                f"attention (attn_implementation={self.cache.attn_name!r}). Call evalkit.kv.attach(model) "
                "once after loading."
            )
        return self.cache.write(self, key_states, value_states)

    def get_seq_length(self) -> int | torch.Tensor:
        return self.cache.seq_length()  # columns seen, pads included: transformers derives positions from it

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # After prefill evalkit's attention builds its own mask from the slots; this keeps transformers' mask
        # (which it then ignores) at q x q instead of growing with the sequence. A static cache reports no
        # offset: a Python int that changes every step would be a guard, hence a recompilation, per step.
        return query_length, 0 if self.cache.static else self.cache.seen

    def get_max_length(self) -> int:
        return self.cache.method.budget if self.cache.method.ring else -1

    # --- compression -------------------------------------------------------------------------------------
    def compress(
        self, query: torch.Tensor, attn_keys: torch.Tensor, attention_mask, scaling: float, hint=None
    ) -> None:
        """Keep the method's selection of the prompt. query (B, H_q, T, D) post-RoPE; attn_keys as attention
        saw them; hint (B, H, T): scores a pass before this prefill computed (`PrefillRecord.hints`)."""
        keys, values = self.pending
        self.pending = None
        if self.cache.record is not None:
            self.cache.record.add(self.layer_idx, keys, values, query, attn_keys, attention_mask, scaling)
        b, h = keys.shape[:2]
        rows = self.cache.prefill_rows(attention_mask, b, keys.shape[2], keys.device, h)
        pos = rows.base_pos[:, None, :].expand(b, h, rows.n).clone()  # (B, H, n) position per slot
        method, evictor = self.cache.method, self.cache.evictor
        scores, record = None, self.cache.record
        # a budget list's record: a prompt this budget keeps whole is still scored for the budgets after it
        records = record is not None and record.usable and method.records_score
        if self.cache.has_topk or evictor.prompt_scores or records:  # (B, H_attn, T); pads masked out
            view = PrefillView(
                query,
                attn_keys,
                values,
                rows.candidates,
                rows.pad,
                scaling,
                self.layer_idx,
                self.cache.rope,
                hint,
                self.cache.agree,
            )
            raw = method.score(view)  # (B, H_attn, T)
            if records:  # replayed as the hint
                record.keep_scores(method, {self.layer_idx: raw})
            scores = group_mean(raw, h)
        if self.cache.has_topk:
            ranked = scores.masked_fill(~rows.candidates[:, None], float("-inf"))  # an evictor keeps from all
            method.place(pos, ranked, rows, self.layer_idx, self.cache.shape, self.cache.agree)
        src = (pos.clamp(min=0) + rows.pad[:, None, None]).unsqueeze(-1)  # (B, H, n, 1) prompt columns
        empty = (pos < 0).unsqueeze(-1)
        cap = rows.valid.shape[1]
        self.keys, self.values = (_gathered(x, src, empty, cap) for x in (keys, values))
        self.pos = pos.new_full((b, h, cap), -1, dtype=torch.int32)
        self.pos[:, :, : rows.n] = pos

        def to_slots(x: torch.Tensor) -> torch.Tensor:  # (B, H, T) per prompt column -> (B, H, cap) per slot
            return _gathered(x.unsqueeze(-1), src, empty, cap).squeeze(-1)

        # MLA: attention reads per-head keys rebuilt from the cache's latent (`attn_keys is not keys`)
        evictor.prefilled(self, query, scaling, attn_keys is not keys, scores, to_slots)
        real = torch.arange(keys.shape[2], device=keys.device)[None] >= rows.pad[:, None]  # (B, T) no pads
        self.cache.storage.seal(self, keys, values, real)  # the kept slots as the storage holds them
        self.cache.allocated(self)

    def grow(self, capacity: int) -> None:
        """Append methods only: move to larger buffers (amortised: capacity grows by half each time)."""
        extra = capacity - self.keys.shape[2]
        self.keys, self.values = (
            torch.cat([x, x.new_zeros(*x.shape[:2], extra, x.shape[3])], 2) for x in (self.keys, self.values)
        )
        self.pos = torch.cat([self.pos, self.pos.new_full((*self.pos.shape[:2], extra), -1)], 2)

    def entry_bytes(self) -> int:
        """Bytes of one slot across batch rows and heads (K and V)."""
        b, h = self.keys.shape[:2]
        width = (
            self.keys.shape[-1] * self.keys.element_size()
            + self.values.shape[-1] * self.values.element_size()
        )
        return b * h * width

    def row_scale_bytes(self, r: int = 0) -> int:
        """Bytes of the storage's per-row tensors (scales, a raw window) batch row r holds (0 for
        `kv=none`)."""
        return self.cache.storage.row_bytes(self, r)

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's K/V in the model dtype (B, H, cap, D): what attention reads, dequantized."""
        return self.cache.storage.load(self, self.keys, self.values)


def _gathered(x: torch.Tensor, src: torch.Tensor, empty: torch.Tensor, cap: int) -> torch.Tensor:
    """A (B, H, cap, D) buffer whose first n slots hold x's prompt columns src (B, H, n, 1), zeros
    elsewhere."""
    b, h, n = src.shape[:3]
    out = x.new_zeros(b, h, cap, x.shape[-1])
    out[:, :, :n] = x.gather(2, src.expand(-1, -1, -1, x.shape[-1])).masked_fill_(empty, 0)
    return out


class KVCache(Cache):
    """Compressed KV cache for any transformers decoder: `model.generate(ids, past_key_values=KVCache(...))`.

    The model must run evalkit's attention (`evalkit.kv.attach(model)`), which hands each layer the queries it
    needs for scoring. `stats()` reports, per layer, tokens seen, kept and evicted and the bytes held.
    """

    static = False  # what attention and transformers' compile check read: the dynamic cache is never compiled
    pooled = False  # the engine's slot pool (`pool.SlotPool`), the one cache a decode-time evictor decodes in
    observing = False  # attention hands each decode step's query to the evictor's `observe` (static caches)

    def __init__(
        self,
        method,
        num_layers: int,
        attn_name="evalkit",
        record=None,
        replay=None,
        max_new_tokens=None,
        agree: Agree = own,
        storage: KVStorage = NONE,
    ):
        self.method, self.attn_name = method, attn_name
        self.storage = storage  # how each slot is held (`evalkit.kv.storage`, conf/kv/): chosen once per run
        self.agree = agree  # kept indices -> the ones every TP rank keeps (`select.agree_for`)
        self.record, self.replay = record, replay  # evalkit.kv.prefill: share one prefill across budgets
        self.max_new_tokens = self._check_max_new(max_new_tokens)
        self.rows: Rows | None = None
        self.seen = 0  # columns seen, pads included (static caches: frozen at the prompt width, see `_seen`)
        self.step = 0  # decode forwards
        self.used = 0  # slots in use per row (static `budget` for ring methods)
        self.visible = 0  # slots attention reads this step (a prefix of `used`)
        # (B, 1, q, visible) bool for this step, None = attend to all
        self.step_mask: torch.Tensor | None = None
        self.has_topk = False  # some row keeps a SnapKV selection (scoring runs at prefill)
        self.evictor = method.evictor()  # the method's decode-time behaviour (`evalkit.kv.evict`)
        self.rope = None  # positions -> (cos, sin): the model's rotary embedding, for scorers that undo RoPE
        self.slot_mask = method.slot_mask  # which slots each KV head reads (one per row, or per head)
        self.shape: Shape | None = None  # KV heads and layers, known at the first layer's prefill
        super().__init__(layers=[KVLayer(self, i) for i in range(num_layers)])

    @classmethod
    def for_model(
        cls,
        method,
        model,
        record=None,
        replay=None,
        max_new_tokens: int | None = None,
        agree: Agree = own,
        storage: KVStorage = NONE,
    ):
        config = model.config.get_text_config()
        layers, attn = config.num_hidden_layers, model.config._attn_implementation
        cache = cls(method, layers, attn, record, replay, max_new_tokens, agree, storage)
        cache.rope = rope_of(model)
        return cache

    def _check_max_new(self, max_new_tokens):
        return max_new_tokens  # the dynamic cache grows as it goes: any budget, or none

    # --- prefill --------------------------------------------------------------------------------------------
    def prefill_rows(self, attention_mask, b: int, t: int, device, heads: int) -> Rows:
        """Plan the layout once, at the first layer's prefill (KV heads `heads`); every later layer shares
        it."""
        if self.rows is None:
            self.shape = Shape(self.agree.heads(heads), len(self.layers))  # the layer's, every TP rank's
            rows = plan_rows(self.method, valid_columns(attention_mask, b, t, device), self.shape)
            extra = self._decode_room(rows.n, t)
            if extra:  # the slots an append method writes during decode (see `_decode_room`)
                rows.valid = torch.cat([rows.valid, rows.valid.new_full((b, extra), not self.static)], 1)
            self.rows, self.seen, self.used = rows, t, rows.n
            self.has_topk = bool(rows.topk.max() > 0)  # one sync per prefill
            self._prompt_width = t
            self._prefilled(rows, t)
        return self.rows

    def _decode_room(self, n: int, t: int) -> int:
        """Append methods start with room to grow; the dynamic cache reads only up to `used`, so these columns
        are marked valid up front."""
        return 0 if self.method.ring else max(64, n // 4)

    def _prefilled(self, rows: Rows, t: int) -> None:
        """After the plan: the dynamic cache keeps its per-step state on the host (rows share one layout)."""
        self._tail, self.filled = int(rows.tail[0]), rows.filled[0]

    def allocated(self, layer: KVLayer) -> None:
        """A layer's buffers were just allocated at prefill (the static cache pins them)."""

    def seq_length(self) -> int | torch.Tensor:
        """Columns seen, pads included."""
        return self.seen

    # --- decode ---------------------------------------------------------------------------------------------
    def write(self, layer: KVLayer, k: torch.Tensor, v: torch.Tensor):
        """Write this step's q new entries of one layer in place (every row at the same columns); returns the
        K/V attention should read."""
        if layer.steps == self.step:  # the first layer to reach a new step advances the shared bookkeeping
            self._advance(k.shape[2])
        layer.steps += 1
        if layer.keys.shape[2] < self.rows.valid.shape[1]:
            layer.grow(self.rows.valid.shape[1])
        slot, q = self._slot, k.shape[2]
        k, v = self.storage.store(layer, k, v)
        layer.keys[:, :, slot : slot + q].copy_(k)
        layer.values[:, :, slot : slot + q].copy_(v)
        layer.pos[:, :, slot : slot + q] = self._pos
        return self.storage.load(layer, layer.keys[:, :, : self.visible], layer.values[:, :, : self.visible])

    def _advance(self, q: int) -> None:
        """Once per decode step: this step's slot and positions (host arithmetic, no device sync)."""
        rows = self.rows
        if self.step == 0:
            self._check_rows()
            self.evictor.check_cache(self)  # a decode-time evictor decodes in the engine's slot pool only
        position = rows.lengths[0] + self.seen - self._prompt_width  # this token's position (every row)
        if self.method.ring:
            self._check_one(q, "a ring cache decodes one token per forward after prefill", "not supported")
            self._slot = ring_slot(position, min(self.method.blocks()[0], rows.n), self._tail)
            self.filled += self._slot == self.filled  # valid slots stay a prefix: the first empty one is next
            # attention reads the valid prefix unmasked: the keys are the full cache's, in the same order, so
            # the short-prompt equivalence is exact
            self.visible = self.filled
        else:
            if self.method.budget is not None:
                why = "compressed at prefill, so it decodes one token per forward"
                self._check_one(q, why, "only supported by `full`")
            if self.used + q > rows.valid.shape[1]:
                grown = rows.valid.new_ones(rows.valid.shape[0], max(q, rows.valid.shape[1] // 2))
                rows.valid = torch.cat([rows.valid, grown], 1)
            self._slot, self.used = self.used, self.used + q
            self.visible = self.used
        if q == 1:
            self._pos = position
        else:  # (q,) positions of a multi-token continuation
            self._pos = torch.arange(position, position + q, dtype=torch.int32, device=rows.valid.device)
        rows.next_pos += q
        self.seen += q
        self.step += 1
        self.step_mask = self._causal(q, rows.valid.device) if q > 1 else None

    def _check_rows(self) -> None:
        """The dynamic cache decodes rows of one layout: a left-padded batch decodes through the engine."""
        lengths = self.rows.lengths
        if any(n != self._prompt_width for n in lengths):
            raise ValueError(
                f"evalkit KVCache: decoding rows of different prompt lengths {lengths} (a left-padded batch) "
                "is not supported by the dynamic cache; use evalkit.kv.generate or evalkit.engine.Engine, "
                "which decode each row in its own slot of one static pool"
            )

    def _check_one(self, q: int, why: str, support: str) -> None:
        if q != 1:
            raise ValueError(
                f"{self.method.name}: {why} (got {q}); chunked prefill and multi-token continuation are "
                f"{support}"
            )

    def decode_mask(self, layer: KVLayer) -> torch.Tensor | None:
        """The mask attention applies to `layer` this step: the rows' (`row_mask`), narrowed per KV head
        where the method's heads keep different slots (`slot_mask`)."""
        return self.slot_mask.mask(layer, self.row_mask(), self.visible)

    def row_mask(self) -> torch.Tensor | None:
        """The rows' slot mask this step, built by `_advance` (None = attend to all `visible` slots)."""
        return self.step_mask

    def _causal(self, q: int, dev) -> torch.Tensor:
        """(1, 1, q, used): multi-token continuation (`full`): the q new tokens are causal among
        themselves."""
        col = torch.arange(self.used, device=dev)
        return (col[None, :] <= (self.used - q + torch.arange(q, device=dev))[:, None])[None, None]

    # --- reporting ------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Tokens seen, kept and evicted and bytes held: totals over batch rows, per layer and per row.

        `slots` is the slot count per row, layer and KV head (= budget for ring methods); bytes count those
        slots (for a static cache, its whole allocation); `reserved_bytes` adds an append cache's spare room;
        `ragged_bytes` counts only the entries each head of each layer holds (what a ragged layout would hold:
        less than `bytes` where heads or layers keep different counts, or a ring is not full).
        In a batch, a row that finished early keeps receiving pad tokens until the longest row ends.
        """
        rows = self.row_stats()
        total, per_layer = summed(rows)
        used = self._in_use()
        reserved = sum(
            lay.entry_bytes() * lay.keys.shape[2] + sum(lay.row_scale_bytes(r) for r in range(len(rows)))
            for lay in self.layers
            if lay.keys is not None
        )
        return {**total, "slots": used, "reserved_bytes": reserved, "per_layer": per_layer, "rows": rows}

    def _in_use(self) -> int:
        """Slots in use per row: `budget` for ring methods, the prompt's and those written since for
        append."""
        return self.used

    def _kept(self) -> list[int]:
        """Valid slots per row (a dynamic ring counts them on the host)."""
        if self.method.ring:
            return [self.filled] * len(self.rows.lengths)
        return self.rows.valid[:, : self._in_use()].sum(1).tolist()

    def _row_slots(self, kept: list[int]) -> list[int]:
        """Each row's own footprint: a ring holds its whole budget whatever it holds, an append row its
        kept."""
        return [self._in_use()] * len(kept) if self.method.ring else kept

    def row_stats(self) -> list[dict]:
        """Per batch row: seen, kept, evicted (of them generated), slots held and their bytes."""
        if self.rows is None or self.layers[0].keys is None:
            return []
        rows, used = self.rows, self._in_use()
        valid = self._kept()  # slots holding an entry of some head
        slots = self._row_slots(valid)
        kept = self.slot_mask.kept(self, valid, used)  # entries per layer and head (adaptive: their mean)
        lengths = torch.tensor(rows.lengths, dtype=torch.int32, device=rows.valid.device)
        kept_generated = (self.layers[0].pos[:, 0, :used] >= lengths[:, None]).sum(1).tolist()
        # (B, L): the storage's per-row tensors of each layer (codes' scales, a raw window), and with them a
        # row's bytes of each layer: its slots, K and V
        scales = [[lay.row_scale_bytes(r) for lay in self.layers] for r in range(len(valid))]
        layer_bytes = [
            [lay.entry_bytes() // len(valid) * slots[r] + s for lay, s in zip(self.layers, scales[r])]
            for r in range(len(valid))
        ]
        ragged = sum(  # (B,) bytes of the entries held, head by head: one sync, at report time
            (lay.pos[:, :, :used] >= 0).sum((1, 2)) * (lay.entry_bytes() // lay.pos[:, :, 0].numel())
            for lay in self.layers
        ).tolist()
        return [
            {
                "seen": seen,
                "kept": kept[r],
                "evicted": seen - kept[r],
                "evicted_generated": seen - length - kept_generated[r],
                "slots": slots[r],
                "bytes": sum(layer_bytes[r]),
                "ragged_bytes": ragged[r] + sum(scales[r]),
                "layer_bytes": layer_bytes[r],
            }
            for r, (seen, length) in enumerate(zip(rows.next_pos.tolist(), rows.lengths))
        ]

    def positions(self, layer_idx: int) -> torch.Tensor:
        """(B, H, slots) original position held by each slot of a layer, -1 = empty."""
        return self.layers[layer_idx].pos[:, :, : self._in_use()]

    # --- unsupported generate paths fail loudly -------------------------------------------------------------
    def reorder_cache(self, beam_idx):
        raise NotImplementedError("evalkit KV caches do not support beam search")

    def batch_repeat_interleave(self, repeats: int):
        if self.rows is not None:
            raise NotImplementedError("evalkit KV caches cannot be expanded after prefill")

    def batch_select_indices(self, indices):
        raise NotImplementedError("evalkit KV caches do not support batch selection")

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("evalkit KV caches cannot be cropped (assisted decoding is not supported)")
