"""The engine's slot pool: a static cache whose rows are filled one request at a time (continuous batching).

Each request is prefilled alone into its own one-row cache, then copied into a free row of the pool; every row
keeps its own method, budget, ring and positions (`StaticKVCache`'s per-row state), so rows of different
budgets decode side by side, and buffer addresses never change, so a compiled (CUDA-graph) step keeps running
as rows are refilled. Used by `evalkit.engine`.
"""

from __future__ import annotations

import torch

from evalkit.kv.cache import KVCache
from evalkit.kv.evict import add_attention, evicted_slot, refit_row
from evalkit.kv.layout import Rows, slots_needed
from evalkit.kv.static import StaticKVCache, pin


class SlotPool(StaticKVCache):
    """`batch` rows of `capacity` slots. Rows are filled by `load_row`; until then they are idle (one valid
    slot, ring of one: they decode harmlessly in place)."""

    evicting: str | None = None  # the rows' decode-time eviction kind (`KVMethod.evict`): one per pool
    pooled = True

    @classmethod
    def shaped_like(cls, like: KVCache, batch: int, capacity: int) -> SlotPool:
        """An empty pool shaped like the prefilled one-row cache `like` (layers, heads, head dims, dtype,
        device)."""
        pool = cls(like.method, len(like.layers), like.attn_name, max_new_tokens=1, agree=like.agree)
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
        pool.rows, pool.seen, pool.used, pool._prompt_width = rows, 0, capacity, 0
        pool._prefilled(rows, 0)
        for src, layer in zip(like.layers, pool.layers):
            layer.lazy_initialization(src.keys, src.values)
            h, dk, dv = src.keys.shape[1], src.keys.shape[3], src.values.shape[3]
            layer.keys = src.keys.new_zeros(batch, h, capacity, dk)
            layer.values = src.values.new_zeros(batch, h, capacity, dv)
            layer.pos = src.pos.new_full((batch, h, capacity), -1)
            pool.allocated(layer)
        pool.evicting = like.method.evict
        if pool.evicting is not None:
            pool._eviction_state(like, batch, capacity)
        for r in range(batch):
            pool.idle_row(r)
        return pool

    # --- decode-time eviction (`evalkit.kv.evict`) ----------------------------------------------------------
    def _eviction_state(self, like: KVCache, batch: int, capacity: int) -> None:
        """Per-row state of `h2o` / `snapkv_decode` rows: device tensors the step updates in place, host
        counters for the re-selection."""
        if self.evicting == "refit" and any(layer.expanded for layer in like.layers):
            raise ValueError(
                f"{like.method.name} re-scores the cached keys, but this model's attention reads keys "
                "rebuilt from a cached latent (MLA, e.g. DeepSeek-V3): use h2o, snapkv or snapstream"
            )
        dev = self.rows.valid.device
        self.observing, self.score_updates = True, True  # score_updates=False: the bench's baseline
        self._head = torch.arange(self.layers[0].keys.shape[1], device=dev)  # (H,)
        self._full = torch.zeros(batch, dtype=torch.bool, device=dev)  # (B,) row holds its budget
        self._recent = torch.zeros(batch, dtype=torch.long, device=dev)  # (B,) h2o: protected last tokens
        window = getattr(like.method, "window", 1) if self.evicting == "refit" else 1
        self._qpos = torch.zeros(batch, window, dtype=torch.long, device=dev)  # (B, w) stored queries' pos
        self._methods, self._since, self._count = [None] * batch, [0] * batch, [0] * batch
        for src, layer in zip(like.layers, self.layers):
            layer.scaling = src.scaling
            if self.evicting == "h2o":
                layer.acc = torch.zeros(batch, *layer.keys.shape[1:3], device=dev)  # (B, H, cap) float32
                pin(layer.acc)
            else:
                h_q, d = src.query_shape
                layer.queries = layer.keys.new_zeros(batch, h_q, window, d)  # (B, H_q, w, D)
                pin(layer.queries)
        pin(self._head, self._full, self._recent, self._qpos)

    def _write_index(self, layer) -> tuple:
        """Eviction rows write per KV head: their next free slot, or (h2o, a full row) the evicted one."""
        if self.evicting is None:
            return super()._write_index(layer)
        slot = self._slot[:, None].expand(-1, self._head.shape[0])  # (B, H)
        if self.evicting == "h2o":
            slot = torch.where(self._full[:, None], evicted_slot(layer, self), slot)
            layer.acc[self._row[:, None], self._head[None, :], slot] = 0.0  # the new entry's own sum
        return self._row[:, None], self._head[None, :], slot

    def _advance_state(self) -> None:
        """Eviction rows: append at the next free slot until full (then `_write_index` picks per head)."""
        if self.evicting is None:
            return super()._advance_state()
        rows = self.rows
        p = rows.next_pos  # (B,) this token's position per row
        full = self._next_slot >= self._slots  # (B,)
        self._full.copy_(full)
        slot = torch.where(full, 0, self._next_slot)  # a full row's slot 0 is valid already
        self._slot.copy_(slot)
        self._slot_pos.copy_(p)
        rows.valid[self._row, slot] = True
        self._qpos[self._row, p % self._qpos.shape[1]] = p
        rows.next_pos.add_(1)
        self._next_slot.add_((~full).long())
        self._seen.add_(1)

    def observe(self, layer, query, key, mask, scaling) -> None:
        """Called by attention after each decode step's attention of a layer."""
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if not self.score_updates:  # the bench's baseline: the step without its scoring
            return
        if self.evicting == "refit":  # this query joins the row's window of the last w
            layer.queries[self._row, :, self._slot_pos % layer.queries.shape[2]] = query[:, :, 0]
        else:
            add_attention(layer, query, key, mask, scaling)

    def decoded(self, active: list[int]) -> None:
        """After a decode step (host only, no sync): `snapkv_decode` rows re-select every `interval` steps,
        as kvpress's DecodingPress (a cache no larger than its target is left alone)."""
        if self.evicting != "refit" or not self.score_updates:
            return
        for r in active:
            method = self._methods[r]
            self._since[r] += 1
            self._count[r] += 1
            if self._since[r] == method.interval:
                self._since[r] = 0
                if self._count[r] > method.target:
                    refit_row(self, r)
                    self._count[r] = method.target

    def _load_eviction(self, r: int, src: KVCache) -> None:
        if src.method.evict != self.evicting or (
            self.evicting == "refit" and src.method.window != self._qpos.shape[1]
        ):
            raise ValueError(
                f"a slot pool decodes rows of one eviction kind (and window): it holds {self.method.name} "
                f"rows, got {src.method.name} ({src.method})"
            )
        n = src.rows.n
        self._methods[r], self._since[r], self._count[r] = src.method, 0, src.rows.filled[0]
        self._next_slot[r] = src.rows.filled[0]  # valid slots are a prefix: the next free one
        self._recent[r] = getattr(src.method, "recent", 0)
        if self.evicting == "h2o":
            for mine, theirs in zip(self.layers, src.layers):
                mine.acc[r].zero_()
                mine.acc[r, :, :n].copy_(theirs.acc[0, :, :n])

    @property
    def capacity(self) -> int:
        return self.rows.valid.shape[1]

    def load_row(self, r: int, src: KVCache) -> None:
        """Row r becomes a copy of the one-row prefilled cache `src` (any method and budget that fits), in
        place: buffer addresses never change, so a compiled (CUDA-graph) step keeps running on the new row."""
        n, cap = src.rows.n, self.capacity
        need = slots_needed(src.method, src._prompt_width, src.max_new_tokens or 0)
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
        if self.evicting is not None:
            self._load_eviction(r, src)

    def idle_row(self, r: int) -> None:
        """Row r holds no request: a ring of one slot at 0 (valid, so its softmax stays finite), never
        read."""
        self.rows.valid[r].fill_(False)
        self.rows.valid[r, 0] = True
        self.rows.tail[r], self._sink[r], self._ring[r], self._slots[r] = 1, 0, True, 1
        self.rows.next_pos[r] = 0  # its positions never reach another row's rotary scaling (dynamic RoPE)
        if self.evicting is not None:  # full at one slot: writes slot 0 in place
            self._next_slot[r], self._recent[r] = 1, 0

    def grow(self, capacity: int) -> None:
        """More slots per row (a longer request arrived): new buffers, contents kept. A compiled step sees a
        new shape and compiles once more."""
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

    def _in_use(self) -> int:
        """Every slot of every row (rows of append methods fill theirs at their own pace)."""
        return self.capacity
