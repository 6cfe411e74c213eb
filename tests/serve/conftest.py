"""Servers for the serve tests, on 127.0.0.1 in a thread: a fake backend (no model: fast, deterministic
tokens) or the real engine on a tiny random model; and small HTTP helpers."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

import pytest
import requests
import torch
from omegaconf import OmegaConf

from evalkit.bench.serving import Background
from evalkit.config import group_config
from evalkit.kv.config import make_method
from evalkit.serve.app import make_app
from evalkit.serve.fake import FakeBackend
from evalkit.serve.service import Card, Service


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from evalkit.config import model_spec
    from evalkit.sources import tokenizer_path

    return AutoTokenizer.from_pretrained(tokenizer_path(model_spec("smollm2_135m")))


@pytest.fixture(scope="session")
def tiny_llama():
    """(model, tokenizer) of conf/model/tiny_llama.yaml: random weights, SmolLM2's tokenizer, 8k context."""
    from evalkit.config import model_spec
    from evalkit.loading import load_model

    return load_model(model_spec("tiny_llama"))


def fake_service(tokenizer, context=256, max_n=4, method="snapstream", budget=64, **backend) -> Service:
    conf = group_config("method", method)
    if budget is not None:
        conf = OmegaConf.merge(conf, {"budget": budget})
    card = Card("fake", context, make_method(conf), conf, {"dtype": "float32"}, "fake weights", None, max_n)
    return Service(card, tokenizer, FakeBackend(tokenizer, **backend))


@pytest.fixture
def serve(tokenizer):
    """serve(service=None, **fake settings) -> (base url, service): stopped when the test ends."""
    running = []

    def start(service: Service | None = None, **settings):
        service = service or fake_service(tokenizer, **settings)
        server = Background(make_app(service)).__enter__()
        running.append(server)
        return server.url, service

    yield start
    for server in running:
        server.__exit__()


@pytest.fixture
def one_thread():
    """The real engine's tests on one torch thread: on a shared 2-core machine, two threads that wait on each
    other at every matmul barrier run many times slower (the bench's --threads note)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def post(url: str, path: str, body, **kw) -> requests.Response:
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return requests.post(
        url + path, data=data, headers={"content-type": "application/json"}, timeout=120, **kw
    )


def events(response: requests.Response) -> list:
    """The server-sent events of a streamed answer, `[DONE]` as the string."""
    out = []
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            out.append("[DONE]" if line == b"data: [DONE]" else json.loads(line[6:]))
    return out


def stream_then_hang_up(url: str, path: str, body: dict, chunks: int, when=None) -> list[dict]:
    """POST a streaming request, read `chunks` events, then close the connection (a client going away); with
    `when` (a threading.Event), only once it is set."""
    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
    conn.request("POST", path, json.dumps({**body, "stream": True}), {"content-type": "application/json"})
    response, got = conn.getresponse(), []
    assert response.status == 200
    while len(got) < chunks:
        line = response.fp.readline()
        if line.startswith(b"data: "):
            got.append(json.loads(line[6:]))
    if when is not None:
        when.wait(timeout=120)
    conn.close()
    return got


def wait_for(condition, what: str, timeout_s: float = 120):
    """Until `condition()` holds (the engine's thread acts on its own time); fails naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
