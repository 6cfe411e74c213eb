"""Served baselines (`model=served`, evalkit.served) against an OpenAI-compatible server on 127.0.0.1.

Fast tests use a small scripted server (http.server in a thread): what is sent (evalkit's exact prompt bytes,
greedy, per-request seeds), what is journaled and reported, concurrency, retries, refusals, a server that is
down, changed or serves another model. The slow test starts a real `transformers serve` with the embedded
SmolLM2 and compares its greedy answers with the in-process `full` run on the same RULER and AIME samples.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import evalkit.run as runner
from evalkit.config import ConfigError
from evalkit.journal import Journal
from evalkit.served import ServedError
from tests.conftest import fresh_run

ROOT = Path(__file__).resolve().parents[2]
AIME = ["task=aime24_greedy", "model.max_new_tokens=16"]


class Fake:
    """A scripted OpenAI-compatible server: /v1/models, /version, /v1/completions, /v1/chat/completions."""

    def __init__(self):
        self.models = [{"id": "fake-model", "object": "model", "created": 0, "root": "/weights/a"}]
        self.version = {"version": "1.0"}
        self.statuses: list[int] = []  # the status of each coming POST (then 200)
        self.posts: list[dict] = []
        self.barrier = (
            1  # a POST waits (up to 5 s) until this many are in flight: concurrency shows as a count
        )
        self.inflight = self.max_inflight = 0
        self.cond = threading.Condition()
        self.usage = {"prompt_tokens": 5, "completion_tokens": 3}
        self.answer_models: list[str] = []  # the `model` field of each coming answer (then none)

    @staticmethod
    def answer(prompt: str) -> str:  # right for the first AIME sample only (its answer is 286)
        return "So \\boxed{286}." if "divisible by $7$" in prompt else "So \\boxed{0}."

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        with self.cond:
            self.posts.append(body)
            status = self.statuses.pop(0) if self.statuses else 200
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.inflight >= self.barrier, timeout=5)
        with self.cond:
            self.inflight -= 1
        if status != 200:
            return status, {"error": "scripted"}
        chat = path.endswith("/chat/completions")
        text = self.answer(json.dumps(body["messages"]) if chat else body["prompt"])
        choice = {"index": 0, "finish_reason": "stop"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        out = {"choices": [choice], "usage": self.usage}
        with self.cond:
            if self.answer_models:
                out["model"] = self.answer_models.pop(0)
        return 200, out


@pytest.fixture
def fake():
    server = Fake()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._send(200, {"object": "list", "data": server.models})
            if self.path == "/version" and server.version is not None:
                return self._send(200, server.version)
            return self._send(404, {"error": "not found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            self._send(*server.post(self.path, body))

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    yield server
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """A served run never loads a model here."""
    monkeypatch.setattr(runner, "get_model", lambda spec: pytest.fail(f"the model {spec.name} was loaded"))


def served(url: str, *overrides: str) -> list[str]:
    return [
        "model=served",
        "method=full",
        f"model.base_url={url}",
        "model.tokenizer=smollm2_135m",
        *overrides,
    ]


run = fresh_run  # conftest: one call stands for one process


def folder(results, task="aime24_greedy", model="served"):
    """The one full run of `task` on `model` under `results` (its settings name the folders:
    `aime24_greedy-n3`)."""
    (found,) = [
        p
        for p in Path(results).glob("runs/*/*/full/none")
        if p.parts[-4].split("-")[0] == task and p.parts[-3].split("-")[0] == model
    ]
    return found


def aime_samples(n):
    from tasks.aime24.aime24 import load

    return load(source="sample", n=n, seed=0).samples


def test_a_served_run_sends_evalkits_prompts_and_reports_like_an_in_process_run(fake, tmp_path):
    from evalkit.sample import render
    from evalkit.task import get_tokenizer
    from tasks.aime24 import aime24

    m = run(*served(fake.url, *AIME, "task.load.n=3"), results=tmp_path)[0]
    samples = aime_samples(3)
    tok = get_tokenizer("smollm2_135m")
    want = {render(tok, s.prompt, s.answer_prefix, s.system) for s in samples}  # what EvalkitLM is given
    assert {p["prompt"] for p in fake.posts} == want and len(fake.posts) == 3
    for p in fake.posts:  # greedy as the task says, capped as the conf says, nothing the task did not set
        assert p["model"] == "fake-model" and p["temperature"] == 0.0 and p["max_tokens"] == 16
        assert "top_k" not in p and "top_p" not in p and "stop" not in p
    assert len({p["seed"] for p in fake.posts}) == 3  # one seed per request

    out = folder(tmp_path)
    rows = {r["id"]: r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}
    for s in samples:  # the task's own scorer on what the server answered
        assert rows[s.id]["predictions"] == [Fake.answer(s.prompt)]
        assert rows[s.id]["scores"] == aime24.score([Fake.answer(s.prompt)], s)
    assert sorted(r["scores"]["pass@1"] for r in rows.values()) == [0.0, 0.0, 100.0]

    assert m["method"]["name"] == "full" and m["budget"] is None and m["n"] == 3
    assert m["model"]["source"].startswith(f"served:{fake.url}") and m["model"]["name"] == "served"
    assert set(m["kv"].values()) == {None}  # the server's cache: unmeasured, never 0
    assert m["generation"]["tokens_generated"] == 9 and m["generation"]["requests"] == 3
    assert m["served"]["model"]["id"] == "fake-model" and m["served"]["version"] == {"version": "1.0"}
    assert m["served"]["server_header"].startswith("BaseHTTP") and m["served"]["base_url"] == fake.url
    record = json.loads((out / "generations.jsonl").read_text().splitlines()[0])
    assert record["stats"]["server_prompt_tokens"] == 5 and record["stats"]["finish_reason"] == "stop"
    assert record["stats"]["output_tokens_from"] == "server" and not any(
        k.startswith("kv_") for k in record["stats"]
    )

    run(*served(fake.url, *AIME, "task.load.n=3"), results=tmp_path)  # finished: skipped, nothing sent
    assert len(fake.posts) == 3


def test_requests_run_num_concurrent_at_a_time(fake, tmp_path):
    fake.barrier = 3
    run(*served(fake.url, *AIME, "task.load.n=6", "model.num_concurrent=3"), results=tmp_path)
    assert len(fake.posts) == 6 and fake.max_inflight == 3


def test_transient_errors_are_retried(fake, tmp_path):
    fake.statuses = [503, 429]
    m = run(*served(fake.url, *AIME, "task.load.n=2", "model.num_concurrent=1"), results=tmp_path)[0]
    assert len(fake.posts) == 4 and m["n"] == 2  # two refusals, each retried once: every request answered


def test_a_server_that_keeps_failing_stops_the_run_and_the_rerun_resumes(fake, tmp_path):
    args = served(fake.url, *AIME, "task.load.n=2", "model.num_concurrent=1", "model.max_retries=2")
    fake.statuses = [200, 503, 503]
    with pytest.raises(ServedError, match="failed after 2 attempts"):
        run(*args, results=tmp_path)
    journal = folder(tmp_path) / "generations.jsonl"
    assert len(Journal(journal).records) == 1 and not (folder(tmp_path) / "metrics.json").exists()
    m = run(*args, results=tmp_path)[0]
    assert m["generation"]["from_journal"] == 1 and m["generation"]["generated_now"] == 1
    assert len(fake.posts) == 4


def test_a_refused_request_is_not_retried_and_stops_the_run(fake, tmp_path):
    fake.statuses = [400]
    with pytest.raises(ServedError, match="refused 1 request.*HTTP 400"):
        run(*served(fake.url, *AIME, "task.load.n=2", "model.num_concurrent=1"), results=tmp_path)
    assert len(fake.posts) == 1  # not retried, and nothing more sent
    assert not Journal(folder(tmp_path) / "generations.jsonl").records


def test_a_server_that_is_down_fails_clearly_before_anything_is_journaled(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    cmd = [
        sys.executable,
        "-m",
        "evalkit",
        *served(f"http://127.0.0.1:{port}/v1", *AIME, "task.load.n=1"),
        f"results_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"evalkit: error: cannot reach the server at http://127.0.0.1:{port}/v1" in proc.stderr
    out = folder(tmp_path)
    assert not (out / "config.yaml").exists() and not (out / "generations.jsonl").read_text()


@pytest.mark.parametrize(
    "setup, overrides, message",
    [
        (
            lambda f: None,
            ["model.model_id=other"],
            r"serves \['fake-model'\]; model.model_id='other' is not one",
        ),
        (lambda f: f.models.append({"id": "b"}), [], r"serves \['fake-model', 'b'\]: set model.model_id"),
        (lambda f: f.models[0].update(max_model_len=1000), [], "set model.max_length=1000"),
    ],
)
def test_another_model_or_a_smaller_context_is_refused_before_any_request(
    fake, tmp_path, setup, overrides, message
):
    setup(fake)
    with pytest.raises(ServedError, match=message):
        run(*served(fake.url, *AIME, "task.load.n=1", *overrides), results=tmp_path)
    assert not fake.posts


def test_a_run_never_mixes_two_servers(fake, tmp_path):
    args = served(fake.url, *AIME, "task.load.n=2", "model.num_concurrent=1")
    fake.statuses = [200, 400]
    with pytest.raises(ServedError):
        run(*args, results=tmp_path)
    fake.models[0]["root"] = "/weights/b"  # other weights behind the same id
    with pytest.raises(ServedError, match="never mixes"):
        run(*args, results=tmp_path)
    fake.models[0]["root"], fake.models[0]["created"] = (
        "/weights/a",
        123,
    )  # what changes per call does not count
    assert run(*args, results=tmp_path)[0]["n"] == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["method=snapstream"], "use method=full"),
        (["kv=fp8_e4m3"], "a served model holds K/V as its server does"),
        (["model.base_url=127.0.0.1:8000"], "model.base_url must be"),
        (["model.api=grpc"], "model.api must be one of"),
        (["model.num_concurrent=0"], "model.num_concurrent must be a positive integer"),
        (["model.tokenizer=null"], "model.tokenizer: name the served model's tokenizer"),
        (["model.reference_for=nope"], "model.reference_for must name an in-process model conf"),
        (["model.reference_for=served"], "model.reference_for must name an in-process model conf"),
    ],
)
def test_bad_served_settings_are_refused_before_any_data(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        run(*served("http://127.0.0.1:9/v1", *AIME), *overrides, results=tmp_path)
    assert not (tmp_path / "runs").exists()


def test_the_chat_api_sends_the_samples_messages(fake, tmp_path):
    run(*served(fake.url, *AIME, "task.load.n=2", "model.api=chat"), results=tmp_path)
    samples = {s.prompt: s for s in aime_samples(2)}
    assert len(fake.posts) == 2
    for p in fake.posts:  # AIME: no system message, no prefill; the server renders the template
        (message,) = p["messages"]
        assert (
            message["role"] == "user" and message["content"] in samples and "continue_final_message" not in p
        )
    rows = [json.loads(x) for x in (folder(tmp_path) / "samples.jsonl").read_text().splitlines()]
    assert sorted(r["predictions"][0] for r in rows) == sorted(
        Fake.answer(p) for p in samples
    )  # message.content


def test_the_chat_api_continues_an_answer_prefix():
    from evalkit.request import Prompt
    from evalkit.sample import Sample
    from evalkit.served import ServedChat, ServedSpec

    spec = ServedSpec(name="s", base_url="http://127.0.0.1:9/v1", api="chat")
    chat = ServedChat(spec, None, 1024, journal=None, report={"model": {"id": "m"}})
    s = Sample(
        id="1",
        task="t",
        prompt="Q?",
        answers=["a"],
        max_new_tokens=8,
        answer_prefix=" A:",
        system="Be brief.",
    )
    payload = chat._payload(Prompt("t/0/0/0", "unused", 8, {"until": []}, s), "unused")
    assert payload["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": " A:"},
    ]
    assert payload["continue_final_message"] is True and payload["add_generation_prompt"] is False


@pytest.mark.parametrize("own", [dict(rendered=True), dict(meta={"prompt_template": "meta-llama3"})])
def test_the_chat_api_refuses_a_prompt_that_carries_its_own_template(own):
    """livecodebench_r1's raw DeepSeek string, RULER's meta-llama3 text: a server's chat template would wrap
    them."""
    from evalkit.request import Prompt
    from evalkit.sample import Sample
    from evalkit.served import ServedChat, ServedSpec, _Final

    spec = ServedSpec(name="s", base_url="http://127.0.0.1:9/v1", api="chat")
    chat = ServedChat(spec, None, 1024, journal=None, report={"model": {"id": "m"}})
    s = Sample(id="1", task="t", prompt="<｜User｜>Q?<｜Assistant｜>", answers=["a"], max_new_tokens=8, **own)
    with pytest.raises(_Final, match="use model.api=completions"):
        chat._payload(Prompt("t/0/0/0", "unused", 8, {"until": []}, s), "unused")


# --- a real server: transformers serve with the embedded SmolLM2 --------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def transformers_serve(tmp_path):
    """`transformers serve <embedded SmolLM2 folder>` on 127.0.0.1, greedy on CPU in fp32; stopped
    afterwards."""
    from evalkit.config import model_spec
    from evalkit.sources import resolve_source

    folder_ = resolve_source(model_spec("smollm2_135m"))
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "transformers.cli.transformers",
        "serve",
        folder_,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                import requests

                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[
                -2000:
            ]
            time.sleep(1)
        yield f"{url}/v1", folder_
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def evalkit_cli(*args, results):
    cmd = [sys.executable, "-m", "evalkit", *args, f"results_dir={results}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def predictions(out: Path) -> dict[str, list[str]]:
    return {
        r["id"]: r["predictions"] for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())
    }


@pytest.mark.slow
def test_transformers_serve_answers_as_the_in_process_full_cache(transformers_serve, tmp_path):
    """Same prompts, greedy, fp32, the same weights: the served answers equal evalkit's in-process `full`
    run."""
    url, _ = transformers_serve
    cases = {
        "ruler": [
            "task=ruler",
            "task.load.n=1",
            "task.load.lengths=[1024]",
            "task.load.tasks=[niah_single_1,vt]",
        ],
        "aime24_greedy": ["task=aime24_greedy", "task.load.n=2"],
    }
    agreement = {}
    for task, args in cases.items():
        common = [*args, "model.max_new_tokens=32"]
        evalkit_cli(*served(url, *common), results=tmp_path)
        evalkit_cli("model=smollm2_135m", "method=full", *common, results=tmp_path)
        a = predictions(folder(tmp_path, task))
        b = predictions(folder(tmp_path, task, "smollm2_135m"))
        agreement[task] = sum(a[k] == b[k] for k in b) / len(b)
        assert a == b, f"{task}: served {a} vs in-process {b}"
        m = json.loads((folder(tmp_path, task) / "metrics.json").read_text())
        assert m["served"]["server_header"] == "uvicorn" and m["served"]["model"]["owned_by"] == "local"
    print(f"served vs in-process greedy agreement: {agreement}")


def test_a_failed_run_leaves_no_unretrieved_task_errors(fake, tmp_path, caplog):
    import gc

    fake.barrier, fake.statuses = 2, [503] * 8  # two requests in flight, both fail on their only attempt
    args = served(fake.url, *AIME, "task.load.n=2", "model.num_concurrent=2", "model.max_retries=1")
    with pytest.raises(ServedError, match="failed after 1 attempts"):
        run(*args, results=tmp_path)
    gc.collect()  # an unretrieved task error is reported when its task is collected
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize(
    "usage, message",
    [
        ({"completion_tokens": -3}, "negative completion_tokens"),
        ({"completion_tokens": True}, None),  # not a count: the tokenizer counts the text instead
    ],
)
def test_a_served_token_count_must_be_a_count(fake, tmp_path, usage, message):
    fake.usage = usage
    args = served(fake.url, *AIME, "task.load.n=1")
    if message is None:
        m = run(*args, results=tmp_path)[0]
        record = json.loads((folder(tmp_path) / "generations.jsonl").read_text().splitlines()[0])
        assert record["stats"]["output_tokens_from"] == "tokenizer"
        assert m["generation"]["tokens_generated"] == record["stats"]["output_tokens"] > 0
        return
    with pytest.raises(ServedError, match=message):
        run(*args, results=tmp_path)
    assert not Journal(folder(tmp_path) / "generations.jsonl").records


def test_a_server_answering_as_another_model_mid_run_is_stopped(fake, tmp_path):
    fake.barrier = 1
    fake.answer_models = ["fake-model", "other-model"]  # the second answer comes from another model
    args = served(fake.url, *AIME, "task.load.n=2", "model.num_concurrent=1")
    with pytest.raises(ServedError, match="answered as model 'other-model', not 'fake-model'"):
        run(*args, results=tmp_path)
    assert len(Journal(folder(tmp_path) / "generations.jsonl").records) == 1  # only the true model's answer


def test_reference_for_is_recorded_and_changes_neither_folder_nor_identity(fake, tmp_path):
    """A served run opted in as the reference of an in-process model (the report pairs on it): its config
    records `reference_for`, its folder and generation identity are those of the same run without it."""
    plain = run(*served(fake.url, *AIME, "task.load.n=2"), results=tmp_path / "a")[0]
    ref = run(
        *served(fake.url, *AIME, "task.load.n=2", "model.reference_for=smollm2_135m"), results=tmp_path / "b"
    )[0]
    assert ref["provenance"]["config"]["model"]["reference_for"] == "smollm2_135m"
    assert ref["identity"]["generation"] == plain["identity"]["generation"]
    assert folder(tmp_path / "b").relative_to(tmp_path / "b") == folder(tmp_path / "a").relative_to(
        tmp_path / "a"
    )
