"""A full (uncompressed) transformers cache whose entries a storage holds: `model.generate(ids,
cache=StoredCache.for_model(storage, model))`.

This is the storage's reference path, the one transformers' own `QuantizedCache` is compared with: prefill
attends over the prompt's K/V as computed (as transformers' and KIVI's prefill do), then the storage holds
them; each decode step writes its token through the storage and attends over what the storage gives back (the
current token included, as held). One prompt per call, or rows of one length: a left-padded batch would let
pad columns into an fp8 scale (the slot pool calibrates on the real columns only).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from evalkit.kv.storage.base import KVStorage


class StoredLayer(DynamicLayer):
    """One layer's full cache, held by `storage` (`hold` at prefill, then `append` / `read` per step)."""

    is_croppable = False

    def __init__(self, storage: KVStorage):
        super().__init__()
        self.storage, self.held, self.length = storage, None, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.length += key_states.shape[-2]
        if self.held is None:
            self.lazy_initialization(key_states, value_states)
            self.held = self.storage.hold(key_states, value_states)
            return key_states, value_states
        self.held.append(key_states, value_states)
        return self.held.read()

    def get_seq_length(self) -> int:
        return self.length

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("evalkit's stored cache does not support beam search")


class StoredCache(Cache):
    """A full cache of `num_layers` layers held by one storage; `nbytes()` is what it holds, all layers."""

    def __init__(self, storage: KVStorage, num_layers: int):
        super().__init__(layers=[StoredLayer(storage) for _ in range(num_layers)])

    @classmethod
    def for_model(cls, storage: KVStorage, model) -> StoredCache:
        return cls(storage, model.config.get_text_config().num_hidden_layers)

    def nbytes(self) -> int:
        return sum(layer.held.nbytes() for layer in self.layers if layer.held is not None)
