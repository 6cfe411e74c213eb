"""The modelled cache of a query-agnostic and a multi-question run is what the cache held after each turn
(the context kept, the questions fed after compression, the answers): the report and the memory report model
the entries the runs measured, and the recommendation follows (issue 31, items 1-2)."""

from __future__ import annotations

import pytest

from evalkit.kv.layout import Shape
from evalkit.memory.report import measured_rows, run_entries
from evalkit.memory.sim import canonical_method
from evalkit.report import settings
from evalkit.report.budget import cache_lengths
from evalkit.report.build import build
from evalkit.report.runs import load_runs
from tests.conftest import fresh_run
from tests.runs_fixture import write_run


def turn_records(context: int, questions: list[int], outputs: list[int], budget, new: bool) -> list[dict]:
    """One conversation's generation records as the engine writes them: turn k feeds its question (and,
    after the first, the previous answer's last token) on the cache the earlier turns left; a cache holds
    every token but the last generated one. `budget`: snapkv's (None: full). `new=False`: the records
    written before `prefill_tokens`, whose later turns counted only their own question as the prompt."""
    recs, before = [], 0
    for k, (q, out) in enumerate(zip(questions, outputs)):
        before = context + q if k == 0 else before + outputs[k - 1] - 1 + 1 + q  # + the fed-back token
        seen = before + out - 1
        kept = seen if budget is None else min(context, budget) + seen - context
        rec = {"output_tokens": out, "hit_limit": False, "max_new_tokens": 4096, "question_tokens": q}
        rec |= {"kv_seen": seen, "kv_kept": kept, "kv_slots": kept, "kv_bytes": 512 * kept}
        rec |= {"conversation": "c", "turn": k, "prompt_tokens": before if new or k == 0 else q}
        recs.append(rec | ({"prefill_tokens": context} if new else {}))
    return recs


def conversation_rows(n: int, budget, new: bool, turns: int = 4) -> list[dict]:
    """`n` conversations of `turns` questions on a 900-token context, every answer right."""
    rows = []
    for c in range(n):
        recs = turn_records(900, [40] * turns, [60] * turns, budget, new)
        for k, rec in enumerate(recs):
            sid = f"c{c}" + (f"/q{k}" if k else "")
            rec["conversation"] = f"c{c}"
            rows.append(
                {"id": sid, "prompt_hash": f"h-{sid}", "predictions": ["x"], "scores": {"score": 100.0}}
            )
            rows[-1] |= {"repeat_scores": [{"score": 100.0}], "generation": [rec]}
    return rows


def measured_at_median(rep, cell) -> int:
    """The compressed run's measured entries at its full run's median request (by cache length)."""
    runs = {r.rel: r for r in rep.runs}
    full = runs[cell.full_run].samples()
    reqs = sorted(
        ((g["kv_seen"], g["prompt_tokens"]), sid) for sid, row in full.items() for g in row["generation"]
    )
    sid = reqs[(len(reqs) - 1) // 2][1]
    return runs[cell.run].samples()[sid]["generation"][0]["kv_slots"]


@pytest.mark.parametrize("new", [True, False], ids=["records", "older records"])
def test_a_multi_question_snapkv_budget_models_what_each_turn_holds_and_is_recommended(tmp_path, new):
    """947 of 947 entries and 'buys no decode gain' before: a later turn's prompt counted only its question,
    so the whole conversation was modelled as prompt appended to a cache of min(question, B)."""
    mq = dict(query_aware=False, multi_question=True)
    write_run(tmp_path, conversation_rows(50, None, new), method="full", budget=None, **mq)
    write_run(tmp_path, conversation_rows(50, 128, new), method="snapkv", budget=128, **mq)
    rep = build(settings(results_dir=str(tmp_path)))
    cell = rep.headline.iloc[0]
    assert cell.kv_entries == measured_at_median(rep, cell) < cell.kv_entries_full
    assert cell.context_prefill_tokens == 900 and cell.memory_saving > 0.5
    (rec,) = rep.by_task
    assert rec["budget"] == 128 and rec["status"] == "non-inferior" and rec["effective_gain_h200"] > 1


@pytest.mark.parametrize("new", [True, False], ids=["records", "older records"])
def test_query_agnostic_snapkv_models_the_question_fed_after_compression(tmp_path, new):
    """Against a query-aware full run: what the compressed run's prefill compressed is the context alone;
    the question fed after it is held whole (modelled 123 entries before, the run held 163)."""
    full = conversation_rows(30, None, new=True, turns=1)
    for row in full:  # query-aware: the question is part of the prefill
        g = row["generation"][0]
        g.pop("question_tokens"), g.pop("conversation"), g.pop("turn")
        g["prefill_tokens"] = g["prompt_tokens"]
    comp = conversation_rows(30, 64, new, turns=1)
    for row in comp:
        row["generation"][0].pop("conversation"), row["generation"][0].pop("turn")
    write_run(tmp_path, full, method="full", budget=None)
    write_run(tmp_path, comp, method="snapkv", budget=64, query_aware=False)
    rep = build(settings(results_dir=str(tmp_path)))
    cell = rep.headline.iloc[0]
    assert cell.kv_entries == measured_at_median(rep, cell) == 163


RUN = [
    "model=tiny_llama",
    "model.max_new_tokens=12",
    "task.load.n=1",
    "task.load.lengths=[1024]",
    "task.load.tasks=[niah_multikey_2]",  # four needles: four questions in multi-question mode
    "query_aware=false",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Full and snapkv 64, query-agnostic and multi-question, on the tiny model."""
    out = tmp_path_factory.mktemp("cache")
    for mode in ([], ["multi_question=true"]):
        for method in (["method=full", "method.budget=null"], ["method=snapkv", "method.budget=64"]):
            fresh_run(*RUN, *mode, *method, results=out)
    return out


def test_the_modelled_cache_is_what_real_query_agnostic_and_multi_question_runs_held(runs):
    """Every request of real runs: the entries modelled from its lengths are the entries its cache held; the
    report at the full run's median request and the memory report's check agree with the runs."""
    found, _ = load_runs(runs)
    assert {(r.method, r.task) for r in found} == {
        (m, t) for m in ("full", "snapkv") for t in ("ruler", "ruler-multi_question")
    }
    for run in found:
        rows = run.samples()
        lengths = cache_lengths(rows)
        assert len(lengths) == (4 if run.task.endswith("multi_question") else 1)
        for (sid, r), (prefill, _, seen) in lengths.items():
            held = rows[sid]["generation"][r]["kv_slots"]
            tiny = Shape(2, 2)  # tiny_llama: 2 KV heads, 2 layers
            assert run_entries(canonical_method(run.method), run.budget, prefill, seen, tiny) == held, (
                run.rel,
                sid,
            )
    rep = build(settings(results_dir=str(runs)))
    for cell in rep.headline.itertuples():
        assert cell.kv_entries == measured_at_median(rep, cell), cell.run
    checked, notes = measured_rows(runs)
    assert not notes and len(checked) == 4 and all(r["match"] for r in checked), checked
