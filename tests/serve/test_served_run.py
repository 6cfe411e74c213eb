"""`MODEL=served` against evalkit's own compressed server (issue 34.5, evalkit/served_kv.py): the run is a
compressed run, its method and budget those the server says it serves (checked before any request, and on
every answer), its KV figures the server's measured ones; the report pairs it with a served full run like an
in-process compressed run. The server runs the fake backend (no model) on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import evalkit.run as runner
from evalkit.report import settings
from evalkit.report.build import pair_all
from evalkit.report.runs import load_runs
from evalkit.served import ServedError
from tests.conftest import fresh_run
from tests.serve.conftest import fake_service

AIME = ["task=aime24_greedy", "model.max_new_tokens=8", "task.load.n=2", "model.max_length=2048"]


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    monkeypatch.setattr(runner, "get_model", lambda spec: pytest.fail(f"the model {spec.name} was loaded"))


def served(url: str, *overrides: str) -> list[str]:
    return ["model=served", f"model.base_url={url}/v1", "model.tokenizer=smollm2_135m", *AIME, *overrides]


def records(results: Path, method: str, tag: str) -> list[dict]:
    (path,) = results.glob(f"runs/*/served*/{method}/{tag}/generations.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_served_compressed_run_is_a_compressed_run_paired_with_the_full_cache(serve, tokenizer, tmp_path):
    url, svc = serve(fake_service(tokenizer, context=2048, budget=64, slot_bytes=10))
    m = fresh_run(*served(url, "method=snapstream", "method.budget=64"), results=tmp_path)[0]
    assert m["method"]["name"] == "snapstream" and m["budget"] == 64
    recs = records(tmp_path, "snapstream", "64")
    for r in recs:  # the server's measured figures, journaled as an in-process generation's
        s = r["stats"]
        assert s["kv_seen"] == s["prompt_tokens"] + 7 and s["kv_kept"] == 64 and s["kv_bytes"] == 640
    assert m["kv"]["peak_bytes"] == 640 and m["kv"]["kept_fraction"] == pytest.approx(
        sum(64 / r["stats"]["kv_seen"] for r in recs) / 2
    )
    assert m["served"]["model"]["evalkit"]["method"]["name"] == "snapstream"

    # a budget the server takes per request: sent with each request, and answered at it
    m32 = fresh_run(*served(url, "method=snapstream", "method.budget=48"), results=tmp_path)[0]
    assert m32["budget"] == 48 and {r["stats"]["kv_kept"] for r in records(tmp_path, "snapstream", "48")} == {
        48
    }

    full_url, _ = serve(fake_service(tokenizer, context=2048, method="full", budget=None))
    fresh_run(*served(full_url, "method=full"), results=tmp_path)
    pairings, problems = pair_all(load_runs(tmp_path)[0], settings(results_dir=tmp_path))
    assert problems == []
    assert sorted((p.compressed.budget, p.full.method) for p in pairings) == [(48, "full"), (64, "full")]


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["method=full"], "serves snapstream at budget 64: method=full differs; run with METHOD=snapstream"),
        (["method=snapkv", "method.budget=64"], "method=snapkv differs; run with METHOD=snapstream"),
        (
            ["method=snapstream", "method.budget=64", "method.sink=8"],
            "method.sink=8 differs from the server's 4",
        ),
    ],
)
def test_a_run_that_is_not_the_servers_configuration_is_refused_naming_the_setting(
    serve, tokenizer, tmp_path, overrides, says
):
    url, svc = serve(fake_service(tokenizer, context=2048, budget=64))
    with pytest.raises(ServedError, match=says):
        fresh_run(*served(url, *overrides), results=tmp_path)
    assert svc.backend.prefill_tokens == 0  # nothing was sent


def test_an_answer_at_another_method_or_budget_is_refused_never_journaled():
    from evalkit.kv.config import make_method
    from evalkit.served_kv import kv_stats

    method = make_method("snapstream", budget=64)
    kv = {
        "method": "snapstream",
        "budget": 64,
        "choices": [{"seen": 90, "kept": 64, "slots": 64, "bytes": 6}],
    }
    assert kv_stats({"kv": kv}, method) == {"kv_seen": 90, "kv_kept": 64, "kv_slots": 64, "kv_bytes": 6}
    assert kv_stats({}, make_method("full")) == {}  # a server that measures nothing
    with pytest.raises(
        ValueError, match="answered with method snapstream at budget 128, the run is snapstream"
    ):
        kv_stats({"kv": {**kv, "budget": 128}}, method)
