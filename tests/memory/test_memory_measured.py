"""The memory report's prediction equals the bytes evalkit's caches really held, for runs of each method."""

import pytest

from evalkit.config import compose
from evalkit.memory.report import measured_rows
from evalkit.run import run


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    base = [
        "model=tiny_llama",
        "task.load.n=1",
        "task.load.lengths=[1024]",
        "task.load.tasks=[niah_single_1,vt]",
        f"results_dir={out}",
    ]
    for method, budgets in (
        ("full", "null"),
        ("streamingllm", "64"),
        ("snapkv", "[64,2048]"),
        ("snapstream", "[64,128]"),
    ):
        run(compose(overrides=[*base, f"method={method}", f"method.budget={budgets}"]))
    return out


def test_predicted_equals_measured_for_every_run(results):
    rows, notes = measured_rows(results)
    assert not notes, notes
    assert {(r["method"], r["budget"]) for r in rows} == {
        ("full", None),
        ("streamingllm", 64),
        ("snapkv", 64),
        ("snapkv", 2048),
        ("snapstream", 64),
        ("snapstream", 128),
    }
    for r in rows:
        assert r["match"], r
        assert r["predicted_bytes"] == r["measured_bytes"] == r["bytes_per_entry"] * r["measured_entries"]
    per_entry = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32 (conf/model/tiny_llama)
    assert all(r["bytes_per_entry"] == per_entry for r in rows)
    snapkv_long = next(r for r in rows if r["method"] == "snapkv" and r["budget"] == 2048)
    assert snapkv_long["measured_entries"] > 1000  # the whole ~1k prompt kept, then decoded tokens appended
