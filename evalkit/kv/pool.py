"""The engine's slot pool: a static cache whose rows are filled one request at a time (continuous batching).

Each request is prefilled alone into its own one-row cache, then copied into a free row of the pool; every row
keeps its own method, budget, ring and positions (`StaticKVCache`'s per-row state), so rows of different
budgets decode side by side, and buffer addresses never change, so a compiled (CUDA-graph) step keeps running
as rows are refilled. The rows' method's evictor (`evalkit.kv.evict`) keeps its own per-row state beside them
(one evictor kind per pool). Used by `evalkit.engine`.
"""

from __future__ import annotations

import torch

from evalkit.kv.cache import KVCache
from evalkit.kv.layout import Rows, slots_needed
from evalkit.kv.static import StaticKVCache, pin


class SlotPool(StaticKVCache):
    """`batch` rows of `capacity` slots. Rows are filled by `load_row`; until then they are idle (one valid
    slot, ring of one: they decode harmlessly in place)."""

    pooled = True

    @classmethod
    def shaped_like(cls, like: KVCache, batch: int, capacity: int) -> SlotPool:
        """An empty pool shaped like the prefilled one-row cache `like` (layers, heads, head dims, dtype,
        device)."""
        pool = cls(
            like.method,
            len(like.layers),
            like.attn_name,
            max_new_tokens=1,
            agree=like.agree,
            storage=like.storage,
        )
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
            layer.dtype = src.dtype  # the model's (the buffers may hold a storage's codes)
            h, dk, dv = src.keys.shape[1], src.keys.shape[3], src.values.shape[3]
            layer.keys = src.keys.new_zeros(batch, h, capacity, dk)
            layer.values = src.values.new_zeros(batch, h, capacity, dv)
            layer.pos = src.pos.new_full((batch, h, capacity), -1)
            layer.scales = tuple(s.new_ones(batch, *s.shape[1:]) for s in src.scales)  # idle rows: finite
            pool.allocated(layer)
        pool.evictor.allocate(pool, like, batch, capacity)
        for r in range(batch):
            pool.idle_row(r)
        return pool

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
            for held, given in zip(mine.scales, theirs.scales):
                held[r].copy_(given[0])
        rows, state = self.rows, self.state
        rows.valid[r].fill_(False)
        rows.valid[r, :n].copy_(src.rows.valid[0, :n])
        rows.next_pos[r] = src.rows.next_pos[0]
        rows.tail[r] = src.rows.tail[0]
        rows.lengths[r] = src.rows.lengths[0]
        state.sink[r] = min(src.method.blocks()[0], n)
        state.ring[r] = src.method.ring
        state.slots[r] = n
        state.next_slot[r] = n
        self.evictor.load_row(self, r, src)

    def idle_row(self, r: int) -> None:
        """Row r holds no request: a ring of one slot at 0 (valid, so its softmax stays finite), never
        read."""
        self.rows.valid[r].fill_(False)
        self.rows.valid[r, 0] = True
        state = self.state
        self.rows.tail[r], state.sink[r], state.ring[r], state.slots[r] = 1, 0, True, 1
        self.rows.next_pos[r] = 0  # its positions never reach another row's rotary scaling (dynamic RoPE)
        self.evictor.idle_row(self, r)

    def keep_slots(self, layer, r: int, keep: torch.Tensor) -> None:
        """Row r of `layer` keeps, per KV head, the slots keep (H, n), moved in that order into its first n
        slots; the rest are emptied (a re-selection: `evict.RefitEvictor`)."""
        n = keep.shape[-1]
        for buf in (layer.keys, layer.values):
            buf[r, :, :n] = buf[r].gather(1, keep[..., None].expand(-1, -1, buf.shape[-1]))
        layer.pos[r, :, :n] = layer.pos[r].gather(-1, keep)
        layer.pos[r, :, n:] = -1

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
        self.evictor.grow(self, capacity)

    def _in_use(self) -> int:
        """Every slot of every row (rows of append methods fill theirs at their own pace)."""
        return self.capacity
