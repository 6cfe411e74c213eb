"""What the report's figures are, said beside them: memory-bound upper bounds at the full run's median
request, the bench's measured speedup next to them, modelled vs measured bytes, small-n CIs marked, and why a
point is inconclusive. Also the docs' report excerpt, rendered here from fixture runs so it cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from evalkit.report import settings
from evalkit.report.build import build
from evalkit.report.render import write
from evalkit.report.tables import markdown
from tests.runs_fixture import binary_rows, sample_row, write_run

ROOT = Path(__file__).resolve().parents[2]
PER_TOKEN = 23_040  # SmolLM2-135M, bf16: 2 x 30 layers x 3 KV heads x 64 x 2 bytes


def _with_lengths(rows: list[dict], seen: list[int]) -> list[dict]:
    for row, s in zip(rows, seen):
        row["generation"] = [{"output_tokens": 100, "prompt_tokens": s - 100, "kv_seen": s}]
    return rows


def test_memory_figures_are_at_the_median_request_and_labelled_as_bounds(tmp_path):
    seen = [1200, 900, 5000, 1500, 1100]  # the longest (5000) is not typical: the median is 1200
    write_run(
        tmp_path, _with_lengths(binary_rows([1] * 5), seen), method="full", budget=None, peak=(4900, 5000)
    )
    write_run(tmp_path, binary_rows([1] * 5), budget=256)
    rep = build(settings(results_dir=str(tmp_path)))
    cell = rep.headline.iloc[0]
    assert (cell.context_tokens, cell.context_prompt_tokens) == (1200, 1100)
    assert cell.context_basis == "median request of 5" and cell.kv_bytes_seq_full == PER_TOKEN * 1200
    md = markdown(rep, {})
    assert "Context: the full run's median request of 5, 1200 tokens (prompt 1100;" in md
    assert "memory-bound upper bounds, not predictions of measured speed" in md
    assert "| max batch bound sn40l (full) |" in md and "| tok/s gain bound h200 |" in md
    assert "| KV / sequence (bfloat16) |" in md and "| peak KV bytes (measured, float32) |" in md
    assert "differ from the modelled bfloat16 bytes" in md


def test_a_run_without_request_lengths_falls_back_to_its_longest_and_says_so(tmp_path):
    write_run(tmp_path, binary_rows([1] * 5), method="full", budget=None, peak=(2000, 2100))
    write_run(tmp_path, binary_rows([1] * 5), budget=256)
    cell = build(settings(results_dir=str(tmp_path))).headline.iloc[0]
    assert cell.context_tokens == 2100
    assert cell.context_basis == "longest request (samples.jsonl holds no per-request lengths)"


def test_the_bench_speedup_stands_beside_the_bound_where_measured(tmp_path):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "decode_speed.csv").write_text(
        "prompt_tokens,config,decode_tok_s,steps,speedup_vs_full\n"
        "1024,snapstream_256,9.0,42,1.10\n4096,snapstream_256,9.0,42,1.40\n16384,snapstream_256,9.0,42,3.50\n"
    )
    seen = [3000, 3500, 4000]  # median 3500: nearest bench prompt (log scale) is 4096
    write_run(tmp_path, _with_lengths(binary_rows([1] * 3), seen), method="full", budget=None)
    write_run(tmp_path, binary_rows([1] * 3), budget=256)
    write_run(tmp_path, binary_rows([1] * 3), budget=512)  # not benched: "-"
    rep = build(settings(results_dir=str(tmp_path)))
    md = markdown(rep, {})
    assert "| decode speedup (measured, bench) |" in md
    assert "| 1.40x at 4096 tokens |" in md and re.search(r"\| snapstream \| 512 \|.*\| - \|\n", md)


def test_small_n_cis_are_marked_and_inconclusive_says_why(tmp_path):
    """n = 6: the bootstrap CI lies below 0 while McNemar's p = 0.25: `inconclusive` must say why."""
    write_run(tmp_path, binary_rows([1, 1, 1, 0, 0, 0]), method="full", budget=None)
    write_run(tmp_path, binary_rows([0] * 6), budget=256)
    rep = build(settings(results_dir=str(tmp_path)))
    cell = rep.headline.iloc[0]
    assert cell.ci_high < 0 and cell.p_value == pytest.approx(0.25) and cell.verdict == "inconclusive"
    assert cell.why == (
        "6 paired problems < min_problems=20: the CI excludes 0 but the exact test does not reject "
        "(p = 0.25 >= 0.05), and at this n the bootstrap CI is too narrow to decide alone"
    )
    md = markdown(rep, {})
    assert "-50.00 [-83.33, -16.67]† ?" in md
    assert "† n = 6 < min_problems = 20: a percentile bootstrap CI over this few problems is too narrow" in md


# --- the docs' excerpt ------------------------------------------------------------------------------------

DOC = ROOT / "docs" / "report.md"
START, END = "<!-- excerpt: tests/report/test_report_labels.py -->", "<!-- /excerpt -->"


def excerpt_runs(root: Path) -> None:
    """24 RULER-like problems (partial credit: 0, 25, 50, 100 points) under full and three budgets."""
    full = [100, 100, 50, 0, 100, 25, 0, 100, 50, 0, 100, 0, 25, 100, 0, 50, 100, 0, 0, 100, 50, 0, 25, 0]
    lost = {128: [0, 1, 2, 4, 5, 7, 8, 10, 13, 15, 16], 256: [1, 5, 8, 13, 16], 512: [8, 16]}

    def rows(scores):
        return [sample_row(f"r{i}", [{"score": float(s)}]) for i, s in enumerate(scores)]

    write_run(root, rows(full), method="full", budget=None, peak=(1912, 1968))
    for budget, where in lost.items():
        comp = [0 if i in where else s for i, s in enumerate(full)]
        write_run(root, rows(comp), budget=budget, compression=budget / 1968)


def rendered_excerpt(root: Path) -> str:
    excerpt_runs(root)
    md = write(build(settings(results_dir=str(root))))["md"].read_text()
    section = md.split("## ruler / smollm2_135m", 1)[1].split("### What the budget buys", 1)[0]
    table = section.split("\n\n", 2)[2]  # after the section's "Paired with ..." line
    return "```\n" + table.strip() + "\n```"


def test_docs_report_excerpt_is_what_the_report_renders(tmp_path):
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC} lost its excerpt markers"
    documented = text.split(START, 1)[1].split(END, 1)[0].strip()
    new = rendered_excerpt(tmp_path)
    assert documented == new, (
        f"docs/report.md's excerpt is stale; replace the block between the markers with:\n{new}"
    )
