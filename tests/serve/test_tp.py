"""Tensor-parallel serving (`make serve NPROC=2 ARGS="parallel.tp_size=2"`) on CPU under torchrun and gloo:
rank 0 serves HTTP, rank 1 runs the same steps on its shard. The TP=2 server answers as a one-process
server of the same configuration (tiny random Llama in float64, so no argmax near-tie flips between the two
reduction orders): concurrent greedy, sampled, streamed, per-request-budget and cancelled requests, an idle
pause longer than the heartbeat. SIGTERM to rank 0 drains it, and both ranks and torchrun end with
status 0."""

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from evalkit.bench.serving import Call, mixed_calls, run_load
from tests.serve.conftest import stream_then_hang_up

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ["model=tiny_llama", "model.dtype=float64", "method=snapstream", "method.budget=64", "batch_size=4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "EVALKIT_DIST_TIMEOUT_S": "10"}  # heartbeat: every 2.5 s


def start(cmd: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    err = open(log, "w")  # noqa: SIM115 (the process holds it)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # rank 0 prints its address once it listens
        if found := re.search(r"(http://\S+)/v1", line):
            return proc, found.group(1)
        assert line or proc.poll() is None, log.read_text()[-3000:]
    raise AssertionError("the server did not start: " + log.read_text()[-3000:])


def stop(proc: subprocess.Popen) -> int:
    os.killpg(proc.pid, signal.SIGTERM)
    return proc.wait(timeout=120)


def rank0(torchrun: subprocess.Popen) -> int:
    """The pid of torchrun's rank-0 worker (the HTTP server)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == torchrun.pid and b"RANK=0" in environ:
            return int(stat.parent.name)
    raise AssertionError("no rank 0 under torchrun")


def answers(url: str, calls: list[Call]) -> list[tuple[str, str]]:
    outcomes, _ = run_load(url, calls, clients=4, backoff_s=0.05, timeout_s=600)
    assert all(o.status == 200 for o in outcomes), [o.text for o in outcomes if o.status != 200]
    return [(o.text, o.finish) for o in outcomes]


@pytest.fixture(scope="module")
def calls() -> list[Call]:
    got = mixed_calls("tiny_llama", 12, seed=5, budgets=(None, 48), max_tokens=(6, 16))
    return [Call(c.id, c.path, c.body) for c in got]  # nobody hangs up: every answer is compared


@pytest.mark.slow  # ~40-60 s on 2 busy cores: three processes start, 12 s idle past the timeout
def test_a_tp2_server_answers_as_one_process(tmp_path, calls, serve, one_thread):
    from dataclasses import replace

    from evalkit.config import model_spec
    from evalkit.loading import load_model
    from evalkit.serve.live import engine_service

    model, tokenizer = load_model(replace(model_spec("tiny_llama"), dtype="float64"))
    url, _ = serve(
        engine_service(model, tokenizer, "tiny_llama", "snapstream", rows=4, queue_limit=64, budget=64)
    )
    want = answers(url, calls)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    tp_args = ["parallel.tp_size=2", "parallel.backend=gloo", "serve.port=0"]
    tp, url = start([*torchrun, "-m", "evalkit.serve", *CONFIG, *tp_args], tmp_path / "tp.log")
    try:
        models = requests.get(url + "/v1/models", timeout=30).json()["data"][0]
        assert models["evalkit"]["method"]["name"] == "snapstream"
        time.sleep(12)  # idle past the timeout: without the heartbeat rank 1 would time out in the broadcast
        got = answers(url, calls)
        body = {
            "model": "tiny_llama",
            "prompt": "seven quiet lamps " * 20,
            "max_tokens": 200,
            "temperature": 0,
        }
        with ThreadPoolExecutor(2) as pool:  # one client hangs up mid-stream beside a complete answer
            cut = pool.submit(stream_then_hang_up, url, "/v1/completions", body, 3)
            whole = pool.submit(answers, url, calls[:2])
            assert len(cut.result()) == 3 and whole.result() == want[:2]
        deadline = time.monotonic() + 60
        while (m := requests.get(url + "/metrics", timeout=30).text) and "evalkit_rows_running 0" not in m:
            assert time.monotonic() < deadline, "a row is still held after the client left"
            time.sleep(0.2)
        assert requests.post(url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=60).ok
        os.kill(rank0(tp), signal.SIGTERM)  # rank 0 drains; rank 1 returns with its engine's last poll
        code = tp.wait(timeout=120)  # torchrun's own status: 0 only when every rank exited 0
    finally:
        if tp.poll() is None:
            stop(tp)
    assert got == want
    assert code == 0, (tmp_path / "tp.log").read_text()[-3000:]
