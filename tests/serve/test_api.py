"""The OpenAI endpoints against the fake backend (deterministic tokens, no model): answers, streams that add
up to the answers, stop strings and EOS, n and prompt lists, seeds, logprobs, the chat template, per-request
budgets and their KV figures in `usage`, /v1/models, /health and /metrics."""

import math

import pytest
import requests

from evalkit.serve.backend import Work
from tests.serve.conftest import events, fake_service, post

PROMPT = "The lamp by the window was"


def fake_tokens(service, ids, n, temperature=0.0, seed=0):
    """What the fake backend generates for a prompt: its deterministic rule, token by token."""
    work, out = Work(ids, n, None, temperature=temperature, seed=seed), []
    for _ in range(n):
        out.append(service.backend.next_token(work, out))
    return out


def ids(service, text):
    return service.tokenizer(text)["input_ids"]


def test_a_completion_is_its_tokens_text_with_usage_and_the_requests_kv_figures(serve):
    url, svc = serve()
    r = post(url, "/v1/completions", {"model": "fake", "prompt": PROMPT, "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body, prompt = r.json(), ids(svc, PROMPT)
    want = svc.tokenizer.decode(fake_tokens(svc, prompt, 5))
    assert body["object"] == "text_completion" and body["model"] == "fake"
    assert body["choices"] == [{"index": 0, "text": want, "logprobs": None, "finish_reason": "length"}]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        len(prompt),
        5,
        len(prompt) + 5,
    )
    seen = len(prompt) + 4  # the last token is never fed
    assert usage["kv"]["method"] == "snapstream" and usage["kv"]["budget"] == 64
    assert usage["kv"]["choices"] == [
        {"index": 0, "seen": seen, "kept": seen, "evicted_generated": 0, "slots": seen, "bytes": 64 * seen}
    ]
    assert usage["kv"]["bytes"] == 64 * seen


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_adds_up_to_the_answer_and_ends_with_usage_and_done(serve, path):
    url, _ = serve()
    body = {"model": "fake", "max_tokens": 7, "temperature": 0}
    body |= (
        {"prompt": PROMPT}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": PROMPT}]}
    )
    answer = post(url, path, body).json()
    r = post(url, path, {**body, "stream": True, "stream_options": {"include_usage": True}}, stream=True)
    assert r.headers["content-type"].startswith("text/event-stream")
    got = events(r)
    assert got[-1] == "[DONE]" and got[-2]["choices"] == [] and got[-2]["usage"] == answer["usage"]
    chunks = got[:-2]
    if path == "/v1/chat/completions":
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert text == answer["choices"][0]["message"]["content"]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    else:
        assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert len({c["id"] for c in chunks}) == 1


def test_a_stop_string_cuts_the_text_and_ends_the_choice_streamed_or_not(serve):
    url, svc = serve()
    tokens = fake_tokens(svc, ids(svc, PROMPT), 20)
    words = [svc.tokenizer.decode([t]) for t in tokens]
    at = next(i for i in range(2, 20) if words[i] not in words[:i])  # a word's first appearance
    body = {"model": "fake", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stop": [words[at]]}
    answer = post(url, "/v1/completions", body).json()
    assert answer["choices"][0]["text"] == "".join(words[:at])
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == at + 1
    streamed = events(post(url, "/v1/completions", {**body, "stream": True}, stream=True))[:-1]
    assert "".join(c["choices"][0]["text"] for c in streamed) == "".join(words[:at])  # held back, never sent


def test_eos_ends_a_choice_as_stop_and_is_not_in_its_text(serve):
    url, svc = serve(eos_after=3)
    answer = post(
        url, "/v1/completions", {"model": "fake", "prompt": PROMPT, "max_tokens": 9, "temperature": 0}
    )
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and answer.json()["usage"]["completion_tokens"] == 4
    assert choice["text"] == svc.tokenizer.decode(fake_tokens(svc, ids(svc, PROMPT), 3))


def test_n_choices_and_prompt_lists_keep_their_order_and_choice_0_keeps_the_seed(serve):
    url, svc = serve()
    sampled = {"model": "fake", "max_tokens": 4, "temperature": 0.8, "seed": 11}
    one = post(url, "/v1/completions", {**sampled, "prompt": PROMPT}).json()
    three = post(url, "/v1/completions", {**sampled, "prompt": PROMPT, "n": 3}).json()
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert three["choices"][0]["text"] == one["choices"][0]["text"]  # the request's seed, as in process
    assert len({c["text"] for c in three["choices"]}) > 1  # the others: seeds derived from it
    assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]  # a prompt counts once
    prompts = [PROMPT, ids(svc, "Seven cats")]  # text, and token ids as lm-eval sends them
    listed = post(
        url,
        "/v1/completions",
        {"model": "fake", "prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0},
    )
    got = listed.json()["choices"]
    assert [c["index"] for c in got] == [0, 1, 2, 3]
    assert got[0]["text"] == got[1]["text"] == svc.tokenizer.decode(fake_tokens(svc, ids(svc, PROMPT), 3))
    assert got[2]["text"] == svc.tokenizer.decode(fake_tokens(svc, prompts[1], 3))


def test_logprobs_in_both_formats_are_the_distributions_and_streams_carry_them_too(serve):
    url, svc = serve()
    vocab = len(svc.tokenizer)
    # the fake's logits: the chosen token 4.0, two runners-up 2.0 and 1.0, every other token 0.0
    norm = math.log(math.exp(4) + math.exp(2) + math.exp(1) + vocab - 3)
    body = {"model": "fake", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2}
    lp = post(url, "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([4 - norm] * 3, abs=1e-4)
    tops = [v for top in lp["top_logprobs"] for v in top.values()]  # the best two, best first
    assert tops == pytest.approx([4 - norm, 2 - norm] * 3, abs=1e-4)
    assert (
        "".join(lp["tokens"])
        == post(url, "/v1/completions", {**body, "logprobs": None}).json()["choices"][0]["text"]
    )
    streamed = events(post(url, "/v1/completions", {**body, "stream": True}, stream=True))[:-1]
    assert [
        t for c in streamed if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]
    ] == lp["tokens"]
    chat = {
        "model": "fake",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 2,
        "temperature": 0,
    }
    content = post(url, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 1}).json()
    entry = content["choices"][0]["logprobs"]["content"][0]
    assert entry["logprob"] == pytest.approx(4 - norm, abs=1e-4) and len(entry["top_logprobs"]) == 1
    assert bytes(entry["bytes"]).decode() == entry["token"]


def test_chat_renders_the_models_chat_template_and_can_continue_an_assistant_prefix(serve):
    url, svc = serve()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    rendered = svc.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = svc.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    body = {"model": "fake", "messages": messages, "max_tokens": 4, "temperature": 0}
    answer = post(url, "/v1/chat/completions", body).json()
    assert answer["object"] == "chat.completion" and answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["choices"][0]["message"] == {
        "role": "assistant",
        "content": svc.tokenizer.decode(fake_tokens(svc, prompt, 4)),
    }
    prefixed = [*messages, {"role": "assistant", "content": "Answer:"}]
    text = svc.tokenizer.apply_chat_template(prefixed, tokenize=False, continue_final_message=True)
    cont = post(url, "/v1/chat/completions", {**body, "messages": prefixed, "continue_final_message": True})
    assert text.endswith("Answer:") and cont.json()["usage"]["prompt_tokens"] == len(
        svc.tokenizer(text)["input_ids"]
    )


def test_a_requests_own_budget_is_the_servers_method_at_that_budget(serve):
    url, _ = serve()
    long = " ".join(["river"] * 120)
    body = {"model": "fake", "prompt": long, "max_tokens": 2, "temperature": 0, "budget": 48}
    kv = post(url, "/v1/completions", body).json()["usage"]["kv"]
    assert (kv["method"], kv["budget"], kv["kept"]) == ("snapstream", 48, 48)
    assert post(url, "/v1/completions", {**body, "budget": None}).json()["usage"]["kv"]["kept"] == 64


def test_models_health_and_metrics_say_what_is_served_and_what_it_did(serve):
    url, svc = serve()
    (entry,) = requests.get(url + "/v1/models", timeout=30).json()["data"]
    assert (entry["id"], entry["object"], entry["owned_by"], entry["max_model_len"]) == (
        "fake",
        "model",
        "evalkit",
        256,
    )
    assert entry["evalkit"]["method"]["name"] == "snapstream" and entry["evalkit"]["budget"] == 64
    assert entry["evalkit"]["budget_per_request"] is True and entry["evalkit"]["kv_storage"] == {
        "dtype": "float32"
    }
    assert requests.get(url + "/health", timeout=30).json() == {"status": "ok", "model": "fake"}
    post(url, "/v1/completions", {"model": "fake", "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    post(url, "/v1/completions", {"model": "nope", "prompt": PROMPT})
    text = requests.get(url + "/metrics", timeout=30)
    assert text.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = dict(line.rsplit(" ", 1) for line in text.text.splitlines() if not line.startswith("#"))
    assert samples['evalkit_requests_total{path="/v1/completions",status="200"}'] == "1"
    assert samples['evalkit_requests_total{path="/v1/completions",status="404"}'] == "1"
    assert samples['evalkit_choices_total{reason="length"}'] == "1"
    assert samples['evalkit_model_info{model="fake",method="snapstream",budget="64"}'] == "1"
    seen = len(ids(svc, PROMPT)) + 2
    assert samples["evalkit_kv_seen_total"] == str(seen) and samples["evalkit_kv_kept_ratio"] == "1.0"
    assert samples["evalkit_queue_depth"] == samples["evalkit_rows_running"] == "0"
    assert samples["evalkit_rows"] == "4" and samples["evalkit_queue_limit"] == "16"
    for name in ("prefill_tokens_per_second", "decode_tokens_per_second", "kv_held_bytes", "kv_pool_bytes"):
        assert f"evalkit_{name}" in samples


def test_method_full_takes_no_budget(serve, tokenizer):
    url, _ = serve(fake_service(tokenizer, method="full", budget=None))
    r = post(url, "/v1/completions", {"model": "fake", "prompt": PROMPT, "budget": 64})
    assert r.status_code == 400 and r.json()["error"]["param"] == "budget"
    assert "full keeps every entry" in r.json()["error"]["message"]
