"""`python -m evalkit.serve [overrides]` (`make serve`): the model, method and budget `make eval` would run,
served over OpenAI's HTTP API (conf/serve.yaml, docs/served.md).

Reads top to bottom: compose the config, check everything that can fail before the model loads (one line,
exit 2), load the model, start the engine loop and uvicorn. SIGTERM (or Ctrl-C) drains: new requests get 503,
in-flight ones may finish for `serve.shutdown_s` seconds, then their rows are cancelled; the process exits 0.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from dataclasses import dataclass

from omegaconf import DictConfig

from evalkit.config import ConfigError, check_choice, compose, model_spec
from evalkit.errors import EvalkitError, exit_with
from evalkit.overrides import check_overrides

PROGRAM = "python -m evalkit.serve"


@dataclass(frozen=True)
class Settings:
    """The `serve` block, checked."""

    host: str
    port: int
    queue_limit: int
    shutdown_s: float
    max_n: int
    rows: int  # batch_size: rows of the slot pool

    @classmethod
    def of(cls, cfg: DictConfig) -> Settings:
        s = cfg.serve
        for key, value, ok, rule in (
            ("serve.host", s.host, lambda v: isinstance(v, str) and v != "", "a host name or address"),
            ("serve.port", s.port, lambda v: _int(v) and 0 <= v <= 65535, "an integer in [0, 65535]"),
            ("serve.queue_limit", s.queue_limit, lambda v: _int(v) and v >= 1, "a positive integer"),
            ("serve.shutdown_s", s.shutdown_s, lambda v: _num(v) and v >= 0, "a number of seconds >= 0"),
            ("serve.max_n", s.max_n, lambda v: _int(v) and v >= 1, "a positive integer"),
            ("batch_size", cfg.batch_size, lambda v: _int(v) and v >= 1, "a positive integer (the rows)"),
        ):
            if not ok(value):
                raise ConfigError(f"{key} must be {rule}, got {value!r}")
        if s.max_n > s.queue_limit:
            raise ConfigError(
                f"serve.max_n={s.max_n} is above serve.queue_limit={s.queue_limit}: a request of n choices "
                "could never be queued"
            )
        return cls(s.host, s.port, s.queue_limit, float(s.shutdown_s), s.max_n, cfg.batch_size)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def checked(cfg: DictConfig):
    """(settings, model spec, context, ranks, KV storage): every refusal before the model loads."""
    from evalkit.checks import check_methods, check_tp, run_facts
    from evalkit.kv.config import make_method
    from evalkit.kv.storage import make_storage
    from evalkit.sources import context_length, model_config, resolve_source
    from evalkit.team import Ranks

    settings = Settings.of(cfg)
    method = make_method(cfg.method)
    storage = make_storage(cfg.kv)  # conf/kv/, as a run's: the slot pool holds K/V as it says
    if cfg.model.get("base_url"):
        raise ConfigError(f"model {cfg.model.name} is served elsewhere already: serve a model evalkit loads")
    ranks = Ranks.from_config(cfg)
    if ranks.dp > 1:
        raise ConfigError(
            f"parallel.dp_size={ranks.dp}: a server is one replica (rank 0 serves HTTP, the other ranks are "
            "its tensor-parallel shards); start one server per replica instead"
        )
    spec = model_spec(cfg.model)
    model_cfg = model_config(spec, resolve_source(spec))
    context = context_length(spec, model_cfg)
    if method.budget is not None and method.budget > context:
        raise ConfigError(f"method.budget={method.budget} is above {spec.name}'s context of {context} tokens")
    check_tp(spec.name, model_cfg, ranks.tp)
    # what the method cannot run with (MLA, a follow-up call), what the storage cannot hold for it; a served
    # request makes no follow-up call
    facts = run_facts(spec.name, model_cfg, cfg.compile, followup=False, tp=ranks.tp)
    check_methods([method], facts, storage, model_cfg)
    return settings, spec, context, ranks, storage


def service(cfg: DictConfig, team, settings: Settings, spec, context: int, storage=None):
    """The model loaded (this rank's shard under TP) and rank 0's engine behind the service, or, on another
    TP rank, the `Follower` that mirrors it."""
    from evalkit.loading import load_model
    from evalkit.serve.live import Follower, engine_service

    model, tokenizer = load_model(spec, team)
    if not team.writer:
        return Follower(model, tokenizer, settings.rows, team, compile=cfg.compile, storage=storage)
    return engine_service(
        model,
        tokenizer,
        spec.name,
        cfg.method,
        settings.rows,
        settings.queue_limit,
        max_n=settings.max_n,
        context=context,
        compile=cfg.compile,
        source=spec.source_label(),
        team=team,
        storage=storage,
    )


def uvicorn_server(app, svc, settings: Settings):
    """uvicorn whose SIGTERM / SIGINT drains the service (new requests 503, /health "draining", what still
    runs after `serve.shutdown_s` cancelled, its clients told) while uvicorn waits for the connections to
    close; the process then ends with status 0 (uvicorn itself re-raises the signal after its graceful
    shutdown, which would end it with 143)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            before = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame):
            svc.drain(settings.shutdown_s)
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                m = svc.card.method
                print(
                    f"evalkit.serve: {svc.card.id} with {m.name} (budget {m.budget}, kv "
                    f"{svc.card.storage['name']}) on "
                    f"http://{host}:{port}/v1 ({settings.rows} rows, queue {settings.queue_limit})",
                    flush=True,
                )

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=settings.shutdown_s + 10,  # a backstop: the drain cancels at shutdown_s
    )
    return Server(config)


def main(argv: list[str] | None = None) -> None:
    from hydra.errors import HydraException

    from evalkit.serve.app import make_app
    from evalkit.serve.live import Follower
    from evalkit.team import Team

    overrides = sys.argv[1:] if argv is None else argv
    team = Team.single()
    try:
        for group, _, name in (o.partition("=") for o in overrides):
            if group in ("model", "method", "task"):
                check_choice(group, name)  # names the valid choices
        check_overrides(overrides, "serve")
        try:
            cfg = compose("serve", overrides)
        except HydraException as e:  # what Hydra refuses otherwise (a malformed override)
            raise ConfigError(str(e).splitlines()[0]) from None
        settings, spec, context, ranks, storage = checked(cfg)
        team = Team.start(ranks)
        svc = service(cfg, team, settings, spec, context, storage)
    except EvalkitError as e:
        exit_with(PROGRAM + team.rank_tag(), e)
    if isinstance(svc, Follower):
        follow(svc)
        return
    uvicorn_server(make_app(svc), svc, settings).run()
    if team.world > 1:  # the followers return with the engine loop's last poll; then all leave together
        svc.backend.join()
        if not svc.backend.inbox.failed:
            team.leave()


def follow(follower) -> None:
    """A TP follower: the drain is rank 0's to decide (torchrun signals every rank; this one keeps stepping
    until rank 0's engine loop closes), then it leaves the process group with rank 0."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    follower.run()
    follower.team.leave()


if __name__ == "__main__":
    main()
