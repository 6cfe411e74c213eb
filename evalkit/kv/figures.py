"""What a cache's rows hold, summed: one home for the totals `KVCache.stats` and `generate`'s `batch_stats`
report from per-row figures (`KVCache.row_stats`, or an engine row's as it ended)."""

from __future__ import annotations

FIGURES = ("seen", "kept", "evicted", "evicted_generated", "bytes", "ragged_bytes")


def summed(rows: list[dict]) -> tuple[dict, list[dict]]:
    """Totals of the rows' figures, and per layer the bytes every row holds of it (its slots and the storage's
    tensors beside them: `layer_bytes`), beside the totals of seen, kept and evicted."""
    total = {k: sum(r[k] for r in rows) for k in FIGURES}
    per_layer = [
        {**{k: total[k] for k in ("seen", "kept", "evicted")}, "layer": i, "bytes": sum(held)}
        for i, held in enumerate(zip(*(r["layer_bytes"] for r in rows)))
    ]
    return total, per_layer
