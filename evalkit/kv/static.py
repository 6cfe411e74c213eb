"""The static cache (what `compile: true` uses): a decode step capturable as one graph.

The buffers' shapes never change after prefill (append methods allocate prompt + `max_new_tokens` slots up
front), the per-step state lives in device tensors updated in place by the first layer of each forward (this
step's slot per row, the next position, the valid-slot mask), and attention reads every slot under that mask.
No host sync, no Python branch on data, no Python counter inside the step: `torch.compile(fullgraph=True)`
captures it once per (batch, slots). Prefill and compression are the dynamic cache's (`evalkit.kv.cache`).
"""

from __future__ import annotations

import torch
from transformers import CompileConfig

from evalkit.kv.cache import KVCache, KVLayer
from evalkit.kv.layout import Rows, ring_slot, slots_needed


def pin(*tensors: torch.Tensor) -> None:
    """Buffers that keep their address for the whole decode: CUDA graphs then update them in place instead of
    copying them at every replay (transformers' StaticCache does the same). No effect on eager runs."""
    if not torch.compiler.is_compiling():  # marking is refused while tracing; prefill is never compiled
        for t in tensors:
            torch._dynamo.mark_static_address(t)


def compile_config(model, backend="inductor", mode: str | None = None) -> CompileConfig:
    """How a static cache's decode forward compiles (`evalkit.kv.generate`, the engine): one graph (fullgraph:
    a graph break is an error, not a slow path), specialised to its shapes (dynamic=False: a static cache has
    one shape per batch and slot count).

    Inductor with CUDA graphs (`reduce-overhead`) on CUDA, plain inductor elsewhere; `backend` may be any
    torch.compile backend (tests count compilations with their own)."""
    cuda = model.device.type == "cuda"
    if mode is None and backend == "inductor":
        mode = "reduce-overhead" if cuda else "default"
    config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=mode)
    config._compile_all_devices = not cuda  # transformers compiles on accelerators only unless told
    return config


class StaticKVCache(KVCache):
    """A compressed cache with fixed shapes and per-row layout state on the device (sink, ring or append, next
    free column), so rows of different methods and budgets can share one (`evalkit.kv.pool.SlotPool`)."""

    static = True
    observing = False  # attention hands this cache each step's query (decode-time eviction scores it)
    pooled = False  # the engine's slot pool (`pool.SlotPool`), the one static cache that evicts at decode

    def _check_max_new(self, max_new_tokens):
        """A static append cache allocates its decode slots at prefill: it must know how many."""
        if self.method.ring:
            return max_new_tokens
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(
                f"{self.method.name}: a static cache (compile) appends every new token into a slot allocated "
                f"at prefill, so it needs max_new_tokens (a positive integer), got {max_new_tokens!r}"
            )
        return max_new_tokens

    def _decode_room(self, n: int, t: int) -> int:
        """One slot per new token, each marked valid when its token is written (attention reads them all)."""
        return slots_needed(self.method, t, self.max_new_tokens or 0) - n

    def _prefilled(self, rows: Rows, t: int) -> None:
        """The per-step state as device tensors that every decode step updates in place."""
        if self.method.evict is not None and not self.pooled:
            raise ValueError(
                f"{self.method.name} chooses what to evict while decoding, in the engine's slot pool only: "
                "decode through evalkit.kv.generate or evalkit.engine.Engine"
            )
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
        state = (self._sink, self._ring, self._slots, self._row, self._slot, self._slot_pos, self._next_slot)
        pin(rows.valid, rows.next_pos, rows.tail, *state, self._seen)

    def allocated(self, layer: KVLayer) -> None:
        pin(layer.keys, layer.values, layer.pos)

    def seq_length(self) -> int | torch.Tensor:
        """A device tensor (as transformers' StaticCache answers): a Python int that grows each step would
        recompile a compiled step each step."""
        return self._seen if self.rows is not None else self.seen

    # --- decode ---------------------------------------------------------------------------------------------
    def write(self, layer: KVLayer, k: torch.Tensor, v: torch.Tensor):
        """One token per row into this step's slot, written with tensor indices; returns the whole buffers."""
        if k.shape[2] != 1:  # a shape, so decided when the graph is traced
            raise ValueError(
                f"{self.method.name}: a static cache (compile) decodes one token per forward after prefill "
                f"(got {k.shape[2]}); chunked prefill and multi-token continuation need compile off"
            )
        if layer.layer_idx == 0:  # the step's first layer advances the state every layer shares
            self._advance_state()
        # index_put_ (not scatter_): inductor writes it in place into the buffers; a scatter it would apply to
        # a copy of each buffer and copy back, moving the whole cache twice per layer and step
        index = self._write_index(layer)
        layer.keys[index] = k[:, :, 0]  # (B, H, D_k)
        layer.values[index] = v[:, :, 0]
        layer.pos[index] = self._slot_pos[:, None]  # (B, 1) -> (B, H)
        return layer.keys, layer.values

    def decoded(self, active: list[int]) -> None:
        """Host hook after each engine decode step (the pool's decode-time re-selection)."""

    def _write_index(self, layer: KVLayer) -> tuple:
        """Where this step's token goes: (B,) rows x all heads x (B,) slots (decode-time eviction: per
        head)."""
        return self._row, slice(None), self._slot

    def _advance_state(self) -> None:
        """This step's slot and position per row, the slot marked valid, counters moved on: all in place."""
        rows = self.rows
        p = rows.next_pos  # (B,) this token's position per row
        # ring rows: their ring slot (short prompts fill the sinks first); append rows: the next free column
        slot = torch.where(self._ring, ring_slot(p, self._sink, rows.tail), self._next_slot)
        self._slot.copy_(slot)
        self._slot_pos.copy_(p)
        rows.valid[self._row, self._slot] = True
        rows.next_pos.add_(1)
        self._next_slot.add_(1)
        self._seen.add_(1)

    def decode_mask(self) -> torch.Tensor:
        """(B, 1, 1, slots): every slot is read, under the valid-slot mask."""
        return self.rows.valid[:, None, None, :]

    # --- reporting ------------------------------------------------------------------------------------------
    def _in_use(self) -> int:
        """An append cache counts the slots written since prefill on the device: one sync, at report time."""
        if self.method.ring or self.rows is None:
            return self.used
        return self.rows.n + int(self._seen) - self._prompt_width

    def _kept(self) -> list[int]:
        """Each slot is marked valid as it is written."""
        return self.rows.valid[:, : self._in_use()].sum(1).tolist()

    def _row_slots(self, kept: list[int]) -> list[int]:
        """A ring row holds its slots after prefill whatever it holds; an append row its kept."""
        return torch.where(self._ring, self._slots, torch.tensor(kept, device=self._slots.device)).tolist()
