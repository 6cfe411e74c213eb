"""evalkit's kept sets equal kvpress 0.5.5's on the embedded model, run side by side
(`scripts/kvpress_side_by_side.py --quick`: one ~1k-token RULER needle prompt, budgets 128 and 256).

kvpress pins transformers < 5.3, so it runs in its own venv, named by `$EVALKIT_KVPRESS_PYTHON` (default
/work/wt/kvpress-venv/bin/python); without it these tests skip. The full figures:
docs/deviations.md#kv-methods.
"""

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("EVALKIT_KVPRESS_PYTHON", "/work/wt/kvpress-venv/bin/python")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(PYTHON).exists(),
        reason=f"kvpress's venv is absent ({PYTHON}): python3 -m venv /work/wt/kvpress-venv && "
        "/work/wt/kvpress-venv/bin/pip install kvpress==0.5.5 torch==2.13.0, or set EVALKIT_KVPRESS_PYTHON",
    ),
]


def script():
    spec = importlib.util.spec_from_file_location(
        "kvpress_side_by_side", ROOT / "scripts/kvpress_side_by_side.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefill_methods_keep_kvpress_sets(tmp_path):
    """knorm, keydiff, tova, expected_attention and kvzip (each head's top-budget of kvpress's scores),
    snapkv, adakv over snapkv and expected_attention, pyramidkv at beta 20 and 4 keep exactly kvpress's
    entries in every layer and KV head; the listed deviations differ: kvzip's own global choice over layers
    and heads (a uniform budget per head here), and pyramidkv at beta 4 and budget 128, where kvpress's
    float n_kept (127.99...) falls back to the uniform budget (equal once its ratio gives exactly 128:
    `_exact`)."""
    rows = script().main(["prefill", "--quick", "--kvpress-python", PYTHON, "--out", str(tmp_path / "p")])
    deviations = {("kvzip", 128), ("kvzip", 256), ("pyramidkv_snapkv_beta4", 128)}
    same = {(r["method"], r["budget"]): r["jaccard_min"] for r in rows}
    for key in deviations:
        del same[key]
    assert len(same) == 23 and all(j == 1.0 for j in same.values()), same
    assert all(r["jaccard_mean"] < 0.9 for r in rows if (r["method"], r["budget"]) in deviations)


def test_snapkv_decode_equals_decoding_press_once_deviations_are_neutralised(tmp_path):
    """DecodingPress(SnapKVPress) patched to keep entries in position order and to rotate each window query at
    its own position (and, query-agnostic, to feed the question one token per step): the same tokens and the
    same kept sets at every re-selection, query-aware and query-agnostic."""
    out = script().main(
        ["decode", "--quick", "--new", "80", "--kvpress-python", PYTHON, "--out", str(tmp_path / "d")]
    )
    for setting in ("query_aware", "query_agnostic"):
        row = out[setting]["neutralised"]
        assert row["identical_tokens"] == row["runs"] > 0, (setting, row)
        assert all(r["jaccard"] == 1.0 for r in row["per_run"]), (setting, row)
