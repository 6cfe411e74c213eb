"""The runner end to end on the tiny random model, for what unit tests cannot see: k repeats reaching pass@1
and cons@k, LiveCodeBench graded in the sandbox with its isolation recorded, LongBench CoT's answer call on a
full cache, context capping and middle truncation counted, shared prefill at batch size > 1, and kills at
chosen moments (no wall clock) resuming to identical results, sampled runs included.

Where an outcome must be known, the model's text is scripted (`scripted`): the harness (journal, scoring,
aggregation) is under test there, not the model."""

import json
from pathlib import Path

import pytest

import evalkit.task
from evalkit import sandbox
from evalkit.config import compose
from evalkit.lm import EvalkitLM
from evalkit.run import run as run_cfg
from tasks.livecodebench import grade
from tests.conftest import killed_run, planned_folder, the_run

ROOT = Path(__file__).resolve().parents[2]


def run(*overrides, results):
    evalkit.task._MEMO.clear()
    return run_cfg(compose(overrides=[*overrides, f"results_dir={results}"]))


def rows(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "samples.jsonl").read_text().splitlines()]


@pytest.fixture
def scripted(monkeypatch):
    """Replace the generated text with `script(sample, repeat)`; generation (and its stats) still runs."""

    def install(script):
        real = EvalkitLM._result

        def result(self, done):
            _, stats = real(self, done)
            p = done.tag.prompt
            return script(p.sample, int(p.key.rsplit("/", 1)[1])), stats

        monkeypatch.setattr(EvalkitLM, "_result", result)

    return install


def test_aime_repeats_reach_pass_at_1_and_cons_at_k(tmp_path, scripted):
    # repeats 0-2 answer correctly for the first problem, one vote goes elsewhere; the second problem gets one
    # right answer out of four, outvoted by a wrong majority
    def script(sample, r):
        right, wrong = int(sample.answers[0]), (int(sample.answers[0]) + 1) % 1000
        if sample.id == first_id:
            return f"\\boxed{{{right if r < 3 else wrong}}}"
        return f"\\boxed{{{right if r == 0 else wrong}}}"

    from tasks.aime24.aime24 import load

    first_id = load(n=2, seed=0).samples[0].id
    scripted(script)
    m = run(
        "model=tiny_llama",
        "task=aime24",
        "task.load.n=2",
        "task.repeats=4",
        "model.max_new_tokens=4",
        "method=full",
        results=tmp_path,
    )[0]
    got = rows(the_run(tmp_path, "full", "none"))
    assert [r["id"] for r in got][0] == first_id and all(len(r["predictions"]) == 4 for r in got)
    assert got[0]["scores"]["pass@1"] == 75.0 and got[0]["scores"]["cons@k"] == 100.0
    assert got[1]["scores"]["pass@1"] == 25.0 and got[1]["scores"]["cons@k"] == 0.0
    assert [s["pass@1"] for s in got[0]["repeat_scores"]] == [100.0, 100.0, 100.0, 0.0]
    assert m["scores"]["pass@1"]["mean"] == 50.0 and m["scores"]["cons@k"]["mean"] == 50.0
    assert m["generation"]["requests"] == 8


def test_livecodebench_grades_in_the_sandbox_and_records_isolation(tmp_path, scripted):
    solutions = json.loads((ROOT / "tasks/livecodebench/data/solutions.json").read_text())
    ids = ["lcbs_001", "lcbs_002"]  # their wrong programs fail fast (a wrong answer, a runtime error)
    data = tmp_path / "lcb.jsonl"
    lines = (ROOT / "tasks/livecodebench/data/sample.jsonl").read_text().splitlines()
    data.write_text("".join(x + "\n" for x in lines if json.loads(x)["question_id"] in ids))

    def script(sample, r):  # repeat 0 the reference, repeat 1 a wrong program of the same problem
        wrong = next(iter(solutions[sample.id]["wrong"].values()))
        return f"```python\n{solutions[sample.id]['reference'] if r == 0 else wrong}```"

    scripted(script)
    m = run(
        "model=tiny_llama",
        "task=livecodebench",
        "task.repeats=2",
        "model.max_new_tokens=4",
        "method=full",
        "task.setup.allow_unisolated=true",
        f"task.load.source={data}",
        results=tmp_path,
    )[0]
    got = {r["id"]: r for r in rows(the_run(tmp_path, "full", "none"))}
    assert sorted(got) == ids
    for sid in ids:
        assert got[sid]["scores"]["pass@1"] == 50.0
        assert [s["pass@1"] for s in got[sid]["repeat_scores"]] == [100.0, 0.0]
    assert m["scores"]["pass@1"]["mean"] == 50.0
    setup = m["task_setup"]
    iso = sandbox.isolation()  # this machine's, probed once per process: what the grading ran under
    assert setup["isolation"] == iso and setup["memory_limit"] == grade.MEMORY_LIMITS[iso["memory"]]
    assert (setup["allow_unisolated"], setup["timeout_s"], setup["memory_mb"]) == (True, 6.0, 4096)


