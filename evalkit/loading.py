"""Loading a model's weights for in-process generation: evalkit's attention attached (`evalkit.kv.attach`), a
left-padding tokenizer, random weights for tiny test models. Where the files come from is evalkit.sources.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evalkit.kv import attach
from evalkit.sources import ModelLoadError, _tf_version, model_config, resolve_source, tokenizer_source

if TYPE_CHECKING:
    from evalkit.models import ModelSpec


def load_model(spec: ModelSpec):
    """(model, tokenizer) for a spec, in eval mode, evalkit attention attached, tokenizer padding left."""
    source = resolve_source(spec)
    if spec.random is not None:
        model = random_model(spec)
    else:
        model = _from_pretrained(spec, source)
    tokenizer = load_tokenizer(spec, source)
    return attach(model.eval()), tokenizer


def _from_pretrained(spec: ModelSpec, source: str):
    config = model_config(spec, source)
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ModelLoadError(
            f"model {spec.name}: unsupported architecture {config.model_type!r} (no causal-LM class in "
            f"transformers {_tf_version()}); evalkit needs a decoder that caches per-head K/V"
        )
    dtype = getattr(torch, spec.dtype)
    return AutoModelForCausalLM.from_pretrained(
        source, revision=spec.revision, dtype=dtype, device_map=spec.device_map, attn_implementation="sdpa"
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
    return model.to(spec.device_map) if spec.device_map not in (None, "auto") else model
