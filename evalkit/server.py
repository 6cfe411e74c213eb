"""What a server says it serves, asked before any request (GET /models, its headers, /version or /info),
pinned to the run folder (`server.json`) so a resumed run never mixes two servers. The LM that sends the
requests is evalkit.served.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import requests

from evalkit.results import write_json
from evalkit.sources import ModelLoadError

IDENTITY = ("id", "root", "parent", "owned_by", "max_model_len")
SERVES = ("method", "budget", "kv_storage", "source")  # an evalkit server's configuration (evalkit.serve)


class Endpoint(Protocol):
    """What this module reads of a served model conf (`evalkit.served.ServedSpec` is one)."""

    root: str  # the API's base address, no trailing slash
    model_id: str | None
    api: str
    timeout_s: float


class ServedError(ModelLoadError):
    """The served model could not be used (server down, another model, a refused request); the message says
    which and how to fix it. A ModelLoadError: the runner reports it as `evalkit: error:` and exits."""


def server_report(spec: Endpoint, context: int) -> dict:
    """GET /models (and the optional /version, /info): what the server serves and says about itself. Raises
    ServedError when it is unreachable, serves another model, or serves a smaller context than evalkit
    assumes."""
    models, header = _get(spec, f"{spec.root}/models", required=True)
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list):
        raise ServedError(f"{spec.root}/models answered {str(models)[:200]!r}, not an OpenAI model list")
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    if spec.model_id is None and len(ids) != 1:
        raise ServedError(f"{spec.root} serves {ids}: set model.model_id to one of them")
    entry = next((m for m in data if isinstance(m, dict) and m.get("id") == (spec.model_id or ids[0])), None)
    if entry is None:
        raise ServedError(f"{spec.root} serves {ids}; model.model_id={spec.model_id!r} is not one of them")
    served_len = entry.get("max_model_len")
    if isinstance(served_len, int) and served_len < context:
        raise ServedError(
            f"{entry['id']} is served with a context of {served_len} tokens, evalkit assumes "
            f"{context}: set model.max_length={served_len}"
        )
    server = urlsplit(spec.root)._replace(path="").geturl()
    about = {name: _get(spec, f"{server}/{name}")[0] for name in ("version", "info")}
    return {
        "base_url": spec.root,
        "api": spec.api,
        "model": entry,
        "server_header": header,
        **{name: body for name, body in about.items() if body is not None},
        "checked_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def listed(spec: Endpoint) -> list[dict]:
    """The server's /models entries; [] when it is unreachable or answers no model list."""
    models = _get(spec, f"{spec.root}/models")[0]
    data = models.get("data") if isinstance(models, dict) else None
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def identity(report: dict) -> dict:
    """The part of a report that must not change while a run is generating: the model and the server build."""
    return {
        "model": {k: report["model"].get(k) for k in IDENTITY},
        "server_header": report.get("server_header"),
        "version": report.get("version"),
        "info": report.get("info"),
        **(
            {"evalkit": {k: block.get(k) for k in SERVES}}
            if isinstance(block := report["model"].get("evalkit"), dict)
            else {}
        ),
    }


def _get(spec: Endpoint, url: str, required: bool = False):
    """(JSON body, `server` header) of a GET; for an optional endpoint (None, None) when it has none."""
    try:
        r = requests.get(url, timeout=min(spec.timeout_s, 30), headers=_auth())
    except requests.RequestException as e:
        if not required:
            return None, None
        raise ServedError(
            f"cannot reach the server at {spec.root} (GET {url}: {type(e).__name__}); start it "
            "or fix model.base_url"
        ) from None
    if not r.ok or "json" not in r.headers.get("content-type", ""):
        if not required:
            return None, None
        raise ServedError(f"GET {url} answered HTTP {r.status_code}: {r.text[:300]!r}")
    return r.json(), r.headers.get("server")


def _auth() -> dict:
    key = os.environ.get(
        "OPENAI_API_KEY", ""
    )  # what lm-eval's local-completions sends; empty for local servers
    return {"Authorization": f"Bearer {key}"} if key else {}


def pin_server(out: Path, report: dict) -> None:
    """Keep the report in the run folder; a run that resumes against another model or server build is
    refused."""
    path = Path(out) / "server.json"
    if path.exists():
        before = json.loads(path.read_text())
        if identity(before) != identity(report):
            raise ServedError(
                f"{out} was generated by {json.dumps(identity(before))}, the server now reports "
                f"{json.dumps(identity(report))}: a run never mixes two servers' generations. Point "
                "model.base_url at the same server, or delete the folder to run again."
            )
        return
    write_json(path, report)


def provenance(out: Path) -> dict | None:
    """What the server reported when the run generated (metrics.json `served`)."""
    path = Path(out) / "server.json"
    return json.loads(path.read_text()) if path.exists() else None


# --- the lm-eval model --------------------------------------------------------------------------------------
