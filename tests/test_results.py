"""The resume journal survives torn writes; run folders are a pure function of the config."""

import json

from omegaconf import OmegaConf

from evalkit.results import Journal, budget_tag
from evalkit.task import subsample


def test_journal_keeps_complete_records_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "generations.jsonl"
    j = Journal(path)
    j.append({"key": "a", "text": "1"})
    j.append({"key": "b", "text": "2"})
    j.close()
    with open(path, "a") as f:  # a kill mid-write: half a record, no newline
        f.write('{"key": "c", "te')
    j = Journal(path)
    assert set(j.records) == {"a", "b"}
    j.append({"key": "c", "text": "3"})
    j.close()
    assert set(Journal(path).records) == {"a", "b", "c"}


def test_journal_record_without_final_newline_is_not_glued_to_the_next(tmp_path):
    path = tmp_path / "generations.jsonl"
    path.write_text(json.dumps({"key": "a"}) + "\n" + json.dumps({"key": "b"}))  # complete, but no newline
    j = Journal(path)
    j.append({"key": "c"})
    j.close()
    assert set(Journal(path).records) == {"a", "b", "c"}


def test_journal_ignores_duplicates_and_foreign_lines(tmp_path):
    path = tmp_path / "generations.jsonl"
    path.write_text('{"key": "a", "text": "first"}\n[1, 2]\n{"nokey": 1}\n{"key": "a", "text": "second"}\n')
    j = Journal(path)
    assert j.records == {"a": {"key": "a", "text": "first"}}
    j.append({"key": "a", "text": "third"})  # already done: not written twice
    j.close()
    assert path.read_text().count('"key": "a"') == 1


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
