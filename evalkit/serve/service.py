"""What the server serves (`Card`) and what every request goes through before it takes a row (`Service`):
the model it names, its prompt tokenized (a chat rendered with the model's chat template), its length against
the context, `n`, its budget made into the server's method at that budget; then its choices as engine
`Work`, submitted to the backend's bounded queue. Every refusal is an `ApiError` naming the field.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field

from evalkit.config import ConfigError
from evalkit.kv.config import make_method
from evalkit.request import request_seed
from evalkit.serve.backend import Closed, End, QueueFull, Work
from evalkit.serve.schema import ApiError, ChatBody, Common, CompletionBody, prompts, stops


@dataclass
class Card:
    """The served configuration, fixed at start: what /v1/models says (a served run records it)."""

    id: str  # the model's name (its conf's model.name)
    context: int  # prompt and completion together, in tokens
    method: object  # the KV method at the server's budget
    method_conf: object  # its conf: a request's own budget is this method at that budget
    storage: dict  # how the cache stores K/V
    source: str  # where the weights came from (metrics.json model.source)
    git_sha: str | None
    max_n: int
    kv: object = None  # the `KVStorage` itself (`storage` is its record): it refuses a request's own budget
    created: int = field(default_factory=lambda: int(time.time()))

    def entry(self, backend_stats: dict) -> dict:
        """The /v1/models entry: OpenAI's fields, and evalkit's configuration under `evalkit`."""
        return {
            "id": self.id,
            "object": "model",
            "created": self.created,
            "owned_by": "evalkit",
            "root": self.id,
            "max_model_len": self.context,
            "evalkit": {
                "method": self.method.describe(),
                "budget": self.method.budget,
                "budget_per_request": self.method.budget_applies,
                "kv_storage": self.storage,
                "source": self.source,
                "git_sha": self.git_sha,
                "rows": backend_stats["rows"],
                "queue_limit": backend_stats["queue_limit"],
                "max_n": self.max_n,
            },
        }


@dataclass
class Prepared:
    """A request ready for the engine."""

    works: list[Work]
    prompt_tokens: int  # each prompt counted once, whatever its `n`
    stops: list[str]
    method: object


def choice_seed(seed: int, index: int) -> int:
    """Choice 0 samples with the request's own seed (as the in-process run seeds a request); the others with
    seeds derived from it."""
    return seed if index == 0 else request_seed(seed, f"choice/{index}")


class Service:
    def __init__(self, card: Card, tokenizer, backend):
        self.card, self.tokenizer, self.backend = card, tokenizer, backend
        self._methods: dict[int, object] = {}
        self.draining = False

    # --- the checks ---------------------------------------------------------------------------------------
    def check_model(self, body: Common) -> None:
        if body.model != self.card.id:
            raise ApiError(
                404,
                f"model {body.model!r} is not served here; this server serves {self.card.id!r}",
                "model",
                "model_not_found",
            )

    def method_for(self, budget: int | None):
        """The server's method, or the same method at the request's own budget (rows of different budgets
        share the pool)."""
        method = self.card.method
        if budget is None:
            return method
        if not method.budget_applies:
            raise ApiError(
                400, f"budget: method {method.name} keeps every entry; leave budget unset", "budget"
            )
        if budget not in self._methods:
            try:
                made = make_method(self.card.method_conf, budget=budget)
            except ConfigError as e:
                raise ApiError(400, f"budget: {e}", "budget") from None
            if budget > self.card.context:
                raise ApiError(
                    400, f"budget={budget} is above the context of {self.card.context} tokens", "budget"
                )
            if self.card.kv is not None and (why := self.card.kv.refusal(made)) is not None:
                raise ApiError(400, f"budget: {why}", "budget")  # e.g. a ring's budget int KV cannot group
            self._methods[budget] = made
        return self._methods[budget]

    def fit(self, body: Common, ids: list[list[int]], max_tokens: int | None, param: str) -> int:
        """The new-token limit of these prompts, or an ApiError: over the context, a bad n or limit."""
        if body.n > self.card.max_n:
            raise ApiError(
                400,
                f"n={body.n} is above this server's limit of {self.card.max_n} choices per request "
                "(serve.max_n)",
                "n",
            )
        vocab = len(self.tokenizer)
        if any(t >= vocab for p in ids for t in p):
            raise ApiError(400, f"{param}: a token id is outside the vocabulary (size {vocab})", param)
        longest, context = max(len(p) for p in ids), self.card.context
        if longest >= context:
            raise ApiError(
                400,
                f"{param}: the prompt is {longest} tokens; {self.card.id}'s context is {context} tokens "
                "(prompt and completion together)",
                param,
                "context_length_exceeded",
            )
        new = context - longest if max_tokens is None else max_tokens
        if new < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {new}", "max_tokens")
        if longest + new > context:
            raise ApiError(
                400,
                f"max_tokens: the prompt ({longest} tokens) + max_tokens ({new}) = {longest + new} tokens, "
                f"above {self.card.id}'s context of {context} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        if body.min_tokens > new:
            raise ApiError(400, f"min_tokens={body.min_tokens} is above max_tokens={new}", "min_tokens")
        return new

    # --- prompts ------------------------------------------------------------------------------------------
    def completion(self, body: CompletionBody) -> Prepared:
        self.check_model(body)
        ids = [
            self.tokenizer(p, add_special_tokens=body.add_special_tokens)["input_ids"]
            if isinstance(p, str)
            else list(p)
            for p in prompts(body.prompt)
        ]
        if not all(ids):
            raise ApiError(400, "prompt: a prompt tokenizes to no tokens", "prompt")
        new = self.fit(body, ids, body.max_tokens, "prompt")
        return self._prepared(body, ids, new, body.logprobs)

    def chat(self, body: ChatBody) -> Prepared:
        self.check_model(body)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, f"{self.card.id} has no chat template: use /v1/completions", "messages")
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in body.messages
        ]
        if body.continue_final_message and messages[-1]["role"] != "assistant":
            raise ApiError(400, "continue_final_message needs an assistant message last", "messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
            )
        except Exception as e:  # jinja's TemplateError, transformers' ValueError: the template refused them
            raise ApiError(400, f"messages: the chat template refused them ({e})", "messages") from None
        ids = [self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        new = self.fit(body, ids, limit, "messages")
        alternatives = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return self._prepared(body, ids, new, alternatives)

    def _prepared(self, body: Common, ids: list[list[int]], new: int, alternatives: int | None) -> Prepared:
        method = self.method_for(body.budget)
        seed = body.seed if body.seed is not None else secrets.randbits(63)  # unseeded: another each time
        until = stops(body.stop)
        works = [
            Work(
                p,
                new,
                method,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),
                seed=choice_seed(seed, j),
                stops=until,
                min_new=body.min_tokens,
                logprobs=alternatives,
            )
            for p in ids
            for j in range(body.n)
        ]
        return Prepared(works, sum(len(p) for p in ids), until, method)

    # --- the queue ----------------------------------------------------------------------------------------
    def submit(self, prepared: Prepared):
        if self.draining:
            raise ApiError(503, "the server is shutting down", None, "shutting_down")
        try:
            return self.backend.submit(prepared.works)
        except QueueFull as e:
            error = ApiError(429, str(e), None, "queue_full")
            error.headers["Retry-After"] = str(e.retry_after)
            raise error from None
        except Closed as e:
            raise ApiError(503, str(e), None, "unavailable") from None

    def usage(self, prepared: Prepared, ends: list[End], completion_tokens: int) -> dict:
        """OpenAI's usage, and this request's KV figures under `kv` (per choice, and summed)."""
        figures = ("seen", "kept", "evicted_generated", "slots", "bytes")
        per = [{"index": i, **{k: e.stats.get(f"kv_{k}") for k in figures}} for i, e in enumerate(ends)]
        total = {k: sum(c[k] or 0 for c in per) for k in figures}
        return {
            "prompt_tokens": prepared.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prepared.prompt_tokens + completion_tokens,
            "kv": {
                "method": prepared.method.name,
                "budget": prepared.method.budget,
                "storage": self.card.storage,
                **total,
                "choices": per,
            },
        }

    def drain(self, grace_s: float) -> None:
        """Take no new work (503); what still runs after `grace_s` seconds is cancelled, and its clients are
        told so (a 503, or an error event ending the stream)."""
        if self.draining:
            return
        self.draining = True
        timer = threading.Timer(grace_s, self.backend.cancel_all)
        timer.daemon = True
        timer.start()

    def health(self) -> tuple[int, dict]:
        failed = self.backend.stats()["failed"]
        if failed:
            return 503, {"status": "failed", "error": failed}
        if self.draining:
            return 503, {"status": "draining"}
        return 200, {"status": "ok", "model": self.card.id}
