"""`MODEL=served` pointed at an evalkit compressed server (`make serve`, evalkit.serve; issue 34.5): a
compressed run in the report, its method and budget read from the server, never assumed.

evalkit's server says what it serves under its /v1/models entry's `evalkit` block (method with every setting,
budget, whether a request may set its own, KV storage, weights, git sha). The run's own method (`METHOD=`,
`method.budget=`) must be the server's: the same method and settings, and the server's budget, or another
budget the server takes per request (then sent as the request's `budget`). Anything else is refused before
any request, naming the setting. Each answer's `usage.kv` must name the run's method and budget; its KV
figures are journaled as an in-process generation's (`kv_seen`, `kv_kept`, ...), so metrics.json's `kv`
block is measured and the report pairs the run with the full cache like an in-process compressed run.
A server without the block (vLLM, SGLang, `transformers serve`) keeps its own full cache: method full only.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from evalkit.kv.config import make_method
from evalkit.server import ServedError

# usage.kv per-choice figures -> the journal's stats names (as evalkit.engine records them)
KV_STATS = {"seen": "kv_seen", "kept": "kv_kept", "evicted_generated": "kv_evicted_generated",
            "slots": "kv_slots", "bytes": "kv_bytes"}  # fmt: skip


def card(entry: dict | None) -> dict | None:
    """The `evalkit` block of a /v1/models entry: what an evalkit server serves (None: another server)."""
    block = (entry or {}).get("evalkit")
    return block if isinstance(block, dict) and isinstance(block.get("method"), dict) else None


def agree(report: dict, method, conf, storage: str = "none") -> dict:
    """The fields every request adds so the server runs the run's configuration ({"budget": n} for a budget
    the server takes per request, else {}); ServedError naming the setting where it cannot. `method` is the
    run's, made from its conf `conf`."""
    root, served = report["base_url"], card(report["model"])
    if served is None:
        if method.name != "full":
            raise ServedError(
                f"{root} is no evalkit server (its /v1/models entry has no `evalkit` block): it keeps its "
                f"own full cache, so method={method.name} cannot be run there; use METHOD=full"
            )
        return {}
    theirs = served["method"]
    what = f"{root} serves {theirs.get('name')} at budget {served.get('budget')}"
    if theirs.get("name") != method.name:
        raise ServedError(f"{what}: method={method.name} differs; run with METHOD={theirs.get('name')}")
    # the run's method conf at the server's budget: settings derived from the budget compare alike
    ours = make_method(OmegaConf.merge(conf, {"budget": served.get("budget")})).describe()
    for key in sorted(set(theirs) | set(ours)):
        if theirs.get(key, "<unset>") != ours.get(key, "<unset>"):
            raise ServedError(
                f"{what}: method.{key}={ours.get(key, '<unset>')!r} differs from the server's "
                f"{theirs.get(key, '<unset>')!r}; set method.{key}={theirs.get(key)!r}"
            )
    stored = (served.get("kv_storage") or {}).get("name", "none")
    if stored != storage:
        raise ServedError(f"{what} with KV storage {stored}: the run's is {storage}; set kv={stored}")
    if method.budget == served.get("budget"):
        return {}
    if not served.get("budget_per_request"):
        raise ServedError(
            f"{what}: method.budget={method.budget} differs and the server takes no per-request budget; "
            f"set method.budget={served.get('budget')}"
        )
    return {"budget": method.budget}


def kv_stats(usage: dict, method) -> dict:
    """An answer's KV figures as the journal's stats; {} from a server that reports none. An answer that
    names another method or budget than the run's raises ValueError (refused, never journaled)."""
    kv = usage.get("kv")
    if not isinstance(kv, dict):
        return {}
    if kv.get("method") != method.name or kv.get("budget") != method.budget:
        raise ValueError(
            f"the server answered with method {kv.get('method')} at budget {kv.get('budget')}, the run is "
            f"{method.name} at budget {method.budget}"
        )
    choices = kv.get("choices") or [{}]
    return {name: choices[0].get(key) for key, name in KV_STATS.items() if key in choices[0]}


def storage_name(cfg) -> str:
    """The run's KV storage by name ("none": the model dtype; a config without the `kv` group: none)."""
    if cfg.get("kv") is None:
        return "none"
    from evalkit.kv.storage import make_storage

    return make_storage(cfg.kv).describe().get("name", "none")
