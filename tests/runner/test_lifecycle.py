"""What a run folder goes through, in process on the tiny random model: re-scoring from the journal without a
model when the scorer changes, a finished run on changed data refused, every bad input refused before the
model loads, one process per folder, and evalkit's scores equal to lm-eval's own `process_results`."""

import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import evalkit.run as runner
from evalkit.config import ConfigError, compose
from evalkit.journal import JournalError
from evalkit.results import RunInUse, RunLock
from evalkit.task import DataError
from tests.conftest import fresh_run, planned_folder

ROOT = Path(__file__).resolve().parents[2]
RULER = [
    "model=tiny_llama",
    "task.load.n=1",
    "task.load.lengths=[1024]",
    "task.load.tasks=[niah_single_1,vt]",
]
AIME = ["model=tiny_llama", "task=aime24", "task.load.n=2", "model.max_new_tokens=8", "method=streamingllm"]


run = fresh_run  # conftest: one call stands for one process


def folder(results, *overrides):
    """The run folder of RULER + budget 64 (or of the overrides given)."""
    return planned_folder(results, *(overrides or (*RULER, "method.budget=64")))


@pytest.fixture
def no_model(monkeypatch):
    """Any model load fails the test: what follows must be done from the journal alone."""

    def refuse(spec):
        raise AssertionError(f"the model {spec.name} was loaded")

    monkeypatch.setattr(runner, "get_model", refuse)


def test_a_changed_scorer_rescores_from_the_journal_without_a_model(tmp_path, monkeypatch, capsys):
    args = [*RULER, "method.budget=64"]
    first = run(*args, results=tmp_path)[0]
    out = folder(tmp_path)
    journal = (out / "generations.jsonl").read_bytes()
    assert first["generation"]["generated_now"] == 2 and first["generation"]["from_journal"] == 0
    import tasks.ruler.ruler as ruler

    version = ruler.SCORER_VERSION
    assert first["scorer_version"] == version and first["identity"]["scoring"]
    monkeypatch.setattr(ruler, "SCORER_VERSION", version + 1)  # a fixed scorer: every prediction scores 42
    monkeypatch.setattr(ruler, "score", lambda predictions, sample: {"score": 42.0})
    with monkeypatch.context() as m:
        m.setattr(runner, "get_model", lambda spec: pytest.fail("re-scoring loaded the model"))
        again = run(*args, results=tmp_path)[0]
    assert "re-scoring from its journal" in capsys.readouterr().out
    assert again["scorer_version"] == version + 1 and again["scores"]["score"]["mean"] == 42.0
    assert again["generation"]["generated_now"] == 0 and again["generation"]["from_journal"] == 2
    assert (out / "generations.jsonl").read_bytes() == journal  # nothing generated, nothing rewritten
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["scores"] for r in rows] == [{"score": 42.0}] * 2 and [r["repeat_scores"] for r in rows] == [
        [{"score": 42.0}]
    ] * 2
    assert again["identity"]["scoring"] != first["identity"]["scoring"]
    assert again["identity"]["generation"] == first["identity"]["generation"]
    capsys.readouterr()
    run(*args, results=tmp_path)  # up to date now: skipped
    assert "is complete; skipping" in capsys.readouterr().out


def test_a_changed_headline_rescores_and_a_changed_generation_setting_is_refused(
    tmp_path, no_model, monkeypatch
):
    monkeypatch.undo()  # the first run needs the model
    run(*RULER, "method.budget=64", results=tmp_path)
    monkeypatch.setattr(runner, "get_model", lambda spec: pytest.fail("loaded"))
    m = run(*RULER, "method.budget=64", "task.headline=score/vt", results=tmp_path)[0]
    assert m["headline"] == "score/vt" and m["generation"]["generated_now"] == 0
    with pytest.raises(ConfigError, match="different config: compile: False there, True now"):
        run(*RULER, "method.budget=64", "compile=true", results=tmp_path)


def test_a_finished_run_without_its_samples_is_rebuilt_from_the_journal(tmp_path, monkeypatch, capsys):
    """samples.jsonl deleted (or lost) under a finished run: rebuilt from the journal without a model, equal
    to what it was, instead of the run being skipped as complete forever."""
    args = [*RULER, "method.budget=64"]
    run(*args, results=tmp_path)
    out = folder(tmp_path)
    samples, journal = (out / "samples.jsonl").read_bytes(), (out / "generations.jsonl").read_bytes()
    (out / "samples.jsonl").unlink()
    monkeypatch.setattr(runner, "get_model", lambda spec: pytest.fail("rebuilding loaded the model"))
    capsys.readouterr()
    again = run(*args, results=tmp_path)[0]
    assert "samples.jsonl is missing; rebuilding it from its journal" in capsys.readouterr().out
    assert (out / "samples.jsonl").read_bytes() == samples
    assert (out / "generations.jsonl").read_bytes() == journal
    assert again["generation"]["generated_now"] == 0 and again["generation"]["from_journal"] == 2


