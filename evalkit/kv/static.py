"""The static cache (what `compile: true` uses): a decode step capturable as one graph.

The buffers' shapes never change after prefill (append methods allocate prompt + `max_new_tokens` slots up
front), the per-step state lives in device tensors updated in place by the first layer of each forward (this
step's slot per row, the next position, the valid-slot mask), and attention reads every slot under that mask.
No host sync, no Python branch on data, no Python counter inside the step: `torch.compile(fullgraph=True)`
captures it once per (batch, slots). Prefill and compression are the dynamic cache's (`evalkit.kv.cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from transformers import CompileConfig

from evalkit.kv.cache import KVCache, KVLayer
from evalkit.kv.layout import Rows, slots_needed


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


@dataclass
class StepState:
    """A static cache's per-row decode state: device tensors that each step's first layer updates in place
    (its evictor's `advance`), so a compiled step holds no Python counter."""

    sink: torch.Tensor  # (B,) sink slots per row
    ring: torch.Tensor  # (B,) bool: ring or append
    slots: torch.Tensor  # (B,) slots after prefill (a fixed-size row's budget)
    row: torch.Tensor  # (B,) row index, for the writes' advanced indexing
    slot: torch.Tensor  # (B,) slot this step writes
    pos: torch.Tensor  # (B,) int32 position of this step's token
    next_slot: torch.Tensor  # (B,) next free slot (append rows; decode-time eviction rows until full)
    seen: torch.Tensor  # () columns seen, pads included

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]


class StaticKVCache(KVCache):
    """A compressed cache with fixed shapes and per-row layout state on the device (sink, ring or append, next
    free column), so rows of different methods and budgets can share one (`evalkit.kv.pool.SlotPool`)."""

    static = True

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
        return slots_needed(self.method, t, self.max_new_tokens or 0, self.shape) - n

    def _prefilled(self, rows: Rows, t: int) -> None:
        """The per-step state as device tensors that every decode step updates in place."""
        self.evictor.check_cache(self)
        self.observing = self.evictor.observes  # an attribute: attention reads it per layer and step
        b, dev = rows.valid.shape[0], rows.valid.device
        self.visible = rows.valid.shape[1]  # attention reads every slot (a pool narrows it: `SlotPool._plan`)
        sink = min(self.method.blocks()[0], rows.n)
        self.state = StepState(
            sink=torch.full((b,), sink, dtype=torch.long, device=dev),
            ring=torch.full((b,), self.method.ring, dtype=torch.bool, device=dev),
            slots=torch.full((b,), rows.n, dtype=torch.long, device=dev),
            row=torch.arange(b, device=dev),
            slot=torch.zeros(b, dtype=torch.long, device=dev),
            pos=torch.zeros(b, dtype=torch.int32, device=dev),
            next_slot=torch.full((b,), rows.n, dtype=torch.long, device=dev),
            seen=torch.tensor(t, device=dev),
        )
        pin(rows.valid, rows.next_pos, rows.tail, *self.state.tensors())

    def allocated(self, layer: KVLayer) -> None:
        pin(layer.keys, layer.values, layer.pos, *layer.scales)

    def seq_length(self) -> int | torch.Tensor:
        """A device tensor (as transformers' StaticCache answers): a Python int that grows each step would
        recompile a compiled step each step."""
        return self.state.seen if self.rows is not None else self.seen

    # --- decode ---------------------------------------------------------------------------------------------
    def write(self, layer: KVLayer, k: torch.Tensor, v: torch.Tensor):
        """One token per row into this step's slot, written with tensor indices; returns what attention reads
        (`read`)."""
        if k.shape[2] != 1:  # a shape, so decided when the graph is traced
            raise ValueError(
                f"{self.method.name}: a static cache (compile) decodes one token per forward after prefill "
                f"(got {k.shape[2]}); chunked prefill and multi-token continuation need compile off"
            )
        if layer.layer_idx == 0:  # the step's first layer advances the state every layer shares
            self.evictor.advance(self)
        # index_put_ (not scatter_): inductor writes it in place into the buffers; a scatter it would apply to
        # a copy of each buffer and copy back, moving the whole cache twice per layer and step
        index = self.evictor.write_index(self, layer)
        self.storage.write(layer, index, k, v)  # as the storage holds them (codes, a raw window)
        layer.pos[index] = self.state.pos[:, None]  # (B, 1) -> (B, H)
        return self.read(layer)

    def read(self, layer: KVLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V attention reads this step, in the model dtype: every slot."""
        return self.storage.load(layer, layer.keys, layer.values)

    def decoded(self, active: list[int]) -> None:
        """Host hook after each engine decode step (a decode-time method's periodic re-selection)."""
        self.evictor.after_step(self, active)

    def row_mask(self) -> torch.Tensor:
        """(B, 1, 1, slots): every slot is read, under the valid-slot mask."""
        return self.rows.valid[:, None, None, :]

    # --- reporting ------------------------------------------------------------------------------------------
    def _in_use(self) -> int:
        """An append cache counts the slots written since prefill on the device: one sync, at report time."""
        if self.method.ring or self.rows is None:
            return self.used
        return self.rows.n + int(self.state.seen) - self._prompt_width

    def _kept(self) -> list[int]:
        """Each slot is marked valid as it is written."""
        return self.rows.valid[:, : self._in_use()].sum(1).tolist()

    def _row_slots(self, kept: list[int]) -> list[int]:
        """A ring row holds its slots after prefill whatever it holds; an append row its kept."""
        state = self.state
        return torch.where(state.ring, state.slots, torch.tensor(kept, device=state.slots.device)).tolist()
