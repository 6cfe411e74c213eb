"""Every input of the memory report checked before anything is computed: a wrong value (a negative MTP factor,
a budget that is not a number, a zero batch) would otherwise come out as a plausible-looking wrong number.
Each error names the setting, the rule and the value given."""

from __future__ import annotations

from typing import Any

from evalkit.memory.model import MemoryReportError, dtype_bits
from evalkit.memory.sim import ATTENTION_MAPPINGS, canonical_method


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # v == v: not NaN


def require(ok: bool, field: str, rule: str, value: Any) -> None:
    if not ok:
        raise MemoryReportError(f"{field} must be {rule}, got {value!r}")


def positive_int(field: str, v: Any) -> None:
    require(_is_int(v) and v > 0, field, "a positive integer", v)


def number(field: str, v: Any, low: float, *, strict: bool = True, rule: str | None = None) -> None:
    """A number above `low` (at least `low` when not strict)."""
    ok = _is_number(v) and (v > low if strict else v >= low)
    require(ok, field, rule or f"a number {'>' if strict else '>='} {low:g}", v)


def int_list(field: str, v: Any) -> None:
    ok = isinstance(v, list | tuple) and len(v) > 0 and all(_is_int(x) and x > 0 for x in v)
    require(ok, field, "a non-empty list of positive integers (e.g. [8192,32768])", v)


def validate_hardware(hw: dict) -> None:
    """conf/hardware/*.yaml: capacities and bandwidths positive (DDR may be absent: 0 GiB)."""
    positive_int("hardware.sockets", hw.get("sockets"))
    for key in ("sram_mib", "hbm_gib", "hbm_tb_s", "bf16_tflops"):
        number(f"hardware.{key}", hw.get(key), 0)
    ddr_gib = hw.get("ddr_gib") or 0
    number("hardware.ddr_gib", ddr_gib, 0, strict=False)
    if ddr_gib:
        number("hardware.ddr_gb_s", hw.get("ddr_gb_s"), 0, rule="a number > 0 when hardware.ddr_gib > 0")
    number("hardware.efficiency", hw.get("efficiency"), 0, rule="a number in (0, 1]")
    require(hw["efficiency"] <= 1, "hardware.efficiency", "a number in (0, 1]", hw["efficiency"])


def validate_model(m: dict) -> None:
    require(
        isinstance(m.get("name"), str) and m["name"] != "", "model.name", "a non-empty string", m.get("name")
    )
    n = m.get("num_parameters")
    require(n is None or _is_number(n) and n > 0, "model.num_parameters", "null (count) or a number > 0", n)
    if m.get("other_dtype") is not None:
        dtype_bits(m["other_dtype"], "model.other_dtype")
    layout = m.get("kv_layout")
    require(layout in (None, "latent", "per_head"), "model.kv_layout", "null, 'latent' or 'per_head'", layout)


def validate(cfg: dict) -> None:
    """Check a resolved conf/memory.yaml (plain dicts); raises MemoryReportError naming the first bad
    setting."""
    require(
        isinstance(cfg.get("results_dir"), str) and cfg["results_dir"] != "",
        "results_dir",
        "a folder path",
        cfg.get("results_dir"),
    )
    validate_model(cfg["model"])
    validate_hardware(cfg["hardware"])
    positive_int("parallel.tp", cfg["parallel"].get("tp"))
    attention = cfg["parallel"].get("attention")
    require(
        attention in ATTENTION_MAPPINGS,
        "parallel.attention",
        f"one of {', '.join(ATTENTION_MAPPINGS)}",
        attention,
    )
    # No world size here to derive a null tp_size from (as the runtime does): the report needs the number.
    for key, what in (("tp_size", "GPUs per model copy"), ("dp_size", "model copies")):
        v = cfg["parallel"].get(key, 1)
        require(_is_int(v) and v > 0, f"parallel.{key}", f"a positive integer ({what})", v)
    int_list("context_lens", cfg.get("context_lens"))
    decode = cfg.get("decode_len")
    require(
        _is_int(decode) and decode >= 0, "decode_len", "an integer >= 0 (0 = no generated tokens)", decode
    )
    methods = cfg.get("methods")
    require(isinstance(methods, list | tuple) and len(methods) > 0, "methods", "a non-empty list", methods)
    names = [canonical_method(m) for m in methods]  # unknown names: an error listing the known ones
    require(len(set(names)) == len(names), "methods", "a list without repeats", methods)
    if any(n != "full" for n in names):
        int_list("budgets", cfg.get("budgets"))
    batch = cfg.get("batch")
    require(batch == "max" or _is_int(batch) and batch > 0, "batch", "'max' or a positive integer", batch)
    number(
        "mtp_factor",
        cfg.get("mtp_factor"),
        1,
        strict=False,
        rule="a number >= 1 (accepted tokens per decode step; 1 = no multi-token prediction)",
    )
    reserve = cfg.get("kv_reserve_gib")
    require(
        reserve is None or _is_number(reserve) and reserve > 0,
        "kv_reserve_gib",
        "null (all free HBM) or a number of GiB > 0",
        reserve,
    )
    tile = cfg.get("tile_tokens")
    require(
        tile is None or _is_int(tile) and tile > 0,
        "tile_tokens",
        "null (whole cache) or a positive integer",
        tile,
    )
    require(isinstance(cfg.get("paper_check"), bool), "paper_check", "true or false", cfg.get("paper_check"))