def test_a_finished_run_on_changed_data_is_refused_not_skipped(tmp_path):
    data = tmp_path / "aime.jsonl"
    shutil.copy(ROOT / "tasks/aime24/data/sample.jsonl", data)
    run(*AIME, f"task.load.source={data}", results=tmp_path / "r")
    rows = data.read_text().splitlines()
    row = json.loads(rows[0])
    row["problem"] += " (edited)"
    data.write_text("\n".join([json.dumps(row), *rows[1:]]) + "\n")
    with pytest.raises(DataError, match="now hashes to"):
        run(*AIME, f"task.load.source={data}", results=tmp_path / "r")


def test_a_journal_for_other_prompts_is_refused_when_scoring(tmp_path, monkeypatch):
    run(*RULER, "method.budget=64", results=tmp_path)
    out = folder(tmp_path)
    recs = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    recs[0]["prompt_hash"] = "f" * 16  # as if the prompt template changed without a VERSION bump
    (out / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (out / "metrics.json").unlink()
    monkeypatch.setattr(runner, "get_model", lambda spec: pytest.fail("loaded"))
    with pytest.raises(JournalError, match="generated for another prompt"):
        run(*RULER, "method.budget=64", results=tmp_path)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["task.load.n=0"], ConfigError, "task.load.n must be null (all) or a positive integer"),
        (["task.load.n=-1"], ConfigError, "task.load.n must be"),
        (["task.name=../../x"], ConfigError, "task.name must be a plain name"),
        (["model.name=../../x"], ConfigError, "model.name must be a plain name"),
        (["method._target_=os.system"], ConfigError, "must name a KV method class in evalkit.kv"),
        (["method.recent=../../y"], ConfigError, "recent must be int or null, got '../../y'"),
        (["method.budget=abc"], ConfigError, "budget must be a positive integer"),
        (["+method.recnet=3"], ConfigError, "unknown setting 'recnet'"),
        (["results_dir=/proc/evalkit"], ConfigError, "results_dir: cannot write into /proc/evalkit"),
        (["model.max_new_tokens=0"], ConfigError, "model.max_new_tokens must be null (the task's own limit)"),
        (["model.max_new_tokens=-5"], ConfigError, "model.max_new_tokens must be"),
        (
            ["+task.load.lenghts=[512]"],
            ConfigError,
            "unknown setting(s) task.load.lenghts; its load settings: ",
        ),
        (
            ["method.budget=9000"],
            ConfigError,
            "method.budget=9000 is above tiny_llama's context of 8192 tokens",
        ),
        (["method.budget=[64,9000]"], ConfigError, "method.budget=9000 is above"),
    ],
)
def test_bad_input_is_refused_before_data_or_model(overrides, error, message, tmp_path, no_model):
    cfg = compose(overrides=[*RULER, f"results_dir={tmp_path}", *overrides])
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        runner.run(cfg)
    assert not (tmp_path / "runs").exists()


def test_a_load_setting_a_tasks_catch_all_would_swallow_is_refused(tmp_path, no_model):
    cfg = compose(overrides=[*AIME, f"results_dir={tmp_path}", "+task.load.sourse=/x.jsonl"])
    with pytest.raises(
        ConfigError, match=r"task aime24: unknown setting\(s\) task.load.sourse; its load settings: n"
    ):
        runner.run(cfg)


