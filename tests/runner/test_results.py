"""The resume journal survives torn writes; run folders are a pure function of the config."""

import json
import os
import re
import stat

import pytest
from omegaconf import OmegaConf

from evalkit.identity import budget_tag
from evalkit.journal import Journal
from evalkit.results import RunInUse, RunLock, atomic_write, save_figure
from evalkit.task import subsample


def rec(key: str, text: str = "out", **extra) -> dict:
    """A journal record as evalkit.lm writes it."""
    return {"key": key, "doc_id": 0, "repeat": 0, "text": text, "prompt_hash": "0" * 16, "stats": {}, **extra}


def test_journal_keeps_complete_records_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "generations.jsonl"
    j = Journal(path)
    j.append(rec("a", "1"))
    j.append(rec("b", "2"))
    j.close()
    with open(path, "a") as f:  # a kill mid-write: half a record, no newline
        f.write('{"key": "c", "te')
    j = Journal(path)
    assert set(j.records) == {"a", "b"} and j.rejected == []  # a torn last line is normal, not a rejection
    assert j.loaded_keys == {"a", "b"}
    j.append(rec("c", "3"))
    j.close()
    assert set(Journal(path).records) == {"a", "b", "c"}


def test_journal_record_without_final_newline_is_not_glued_to_the_next(tmp_path):
    path = tmp_path / "generations.jsonl"
    path.write_text(json.dumps(rec("a")) + "\n" + json.dumps(rec("b")))  # complete, but no newline
    j = Journal(path)
    j.append(rec("c"))
    j.close()
    assert set(Journal(path).records) == {"a", "b", "c"}


def test_journal_sets_aside_invalid_lines_by_number_and_keeps_first_of_a_key(tmp_path):
    path = tmp_path / "generations.jsonl"
    lines = [
        json.dumps(rec("a", "first")),
        "[1, 2]",  # not an object
        json.dumps(
            {"key": "x", "text": "no doc_id"}
        ),  # a line that once crashed resume: a key and nothing else
        "{not json",  # corrupt in the middle of the file (not a torn last line)
        json.dumps(rec("b", doc_id="3")),  # a field of the wrong type
        json.dumps(rec("a", "second")),  # a duplicate key: the first one stands
        json.dumps(rec("c")),
    ]
    path.write_text("\n".join(lines) + "\n")
    j = Journal(path)
    assert set(j.records) == {"a", "c"} and j.records["a"]["text"] == "first"
    assert [n for n, _ in j.rejected] == [2, 3, 4, 5]
    assert "missing 'doc_id'" in j.rejected[1][1] and "'doc_id' is str" in j.rejected[3][1]
    rejected = (tmp_path / "generations.jsonl.rejected").read_text().splitlines()
    assert rejected == lines[1:5]  # nothing is lost: the set-aside lines are kept verbatim
    j.append(rec("a", "third"))  # already done: not written twice
    j.close()
    assert path.read_text().count('"key": "a"') == 1
    assert Journal(path).rejected == []  # the journal was repaired on disk


def test_journal_refuses_to_write_a_record_it_could_not_read_back(tmp_path):
    j = Journal(tmp_path / "g.jsonl")
    with pytest.raises(ValueError, match="missing 'prompt_hash'"):
        j.append({"key": "a", "doc_id": 0, "repeat": 0, "text": "", "stats": {}})
    j.close()


def test_run_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    first = RunLock(tmp_path)
    first.acquire()
    # flock is per open file description: a second acquire in this process is refused like another process
    with pytest.raises(RunInUse, match=f"pid {os.getpid()}"):
        RunLock(tmp_path).acquire()
    first.release()
    again = RunLock(tmp_path)
    again.acquire()  # released: free again
    again.release()


def test_atomic_write_leaves_no_temp_file_on_failure_and_uses_the_umask_mode(tmp_path):
    with pytest.raises(TypeError):
        atomic_write(tmp_path / "m.json", 12345)  # not text: the write fails half way
    assert list(tmp_path.iterdir()) == []
    atomic_write(tmp_path / "a.txt", "x")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o666 & ~mask


def test_save_figure_is_atomic_and_readable(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "p.png")
    plt.close(fig)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in tmp_path.iterdir()] == ["p.png"]