def test_longbench_cot_answer_call_runs_on_a_full_cache(tmp_path):
    run(
        "model=tiny_llama",
        "task=longbench_v2_cot",
        "task.load.n=2",
        "method=snapstream",
        "method.budget=128",
        "model.max_new_tokens=16",
        results=tmp_path,
    )
    for row in rows(the_run(tmp_path, "snapstream", "128")):
        first = row["generation"][0]
        second = first["followup"]
        assert first["followup_method"] == "full"
        assert (
            first["kv_kept"] < first["kv_seen"] and first["kv_slots"] == 128
        )  # the document call: compressed
        assert (
            second["kv_kept"] == second["kv_seen"] and second["kv_evicted_generated"] == 0
        )  # the answer call


def test_context_capping_and_middle_truncation_are_counted(tmp_path):
    # a ~900-token AIME problem and 32k new tokens asked in a 600-token context: cut in the middle, and
    # counted
    data = tmp_path / "long.jsonl"
    data.write_text(
        json.dumps({"id": 1, "problem": "Find x. " * 300 + "What is 1 + 1?", "answer": "2"}) + "\n"
    )
    m = run(
        "model=tiny_llama",
        "task=aime24",
        f"task.load.source={data}",
        "method=full",
        "model.max_length=600",
        "model.max_new_tokens=null",
        results=tmp_path / "long",
    )[0]
    stats = rows(the_run(tmp_path / "long", "full", "none"))[0]["generation"][0]
    assert stats["truncated"] and stats["prompt_tokens"] + stats["max_new_tokens"] <= 600
    assert stats["prompt_tokens"] == 300  # the larger of context - new tokens and half the context is kept
    assert m["generation"]["truncated_prompts"] == 1
    # AIME: a short prompt, 32k new tokens asked, in a 600-token context: generation capped, prompt whole
    m = run(
        "model=tiny_llama",
        "task=aime24",
        "task.load.n=1",
        "method=full",
        "model.max_length=600",
        "model.max_new_tokens=null",
        results=tmp_path / "aime",
    )[0]
    stats = rows(the_run(tmp_path / "aime", "full", "none"))[0]["generation"][0]
    assert not stats["truncated"] and stats["max_new_tokens"] == 600 - stats["prompt_tokens"]
    assert m["generation"]["truncated_prompts"] == 0


def test_shared_prefill_at_batch_size_2_equals_separate_runs(tmp_path):
    common = [
        "model=tiny_llama",
        "task.load.n=2",
        "task.load.lengths=[1024]",
        "task.load.tasks=[niah_single_1]",
        "method=snapstream",
        "batch_size=2",
    ]
    run(*common, "method.budget=[64,128]", results=tmp_path / "shared")
    for budget in ("64", "128"):
        run(*common, f"method.budget={budget}", results=tmp_path / budget)
        a, b = (rows(the_run(tmp_path / d, "snapstream", budget)) for d in ("shared", budget))
        assert [r["predictions"] for r in a] == [r["predictions"] for r in b]
        assert [g["prefill_replayed"] for r in a for g in r["generation"]] == [budget == "128"] * 2


@pytest.mark.parametrize("after", [1, 5])
def test_a_sampled_run_killed_mid_way_resumes_to_identical_samples(tmp_path, after):
    args = [
        "model=tiny_llama",
        "task=aime24",
        "task.load.n=2",
        "task.repeats=3",
        "model.max_new_tokens=12",
        "method=snapstream",
        "method.budget=64",
        "method.recent=32",
        "method.window=16",
    ]
    clean = run(*args, results=tmp_path / "clean")[0]
    killed = killed_run(args, tmp_path / "killed", after)
    assert killed.returncode == -9
    folder = planned_folder(tmp_path / "killed", *args)
    assert folder.name == "64-recent32-window16" and not (folder / "metrics.json").exists()
    resumed = run(*args, results=tmp_path / "killed")[0]
    assert (
        resumed["generation"]["from_journal"] == after and resumed["generation"]["generated_now"] == 6 - after
    )
    a, b = rows(planned_folder(tmp_path / "clean", *args)), rows(folder)
    assert [r["predictions"] for r in a] == [r["predictions"] for r in b]
    assert len({p for r in a for p in r["predictions"]}) > 2  # sampled: the repeats really differ
    assert clean["scores"] == resumed["scores"]