def test_results_dir_that_is_a_file_fails_early_and_leaves_nothing(tmp_path, no_model):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="results_dir: cannot write"):
        run(*RULER, results=blocker / "sub")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_writable_check_keeps_a_concurrent_jobs_folder_and_retries_a_removed_parent(
    tmp_path, monkeypatch
):
    """A parallel sweep's two jobs check sibling run folders under one new parent: one's clean-up finds the
    other's folder inside the parent it made and keeps both (rmdir raised ENOTEMPTY: the job failed); a
    parent the other's clean-up removed between two steps is made again."""
    import tempfile

    from evalkit import results

    parent, real, calls = tmp_path / "runs" / "snapstream", tempfile.TemporaryFile, []

    def concurrent(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            (parent / "128").mkdir()  # the other job, meanwhile
        elif len(calls) == 2:
            raise FileNotFoundError(2, "No such file or directory")  # the other job's clean-up, meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(results.tempfile, "TemporaryFile", concurrent)
    results.check_writable(parent / "64")
    assert sorted(p.name for p in parent.iterdir()) == ["128"]
    results.check_writable(parent / "256")  # the retry finds it writable
    assert len(calls) == 3 and sorted(p.name for p in parent.iterdir()) == ["128"]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "no usable samples in local:.*: the source holds no rows"),
        (
            '{"id": 1, "problem": "p"}\n{"id": 2, "answer": "12"}\n',
            "1: missing field.*answer.*2: missing field.*problem",
        ),
    ],
)
def test_zero_samples_fail_before_the_model_with_the_reasons(content, message, tmp_path, no_model):
    data = tmp_path / "aime.jsonl"
    data.write_text(content)
    with pytest.raises(DataError, match=message):
        run(*AIME, f"task.load.source={data}", results=tmp_path / "r")
    assert not (tmp_path / "r" / "runs").exists()


def test_model_max_length_and_revision_are_settable_on_every_model_conf():
    from evalkit.config import choices

    for name in choices("model"):
        cfg = compose(overrides=[f"model={name}", "model.max_length=2048", "model.revision=abc"])
        assert cfg.model.max_length == 2048 and cfg.model.revision == "abc"


def test_a_second_process_on_the_same_folder_is_refused(tmp_path):
    out = folder(tmp_path)
    lock = RunLock(out)
    lock.acquire()
    try:
        with pytest.raises(RunInUse, match="is being run by pid"):
            run(*RULER, "method.budget=64", results=tmp_path)
    finally:
        lock.release()
    assert not (out / "generations.jsonl").exists()  # refused before generating anything


def test_evalkit_scores_equal_lm_evals_process_results(tmp_path, monkeypatch):
    """The runner scores from the journal itself; lm-eval's own path (the YAML's process_results, fed the same
    generations) must give the same per-sample scores."""
    from lm_eval import simple_evaluate
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager, get_task_dict

    from evalkit.journal import Journal
    from evalkit.lm import EvalkitLM

    run(*AIME, "task.repeats=2", results=tmp_path)  # sampled at T=0.6: the two repeats differ
    out = folder(tmp_path, *AIME, "task.repeats=2")
    journal = Journal(out / "generations.jsonl")
    model, tokenizer = runner.get_model(runner.plans_for(compose(overrides=AIME))[0].spec)
    evalkit_lm = EvalkitLM(model="tiny_llama", hf_model=model, tokenizer=tokenizer, journal=journal)

    class Replay(LM):  # answers every request from the journal, exactly as EvalkitLM keys them
        def generate_until(self, requests, disable_tqdm=False):
            return evalkit_lm.generate_until(requests, disable_tqdm=True)

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    from evalkit.engine import Engine

    monkeypatch.setattr(Engine, "_prefill", lambda *a, **k: pytest.fail("a request was not in the journal"))
    meta = {"source": "sample", "n": 2, "seed": 0, "tokenizer": "smollm2_135m"}
    manager = TaskManager(include_path=str(ROOT / "tasks"), include_defaults=False, metadata=meta)
    tasks = get_task_dict(["evalkit_aime24"], manager)
    for task in tasks.values():
        task.config.repeats = 2
    result = simple_evaluate(
        model=Replay(), tasks=list(tasks.values()), log_samples=True, bootstrap_iters=0, task_manager=manager
    )
    journal.close()
    logged = sorted(result["samples"]["evalkit_aime24"], key=lambda s: s["doc_id"])
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == len(logged) == 2
    for row, s in zip(rows, logged):
        assert (
            row["predictions"] == s["resps"][0] and len(set(row["predictions"])) == 2
        )  # lm-eval batches repeats
        assert row["scores"] == {k: s[k] for k in s["metrics"]} and row["id"] == s["doc"]["id"]
        assert len(row["repeat_scores"]) == 2
        assert row["scores"]["pass@1"] == sum(r["pass@1"] for r in row["repeat_scores"]) / 2


def test_a_malformed_data_file_is_named_in_the_error(tmp_path, no_model):
    essay = tmp_path / "PaulGrahamEssays.json"
    essay.write_text('{"text": "an essay", oops}')
    with pytest.raises(DataError, match=f"{essay}: not valid JSON \\(line 1, column 22"):
        run(
            "model=tiny_llama",
            "task=ruler_paper",
            "task.load.n=1",
            "task.load.lengths=[1024]",
            "task.load.tasks=[niah_single_2]",
            f"task.load.essay_path={essay}",
            results=tmp_path / "r",
        )


