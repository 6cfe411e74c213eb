"""metrics.json's KV figures under any process layout: `kv.peak_bytes` is the peak request's whole cache,
`kv.peak_bytes_per_rank` what one process held of it, and the peak request is chosen by what the cache held,
never by a rank's bytes (issue 31, item 3)."""

from __future__ import annotations

from types import SimpleNamespace

from evalkit.memory.model import kv_geometry
from evalkit.summary import kv_summary
from tests.runs_fixture import SMOL_CONFIG

TINY = SimpleNamespace(num_key_value_heads=2, num_attention_heads=4)  # tiny_llama's KV geometry
PER_ENTRY = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32


def record(slots: int, seen: int, heads: int) -> dict:
    """A generation record as a process caching `heads` of the model's 2 KV heads writes it."""
    return {
        "kv_slots": slots, "kv_kept": slots, "kv_seen": seen, "prompt_tokens": seen - 10,
        "prefill_tokens": seen - 40, "kv_bytes": PER_ENTRY * heads // 2 * slots, "kv_heads": heads,
        "kv_evicted_generated": 0,
    }  # fmt: skip


def test_a_tensor_parallel_run_reports_the_whole_cache_and_its_rank_share_beside_it():
    """Every record from a TP=2 rank (one of the two KV heads): the figure a TP=2 run once reported was half
    the one-process figure."""
    kv = kv_summary([record(900, 1000, heads=1), record(700, 800, heads=1)], TINY)
    one = kv_summary([record(900, 1000, heads=2), record(700, 800, heads=2)], TINY)
    assert kv["peak_bytes"] == one["peak_bytes"] == PER_ENTRY * 900
    assert (
        kv["peak_bytes_per_rank"] == PER_ENTRY * 900 // 2 and one["peak_bytes_per_rank"] == one["peak_bytes"]
    )
    assert kv["peak_prefill_tokens"] == 960 and kv["peak_entries"] == 900


def test_a_run_resumed_across_layouts_ends_with_the_same_peak_request():
    """The longest request generated under TP=2 (its record holds half the bytes) and a shorter one in one
    process: the peak is the longest whatever layout generated what (by bytes, the shorter one won)."""
    mixed = kv_summary([record(900, 1000, heads=1), record(800, 900, heads=2)], TINY)
    alone = kv_summary([record(900, 1000, heads=2), record(800, 900, heads=2)], TINY)
    for key in (
        "peak_bytes",
        "peak_entries",
        "peak_prompt_tokens",
        "peak_prefill_tokens",
        "peak_seen_tokens",
    ):
        assert mixed[key] == alone[key], key
    assert mixed["peak_seen_tokens"] == 1000


def test_mla_latent_is_whole_on_every_rank():
    """DeepSeek-V3's latent cache is replicated across TP ranks: a rank's bytes are the whole cache."""
    mla = SimpleNamespace(kv_lora_rank=16, num_key_value_heads=4, num_attention_heads=4)
    rec = record(500, 600, heads=1) | {"kv_bytes": 12_345 * 500}
    kv = kv_summary([rec], mla)
    assert kv["peak_bytes"] == kv["peak_bytes_per_rank"] == 12_345 * 500 and kv["cache_layout"] == "latent"


def test_the_whole_cache_is_what_the_memory_model_predicts_per_entry():
    """The bytes per entry behind `peak_bytes` are the memory model's for the model's every KV head."""
    geo = kv_geometry(SMOL_CONFIG, "float32")
    smol = SimpleNamespace(num_key_value_heads=3, num_attention_heads=9)
    rec = {"kv_slots": 10, "kv_kept": 10, "kv_seen": 10, "kv_evicted_generated": 0, "kv_heads": 1}
    kv = kv_summary([rec | {"kv_bytes": geo.bytes_per_entry // 3 * 10}], smol)  # one of three heads
    assert kv["peak_bytes"] == geo.bytes_per_entry * 10
