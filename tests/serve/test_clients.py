"""The clients docs/served.md points at the server speak to it unchanged: the OpenAI Python client (answers,
streams, the budget as `extra_body`, the KV figures in `usage`, errors as its exceptions) and lm-eval's
`local-completions` / `local-chat-completions` (generation requests, text or token ids, concurrent)."""

import json

import openai
import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.api_models import JsonChatStr
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

from tests.serve.test_api import PROMPT, fake_tokens, ids


def test_the_openai_client(serve):
    url, svc = serve()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    want = svc.tokenizer.decode(fake_tokens(svc, ids(svc, PROMPT), 4))
    r = client.completions.create(
        model="fake", prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"budget": 48}
    )
    assert r.choices[0].text == want and r.usage.completion_tokens == 4
    assert r.usage.model_extra["kv"]["budget"] == 48
    stream = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    whole = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0
    )
    assert "".join(pieces) == whole.choices[0].message.content != ""
    assert [m.id for m in client.models.list()] == ["fake"]
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        client.completions.create(model="fake", prompt=PROMPT, max_tokens=-1)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt=PROMPT)


def request(context, until, n=5):
    return Instance("generate_until", {}, (context, {"until": until, "max_gen_toks": n}), 0)


@pytest.mark.parametrize("tokenized", [False, True])
def test_lm_evals_local_completions(serve, tokenizer, tokenized):
    url, svc = serve()
    lm = LocalCompletionsAPI(
        base_url=url + "/v1/completions",
        model="fake",
        tokenizer_backend="huggingface" if tokenized else None,
        tokenizer=tokenizer.name_or_path,
        tokenized_requests=tokenized,
        num_concurrent=2,
        max_retries=1,
    )
    contexts = [PROMPT, "Seven cats sleep"]
    got = lm.generate_until([request(c, ["\n\n"]) for c in contexts], disable_tqdm=True)
    # lm-eval adds its EOS string to the stops; the fake's words never hold it
    assert got == [svc.tokenizer.decode(fake_tokens(svc, ids(svc, c), 5)) for c in contexts]


def test_lm_evals_local_chat_completions(serve):
    url, svc = serve()
    lm = LocalChatCompletion(
        base_url=url + "/v1/chat/completions", model="fake", num_concurrent=1, max_retries=1
    )
    messages = [{"role": "user", "content": PROMPT}]
    (got,) = lm.generate_until([request(JsonChatStr(json.dumps(messages)), ["\n\n"])], disable_tqdm=True)
    rendered = svc.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got == svc.tokenizer.decode(fake_tokens(svc, svc.tokenizer(rendered)["input_ids"], 5))
