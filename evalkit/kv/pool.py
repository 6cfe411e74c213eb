"""The engine's slot pool: a static cache whose rows are filled one request at a time (continuous batching).

Each request is prefilled alone into its own one-row cache, then copied into a free row of the pool; every row
keeps its own method, budget, ring and positions (`StaticKVCache`'s per-row state), so rows of different
budgets decode side by side, and buffer addresses never change as rows are refilled, so a compiled
(CUDA-graph) step keeps running (except where the pool grows: more slots for a longer request, or an int
storage's wider residual window for a wider ring, each a new shape compiled once more). The rows' method's
evictor (`evalkit.kv.evict`) keeps its own per-row state beside them (one evictor kind per pool). Used by
`evalkit.engine`.

With `Buckets` (the engine's), a step attends over the filled slots rounded up to a bucket (`visible`), not
the whole capacity: a full cache sized for prompt + max_new_tokens reads what it holds, and a compiled step is
one graph per bucket. The host knows a bound on every row's filled slots without a sync (slots after load +
steps since, at most what the row needs), moved on by `decoded`, the engine's hook after each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evalkit.kv.cache import KVCache
from evalkit.kv.layout import Rows, slots_needed
from evalkit.kv.static import StaticKVCache, pin


@dataclass(frozen=True)
class Buckets:
    """The slot counts a pool's step attends over: `floor`, then `per_octave` evenly spaced sizes per doubling
    (4: 256, 320, 384, 448, 512, 640, ...; at most 25% more slots than filled), the pool's capacity last.
    `per_octave=0`: always the whole capacity (one shape per pool size). A compiled step compiles once per
    bucket it reaches; a run reaches the few between its shortest and its longest request."""

    floor: int = 256
    per_octave: int = 4

    def __post_init__(self):
        if self.floor < 1 or self.per_octave < 0:
            raise ValueError(f"buckets need floor >= 1 and per_octave >= 0, got {self}")

    def of(self, filled: int, capacity: int) -> int:
        """The smallest bucket holding `filled` slots (at most `capacity`)."""
        if self.per_octave == 0 or filled >= capacity:
            return capacity
        if filled <= self.floor:
            return min(self.floor, capacity)
        octave = 1 << ((filled - 1).bit_length() - 1)  # the largest power of two below filled
        step = max(octave // self.per_octave, 1)
        return min(-(-filled // step) * step, capacity)

    def count(self, capacity: int) -> int:
        """How many buckets a pool of `capacity` slots has: the most graphs its compiled step needs."""
        sizes, n = set(), 1
        while True:
            sizes.add(self.of(n, capacity))
            if n >= capacity:
                return len(sizes)
            n = self.of(n, capacity) + 1


WHOLE = Buckets(per_octave=0)  # attend over every slot (a pool driven without `decoded`)
BUCKETS = Buckets()  # the engine's default


class SlotPool(StaticKVCache):
    """`batch` rows of `capacity` slots. Rows are filled by `load_row`; until then they are idle (one valid
    slot, ring of one: they decode harmlessly in place)."""

    pooled = True

    @classmethod
    def shaped_like(cls, like: KVCache, batch: int, capacity: int, buckets: Buckets = WHOLE) -> SlotPool:
        """An empty pool shaped like the prefilled one-row cache `like` (layers, heads, head dims, dtype,
        device); its steps attend over `buckets` of the filled slots (then `decoded` must follow each
        step)."""
        pool = cls(
            like.method,
            len(like.layers),
            like.attn_name,
            max_new_tokens=1,
            agree=like.agree,
            storage=like.storage,
        )
        # per row: slots that may hold an entry (a host bound, no sync), and the most it ever needs
        pool.buckets, pool.reach, pool.need, pool.visible = buckets, [1] * batch, [1] * batch, capacity
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
        pool.shape = like.shape
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

    def allocated_bytes(self) -> int:
        """Bytes every layer's buffers hold, all rows: the K/V slots and the storage's tensors beside them
        (fp8's scales, int's raw windows and group parameters)."""
        held = (x for lay in self.layers for x in (lay.keys, lay.values, *lay.scales) if x is not None)
        return sum(x.numel() * x.element_size() for x in held)

    def load_row(self, r: int, src: KVCache) -> None:
        """Row r becomes a copy of the one-row prefilled cache `src` (any method and budget that fits), in
        place: buffer addresses never change (unless an int storage's windows must grow for its ring), so a
        compiled (CUDA-graph) step keeps running on the new row."""
        n, cap = src.rows.n, self.capacity
        need = slots_needed(src.method, src._prompt_width, src.max_new_tokens or 0, src.shape)
        if need > cap:
            raise ValueError(f"a request needs {need} slots, the pool has {cap} (grow it first)")
        if not self.slot_mask.admits(src.slot_mask):
            raise ValueError(
                f"{src.method.name} keeps other slots per KV head, but this pool reads one slot mask per row "
                f"(it was shaped like a {self.method.name} row): shape the pool like a per-head row"
            )
        for mine, theirs in zip(self.layers, src.layers):
            # slots from n on keep the last occupant's (finite) K/V: masked until written, never read
            mine.pos[r, :, n:].fill_(-1)
            mine.keys[r, :, :n].copy_(theirs.keys[0, :, :n])
            mine.values[r, :, :n].copy_(theirs.values[0, :, :n])
            mine.pos[r, :, :n].copy_(theirs.pos[0, :, :n])
            mine.scales = tuple(_took(held, given, r) for held, given in zip(mine.scales, theirs.scales))
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
        self.reach[r], self.need[r] = n, need
        self._plan()

    def idle_row(self, r: int) -> None:
        """Row r holds no request: a ring of one slot at 0 (valid, so its softmax stays finite), never
        read."""
        self.rows.valid[r].fill_(False)
        self.rows.valid[r, 0] = True
        state = self.state
        self.rows.tail[r], state.sink[r], state.ring[r], state.slots[r] = 1, 0, True, 1
        self.rows.next_pos[r] = 0  # its positions never reach another row's rotary scaling (dynamic RoPE)
        self.evictor.idle_row(self, r)
        self.reach[r] = self.need[r] = 1
        self._plan()

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
        self._plan()

    # --- the visible slots (buckets) ------------------------------------------------------------------------
    def _plan(self) -> None:
        """The next step's visible slots: every row's next write lands below min(reach + 1, need) (an append
        row's next free slot, a ring's or a full evicting row's slot below its budget). An evictor that reads
        every slot's attention (h2o's sums, shaped by capacity) sees them all."""
        reach = max(min(r + 1, n) for r, n in zip(self.reach, self.need))
        whole = self.evictor.observes
        self.visible = self.capacity if whole else self.buckets.of(reach, self.capacity)

    def decoded(self, active: list[int]) -> None:
        """After each step: every row may hold one slot more (up to what it needs)."""
        super().decoded(active)
        self.reach = [min(r + 1, n) for r, n in zip(self.reach, self.need)]
        self._plan()

    def read(self, layer) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `visible` slots only, sliced before the storage reads them (views in the model dtype; a
        quantizing storage decodes just those, not the whole capacity)."""
        n = self.visible
        return self.storage.load(layer, layer.keys[:, :, :n], layer.values[:, :, :n])

    def row_mask(self) -> torch.Tensor:
        """(B, 1, 1, visible): the valid-slot mask over the slots attention reads."""
        return self.rows.valid[:, None, None, : self.visible]

    def _in_use(self) -> int:
        """Every slot of every row (rows of append methods fill theirs at their own pace)."""
        return self.capacity


def _took(held: torch.Tensor, given: torch.Tensor, r: int) -> torch.Tensor:
    """A per-row storage tensor (B, ...) with row r taking the one-row `given` (1, ...) in its leading corner;
    grown first (new tensor, contents kept, pinned) where `given` is larger (a wider raw window: a
    quantizing storage's row of a larger ring). A compiled step sees a new shape and compiles once more."""
    shape = [max(a, b) for a, b in zip(held.shape[1:], given.shape[1:])]
    if shape != list(held.shape[1:]):
        grown = held.new_ones(held.shape[0], *shape)  # rows that never use the new part: finite
        grown[(slice(None), *(slice(0, n) for n in held.shape[1:]))] = held
        pin(grown)
        held = grown
    held[(r, *(slice(0, n) for n in given.shape[1:]))] = given[0]
    return held
