"""`make serve`: evalkit's engine, with its compressed KV caches, behind an OpenAI-compatible HTTP server
(docs/served.md).

- `__main__`: the config (conf/serve.yaml), the checks before the model loads, uvicorn, SIGTERM;
- `app`: the endpoints, server-sent events, cancellation when a client goes away;
- `service`: what a request goes through before it takes a row (model, context, n, budget), its usage;
- `schema`: the request bodies, and errors in OpenAI's shape;
- `backend`: the engine-facing protocol (submit / cancel / stats) and the bounded queue between the threads;
- `live`: the real engine behind it (`evalkit.engine.Engine` through its Feed hooks); `fake`: a model-free
  one for fast tests;
- `text`: streamed text and logprobs; `metrics`: /metrics in Prometheus' text format.
"""
