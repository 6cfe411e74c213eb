"""`python -m evalkit.serve`: bad settings are refused before the model loads (one line, exit 2); SIGTERM lets
an in-flight request finish, cancels one that outlasts `serve.shutdown_s`, and the process exits 0."""

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from evalkit.config import ConfigError, compose
from evalkit.overrides import check_overrides
from evalkit.serve.__main__ import checked, main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny_llama", "method=snapstream", "method.budget=64"]
SERVE_SETTINGS = "serve settings: host, max_n, port, queue_limit, shutdown_s"


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["serve.port=-1"], "serve.port must be an integer in [0, 65535], got -1"),
        (["serve.queue_limit=0"], "serve.queue_limit must be a positive integer, got 0"),
        (["serve.shutdown_s=soon"], "serve.shutdown_s must be a number of seconds >= 0, got 'soon'"),
        (["serve.max_n=100"], "serve.max_n=100 is above serve.queue_limit=64"),
        (["batch_size=0"], "batch_size must be a positive integer (the rows), got 0"),
        (["method.budget=9000"], "method.budget=9000 is above tiny_llama's context of 8192 tokens"),
        (["model=served"], "model served is served elsewhere already"),
        (["method=snapstream", "method.budget=8"], "snapstream: sink + recent must be <= budget"),
    ],
)
def test_bad_settings_are_refused_before_the_model_loads(overrides, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        checked(compose("serve", [*TINY, *overrides]))


def test_an_unknown_serve_setting_lists_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        check_overrides(["serve.prot=8001"], "serve")
    assert str(e.value) == f"unknown setting 'serve.prot'; {SERVE_SETTINGS}"


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["serve.port=70000"], "serve.port must be an integer in [0, 65535], got 70000"),
        (["serve.prot=1"], f"unknown setting 'serve.prot'; {SERVE_SETTINGS}"),
        (
            ["method=nope"],
            "unknown method 'nope'; valid choices: adakv_expected_attention, adakv_snapkv, "
            "expected_attention, expected_attention_ring",
        ),
        (["serve.port=80", "+serve"], "Error parsing override '+serve'"),
    ],
)
def test_the_cli_says_it_in_one_line_and_exits_2(capsys, monkeypatch, overrides, says):
    monkeypatch.setattr("evalkit.loading.load_model", lambda spec: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        main([*TINY, *overrides])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m evalkit.serve: error: {says}") and err.count("\n") == 1


def test_sigterm_finishes_what_it_can_cancels_the_rest_and_exits_0():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread: a shared 2-core machine
    cmd = [sys.executable, "-m", "evalkit.serve", *TINY, "serve.port=0", "serve.shutdown_s=5"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the server listens
        url = re.search(r"(http://\S+)/v1", line).group(1)
        body = {"model": "tiny_llama", "prompt": "The lamp by the window", "temperature": 0, "stream": True}
        got: dict[str, list] = {"short": [], "long": []}
        started = {name: threading.Event() for name in got}

        def stream(name: str, max_tokens: int) -> None:
            payload = {**body, "max_tokens": max_tokens}
            r = requests.post(f"{url}/v1/completions", json=payload, stream=True, timeout=300)
            try:
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        got[name].append(line[6:].decode())
                        started[name].set()
            except requests.RequestException:
                pass  # the server hung up: the long one is cut at shutdown
            started[name].set()

        clients = [threading.Thread(target=stream, args=a) for a in (("short", 6), ("long", 8000))]
        for c in clients:
            c.start()
        for e in started.values():
            assert e.wait(timeout=300), "no first chunk"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 0
        for c in clients:
            c.join(timeout=60)
    finally:
        proc.kill()
        stderr = proc.stderr.read()
    assert got["short"][-1] == "[DONE]" and '"finish_reason": "length"' in got["short"][-2]  # finished
    assert got["long"][-1] == "[DONE]" and len(got["long"]) < 8000  # cut after 5 s, and told why:
    assert '"code": "shutting_down"' in got["long"][-2]
    assert "Traceback" not in stderr and "ERROR" not in stderr