def test_an_unparsable_json_line_is_a_skipped_row_named_by_file_and_line(tmp_path):
    from tasks.aime24.aime24 import load

    rows = (ROOT / "tasks/aime24/data/sample.jsonl").read_text().splitlines()
    data = tmp_path / "aime.jsonl"
    data.write_text("\n".join([rows[0], '{"id": 99, "problem": "torn', *rows[1:]]) + "\n")
    loaded = load(source=str(data))
    assert [(s.id, s.reason) for s in loaded.skipped] == [
        ("aime.jsonl:2", "line 2 is not valid JSON (Unterminated string starting at)")
    ]
    assert len(loaded.samples) == len(rows)


def test_a_headline_naming_no_metric_is_refused_before_the_model_loads(tmp_path, no_model):
    """The task declares its metrics (`score_keys`): a headline naming none is refused before anything loads
    (issue 31.10: it was refused only after every sample had been generated)."""
    with pytest.raises(
        ConfigError, match=r"task.headline='scroe' names no metric of task ruler \(its metrics: score, and "
    ):
        run(*RULER, "method.budget=64", "task.headline=scroe", results=tmp_path)
    assert not folder(tmp_path).exists()  # nothing generated, nothing written


def test_a_breakdown_headline_no_sample_scored_is_named_and_the_fix_rescores_without_the_model(
    tmp_path, no_model, monkeypatch
):
    monkeypatch.undo()  # the first run needs the model
    with pytest.raises(
        ConfigError, match=r"task.headline='score/nope' names no metric of task ruler \(its metrics: "
    ):
        run(*RULER, "method.budget=64", "task.headline=score/nope", results=tmp_path)
    assert not (folder(tmp_path) / "metrics.json").exists()
    monkeypatch.setattr(runner, "get_model", lambda spec: pytest.fail("loaded"))
    m = run(*RULER, "method.budget=64", results=tmp_path)[0]  # every generation was journaled
    assert m["headline"] == "score" and m["generation"]["generated_now"] == 0


@pytest.mark.parametrize(
    "damage, message",
    [
        ("config", "config.yaml is not a config evalkit wrote"),
        ("journal", "generations.jsonl is not a file"),
    ],
)
def test_a_damaged_run_folder_is_refused_by_name(tmp_path, damage, message, no_model):
    out = folder(tmp_path)
    out.mkdir(parents=True)
    if damage == "config":
        (out / "config.yaml").write_bytes(b"\x00\xff: [unclosed")
    else:
        (out / "generations.jsonl").mkdir()
    with pytest.raises(ConfigError, match=message):
        run(*RULER, "method.budget=64", results=tmp_path)


def test_a_method_setting_equal_to_its_default_is_the_default_run(tmp_path):
    """`method.recent=32` at budget 256 is what the default (budget // 8) resolves to: the same folder, config
    and identity as the default run, so it is skipped or resumed, never run again into a second folder; at
    budget 512 (default recent 64) it is a setting of its own."""

    def planned(*overrides):
        return runner.plan(compose(overrides=[*RULER, *overrides, f"results_dir={tmp_path}"]))

    default = planned("method.budget=256")
    same = planned("method.budget=256", "method.recent=32")
    assert same.out == default.out and same.out.name == "256"
    assert OmegaConf.to_yaml(same.cfg) == OmegaConf.to_yaml(default.cfg)
    assert planned("method.budget=512", "method.recent=32").out.name == "512-recent32"
    assert planned("method.budget=256", "method.recent=64").out.name == "256-recent64"


def test_settings_are_canonicalised_one_at_a_time_with_the_others_as_given(tmp_path):
    """recent=32 is the default recent at budget 64 only with the default window (max(64 // 8, 32)); with
    window=16 the default would be 16, so recent=32 is a setting of its own there."""
    plan = runner.plan(
        compose(
            overrides=[
                *RULER,
                "method.budget=64",
                "method.recent=32",
                "method.window=16",
                f"results_dir={tmp_path}",
            ]
        )
    )
    assert plan.out.name == "64-recent32-window16" and plan.method.recent == 32
    plan = runner.plan(
        compose(overrides=[*RULER, "method.budget=64", "method.recent=32", f"results_dir={tmp_path}"])
    )
    assert plan.out.name == "64"


