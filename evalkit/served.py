"""Served baselines: a model behind an OpenAI-compatible server (vLLM, SGLang, TGI, `transformers serve`)
scored on evalkit's tasks exactly as an in-process run is, through lm-eval's own API models.

`model=served` (conf/model/served.yaml) names the server (`base_url`, `model_id`), the API (`completions` or
`chat`) and the served model's tokenizer. Nothing is loaded locally: prompts are rendered and counted with the
tokenizer, requests go through lm-eval's `local-completions` / `local-chat-completions` machinery (its
`num_concurrent` requests in flight, its retries), and every finished generation is journaled in the same
record format as `EvalkitLM`'s (evalkit.request and evalkit.journal hold what both share), so resume, scoring,
`metrics.json` and the leaderboard are the in-process ones. The server keeps its own full cache: the method is
`full`, budget none, and no KV figure is measured (null in metrics.json, never 0); evalkit's own server
(`make serve`) may serve a compressed cache, whose method, budget and KV figures it reports
(evalkit.served_kv).

- completions: the request's prompt is `evalkit.request.sample_prompt(...)`, byte for byte what the in-process
  model is given (chat template and assistant prefill rendered here). A server may still add special tokens
  when it tokenizes (a second BOS with Llama-3 templates on vLLM: `extra_body: {add_special_tokens: false}`);
  the prompt tokens it reports are journaled beside evalkit's count (`server_prompt_tokens`) so any such
  difference shows.
- chat: the server renders its own chat template from [system, user] messages; an answer prefix (RULER's)
  becomes a final assistant message continued with vLLM/SGLang's `continue_final_message` (servers without it
  refuse).

Before any request the server is asked what it serves (GET /models): an unreachable server, another model or a
smaller context is an error before anything is journaled. What it reports about itself (its /models entry, its
`server` header, /version or /info where it has them) is kept in the run folder (`server.json`) and in
metrics.json; a resumed run whose server reports another model or version is refused, never mixed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp
from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI
from omegaconf import OmegaConf

from evalkit.config import ConfigError
from evalkit.journal import journal_record, journaled, keyed
from evalkit.kv.methods import Full
from evalkit.models import ModelSpec
from evalkit.request import (
    Prompt,
    finish_text,
    fit_prompt,
    followup_prompt,
    generation_config,
    new_tokens_cap,
    request_prompt,
    request_seed,
    stop_strings,
)
from evalkit.sample import TEMPLATE_KEY
from evalkit.served_kv import agree, card, kv_stats, storage_name
from evalkit.server import ServedError, listed, pin_server, provenance, server_report
from evalkit.sources import tokenizer_path

if TYPE_CHECKING:
    from evalkit.checks import RunNeeds

APIS = ("completions", "chat")
# /models entry fields that identify what is served (others, like `created`, change on every call)
TRANSIENT = {408, 409, 425, 429}  # and every 5xx: worth another attempt; any other 4xx is final


@dataclass
class ServedSpec(ModelSpec):
    """A model conf for a served model. The ModelSpec fields name where its tokenizer and config are read
    (filled from `tokenizer`); the weights are the server's."""

    base_url: str | None = None
    model_id: str | None = None  # None: the server's one model
    api: str = "completions"
    num_concurrent: int = 8
    max_retries: int = 3
    timeout_s: int = 1800
    extra_body: dict = field(default_factory=dict)
    dtype: str | None = None  # what the server computes in is its own business
    reference_for: str | None = None  # an in-process model conf this full run is the report's reference of

    def check(self, needs: RunNeeds) -> None:
        """Refuse what a server cannot run and a bad served conf before any data or request (ConfigError
        naming the setting), and resolve `tokenizer` to the files it names. query_aware=false runs: a full
        cache is query-agnostic by nature, so its prompts go as they are (the same outputs)."""
        if needs.multi_question:
            raise ConfigError(
                f"multi_question=true: model {self.name} is served (a served cache is not held between "
                "requests): run it in process"
            )
        if needs.storage != "none":
            raise ConfigError(
                f"kv={needs.storage}: a served model holds K/V as its server does (vLLM: --kv-cache-dtype); "
                "run it with kv=none"
            )
        if needs.processes > 1:
            raise ConfigError(
                f"model {self.name} is served at {self.base_url}: its server does the parallel work; run it "
                f"with NPROC=1 (this run started {needs.processes} processes)"
            )
        url = urlsplit(self.base_url or "")
        if url.scheme not in ("http", "https") or not url.netloc or url.query or url.fragment:
            raise ConfigError(
                f"model.base_url must be the server's http(s) OpenAI root (e.g. "
                f"http://127.0.0.1:8000/v1), got {self.base_url!r}"
            )
        if needs.method != "full" and not any(card(m) for m in listed(self)):
            raise ConfigError(
                "a served model keeps the server's own full cache: use method=full (got "
                f"method={needs.method}), or point model.base_url at an evalkit server (`make serve`): it "
                "serves a compressed cache and says which in its /v1/models"
            )
        if self.api not in APIS:
            raise ConfigError(f"model.api must be one of {', '.join(APIS)}, got {self.api!r}")
        for key in ("num_concurrent", "max_retries", "timeout_s"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{key} must be a positive integer, got {value!r}")
        if OmegaConf.is_config(self.extra_body):  # hydra hands over a DictConfig
            self.extra_body = OmegaConf.to_container(self.extra_body, resolve=True)
        if not isinstance(self.extra_body, dict):
            raise ConfigError(
                f"model.extra_body must be a mapping of request fields, got {self.extra_body!r}"
            )
        if not self.tokenizer:
            raise ConfigError(
                "model.tokenizer: name the served model's tokenizer and config (a model conf such as "
                "llama31_8b_instruct, a local folder or a hub id): prompts are rendered and counted with it"
            )
        self._check_reference()
        self._resolve_files()

    def _check_reference(self) -> None:
        """`reference_for` names an in-process model conf (the report pairs its compressed runs with this
        full run, docs/served.md)."""
        from evalkit.config import CONF_DIR, model_spec

        if self.reference_for is None:
            return
        name = self.reference_for
        if not (CONF_DIR / "model" / f"{name}.yaml").exists() or isinstance(model_spec(name), ServedSpec):
            raise ConfigError(
                f"model.reference_for must name an in-process model conf (conf/model/<name>.yaml, e.g. "
                f"llama31_8b_instruct), got {name!r}"
            )

    def _resolve_files(self) -> None:
        from evalkit.config import CONF_DIR, model_spec

        if (CONF_DIR / "model" / f"{self.tokenizer}.yaml").exists():
            named = model_spec(self.tokenizer)
            if named.random is not None or isinstance(named, ServedSpec):
                raise ConfigError(f"model.tokenizer={self.tokenizer} names no real model's files")
            source = tokenizer_path(named)  # its folder (the embedded GGUF is converted once) or its hub id
            if Path(source).is_dir():
                self.path = source
            else:
                self.id, self.revision = named.id, named.revision
        elif Path(self.tokenizer).is_dir():
            self.path = self.tokenizer
        else:
            self.id = self.tokenizer

    @property
    def root(self) -> str:
        return self.base_url.rstrip("/")

    # --- ModelBackend: generation by the server -------------------------------------------------------------
    def make_lm(self, plans: list, context: int, load, team=None):
        """The served LM for the one plan (the server's method), after the server was checked and pinned to
        its folder; nothing is loaded here (`load` is not called): prompts are rendered with the tokenizer
        alone. One process only (`Team.check_model`)."""
        from evalkit.task import get_tokenizer

        (p,) = plans
        return served_lm(self, get_tokenizer(tokenizer_path(self)), context, p)

    def source_label(self) -> str:
        """The weights are the server's, only its tokenizer is here."""
        return (
            f"served:{self.base_url} (model {self.model_id or 'the one it serves'}; tokenizer "
            f"{self.tokenizer})"
        )

    def extra_metrics(self, out: Path) -> dict:
        return {"served": provenance(out)}  # the server's URL, model id and what it said about itself


# --- the server: what it serves, before any request ---------------------------------------------------------
class _Transient(RuntimeError):
    """Worth another attempt (lm-eval's retry loop retries what amodel_call raises)."""


class _Final(RuntimeError):
    """Not worth another attempt: the request itself was refused."""


FAILED = (TimeoutError, _Transient, aiohttp.ClientError, OSError)  # after lm-eval's last retry


def _quiet(loop, context: dict) -> None:
    if not isinstance(context.get("exception"), FAILED):
        loop.default_exception_handler(context)


def _count(value) -> int | None:
    """A server's token count: None when it gave none (or not a number); a negative one is refused."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    if value < 0:
        raise _Final(f"the server reported negative completion_tokens ({value})")
    return value


class _Served:
    """What the completions and chat variants share: evalkit prompts, lm-eval's concurrency and retries, the
    journal.

    `generate_until` replaces TemplateAPI's: each request is keyed and rendered exactly as EvalkitLM does it,
    the ones not journaled yet go through lm-eval's `get_batched_requests` (an aiohttp session,
    `num_concurrent` requests in flight, `max_retries` attempts with exponential back-off), and `amodel_call`
    journals each one as it finishes, so a killed run loses nothing that finished."""

    def __init__(self, spec: ServedSpec, tokenizer, context: int, journal, report: dict, seed: int = 0):
        endpoint = f"{spec.root}/chat/completions" if spec.api == "chat" else f"{spec.root}/completions"
        super().__init__(
            base_url=endpoint,
            model=report["model"]["id"],
            tokenizer_backend=None,
            tokenized_requests=False,
            num_concurrent=spec.num_concurrent,
            max_retries=spec.max_retries,
            timeout=spec.timeout_s,
            max_length=context + 1,
            batch_size=1,
            seed=seed,
        )
        self.spec, self.prompt_tokenizer, self.context, self.journal = spec, tokenizer, context, journal
        self.method, self.extra = Full(), {}  # the run's method; what each request adds (served_kv.agree)
        self._failed: list[str] = []
        # servers answer with the id asked for, or with the weights' path (vLLM's `root`)
        self._names = {report["model"]["id"], report["model"].get("root")} - {None}

    def _cap(self, n: int) -> int:
        return new_tokens_cap(self.spec, n)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts = [
            request_prompt(r, k, self.prompt_tokenizer, self._max_gen_toks, self._cap)
            for r, k in zip(requests, keyed(requests))
        ]
        todo = [p for p in prompts if journaled(self.journal, p) is None]
        if todo:  # lm-eval's gather shows the progress ("Requesting API")
            try:
                asyncio.run(self._requests(todo))
            except FAILED as e:
                raise ServedError(
                    f"{self.base_url} failed after {self.max_retries} attempts ({e or type(e).__name__}); "
                    "the finished requests are journaled: run the same command again to resume"
                ) from None
            if self._failed:
                raise ServedError(
                    f"the server refused {len(self._failed)} request(s): {'; '.join(self._failed[:3])}"
                )
        return [self.journal.get(p.key)["text"] for p in prompts]

    async def _requests(self, todo: list[Prompt]) -> None:
        # One failure ends the run with a clear error (above); the requests that failed beside it would each
        # print "Task exception was never retrieved" when collected: the run's error already says it.
        asyncio.get_running_loop().set_exception_handler(_quiet)
        await self.get_batched_requests(todo, cache_keys=[p.key for p in todo], generate=True)

    async def amodel_call(self, session, sem, messages, *, cache_keys=None, **kwargs):
        """One request (and its follow-up call, LongBench CoT), journaled when it finishes."""
        (p,) = messages
        async with sem:
            if self._failed:  # a refused request stops the run: send nothing more
                return [None]
            try:
                text, stats = await self._call(session, p)
                if p.followup is not None:
                    first = text
                    text, second = await self._call(
                        session, followup_prompt(p, first, self.prompt_tokenizer, self._cap)
                    )
                    stats.update(followup=second, first_output=first, followup_method=self.method.name)
            except _Final as e:
                self._failed.append(f"{p.key}: {e}")
                return [None]
        self.journal.append(journal_record(p, text, stats))
        return [text]

    async def _call(self, session, p: Prompt) -> tuple[str, dict]:
        """POST one prompt: (text as the scorer sees it, the journal's stats: tokens, finish reason,
        latency)."""
        ids, truncated, max_new = fit_prompt(self.prompt_tokenizer, p, self.context)
        p = replace(p, max_new=max_new)  # a generation capped by the model context
        if truncated and self.spec.api == "chat":
            raise _Final(
                f"{len(ids)}-token cut of a prompt longer than the context: only api=completions can cut it"
            )
        text = self.prompt_tokenizer.decode(ids) if truncated else p.text  # cut in the middle, as in process
        payload = self._payload(p, text)
        start = time.perf_counter()
        try:
            async with session.post(self.base_url, json=payload, headers=self.header) as response:
                body = await response.text()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise _Transient(f"{type(e).__name__}: {e}") from e
        latency = time.perf_counter() - start
        if response.status in TRANSIENT or response.status >= 500:
            raise _Transient(f"HTTP {response.status}: {body[:300]!r}")
        if not response.ok:
            raise _Final(f"HTTP {response.status}: {body[:300]!r}")
        choice, usage = self._choice(body)
        out = self._text(choice)
        if not isinstance(out, str):
            raise _Final(f"the answer holds no text: {body[:300]!r}")
        self._check_model(choice, body)
        try:
            kv = kv_stats(usage, self.method)
        except ValueError as e:
            raise _Final(str(e)) from None
        until = stop_strings(p)
        tokens = _count(usage.get("completion_tokens"))
        if tokens is None:  # the server reports no usage: count the text with the tokenizer
            tokens = len(self.prompt_tokenizer(out, add_special_tokens=False)["input_ids"])
        return finish_text(p, out, until), {
            "prompt_tokens": len(ids),
            "server_prompt_tokens": usage.get("prompt_tokens"),
            "truncated": truncated,
            "max_new_tokens": p.max_new,
            "output_tokens": tokens,
            "output_tokens_from": "tokenizer" if _count(usage.get("completion_tokens")) is None else "server",
            "hit_limit": choice.get("finish_reason") == "length",
            "finish_reason": choice.get("finish_reason"),
            "wall_s": latency,
            "tokens_per_s": tokens / max(latency, 1e-9),
            "api": self.spec.api,
            **kv,  # an evalkit server's measured KV figures of this request
        }

    def _payload(self, p: Prompt, text: str) -> dict:
        """lm-eval's request body for this API with the task's decoding settings, as evalkit decodes in
        process: greedy unless the task samples, top_p / top_k only when sampling, top_k only when set
        (servers differ)."""
        decode = generation_config(p.gen, p.max_new, [0], 0)
        gen = {
            "max_gen_toks": p.max_new,
            "until": stop_strings(p),
            "temperature": decode.temperature if decode.do_sample else 0.0,
        }
        if decode.do_sample:
            gen["top_p"] = decode.top_p
            if decode.top_k:
                gen["top_k"] = decode.top_k
        payload = self._create_payload(
            self._messages(p, text),
            generate=True,
            gen_kwargs=gen,
            seed=request_seed(self._seed, p.key),
            eos=None,
        )
        if not payload.get("stop"):
            payload.pop("stop", None)  # no stop strings: the server stops at its EOS, as evalkit does
        return {**payload, **self.spec.extra_body, **self.extra}

    def _choice(self, body: str) -> tuple[dict, dict]:
        try:
            out = json.loads(body)
            choice, usage = out["choices"][0], out.get("usage") or {}
            if not isinstance(choice, dict) or not isinstance(usage, dict):
                raise TypeError
            choice["model"] = out.get("model")  # checked against the pinned model (`_check_model`)
            return choice, usage
        except (json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
            raise _Final(f"not an OpenAI answer: {body[:300]!r}") from None

    def _check_model(self, choice: dict, body: str) -> None:
        """A server that starts answering as another model mid-run (a redeploy behind the same address) stops
        the run before that answer is journaled. An answer naming no model is taken as the pinned one."""
        model = choice.get("model")  # `transformers serve` appends the revision it resolved: "org/name@main"
        if model is not None and model not in self._names and str(model).rsplit("@", 1)[0] not in self._names:
            raise _Final(
                f"the server answered as model {model!r}, not {self.model!r} (the model it served when the "
                f"run started); nothing from it is journaled: {body[:200]!r}"
            )


class ServedCompletions(_Served, LocalCompletionsAPI):
    """/v1/completions with evalkit's rendered prompt text."""

    def _messages(self, p: Prompt, text: str):
        return text

    @staticmethod
    def _text(choice: dict):
        return choice.get("text")


