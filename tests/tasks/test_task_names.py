"""evalkit's lm-eval task names (`evalkit_<task>`) collide with nothing lm-eval ships, and run folders made
before the rename (lm-eval names `ruler`, `aime24`, ...) are still skipped, re-scored and resumed as they
were."""

import json
import shutil
from pathlib import Path

import lm_eval.tasks
import pytest
from lm_eval.tasks._index import TaskIndex

import evalkit.run as runner
from evalkit.config import choices, compose, group_config
from evalkit.journal import LM_EVAL_PREFIX, task_id
from tests.conftest import fresh_run, the_run

ROOT = Path(__file__).resolve().parents[2]
# sampled (T=0.6): equal scores before and after the rename also mean equal per-request seeds
AIME = [
    "model=tiny_llama",
    "task=aime24",
    "task.load.n=2",
    "model.max_new_tokens=8",
    "method=streamingllm",
    "method.budget=64",
]


def test_no_evalkit_task_or_group_name_is_one_lm_eval_ships():
    ours = TaskIndex.build([ROOT / "tasks"])  # every name our YAMLs register: tasks, groups, tags
    shipped = TaskIndex.build([Path(lm_eval.tasks.__file__).parent])  # lm-eval's own registry (~15k names)
    assert {"ruler", "aime24", "longbench2"} <= set(shipped)  # the names that used to collide
    assert ours and not set(ours) & set(shipped)
    assert all(name.startswith(LM_EVAL_PREFIX) for name in ours)  # one scheme: evalkit_<task>
    # every task conf points at one of them, and keeps its own name (make eval TASK=ruler)
    for name in choices("task"):
        cfg = compose(overrides=[f"task={name}"]).task
        assert cfg.name == name and cfg.lm_eval_task in ours
        assert task_id(cfg.lm_eval_task) == cfg.lm_eval_task.removeprefix("evalkit_")


run = fresh_run  # conftest: one call stands for one process


@pytest.fixture
def legacy_tasks(tmp_path, monkeypatch):
    """tasks/ as it was before the rename: AIME registered under lm-eval's name `aime24` (which lm-eval
    ships)."""
    old = tmp_path / "old_tasks" / "aime24"
    shutil.copytree(ROOT / "tasks" / "aime24", old, ignore=shutil.ignore_patterns("__pycache__"))
    yaml = old / "aime24.yaml"
    yaml.write_text(yaml.read_text().replace("task: evalkit_aime24\n", "task: aime24\n"))
    assert "task: aime24\n" in yaml.read_text()
    monkeypatch.setattr(runner, "TASKS_DIR", old.parent)


def test_a_run_folder_made_under_the_old_names_is_skipped_rescored_and_resumed(
    tmp_path, monkeypatch, capsys, legacy_tasks
):
    assert group_config("task", "aime24").lm_eval_task == "evalkit_aime24"
    legacy = run(*AIME, "task.lm_eval_task=aime24", results=tmp_path / "old")[0]  # the old naming, as then
    out = the_run(tmp_path / "old", "streamingllm", "64")
    assert "lm_eval_task: aime24\n" in (out / "config.yaml").read_text()
    old_keys = [json.loads(x)["key"] for x in (out / "generations.jsonl").read_text().splitlines()]
    assert sorted(old_keys) == ["aime24/0/0/0", "aime24/1/0/0"]
    monkeypatch.undo()  # from here on: today's tasks/ and conf (lm_eval_task: evalkit_aime24)

    fresh = run(*AIME, results=tmp_path / "new")[0]
    new_out = the_run(tmp_path / "new", "streamingllm", "64")
    new_keys = [json.loads(x)["key"] for x in (new_out / "generations.jsonl").read_text().splitlines()]
    # the journal keys, and the per-request sampling seeds built from them, did not change
    assert sorted(new_keys) == sorted(old_keys)
    assert fresh["identity"] == legacy["identity"] and fresh["scores"] == legacy["scores"]

    def no_model(spec):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(runner, "get_model", no_model)
    capsys.readouterr()
    run(*AIME, results=tmp_path / "old")  # done: skipped, not refused as "a different config"
    assert "is complete; skipping" in capsys.readouterr().out

    import tasks.aime24.aime24 as aime24

    monkeypatch.setattr(aime24, "SCORER_VERSION", aime24.SCORER_VERSION + 1)
    rescored = run(*AIME, results=tmp_path / "old")[0]  # re-scored from the old journal, without a model
    assert rescored["generation"]["from_journal"] == 2 and rescored["scores"] == legacy["scores"]
    assert rescored["identity"]["generation"] == legacy["identity"]["generation"]
    monkeypatch.undo()

    lines = (out / "generations.jsonl").read_text().splitlines()
    (out / "generations.jsonl").write_text(lines[0] + "\n")  # killed after one generation
    for name in ("metrics.json", "samples.jsonl"):
        (out / name).unlink()
    resumed = run(*AIME, results=tmp_path / "old")[0]
    assert resumed["generation"]["from_journal"] == 1 and resumed["generation"]["generated_now"] == 1
    assert resumed["scores"] == legacy["scores"]  # the resumed request sampled what it did the first time

    def predictions(folder):
        return [json.loads(x)["predictions"] for x in (folder / "samples.jsonl").read_text().splitlines()]

    assert predictions(out) == predictions(new_out)