def test_a_scorer_edited_without_a_version_bump_rescores(tmp_path, monkeypatch, capsys):
    import evalkit.identity

    run(*RULER, "method.budget=64", results=tmp_path)
    monkeypatch.setattr(evalkit.identity, "scorer_code", lambda module: "edited")  # same SCORER_VERSION
    monkeypatch.setattr(runner, "get_model", lambda spec: pytest.fail("re-scoring loaded the model"))
    capsys.readouterr()
    again = run(*RULER, "method.budget=64", results=tmp_path)[0]
    assert "re-scoring from its journal" in capsys.readouterr().out
    assert again["generation"]["generated_now"] == 0


def test_the_scorer_digest_follows_the_task_packages_source(tmp_path):
    import importlib.util

    from evalkit.identity import scorer_code

    pkg = tmp_path / "mytask"
    pkg.mkdir()
    (pkg / "mytask.py").write_text("def score(p, s):\n    return {'score': 1.0}\n")
    (pkg / "grade.py").write_text("X = 1\n")
    spec = importlib.util.spec_from_file_location("mytask_probe", pkg / "mytask.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = scorer_code(module)
    assert scorer_code(module) == before  # stable
    (pkg / "grade.py").write_text("X = 2\n")  # a grader beside the module changed
    assert scorer_code(module) != before


def test_a_run_says_what_it_evaluates_where_it_lands_and_what_comes_next(tmp_path, capsys):
    out = folder(tmp_path)
    run(*RULER, "method.budget=64", results=tmp_path)
    said = capsys.readouterr().out
    assert "evalkit: ruler: 2 problems x 1 repeat (generated:ruler@v" in said and "on tiny_llama" in said
    assert f"  -> {out}  (new)" in said and f"evalkit: results in {out}/" in said
    assert "next: the full-cache reference on the same problems: make eval METHOD=full" in said
    run(*RULER, "method=full", results=tmp_path)
    assert "next: a compressed run on the same problems" in capsys.readouterr().out
    run(*RULER, "method.budget=64", results=tmp_path)
    said = capsys.readouterr().out
    assert f"  -> {out}  (complete: skipped)" in said
    assert f'next: compressed vs full, problem by problem: make report ARGS="results_dir={tmp_path}"' in said


def test_skipped_rows_are_listed_when_the_run_starts(tmp_path, capsys):
    rows = (ROOT / "tasks/aime24/data/sample.jsonl").read_text().splitlines()
    data = tmp_path / "aime.jsonl"
    data.write_text("\n".join([rows[0], '{"id": 99, "problem": "torn', *rows[1:2]]) + "\n")
    run(*AIME, f"task.load.source={data}", results=tmp_path / "r")
    said = capsys.readouterr().out
    assert f"evalkit: 1 row(s) of local:{data} skipped: aime.jsonl:2: line 2 is not valid JSON" in said


def test_real_runner_output_pairs_in_the_report_across_batch_sizes(tmp_path):
    """The runner's own metrics.json and samples.jsonl (not fixtures) pair through the report; a full run at
    batch 2 pairs with a compressed run at batch 1 (outputs do not depend on the batch); a full run on other
    data (another seed) is never its partner."""
    from evalkit.report import settings
    from evalkit.report.build import pair_all
    from evalkit.report.runs import load_runs

    run(*RULER, "method=full", "batch_size=2", results=tmp_path)
    run(*RULER, "method.budget=64", results=tmp_path)
    runs, notes = load_runs(tmp_path)
    pairings, problems = pair_all(runs, settings(results_dir=str(tmp_path)))
    assert not problems and not notes and len(pairings) == 1
    (p,) = pairings
    assert p.full.is_full and p.compressed.budget == 64 and not p.only_full and not p.only_compressed
    assert p.cells["score"]["n_paired"] == 2
    import os

    from evalkit.leaderboard import _model_title

    hw = p.compressed.metrics.provenance["hardware"]  # where it computed, named in the plots' titles
    assert hw.startswith(f"CPU ({os.cpu_count()} cores") and hw in _model_title([p.compressed])
    run(*RULER, "method=full", "seed=1", results=tmp_path / "other")  # another seed: other problems
    (tmp_path / "runs").rename(tmp_path / "runs_a")
    (tmp_path / "other" / "runs").rename(tmp_path / "runs")
    for path in (tmp_path / "runs_a").glob("*/*/snapstream"):
        path.rename(next((tmp_path / "runs").glob("*/*")) / "snapstream")
    runs, _ = load_runs(tmp_path)
    pairings, problems = pair_all(runs, settings(results_dir=str(tmp_path)))
    assert not pairings and problems
