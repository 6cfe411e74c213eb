"""A served full run as the reference of in-process compressed runs of the same weights (issue 35.2,
evalkit/report/reference.py): it pairs only when opted in (`model.reference_for`), on equal generation
settings and data, and when every shared problem's prompt (hash and token count) is equal; a mismatch is
refused naming the problem or the setting; the report labels the partner as served. Run folders are
fabricated in the runner's format (tests/runs_fixture.py); no model runs."""

from __future__ import annotations

import json
from pathlib import Path

from evalkit.report import settings
from evalkit.report.build import build, pair_all
from evalkit.report.runs import load_runs
from tests.runs_fixture import binary_rows, write_run

SERVED = {
    "base_url": "http://127.0.0.1:8000/v1",
    "api": "completions",
    "model": {"id": "meta-llama/Llama-3.1-8B-Instruct", "max_model_len": 32768},
    "server_header": "uvicorn",
    "version": {"version": "0.11.0"},
}


def rows(n: int = 30, prompt_tokens: int = 100) -> list[dict]:
    out = binary_rows([1] * n)
    for r in out:
        r["generation"] = [{"output_tokens": 3, "prompt_tokens": prompt_tokens, "kv_seen": prompt_tokens + 3}]
    return out


def served_run(root: Path, rows: list[dict], reference_for: str | None = "smollm2_135m", **kw) -> Path:
    """A served full run (metrics.json `served`, model conf `served`'s keys) standing in for
    `reference_for`."""
    folder = write_run(root, rows, model="vllm_smol", method="full", budget=None, **kw)
    path = folder / "metrics.json"
    m = json.loads(path.read_text())
    model = m["provenance"]["config"]["model"]
    model |= {"api": "completions", "tokenizer": "smollm2_135m", "base_url": SERVED["base_url"]}
    if reference_for is not None:
        model["reference_for"] = reference_for
    m["served"] = SERVED
    m["kv"] = dict.fromkeys(m["kv"])  # the server's cache: unmeasured
    path.write_text(json.dumps(m))
    return folder


def pairings(root: Path):
    return pair_all(load_runs(root)[0], settings(results_dir=root))


def test_a_served_reference_pairs_with_the_compressed_run_and_is_labelled_served(tmp_path):
    served_run(tmp_path, rows())
    write_run(tmp_path, rows(), budget=256)
    (p,), problems = pairings(tmp_path)
    assert problems == []
    assert (
        p.full.rel == "ruler/vllm_smol/full/none" and p.compressed.rel == "ruler/smollm2_135m/snapstream/256"
    )
    assert p.reference.startswith("served: meta-llama/Llama-3.1-8B-Instruct at http://127.0.0.1:8000/v1")
    assert "uvicorn 0.11.0" in p.reference and "batching" in p.reference
    assert any("served full-cache reference" in n for n in p.notes)

    rep = build(settings(results_dir=tmp_path))
    head = rep.headline.iloc[0]
    assert head.reference == p.reference and head.full_run == "ruler/vllm_smol/full/none"
    assert head.kv_entries_full == 103  # the full cache's lengths from the compressed run's own requests
    assert not any("memory model not joined" in x for x in rep.problems)
    assert not any("smollm2_135m/full: missing" in x for x in rep.missing)


def test_one_altered_prompt_refuses_the_served_reference_naming_the_problem(tmp_path):
    served = rows()
    served[7]["prompt_hash"] = "another rendering"
    served_run(tmp_path, served)
    write_run(tmp_path, rows(), budget=256)
    assert pairings(tmp_path)[0] == []
    (problem,) = pairings(tmp_path)[1]
    assert "cannot be paired with served reference ruler/vllm_smol/full/none" in problem
    assert (
        "1 of 30 shared problems differ: s7 (prompt hash h-s7 in process, another rendering served)"
        in problem
    )


def test_a_missing_prompt_hash_or_another_token_count_refuses_too(tmp_path):
    served = rows()
    served[3]["prompt_hash"] = None
    served[5]["generation"][0]["prompt_tokens"] = 101  # the same text, tokenized otherwise
    served_run(tmp_path, served)
    write_run(tmp_path, rows(), budget=256)
    (problem,) = pairings(tmp_path)[1]
    assert (
        "2 of 30 shared problems differ: s3 (prompt hash h-s3 in process, None served); "
        "s5 (prompt tokens [100] in process, [101] served)" in problem
    )


def test_another_generation_setting_is_refused_naming_it(tmp_path):
    served_run(tmp_path, rows(), seed=1)
    write_run(tmp_path, rows(), budget=256)
    (problem,) = pairings(tmp_path)[1]
    assert "no `full` run of model smollm2_135m" in problem
    assert "cannot be paired with served reference ruler/vllm_smol/full/none: seed 0 vs 1" in problem


def test_a_served_run_without_reference_for_is_no_reference(tmp_path):
    served_run(tmp_path, rows(), reference_for=None)
    write_run(tmp_path, rows(), budget=256)
    (problem,) = pairings(tmp_path)[1]
    assert "no `full` run of model smollm2_135m" in problem and "served reference" not in problem


def test_an_in_process_full_run_is_preferred_to_the_served_reference(tmp_path):
    served_run(tmp_path, rows())
    write_run(tmp_path, rows(), method="full", budget=None)
    write_run(tmp_path, rows(), budget=256)
    (p,), problems = pairings(tmp_path)
    assert problems == [] and p.full.rel == "ruler/smollm2_135m/full/none" and p.reference is None
