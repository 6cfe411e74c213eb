"""`python -m evalkit` across 2 processes under torchrun (CPU, gloo): one writer, DP shards, failures and
resumes. Each run starts two Python processes (TP=2 x DP=2 starts four: those two cases are marked slow)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import evalkit.run as runner
import evalkit.task
from evalkit.config import compose
from evalkit.journal import read_records
from evalkit.results import RunLock
from tests.conftest import planned_folder

ROOT = Path(__file__).resolve().parents[2]
RUN = ["model=tiny_llama", "task.load.n=1", "task.load.lengths=[1024]", "limit=4", "model.max_new_tokens=4"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def torchrun(
    results: Path, *overrides: str, script=("-m", "evalkit"), fail=None, nproc=2, env=()
) -> subprocess.CompletedProcess:
    env = {**ENV, **dict(env), **({"EVALKIT_TEST_FAIL": fail} if fail else {})}
    cmd = [*TORCHRUN, str(nproc), *script, *RUN, *overrides, f"results_dir={results}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def one_process(results: Path, *overrides: str) -> Path:
    evalkit.task._MEMO.clear()
    runner.run(compose(overrides=[*RUN, *overrides, f"results_dir={results}"]))
    return planned_folder(results, *RUN, *overrides)


def predictions(folder: Path) -> list:
    """What a run answered and scored, sample by sample (timings left out)."""
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    return [(r["id"], r["predictions"], r["scores"]) for r in rows]


def headline(folder: Path) -> dict:
    m = json.loads((folder / "metrics.json").read_text())
    return {k: m[k] for k in ("scores", "n", "identity")}  # the identity too: the layout is no part of it


def journal_keys(folder: Path) -> list[str]:
    return [json.loads(line)["key"] for line in (folder / "generations.jsonl").read_text().splitlines()]


def test_make_eval_nproc2_tensor_parallel_writes_the_journal_once(tmp_path):
    args = f"parallel.tp_size=2 {' '.join(RUN[1:])} results_dir={tmp_path}"
    cmd = [
        "make",
        "-s",
        "-o",
        ".venv/.stamp",
        "eval",
        "MODEL=tiny_llama",
        "METHOD=snapstream",
        "BUDGET=64",
        "NPROC=2",
        f"ARGS={args}",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = planned_folder(tmp_path, *RUN, "method.budget=64")
    keys = journal_keys(folder)
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 4  # each request journaled once, by rank 0
    assert done.stdout.count("evalkit: results in") == 1  # one writer reports
    layout = json.loads((folder / "metrics.json").read_text())["parallel"]
    assert {k: layout[k] for k in ("tp", "dp", "world_size", "backend")} == dict(
        tp=2, dp=1, world_size=2, backend="gloo"
    )
    kv = layout["kv_bytes_allocated_per_rank"]
    assert len(kv) == 2 and all(b > 0 for b in kv)
    ref = one_process(tmp_path / "one", "method.budget=64")
    assert predictions(folder) == predictions(ref) and headline(folder) == headline(ref)
    # the whole cache under any layout, and each rank's share of tiny_llama's 2 KV heads beside it
    tp2, one = (json.loads((f / "metrics.json").read_text())["kv"] for f in (folder, ref))
    assert tp2["peak_bytes"] == one["peak_bytes"] == 2 * tp2["peak_bytes_per_rank"] > 0
    assert one["peak_bytes_per_rank"] == one["peak_bytes"]
    assert tp2["peak_seen_tokens"] == one["peak_seen_tokens"]


def test_a_layout_that_does_not_fit_the_processes_is_refused_before_any_load(tmp_path):
    cmd = [sys.executable, "-m", "evalkit", *RUN, "parallel.tp_size=2", f"results_dir={tmp_path}"]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert (
        "parallel.tp_size=2 x parallel.dp_size=1 = 2 processes, but 1 were started (NPROC=1): set NPROC=2"
        in done.stderr
    )
    assert not (tmp_path / "runs").exists()


def test_a_bad_dist_timeout_is_one_line_on_each_rank(tmp_path):
    """EVALKIT_DIST_TIMEOUT_S=abc under a 2-process layout: one line on stderr and exit status 2,
    before anything loads (it was a ValueError traceback once the rank joined the process group)."""
    env = {**ENV, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "EVALKIT_DIST_TIMEOUT_S": "abc"}
    cmd = [sys.executable, "-m", "evalkit", *RUN, f"results_dir={tmp_path}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "evalkit: error: EVALKIT_DIST_TIMEOUT_S must be a positive number of seconds (how long a rank waits "
        "for the others in a collective), got 'abc'"
    ]
    assert not (tmp_path / "runs").exists()


def alive(pid: int) -> bool:
    """A process that runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_ranks_die_with_their_launcher(tmp_path):
    """`kill -9` of torchrun: its ranks (each in a session of its own) die with it instead of running on as
    orphans, rank 0 holding the run folder's lock."""
    cmd = [*TORCHRUN, "2", "tests/parallel/orphan.py", str(tmp_path)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
            time.sleep(0.2)
        assert len(pids) == 2, "the ranks did not start"
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in pids if alive(p)] == []
        RunLock(tmp_path).acquire()  # the lock is free
    finally:
        for pid in pids:  # the orphans, where they survived (this test's own processes, by id)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


