"""What a run is: each setting that changes generations changes the generation identity (and nothing else
does), so the report never pairs, and the leaderboard never merges, runs that generated differently."""

from __future__ import annotations

import pytest

from evalkit.config import compose
from evalkit.identity import hashes

BASE = ["model=tiny_llama", "task=ruler", "method=snapstream", "method.budget=64"]


def identity(*overrides, task_version=1, data_hash="d" * 64, scorer_version=1) -> dict:
    return hashes(compose(overrides=[*BASE, *overrides]), task_version, data_hash, scorer_version)


@pytest.mark.parametrize(
    "overrides, changed",
    [
        (["seed=1"], {}),
        ([], {"data_hash": "e" * 64}),
        (["model=smollm2_135m"], {}),
        (["model.max_new_tokens=7"], {}),
        ([], {"task_version": 2}),
        (["task.repeats=2"], {}),
        (["limit=3"], {}),
        (["task.load.n=5"], {}),
    ],
)
def test_each_generation_setting_changes_the_generation_identity(overrides, changed):
    base, other = identity(), identity(*overrides, **changed)
    assert other["generation"] != base["generation"]
    assert other["method"] == base["method"] and other["scoring"] == base["scoring"]


@pytest.mark.parametrize(
    "overrides, generation_same, method_same, scoring_same",
    [
        (["method.budget=128"], True, False, True),  # the method is its own identity
        (["results_dir=/elsewhere"], True, True, True),  # where results live changes nothing
        (["task.headline=score/vt"], True, True, False),  # grading: re-scored, never regenerated
        (["compile=false"], True, True, True),  # an added setting at the value older runs had
        (["batch_size=4"], True, True, True),  # outputs equal batch 1: a batch-4 run resumes or pairs
    ],
)
def test_what_does_not_change_the_generation_identity(overrides, generation_same, method_same, scoring_same):
    base, other = identity(), identity(*overrides)
    assert (other["generation"] == base["generation"]) is generation_same
    assert (other["method"] == base["method"]) is method_same
    assert (other["scoring"] == base["scoring"]) is scoring_same


def test_a_new_scorer_version_changes_only_the_scoring_identity():
    base, other = identity(), identity(scorer_version=2)
    assert other["scoring"] != base["scoring"] and other["generation"] == base["generation"]
