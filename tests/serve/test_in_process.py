"""Must show (issue 34): lm-eval's `local-completions` and `local-chat-completions` against
`python -m evalkit.serve model=smollm2_135m method=snapstream method.budget=128` (the embedded model, a
separate process) give, sample for sample, the greedy answers of the in-process run of the same configuration
(`EvalkitLM`, lm-eval's `--model evalkit`) on the same lm-eval requests. The prompts are 200-700 tokens and
the answers 48 tokens, so SnapStream evicts at prefill and again while it decodes."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from lm_eval.api.instance import Instance
from lm_eval.models.api_models import JsonChatStr
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ["model=smollm2_135m", "method=snapstream", "method.budget=128"]
ROWS = 4  # the server's slot pool and the in-process run's rows: the same decode shapes
FACTS = (
    "The lighthouse keeper on the northern island wrote in his log every evening. ",
    "Trains from the valley arrive twice a day, once at dawn and once after the market closes. ",
    "In the old library the maps are kept in drawers sorted by the year they were drawn. ",
    "The baker opens at six, and the first loaves are always the rye ones his grandmother taught him. ",
)
QUESTIONS = (
    ("The secret code is 4721. ", "What is the secret code? Answer:"),
    ("The blue key is under the third stone. ", "Where is the blue key? Answer:"),
    ("Mira's favourite colour is green. ", "What is Mira's favourite colour? Answer:"),
    ("The meeting moved to Thursday at noon. ", "When is the meeting? Answer:"),
)


def documents() -> list[str]:
    """Long enough to be evicted at budget 128: filler with one fact somewhere inside, then the question."""
    out = []
    for i, (needle, question) in enumerate(QUESTIONS):
        filler = [FACTS[(i + j) % len(FACTS)] for j in range(10 + 8 * i)]
        filler.insert(len(filler) // 3, needle)
        out.append("".join(filler) + question)
    return out


def request(context, doc_id: int, n: int = 48) -> Instance:
    gen = {"until": [], "max_gen_toks": n}  # EOS (lm-eval adds it) or n tokens
    return Instance("generate_until", {}, (context, gen), 0, metadata=("served_vs_in_process", doc_id, 1))


@pytest.fixture
def evalkit_server(tmp_path):
    """The compressed server in its own process (one torch thread: a shared 2-core machine)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "evalkit.serve", *CONFIG, f"batch_size={ROWS}", "serve.port=0"]
    log = open(tmp_path / "serve.err", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
    )
    try:
        line = proc.stdout.readline()  # printed once the server listens
        found = re.search(r"(http://\S+)/v1", line)
        assert found, line + (tmp_path / "serve.err").read_text()[-3000:]
        yield found.group(1)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        log.close()


@pytest.mark.slow
def test_lm_eval_against_the_server_answers_as_the_in_process_run(evalkit_server, one_thread):
    from transformers import AutoTokenizer

    from evalkit.config import model_spec
    from evalkit.lm import EvalkitLM
    from evalkit.sources import tokenizer_path

    url = evalkit_server
    messages = [[{"role": "user", "content": d}] for d in documents()]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(model_spec("smollm2_135m")))
    rendered = [
        tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages
    ]
    assert all(len(tokenizer(r)["input_ids"]) > 200 for r in rendered)  # evicted: well over the budget
    docs = [r + "The answer:" for r in rendered]  # completions: evalkit's way, template and answer prefix
    completions = LocalCompletionsAPI(
        base_url=url + "/v1/completions",
        model="smollm2_135m",
        tokenizer_backend="huggingface",
        tokenizer=str(tokenizer_path(model_spec("smollm2_135m"))),
        tokenized_requests=True,  # token ids, as docs/served.md points lm-eval at it
        num_concurrent=ROWS,
        max_retries=1,
    )
    served = completions.generate_until([request(d, i) for i, d in enumerate(docs)], disable_tqdm=True)
    chat = LocalChatCompletion(
        base_url=url + "/v1/chat/completions", model="smollm2_135m", num_concurrent=ROWS, max_retries=1
    )
    chats = [JsonChatStr(json.dumps(m)) for m in messages]
    served_chat = chat.generate_until([request(c, i) for i, c in enumerate(chats)], disable_tqdm=True)

    metrics = dict(
        line.rsplit(" ", 1)
        for line in requests.get(url + "/metrics", timeout=30).text.splitlines()
        if line.startswith("evalkit_kv_") and "{" not in line
    )
    assert float(metrics["evalkit_kv_kept_total"]) < float(metrics["evalkit_kv_seen_total"]) / 2  # evicted
    lm = EvalkitLM(model="smollm2_135m", method="snapstream", budget=128, batch_size=ROWS)
    local = lm.generate_until([request(d, i) for i, d in enumerate(docs)], disable_tqdm=True)
    local_chat = lm.generate_until([request(r, i) for i, r in enumerate(rendered)], disable_tqdm=True)

    print(f"served vs in-process: {served} / {local}; chat: {served_chat} / {local_chat}")
    assert served == local and served_chat == local_chat
    assert all(a.strip() for a in local + local_chat)  # something was generated to compare