def test_budget_tag_names_every_changed_setting():
    defaults = OmegaConf.create({"budget": 256, "sink": 4, "recent": None, "window": 32})
    assert (
        budget_tag(OmegaConf.create({"budget": 512, "sink": 4, "recent": None, "window": 32}), defaults)
        == "512"
    )
    changed = OmegaConf.create({"budget": 512, "sink": 4, "recent": 64, "window": 16})
    assert budget_tag(changed, defaults) == "512-recent64-window16"
    assert budget_tag(OmegaConf.create({"budget": None}), OmegaConf.create({"budget": None})) == "none"


def test_subsample_is_seeded_and_keeps_input_order():
    items = list(range(50))
    picks = {tuple(subsample(items, 10, seed)) for seed in range(5)}
    assert len(picks) == 5  # the seed chooses the subset
    assert all(list(p) == sorted(p) and len(p) == 10 for p in picks)  # in input order
    assert subsample(items, 10, 3) == subsample(items, 10, 3) and subsample(items, None, 0) == items
    assert subsample(items, 80, 0) == items


def test_journal_drops_a_line_torn_inside_a_multibyte_character(tmp_path):
    """A kill (or a full disk) can cut the last line inside a UTF-8 character: that torn tail is dropped like
    any other and the run resumes; the same bytes in the middle of the file are set aside, verbatim."""
    path = tmp_path / "generations.jsonl"
    j = Journal(path)
    j.append(rec("a", "café"))
    j.close()
    torn = json.dumps(rec("b", "é"), ensure_ascii=False).encode()
    cut = torn[: torn.index("é".encode()) + 1]  # the first of é's two bytes
    with open(path, "ab") as f:
        f.write(cut)
    j = Journal(path)
    assert set(j.records) == {"a"} and j.records["a"]["text"] == "café" and j.rejected == []
    j.append(rec("c"))
    j.close()
    assert set(Journal(path).records) == {"a", "c"}
    with open(path, "ab") as f:  # not a torn tail: an undecodable line with complete lines after it
        f.write(cut + b"\n" + json.dumps(rec("d")).encode() + b"\n")
    j = Journal(path)
    assert set(j.records) == {"a", "c", "d"} and j.rejected == [(3, "not valid UTF-8")]
    j.close()
    assert (tmp_path / "generations.jsonl.rejected").read_bytes() == cut + b"\n"


@pytest.mark.parametrize(
    "overrides, task, model, tag",
    [
        ([], "ruler", "smollm2_135m", "256"),  # the defaults: the folder every earlier run has
        (["task.load.n=1", "task.load.lengths=[1024]"], "ruler-lengths1024-n1", "smollm2_135m", "256"),
        (["task.load.tasks=[niah_single_1,vt]"], "ruler-tasksniah_single_1+vt", "smollm2_135m", "256"),
        (["limit=2", "seed=3"], "ruler-limit2-seed3", "smollm2_135m", "256"),
        (
            ["model.max_new_tokens=64", "method.recent=64"],
            "ruler",
            "smollm2_135m-max_new_tokens64",
            "256-recent64",
        ),
        (["task=aime24", "task.load.source=/data/aime 2024.jsonl"], "aime24-sourceh", "smollm2_135m", "256"),
        # what never changes a generation stays out: grading, the headline, batching, compiling, where
        (["task.headline=score/vt", "batch_size=4", "compile=true"], "ruler", "smollm2_135m", "256"),
        (["task=livecodebench", "task.setup.workers=1"], "livecodebench", "smollm2_135m", "256"),
    ],
)
def test_settings_changed_from_the_confs_name_the_folders(overrides, task, model, tag):
    """A 6-problem run and the 24-problem default land in different folders, so both can exist; a path
    becomes a short hash (`sourceh<8 hex>`)."""
    import evalkit.run as runner
    from evalkit.config import compose

    out = runner.plan(compose(overrides=[*overrides, "results_dir=R"])).out
    assert out.parts[:2] == ("R", "runs") and out.parts[3:5] == (model, "snapstream") and out.name == tag
    hashed = r"[0-9a-f]{8}" if task.endswith("sourceh") else ""  # a path: 8 hex digits of its hash
    assert re.fullmatch(re.escape(task) + hashed, out.parts[2]), out.parts[2]


def test_a_metrics_file_from_before_the_kept_fraction_name_reads_as_today():
    from evalkit.metrics import Metrics

    old = {"task": "ruler", "headline": "score", "model": {"name": "m"}, "method": {"name": "snapstream"}}
    old |= {"scores": {"score": {"mean": 1.0, "stderr": 0.0, "n": 1}}, "kv": {"compression_ratio": 0.25}}
    assert Metrics.from_json(old).kv == {"kept_fraction": 0.25}
