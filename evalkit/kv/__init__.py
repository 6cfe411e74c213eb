"""KV-cache compression: methods (dataclasses), the static-shape cache, and the attention hook.

from evalkit.kv import SnapStream, attach, KVCache
attach(model)
cache = KVCache.for_model(SnapStream(budget=256), model)
out = model.generate(ids, past_key_values=cache, max_new_tokens=64)
cache.stats()  # tokens seen / kept / evicted and bytes, per layer
"""

from evalkit.kv.attention import attach, register
from evalkit.kv.cache import KVCache
from evalkit.kv.generate import generate
from evalkit.kv.methods import Full, KVMethod, SnapKV, SnapStream, StreamingLLM
from evalkit.kv.static import StaticKVCache

register()

__all__ = [
    "KVCache",
    "StaticKVCache",
    "generate",
    "KVMethod",
    "Full",
    "StreamingLLM",
    "SnapKV",
    "SnapStream",
    "attach",
    "register",
]
