"""Decode-time eviction after 16k-token prompts (`--only eviction_16k`; see `evalkit.bench.eviction`)."""

from evalkit.bench.eviction import MEASUREMENT_16K as MEASUREMENT

__all__ = ["MEASUREMENT"]
