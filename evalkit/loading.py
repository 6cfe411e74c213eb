"""Loading a model's weights for in-process generation: evalkit's attention attached (`evalkit.kv.attach`), a
left-padding tokenizer, random weights for tiny test models, and the placement a run's processes ask for
(tensor parallel shards per TP group, a DP replica on its own GPU: `evalkit.team`). Where the files come from
is evalkit.sources.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from evalkit.kv import attach
from evalkit.sources import (
    ModelConf,
    ModelLoadError,
    _tf_version,
    model_config,
    resolve_source,
    tokenizer_source,
)
from evalkit.team import Ranks, Team


def load_model(spec: ModelConf, team: Team | None = None):
    """(model, tokenizer) for a spec, in eval mode, evalkit attention attached, tokenizer padding left; placed
    as `team`'s processes ask (one process by default)."""
    team = team or Team.single()
    source = resolve_source(spec)
    if team.tp > 1:
        model = _tensor_parallel(spec, source, team)
    elif spec.random is not None:
        model = random_model(spec, team.ranks)
    else:
        model = _from_pretrained(spec, source, team.ranks)
    tokenizer = load_tokenizer(spec, source)
    return attach(model.eval()), tokenizer


def _tensor_parallel(spec: ModelConf, source: str, team: Team):
    """The model sharded over this rank's TP group by transformers' plan (`DistributedConfig`). Random weights
    are made once on rank 0 and saved to a scratch folder every rank loads (the plan shards while loading)."""
    import shutil
    import tempfile

    if spec.random is None:
        return _from_pretrained(spec, source, team.ranks, distributed_config(team.ranks))
    folder = tempfile.mkdtemp(prefix="evalkit-tp-") if team.writer else None
    if folder is not None:
        random_model(spec, team.ranks).save_pretrained(folder)
    folder = team.from_writer(folder)
    try:
        return _from_pretrained(spec, folder, team.ranks, distributed_config(team.ranks))
    finally:
        team.barrier()  # every rank has read the weights
        if team.writer:
            shutil.rmtree(folder, ignore_errors=True)


def _from_pretrained(spec: ModelConf, source: str, ranks: Ranks, tp_config=None):
    config = model_config(spec, source) if tp_config is None or spec.random is None else None
    if config is not None and type(config) not in AutoModelForCausalLM._model_mapping:
        raise ModelLoadError(
            f"model {spec.name}: unsupported architecture {config.model_type!r} (no causal-LM class in "
            f"transformers {_tf_version()}); evalkit needs a decoder that caches per-head K/V"
        )
    dtype = getattr(torch, spec.dtype)
    if tp_config is not None:  # TP: transformers places each shard; no device_map with it
        with replica_meshes(ranks):  # under DP too, each replica's TP group is its own mesh
            return AutoModelForCausalLM.from_pretrained(
                source,
                revision=None if spec.random is not None else spec.revision,
                dtype=dtype,
                distributed_config=tp_config,
                attn_implementation="sdpa",
            )
    return AutoModelForCausalLM.from_pretrained(
        source,
        revision=spec.revision,
        dtype=dtype,
        device_map=device_map(ranks, spec.device_map),
        attn_implementation="sdpa",
    )


def load_tokenizer(spec: ModelConf, source: str):
    if spec.random is not None:
        source = tokenizer_source(spec.tokenizer)
    tok = AutoTokenizer.from_pretrained(source, revision=None if spec.random else spec.revision)
    tok.padding_side = "left"  # evalkit caches need left padding for batched prompts
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def random_model(spec: ModelConf, ranks: Ranks | None = None):
    """Random weights from a config dict: tiny versions of real architectures for tests and GPU checks."""
    ranks = ranks or Ranks()
    config = model_config(spec, None)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=getattr(torch, spec.dtype), attn_implementation="sdpa"
    )
    place = device_map(ranks, spec.device_map)
    return model.to(place) if place not in (None, "auto") else model


# --- placement under several processes ----------------------------------------------------------------------
def distributed_config(ranks: Ranks):
    """transformers' DistributedConfig for these ranks' tensor parallelism (None: no TP)."""
    if ranks.tp == 1:
        return None
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=ranks.tp)


@contextmanager
def replica_meshes(ranks: Ranks):
    """transformers' TP loading with one TP group per DP replica. `DistributedConfig(tp_size=tp)` alone builds
    a mesh of tp ranks and refuses any other world size; `dp_replicate_size=dp` would build the right mesh but
    also wraps the model in FSDP. Here, for the length of one `from_pretrained`, the mesh it builds is
    (pp=1, dp_replicate=dp, fsdp=1, tp) over every rank, so the model's "tp" sub-mesh (the only one its TP
    plan shards over and communicates on) is this replica's `tp` consecutive ranks; the config keeps
    dp_size 1, so no FSDP. Nothing changes for dp = 1."""
    if ranks.tp == 1 or ranks.dp == 1:
        yield
        return
    import torch.distributed as dist
    from transformers.distributed import mixin

    build = mixin.initialize_distributed_mesh

    def per_replica(config):
        from transformers.distributed.utils import TransformersDeviceMesh, _bind_local_device

        kind = torch._C._get_accelerator().type
        shape, ep = (1, ranks.dp, 1, config.tp_size), (1, ranks.dp, config.efsdp_size, config.ep_size)
        dense = dist.init_device_mesh(kind, shape, mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
        expert = dist.init_device_mesh(kind, ep, mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
        return _bind_local_device(kind, ranks.local_rank), TransformersDeviceMesh(dense, expert)

    mixin.initialize_distributed_mesh = per_replica
    try:
        yield
    finally:
        mixin.initialize_distributed_mesh = build


def device_map(ranks: Ranks, requested: str | None) -> str | None:
    """Where a DP replica's model goes: its own GPU whole (a conf's `device_map: auto` would spread every
    replica over every GPU of the node); one process or TP (transformers places the shards): `requested`."""
    if ranks.dp > 1 and ranks.backend == "nccl":
        return ranks.device
    return requested
