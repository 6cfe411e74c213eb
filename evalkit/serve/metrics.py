"""`/metrics` in Prometheus' text format (version 0.0.4): requests, the queue, the rows, the engine's prefill
and decode rates, and the KV cache (bytes held, kept/seen). Counters end in `_total`; the rates are busy-time
averages since start (`rate()` over the `_tokens_total` and `_seconds_total` counters gives windowed ones).
"""

from __future__ import annotations

from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _line(name: str, kind: str, doc: str, samples: list[tuple[dict, float]]) -> str:
    out = [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        tags = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{tags}}} {_number(value)}" if tags else f"{name} {_number(value)}")
    return "\n".join(out)


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))


# (name, type, help, the backend stats' key): one unlabelled sample each
SCALARS = [
    ("evalkit_queue_depth", "gauge", "Choices waiting for a row.", "waiting"),
    ("evalkit_queue_limit", "gauge", "Choices the queue holds before HTTP 429.", "queue_limit"),
    ("evalkit_rows", "gauge", "Rows of the engine's slot pool.", "rows"),
    ("evalkit_rows_running", "gauge", "Choices holding a row now.", "running"),
    ("evalkit_prefill_tokens_total", "counter", "Prompt tokens prefilled.", "prefill_tokens"),
    ("evalkit_prefill_seconds_total", "counter", "Seconds spent prefilling.", "prefill_s"),
    ("evalkit_decode_tokens_total", "counter", "Tokens decoded (a token per row and step).", "decode_tokens"),
    ("evalkit_decode_seconds_total", "counter", "Seconds spent in decode steps.", "decode_s"),
    ("evalkit_kv_held_bytes", "gauge", "KV bytes of the rows holding a choice.", "kv_held_bytes"),
    ("evalkit_kv_pool_bytes", "gauge", "KV bytes the slot pool allocates (all its rows).", "kv_pool_bytes"),
    ("evalkit_kv_held_seen", "gauge", "Tokens seen by the rows holding a choice.", "kv_held_seen"),
    ("evalkit_kv_held_kept", "gauge", "KV entries kept by those rows (per layer and head).", "kv_held_kept"),
    ("evalkit_kv_seen_total", "counter", "Tokens seen by ended choices.", "kv_seen_total"),
    (
        "evalkit_kv_kept_total",
        "counter",
        "KV entries kept by ended choices when they ended.",
        "kv_kept_total",
    ),
]


def render(card, stats: dict, requests: Counter) -> str:
    """The exposition of one scrape: `stats` the backend's, `requests` the HTTP answers by (path, status)."""
    s = stats
    method = card.method
    info = {"model": card.id, "method": method.name, "budget": method.budget}
    blocks = [
        _line("evalkit_model_info", "gauge", "The served configuration (labels); always 1.", [(info, 1)]),
        _line(
            "evalkit_requests_total",
            "counter",
            "HTTP requests answered, by path and status code.",
            [({"path": p, "status": c}, n) for (p, c), n in sorted(requests.items())],
        ),
        _line(
            "evalkit_choices_total",
            "counter",
            "Choices ended, by reason (stop, length, cancelled, error).",
            [({"reason": r}, n) for r, n in sorted(s["ended"].items())],
        ),
        *(_line(name, kind, doc, [({}, s.get(key, 0))]) for name, kind, doc, key in SCALARS),
    ]
    for phase in ("prefill", "decode"):
        tokens, seconds = s.get(f"{phase}_tokens", 0), s.get(f"{phase}_s", 0.0)
        doc = f"{phase.capitalize()} tokens per second of {phase} time since start (all rows together)."
        blocks.append(
            _line(
                f"evalkit_{phase}_tokens_per_second",
                "gauge",
                doc,
                [({}, tokens / seconds if seconds else 0.0)],
            )
        )
    seen, kept = s["kv_seen_total"], s["kv_kept_total"]
    doc = "Kept / seen over ended choices (1: nothing evicted)."
    blocks.append(_line("evalkit_kv_kept_ratio", "gauge", doc, [({}, kept / seen if seen else 1.0)]))
    return "\n".join(blocks) + "\n"
