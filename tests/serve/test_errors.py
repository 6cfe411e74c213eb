"""Bad requests get a 4xx with OpenAI's error body naming the field, before they take a place in the queue,
and the server keeps serving; a full queue answers 429 with Retry-After; a draining server answers 503."""

import threading

import pytest
import requests

from tests.serve.conftest import fake_service, post, stream_then_hang_up, wait_for

GOOD = {"model": "fake", "prompt": "The lamp", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LONG = " ".join(["river"] * 300)  # over the fake's 256-token context


C, H = "/v1/completions", "/v1/chat/completions"
NO_MODEL = {k: v for k, v in GOOD.items() if k != "model"}
IMAGE = [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]
BAD = [  # (path, body, status, the field named, what the message says)
    (C, {**GOOD, "model": "gpt-4"}, 404, "model", "model 'gpt-4' is not served here"),
    (C, {**GOOD, "max_tokens": -5}, 400, "max_tokens", "max_tokens must be at least 1, got -5"),
    (C, {**GOOD, "prompt": LONG}, 400, "prompt", "the prompt is 300 tokens; fake's context is 256"),
    (C, {**GOOD, "max_tokens": 300}, 400, "max_tokens", "above fake's context of 256 tokens"),
    (C, '{"model": "fake", "prompt": ', 400, None, "malformed JSON body"),
    (C, "[1, 2]", 400, None, "the body must be a JSON object"),
    (C, {**GOOD, "n": 10**9}, 400, "n", "n=1000000000 is above this server's limit of 4"),
    (C, {**GOOD, "n": "2"}, 400, "n", "n: Input should be a valid integer (got '2')"),
    (C, {**GOOD, "temperature": "hot"}, 400, "temperature", "valid number"),
    (C, {**GOOD, "temperature": 3}, 400, "temperature", "less than or equal to 2"),
    (C, {**GOOD, "stream": "yes"}, 400, "stream", "valid boolean"),
    (C, {**GOOD, "prompt": 5}, 400, "prompt", "prompt must be a non-empty string"),
    (C, {**GOOD, "prompt": [10**9]}, 400, "prompt", "outside the vocabulary"),
    (C, {**GOOD, "stop": 3}, 400, "stop", "stop must be a string or a list of strings"),
    (C, {**GOOD, "best_guess": 1}, 400, "best_guess", "unknown field 'best_guess'"),
    (C, NO_MODEL, 400, "model", "missing required field 'model'"),
    (C, {**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
    (C, {**GOOD, "echo": True}, 400, "echo", "no prompt logprobs"),
    (C, {**GOOD, "logprobs": 50}, 400, "logprobs", "less than or equal to 20"),
    (C, {**GOOD, "budget": 2}, 400, "budget", "budget: snapstream: sink + recent must be"),
    (C, {**GOOD, "budget": 4096}, 400, "budget", "budget=4096 is above the context"),
    (C, {**GOOD, "min_tokens": 9}, 400, "min_tokens", "min_tokens=9 is above max_tokens=2"),
    (C, {**GOOD, "seed": 2**70}, 400, "seed", "seed"),
    (H, {**CHAT, "messages": "hi"}, 400, "messages", "valid array"),
    (H, {**CHAT, "messages": []}, 400, "messages", "at least 1 item"),
    (H, {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "'system'"),
    (H, {**CHAT, "messages": IMAGE}, 400, "messages.0.content", "a list of text parts"),
    (H, {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "top_logprobs needs logprobs=true"),
    (H, {**CHAT, "continue_final_message": True}, 400, "messages", "assistant message last"),
    (H, {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", "no tool calling"),
]


@pytest.mark.parametrize("path, body, status, param, says", BAD)
def test_a_bad_request_is_refused_naming_the_field_before_it_takes_a_place(
    serve, path, body, status, param, says
):
    url, svc = serve()
    r = post(url, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert says in error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert svc.backend.stats()["submitted"] == 0  # it never reached the queue
    assert post(url, "/v1/completions", GOOD).status_code == 200  # and the server keeps serving


def test_a_full_queue_answers_429_with_retry_after_and_takes_the_request_once_there_is_room(serve, tokenizer):
    url, svc = serve(fake_service(tokenizer, context=100_000, rows=1, queue_limit=2, step_s=0.01))
    release = threading.Event()
    holder = threading.Thread(  # holds the one row until it is told to hang up
        target=stream_then_hang_up, args=(url, "/v1/completions", {**GOOD, "max_tokens": 50_000}, 1, release)
    )
    answers = []
    holder.start()
    wait_for(lambda: svc.backend.stats()["running"] == 1, "the row to be held")
    waiting = [
        threading.Thread(target=lambda: answers.append(post(url, "/v1/completions", GOOD))) for _ in range(2)
    ]
    for t in waiting:
        t.start()
    wait_for(lambda: svc.backend.stats()["waiting"] == 2, "two waiting requests")
    full = post(url, "/v1/completions", GOOD)
    assert full.status_code == 429 and full.headers["Retry-After"] == "1"
    assert full.json()["error"]["type"] == "rate_limit_error" and full.json()["error"]["code"] == "queue_full"
    release.set()
    holder.join()  # the holder hung up: its row goes to the waiting requests
    for t in waiting:
        t.join()
    assert [a.status_code for a in answers] == [200, 200]
    assert post(url, "/v1/completions", GOOD).status_code == 200  # room again


def test_a_draining_server_refuses_new_work_with_503_and_says_so_on_health(serve):
    url, svc = serve()
    svc.draining = True
    r = post(url, "/v1/completions", GOOD)
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    health = requests.get(url + "/health", timeout=30)
    assert health.status_code == 503 and health.json() == {"status": "draining"}


def test_unknown_paths_and_methods_answer_in_openais_shape(serve):
    url, _ = serve()
    r = requests.get(url + "/v1/embeddings", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "GET /v1/embeddings: Not Found"
    assert requests.post(url + "/v1/models", timeout=30).status_code == 405