MQ = [  # two conversations of 4 questions each (RULER multikey_2 at n=2), 8 samples
    "task.load.n=2",
    "task.load.tasks=[niah_multikey_2]",
    "limit=8",
    "query_aware=false",
    "multi_question=true",
    "method.budget=64",
]


def test_dp2_multi_question_deals_conversations_to_both_replicas(tmp_path):
    """DP=2 with two 4-question conversations: each replica generates one whole conversation (dealt by its
    first question's index, both went to replica 0 and replica 1 idled); the results are one process's."""
    noted = tmp_path / "noted"
    noted.mkdir()
    script = ("tests/parallel/failing.py",)
    env = {"EVALKIT_TEST_JOURNALED": str(noted)}
    done = torchrun(tmp_path / "dp", "parallel.dp_size=2", *MQ, script=script, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = planned_folder(tmp_path / "dp", *RUN, *MQ)
    lines = [json.loads(x) for x in (folder / "generations.jsonl").read_text().splitlines()]
    conversation = {r["key"]: r["stats"]["conversation"] for r in lines}
    mine = {r: (noted / f"rank{r}").read_text().split() for r in (0, 1)}  # rank 0's: its own, then folded
    assert len(mine[1]) == 4 and len({conversation[k] for k in mine[1]}) == 1  # one whole conversation
    assert {conversation[k] for k in mine[0][:4]} | {conversation[k] for k in mine[1]} == set(
        conversation.values()
    )
    assert len(set(conversation.values())) == 2
    ref = one_process(tmp_path / "one", *MQ)
    assert predictions(folder) == predictions(ref) and headline(folder) == headline(ref)
    assert sorted(journal_keys(folder)) == sorted(journal_keys(ref))


def test_dp2_writes_what_one_process_does(tmp_path):
    done = torchrun(tmp_path / "dp", "parallel.dp_size=2", "method.budget=64")
    assert done.returncode == 0, done.stderr[-3000:]
    folder = planned_folder(tmp_path / "dp", *RUN, "method.budget=64")
    ref = one_process(tmp_path / "one", "method.budget=64")
    assert predictions(folder) == predictions(ref) and headline(folder) == headline(ref)
    assert sorted(p.name for p in folder.glob("generations*")) == ["generations.jsonl"]  # shards folded
    assert sorted(journal_keys(folder)) == sorted(journal_keys(ref))


@pytest.mark.slow
def test_tp2_by_dp2_writes_what_one_process_does(tmp_path):
    """4 processes: two replicas, each a TP group of 2 sharding the model by KV head. limit=3 gives the
    replicas unequal shares (2 and 1 requests): a collective across replicas would hang (bounded by the
    process group timeout) or mix their tensors; the results equal one process's."""
    args = ("parallel.tp_size=2", "parallel.dp_size=2", "method.budget=64", "limit=3")
    done = torchrun(tmp_path / "tpdp", *args, nproc=4, env={"EVALKIT_DIST_TIMEOUT_S": "60"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("evalkit: results in") == 1  # one writer reports
    folder = planned_folder(tmp_path / "tpdp", *RUN, *args[2:])
    ref = one_process(tmp_path / "one", *args[2:])
    assert predictions(folder) == predictions(ref) and headline(folder) == headline(ref)
    assert sorted(p.name for p in folder.glob("generations*")) == ["generations.jsonl"]  # shards folded
    keys = journal_keys(folder)
    assert sorted(keys) == sorted(set(keys)) == sorted(journal_keys(ref))
    layout = json.loads((folder / "metrics.json").read_text())["parallel"]
    assert {k: layout[k] for k in ("tp", "dp", "world_size")} == dict(tp=2, dp=2, world_size=4)
    one = json.loads((ref / "metrics.json").read_text())["parallel"]["kv_bytes_allocated_per_rank"]
    assert layout["kv_bytes_allocated_per_rank"] == [one[0] // 2] * 4  # each rank: 1 of the 2 KV heads
    # the printed next command runs as printed: it starts the 4 processes its overrides need
    said = done.stdout.split("next: the full-cache reference on the same problems: ")[1].splitlines()[0]
    assert said.startswith("make eval METHOD=full NPROC=4 ARGS=")
    cmd = said.replace("make eval", "make -s -o .venv/.stamp eval", 1)
    full = subprocess.run(cmd, shell=True, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    reference = json.loads((folder.parents[1] / "full" / "none" / "metrics.json").read_text())
    assert reference["parallel"]["dp"] == 2


@pytest.mark.slow
def test_tp2_by_dp2_agrees_mla_kept_sets_within_each_replica(tmp_path):
    """tiny DeepSeek-V3 (MLA replicated over TP: SnapKV's kept sets broadcast from each replica's TP root over
    that replica's group), replicas with unequal shares: the one-process results."""
    run = [o if not o.startswith("model=") else "model=tiny_deepseek" for o in RUN]
    args = ["method=snapkv", "method.budget=64", "limit=3"]
    layout = ["parallel.tp_size=2", "parallel.dp_size=2", f"results_dir={tmp_path / 'tpdp'}"]
    cmd = [*TORCHRUN, "4", "-m", "evalkit", *run, *args, *layout]
    env = {**ENV, "EVALKIT_DIST_TIMEOUT_S": "60"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    evalkit.task._MEMO.clear()
    runner.run(compose(overrides=[*run, *args, f"results_dir={tmp_path / 'one'}"]))
    folder, ref = (planned_folder(tmp_path / d, *run, *args) for d in ("tpdp", "one"))
    assert predictions(folder) == predictions(ref) and headline(folder) == headline(ref)
    kv = json.loads((folder / "metrics.json").read_text())["parallel"]["kv_bytes_allocated_per_rank"]
    one = json.loads((ref / "metrics.json").read_text())["parallel"]["kv_bytes_allocated_per_rank"]
    assert kv == one * 4  # the latent cache whole on every rank


def test_a_killed_dp_rank_ends_the_run_and_the_rerun_resumes(tmp_path):
    """Rank 1 SIGKILLed after its first journal append: torchrun ends the run naming rank 1; the same command
    resumes (rank 1's shard is kept) to the one-process result, each request journaled once."""
    script = ("tests/parallel/failing.py",)
    start = time.monotonic()
    killed = torchrun(
        tmp_path / "dp", "parallel.dp_size=2", "method.budget=64", script=script, fail="kill:1:1"
    )
    assert killed.returncode != 0 and time.monotonic() - start < 120
    assert "Signal 9 (SIGKILL)" in killed.stderr and "rank      : 1" in killed.stderr
    folder = planned_folder(tmp_path / "dp", *RUN, "method.budget=64")
    assert not (folder / "metrics.json").exists() and (folder / "generations.dp1.jsonl").exists()
    shard = list(read_records(folder / "generations.dp1.jsonl")[0])  # its records (after the run's stamp)
    before = len(shard) + (len(journal_keys(folder)) if (folder / "generations.jsonl").exists() else 0)
    again = torchrun(tmp_path / "dp", "parallel.dp_size=2", "method.budget=64")
    assert again.returncode == 0, again.stderr[-3000:]
    ref = one_process(tmp_path / "one", "method.budget=64")
    assert predictions(folder) == predictions(ref) and headline(folder) == headline(ref)
    keys = journal_keys(folder)
    assert len(keys) == len(set(keys)) == 4 and set(shard) <= set(keys)
    gen = json.loads((folder / "metrics.json").read_text())["generation"]
    assert (gen["from_journal"], gen["generated_now"]) == (before, 4 - before)  # nothing done twice


def test_a_failing_tp_rank_ends_the_run_with_its_error_and_another_layout_resumes(tmp_path):
    """Rank 1 raises at its second decode step while rank 0 waits in a collective: the run ends within bounded
    time with rank 1's error; one process then resumes the folder (the layout is no part of the identity)."""
    start = time.monotonic()
    failed = torchrun(
        tmp_path, "parallel.tp_size=2", "method=snapkv", "method.budget=64",
        script=("tests/parallel/failing.py",), fail="raise:1:2",
    )  # fmt: skip
    assert failed.returncode != 0 and time.monotonic() - start < 120
    assert "RuntimeError: injected failure on rank 1" in failed.stderr
    folder = one_process(tmp_path, "method=snapkv", "method.budget=64")
    ref = one_process(tmp_path / "one", "method=snapkv", "method.budget=64")
    assert predictions(folder) == predictions(ref) and headline(folder) == headline(ref)