class ServedChat(_Served, LocalChatCompletion):
    """/v1/chat/completions: the server renders its own chat template from the sample's messages."""

    def _messages(self, p: Prompt, text: str):
        s = p.sample
        if s is None:
            raise _Final(
                "the chat API needs evalkit's sample fields (a plain lm-eval task: use api=completions)"
            )
        if s.rendered or s.meta.get(
            TEMPLATE_KEY
        ):  # the task's own template: a chat template would wrap it again
            raise _Final(
                f"task {s.task} renders its own prompt template (e.g. livecodebench_r1, RULER's "
                "meta-llama3); the chat API would wrap it in the server's chat template: use "
                "model.api=completions"
            )
        messages = [{"role": "system", "content": s.system}] if s.system else []
        messages.append({"role": "user", "content": s.prompt})
        if s.answer_prefix:
            messages.append({"role": "assistant", "content": s.answer_prefix})
        return messages

    def _payload(self, p: Prompt, text: str) -> dict:
        payload = super()._payload(p, text)
        if p.sample is not None and p.sample.answer_prefix:  # vLLM / SGLang: continue the assistant's prefill
            payload.update(add_generation_prompt=False, continue_final_message=True)
        return payload

    @staticmethod
    def _text(choice: dict):
        return (choice.get("message") or {}).get("content")


def served_lm(spec: ServedSpec, tokenizer, context: int, plan):
    """The lm-eval model for a served run, after the server was checked (an evalkit server serves the run's
    method, budget and storage: evalkit.served_kv) and pinned to the run folder."""
    report = server_report(spec, context)
    extra = agree(report, plan.method, plan.cfg.method, storage_name(plan.cfg))
    pin_server(plan.out, report)
    cls = ServedChat if spec.api == "chat" else ServedCompletions
    lm = cls(spec, tokenizer, context, plan.journal, report, seed=plan.cfg.seed)
    lm.method, lm.extra = plan.method, extra
    return lm
