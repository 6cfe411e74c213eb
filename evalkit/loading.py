"""Loading a model's weights for in-process generation: evalkit's attention attached (`evalkit.kv.attach`), a
left-padding tokenizer, random weights for tiny test models. Where the files come from is evalkit.sources.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evalkit import parallel
from evalkit.kv import attach
from evalkit.sources import ModelLoadError, _tf_version, model_config, resolve_source, tokenizer_source

if TYPE_CHECKING:
    from evalkit.models import ModelSpec


def load_model(spec: ModelSpec):
    """(model, tokenizer) for a spec, in eval mode, evalkit attention attached, tokenizer padding left."""
    source = resolve_source(spec)
    if parallel.LAYOUT.tp > 1:
        model = _tensor_parallel(spec, source)
    elif spec.random is not None:
        model = random_model(spec)
    else:
        model = _from_pretrained(spec, source)
    tokenizer = load_tokenizer(spec, source)
    parallel.note_model(model)
    return attach(model.eval()), tokenizer


def _tensor_parallel(spec: ModelSpec, source: str):
    """The model sharded over this rank's TP group by transformers' plan (`DistributedConfig`). Random weights
    are made once on rank 0 and saved to a scratch folder every rank loads (the plan shards while loading)."""
    import shutil
    import tempfile

    if spec.random is None:
        return _from_pretrained(spec, source, distributed_config=parallel.distributed_config())
    folder = tempfile.mkdtemp(prefix="evalkit-tp-") if parallel.LAYOUT.writer else None
    if folder is not None:
        random_model(spec).save_pretrained(folder)
    folder = parallel.from_writer(folder)
    try:
        return _from_pretrained(spec, folder, distributed_config=parallel.distributed_config())
    finally:
        parallel.barrier()  # every rank has read the weights
        if parallel.LAYOUT.writer:
            shutil.rmtree(folder, ignore_errors=True)


def _from_pretrained(spec: ModelSpec, source: str, distributed_config=None):
    config = model_config(spec, source) if distributed_config is None or spec.random is None else None
    if config is not None and type(config) not in AutoModelForCausalLM._model_mapping:
        raise ModelLoadError(
            f"model {spec.name}: unsupported architecture {config.model_type!r} (no causal-LM class in "
            f"transformers {_tf_version()}); evalkit needs a decoder that caches per-head K/V"
        )
    dtype = getattr(torch, spec.dtype)
    if distributed_config is not None:  # TP: transformers places each shard; no device_map with it
        with parallel.replica_meshes():  # under DP too, each replica's TP group is its own mesh
            return AutoModelForCausalLM.from_pretrained(
                source,
                revision=None if spec.random is not None else spec.revision,
                dtype=dtype,
                distributed_config=distributed_config,
                attn_implementation="sdpa",
            )
    return AutoModelForCausalLM.from_pretrained(
        source,
        revision=spec.revision,
        dtype=dtype,
        device_map=parallel.device_map(spec.device_map),
        attn_implementation="sdpa",
    )


def load_tokenizer(spec: ModelSpec, source: str):
    if spec.random is not None:
        source = tokenizer_source(spec.tokenizer)
    tok = AutoTokenizer.from_pretrained(source, revision=None if spec.random else spec.revision)
    tok.padding_side = "left"  # evalkit caches need left padding for batched prompts
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def random_model(spec: ModelSpec):
    """Random weights from a config dict: tiny versions of real architectures for tests and GPU checks."""
    config = model_config(spec, None)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=getattr(torch, spec.dtype), attn_implementation="sdpa"
    )
    device_map = parallel.device_map(spec.device_map)
    return model.to(device_map) if device_map not in (None, "auto") else model
