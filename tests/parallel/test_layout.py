"""The ranks of a multi-process run (no process group needed): their checks, torchrun's and SLURM's
environments, the DP split, journal shards, and the layout's absence from a result's identity."""

from __future__ import annotations

import json
import os
import re

import pytest

from evalkit.config import ConfigError, compose
from evalkit.identity import generation_yaml
from evalkit.journal import Journal, JournalError, adopt_shards, fold_shards, shard_path
from evalkit.loading import device_map
from evalkit.team import Ranks, Team, first_host, world_from_env

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}


def cfg(**block):
    return {"parallel": {"tp_size": None, "dp_size": 1, "backend": None, **block}}


@pytest.mark.parametrize(
    "block, env, want",
    [
        ({}, {}, (1, 1, 0, None)),  # one process: today's run
        ({}, TORCHRUN, (4, 1, 3, "gloo")),  # tp defaults to the world size
        ({"dp_size": 4}, TORCHRUN, (1, 4, 3, "gloo")),
        ({"tp_size": 4, "backend": "nccl"}, TORCHRUN, (4, 1, 3, "nccl")),
        ({"tp_size": 2, "dp_size": 2}, TORCHRUN, (2, 2, 3, "gloo")),  # two replicas, each a TP group of 2
        ({}, {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, (8, 1, 5, "gloo")),
    ],
)
def test_layout_from_the_config_and_the_environment(block, env, want, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    lay = Ranks.from_config(cfg(**block), env)
    assert (lay.tp, lay.dp, lay.rank, lay.backend) == want


def test_tp_and_dp_lay_ranks_out_replica_by_replica():
    """rank = dp_rank x tp + tp_rank: a replica's TP group is tp consecutive ranks, its first the TP root."""
    lays = [Ranks(tp=2, dp=2, rank=r) for r in range(4)]
    assert [(x.dp_rank, x.tp_rank, x.writer, x.journals) for x in lays] == [
        (0, 0, True, True), (0, 1, False, False), (1, 0, False, True), (1, 1, False, False)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "block, env, message",
    [
        (
            {"tp_size": 2},
            {},
            "parallel.tp_size=2 x parallel.dp_size=1 = 2 processes, but 1 were started (NPROC=1): set "
            "NPROC=2, or tp_size x dp_size = 1",
        ),
        (
            {"dp_size": 3},
            TORCHRUN,
            "parallel.dp_size=3 does not divide the 4 processes started (NPROC=4); make NPROC a multiple of "
            "dp_size",
        ),
        ({"tp_size": 0}, {}, "parallel.tp_size must be a positive integer, got 0"),
        ({"dp_size": "2"}, {}, "parallel.dp_size must be a positive integer, got '2'"),
        ({"backend": "mpi"}, {}, "parallel.backend must be null, nccl or gloo, got 'mpi'"),
    ],
)
def test_a_layout_that_cannot_run_is_refused(block, env, message):
    with pytest.raises(ConfigError) as e:
        Ranks.from_config(cfg(**block), env)
    assert message in str(e.value)


def test_slurm_sets_the_master_address_from_its_node_list(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_NODELIST": "gpu[03-04]"}
    assert world_from_env(env) == (0, 16, 0)
    assert first_host("gpu[03-05,09],cpu1") == "gpu03"
    assert first_host("node7") == "node7"
    assert os.environ["MASTER_ADDR"] == "gpu03"


def test_replicas_split_the_requests_between_them():
    split = []
    for r in range(3):
        team = Team(Ranks(dp=3, rank=r))
        split.append([i for i in range(10) if team.owns(i)])
    assert split == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_conversations_are_dealt_whole_and_balanced_across_replicas():
    """Two 4-question conversations at DP=2 go one to each replica (dealt by their first question's index,
    both went to replica 0); a conversation is never split; requests of one question are dealt as `owns`
    deals them."""
    convs = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [Team(Ranks(dp=2, rank=r)).take(convs) for r in range(2)] == [[convs[0]], [convs[1]]]
    mixed = [[0], [1, 2, 3, 4], [5], [6], [7]]
    assert [Team(Ranks(dp=2, rank=r)).take(mixed) for r in range(2)] == [[[0], [5], [6], [7]], [[1, 2, 3, 4]]]
    singles = [[i] for i in range(10)]
    for r in range(3):
        team = Team(Ranks(dp=3, rank=r))
        assert [g[0] for g in team.take(singles)] == [i for i in range(10) if team.owns(i)]


@pytest.mark.parametrize("value", ["abc", "nan", "0", "-5", "inf"])
def test_a_bad_dist_timeout_is_refused_in_one_line(value):
    """EVALKIT_DIST_TIMEOUT_S is read with the ranks, before anything loads (it was read when joining the
    process group: a ValueError traceback on every rank, or a timeout of 0)."""
    with pytest.raises(ConfigError) as e:
        Ranks.from_config(cfg(), {**TORCHRUN, "EVALKIT_DIST_TIMEOUT_S": value})
    assert str(e.value) == (
        "EVALKIT_DIST_TIMEOUT_S must be a positive number of seconds (how long a rank waits for the others "
        f"in a collective), got {value!r}"
    )
    assert Ranks.from_config(cfg(), {**TORCHRUN, "EVALKIT_DIST_TIMEOUT_S": "60"}).timeout_s == 60.0


def rec(key: str) -> dict:
    return {"key": key, "doc_id": 0, "repeat": 0, "text": key, "prompt_hash": "0" * 16, "stats": {}}


def test_shards_count_as_done_and_fold_into_one_journal(tmp_path):
    """A shard's records are done for every replica; at scoring rank 0 appends them to its journal once and
    removes the shard; a shard with a line it cannot read is kept (nothing is lost)."""
    (tmp_path / "generations.dp1.jsonl").write_text(json.dumps(rec("t/1/0/0")) + "\n")
    (tmp_path / "generations.dp2.jsonl").write_text(json.dumps(rec("t/2/0/0")) + "\nnot json\n")
    journal = Journal(shard_path(tmp_path, 0))
    journal.append(rec("t/0/0/0"))
    adopt_shards(journal)
    assert set(journal.records) == {"t/0/0/0", "t/1/0/0", "t/2/0/0"}
    fold_shards(journal)
    journal.close()
    lines = [json.loads(x)["key"] for x in journal.path.read_text().splitlines()]
    assert lines == ["t/0/0/0", "t/1/0/0", "t/2/0/0"]
    assert journal.generated_keys == {"t/0/0/0"}  # the shards' records were done before this process
    assert sorted(p.name for p in tmp_path.iterdir()) == ["generations.dp2.jsonl", "generations.jsonl"]


def test_a_shard_names_its_run_and_one_of_another_run_is_refused(tmp_path):
    """A replica shard's first line is the identity of the run that writes it: the same run reopens and
    adopts it; another configuration's run refuses it by name (it was adopted: a budget-64 run scored a
    budget-128 run's generations). The run's own generations.jsonl carries no stamp."""
    shard = Journal(shard_path(tmp_path, 1), run="budget64")
    shard.append(rec("t/1/0/0"))
    shard.close()
    assert json.loads(shard.path.read_text().splitlines()[0]) == {"run": "budget64"}
    assert set(Journal(shard.path, run="budget64").records) == {"t/1/0/0"}  # reopened by its own run
    own = Journal(shard_path(tmp_path, 0), run="budget64")
    adopt_shards(own)
    assert own.adopted == {"t/1/0/0"} and own.path.read_text() == ""
    fold_shards(own)
    assert [json.loads(x)["key"] for x in own.path.read_text().splitlines()] == ["t/1/0/0"]
    assert not shard.path.exists()  # the stamp is no unreadable line: the shard folded away
    shard = Journal(shard_path(tmp_path, 1), run="budget128")
    shard.append(rec("t/2/0/0"))
    shard.close()
    message = f"{shard.path} holds generations of another configuration (run budget128; this run is budget64)"
    with pytest.raises(JournalError, match=re.escape(message)):
        adopt_shards(Journal(shard_path(tmp_path, 0), run="budget64"))
    with pytest.raises(JournalError, match=re.escape(message)):
        Journal(shard.path, run="budget64")


def test_a_stale_shard_of_another_configuration_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """`python -m evalkit` stamps its shards with the run's identity and checks every shard it finds."""
    import evalkit.run as runner
    from evalkit.identity import run_identity
    from tests.conftest import fresh_run, planned_folder

    monkeypatch.setattr(runner, "get_model", lambda spec, team=None: pytest.fail("the model was loaded"))
    args = ["model=tiny_llama", "task.load.n=1", "task.load.lengths=[1024]", "limit=2", "method=snapkv"]
    other = runner.plan(compose(overrides=[*args, "method.budget=128"])).cfg
    folder = planned_folder(tmp_path, *args, "method.budget=64")
    folder.mkdir(parents=True)
    stale = folder / "generations.dp1.jsonl"
    stale.write_text(json.dumps({"run": run_identity(other)}) + "\n" + json.dumps(rec("ruler/0/0/0")) + "\n")
    with pytest.raises(JournalError, match=f"{re.escape(str(stale))} holds generations of another config"):
        fresh_run(*args, "method.budget=64", results=tmp_path)


def test_a_torn_shard_left_beside_a_scored_run_is_said(tmp_path, capsys):
    """A shard whose last line was cut inside a UTF-8 character (its replica killed mid-write, the run then
    resumed under another layout) is kept when the others fold, and the runner says so."""
    cut = '{"key": "t/2/0/0", "text": "é'.encode()[:-1]  # the first byte of two
    (tmp_path / "generations.dp1.jsonl").write_bytes(json.dumps(rec("t/1/0/0")).encode() + b"\n" + cut)
    journal = Journal(shard_path(tmp_path, 0))
    adopt_shards(journal)
    fold_shards(journal)
    assert set(journal.records) == {"t/1/0/0"} and (tmp_path / "generations.dp1.jsonl").exists()
    assert capsys.readouterr().err == (
        f"evalkit: {tmp_path}/generations.dp1.jsonl is left beside a scored run (line 2: not valid UTF-8 (a "
        "write cut short)): its readable records are in generations.jsonl and every request the run scored "
        "was generated; delete the file once you have looked\n"
    )


def test_the_layout_is_no_part_of_a_runs_identity():
    one = compose(overrides=["model=tiny_llama"])
    tp = compose(overrides=["model=tiny_llama", "parallel.tp_size=8", "parallel.backend=nccl"])
    assert generation_yaml(one) == generation_yaml(tp)


def test_a_served_model_is_refused_under_several_processes():
    from evalkit.checks import RunNeeds
    from evalkit.served import ServedSpec

    spec = ServedSpec(name="served", base_url="http://127.0.0.1:8000/v1", tokenizer="smollm2_135m")
    spec.check(RunNeeds("full", "ruler"))  # one process: fine
    with pytest.raises(ConfigError) as e:
        spec.check(RunNeeds("full", "ruler", processes=2))
    assert str(e.value) == (
        "model served is served at http://127.0.0.1:8000/v1: its server does the parallel work; run it with "
        "NPROC=1 (this run started 2 processes)"
    )


@pytest.mark.parametrize(
    "lay, requested, want",
    [
        (Ranks(), "auto", "auto"),  # one process: the conf's own placement
        (Ranks(dp=8, rank=5, local_rank=5, backend="nccl"), "auto", "cuda:5"),  # its own GPU
        (Ranks(dp=2, rank=1, backend="gloo"), None, None),  # CPU replicas
        (Ranks(tp=8, rank=3, local_rank=3, backend="nccl"), None, None),  # TP: transformers places
    ],
)
def test_each_gpu_replica_loads_onto_its_own_gpu(lay, requested, want):
    assert device_map(lay, requested) == want


def test_the_next_command_after_a_parallel_run_starts_as_many_processes(tmp_path, monkeypatch, capsys):
    """The printed `make eval` repeats the run's `parallel.*` overrides: it must start the processes they
    need (NPROC), or it is refused before it loads anything."""
    from types import SimpleNamespace

    from evalkit import summary

    out = tmp_path / "runs" / "ruler" / "tiny_llama" / "snapstream" / "64"
    plan = SimpleNamespace(
        cfg=SimpleNamespace(results_dir=str(tmp_path)), method=SimpleNamespace(name="snapstream"), out=out
    )
    monkeypatch.setattr(summary, "_same_args", lambda: ' ARGS="parallel.tp_size=2 parallel.dp_size=2"')
    summary.next_step([plan])
    assert 'make eval METHOD=full ARGS="parallel.tp_size=2' in capsys.readouterr().out  # one process
    summary.next_step([plan], world=4)
    said = capsys.readouterr().out
    assert 'next: the full-cache reference on the same problems: make eval METHOD=full NPROC=4 ARGS="' in said
    plan.method.name = "full"
    summary.next_step([plan], world=4)
    assert "(make eval METHOD=snapstream BUDGET=256 NPROC=4 ARGS=" in capsys.readouterr().out


def test_the_layout_record_names_every_ranks_gpu():
    """Two nodes of 2 GPUs, TP=2 x DP=2 under nccl: ranks 0-3 sit on cuda:0, cuda:1 of each node (the local
    ranks gathered when the team starts), not on cuda:0..tp-1."""
    team = Team(Ranks(tp=2, dp=2, backend="nccl"), local_ranks=[0, 1, 0, 1])
    assert team.provenance()["devices"] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert Team(Ranks(dp=2, backend="gloo")).provenance()["devices"] == ["cpu", "cpu"]
