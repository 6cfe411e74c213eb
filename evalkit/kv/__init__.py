"""KV-cache compression: methods (dataclasses), the static-shape cache, and the attention hook.

from evalkit.kv import SnapStream, attach, generate
attach(model)
out, stats = generate(model, ids, SnapStream(budget=256), attention_mask=mask, max_new_tokens=64)
stats  # tokens seen / kept / evicted and bytes, per layer and per row

`generate` decodes through the engine (`evalkit.engine`, the runner's decode path). A `KVCache` passed to
`model.generate` decodes one prompt (or rows of one length) with the dynamic cache.
"""

from evalkit.kv.adaptive import AdaKV, PyramidKV
from evalkit.kv.attention import attach, register
from evalkit.kv.cache import KVCache
from evalkit.kv.generate import generate
from evalkit.kv.methods import H2O, Full, KVMethod, SnapKV, SnapKVDecode, SnapStream, StreamingLLM
from evalkit.kv.rivals import TOVA, ExpectedAttention, KeyDiff, KNorm, KVzip, Ringed
from evalkit.kv.static import StaticKVCache
from evalkit.kv.tova import TOVADecode

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
    "H2O",
    "SnapKVDecode",
    "KNorm",
    "KeyDiff",
    "TOVA",
    "ExpectedAttention",
    "KVzip",
    "Ringed",
    "AdaKV",
    "PyramidKV",
    "TOVADecode",
    "attach",
    "register",
]
