"""One run across several processes: tensor parallel (TP) and data parallel (DP) under torchrun or SLURM.

`make eval NPROC=N` starts N processes (`python -m torch.distributed.run --standalone --nproc_per_node N -m
evalkit ...`); `parallel.tp_size` x `parallel.dp_size` must equal that world size. Ranks are laid out
`rank = dp_rank * tp + tp_rank`: a TP group is `tp` consecutive ranks that load one model sharded by
transformers (`DistributedConfig(tp_size=tp)`) and run the same requests in the same order; the `dp` groups
(replicas) split the requests by lm-eval's request index (`owns`).

The rules this module keeps:
- one writer: only rank 0 reads and writes the run folder (lock, config, samples, metrics); each replica's
  TP root (tp_rank 0) appends to its own journal shard (`generations.jsonl` for replica 0,
  `generations.dp<d>.jsonl` for the others), and rank 0 folds the shards into `generations.jsonl` when it
  scores. TP peers learn what is journaled from their root (`share`), never from the folder.
- identical decisions: a choice every rank of a TP group must make alike (a kept-token set of replicated
  attention, MLA; the next token) is taken on the TP root and broadcast (`agree`), never trusted to equal
  floating point.
- bounded failure: the process group has a timeout (`EVALKIT_DIST_TIMEOUT_S`, default 600 s), and torchrun
  ends every rank when one exits non-zero, so a failing rank ends the run with its own error.
"""

from __future__ import annotations

import atexit
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from evalkit.journal import JOURNAL, journal_files, read_records


@dataclass(frozen=True)
class Layout:
    """Where this process sits: `tp` x `dp` ranks in all, this one `rank` (its device `local_rank`)."""

    tp: int = 1
    dp: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: str | None = None  # None: one process, no process group

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def writer(self) -> bool:
        """Rank 0: the one process that reads and writes the run folder."""
        return self.rank == 0

    @property
    def journals(self) -> bool:
        """A TP root: appends its replica's journal shard."""
        return self.tp_rank == 0


LAYOUT = Layout()  # this process's layout, set by `init`
REPLICATED_ATTENTION = False  # set when a TP model loads (`note_model`): its kept sets must be agreed
_TP_GROUP = None  # the process group of this rank's TP group (None: the whole world, or no group)


# --- the environment ----------------------------------------------------------------------------------------
def world_from_env(env=os.environ) -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's variables, else SLURM's (`srun` starting one task per
    GPU; MASTER_ADDR becomes the first host of SLURM_NODELIST), else one process."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", 1)) > 1:
        os.environ.setdefault("MASTER_ADDR", first_host(env.get("SLURM_NODELIST", "127.0.0.1")))
        os.environ.setdefault("MASTER_PORT", "29500")
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0))
    return 0, 1, 0


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `gpu[03-05,09],cpu1` -> `gpu03` (what `scontrol show hostnames`
    prints first)."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return nodelist
    prefix, ranges = m.groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def layout(cfg, env=os.environ) -> Layout:
    """The layout `cfg.parallel` asks for in this environment; a ConfigError before any model loads when the
    keys are malformed or tp x dp is not the world size."""
    from evalkit.config import ConfigError

    block = cfg.get("parallel") or {}
    rank, world, local_rank = world_from_env(env)
    tp, dp, backend = block.get("tp_size"), block.get("dp_size", 1), block.get("backend")
    for key, value in (("tp_size", tp), ("dp_size", dp)):
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(f"parallel.{key} must be a positive integer, got {value!r}")
    if dp is None:
        raise ConfigError("parallel.dp_size must be a positive integer, got None")
    if tp is None:
        if world % dp:
            raise ConfigError(
                f"parallel.dp_size={dp} does not divide the {world} processes started (NPROC={world}); "
                "make NPROC a multiple of dp_size"
            )
        tp = world // dp
    if tp * dp != world:
        raise ConfigError(
            f"parallel.tp_size={tp} x parallel.dp_size={dp} = {tp * dp} processes, but {world} were started "
            f"(NPROC={world}): set NPROC={tp * dp}, or tp_size x dp_size = {world}"
        )
    if backend not in (None, "nccl", "gloo"):
        raise ConfigError(f"parallel.backend must be null, nccl or gloo, got {backend!r}")
    if world > 1:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    return Layout(tp=tp, dp=dp, rank=rank, local_rank=local_rank, backend=backend if world > 1 else None)


# --- the process group --------------------------------------------------------------------------------------
def init(lay: Layout) -> Layout:
    """Join the process group of a multi-process layout (nothing for one process); remember the layout."""
    global LAYOUT, _TP_GROUP
    LAYOUT = lay
    if lay.world == 1:
        return lay
    if lay.backend == "nccl":
        torch.cuda.set_device(lay.local_rank)
    if not dist.is_initialized():
        timeout = timedelta(seconds=float(os.environ.get("EVALKIT_DIST_TIMEOUT_S", 600)))
        dist.init_process_group(lay.backend, rank=lay.rank, world_size=lay.world, timeout=timeout)
        atexit.register(_leave)  # no barrier at exit: a rank that failed must not hold the others
    _TP_GROUP = tp_groups(lay)
    return lay


def tp_groups(lay: Layout):
    """This rank's TP group when there are several (tp > 1 and dp > 1), else None (the world is the one TP
    group, or there is no TP). Every rank creates every group in the same order: `new_group` is collective."""
    if lay.tp == 1 or lay.dp == 1:
        return None
    groups = [dist.new_group(list(range(d * lay.tp, (d + 1) * lay.tp))) for d in range(lay.dp)]
    return groups[lay.dp_rank]


def teardown() -> None:
    """Leave the process group once the run is over on every rank (tests; `python -m evalkit` leaves at
    exit)."""
    global LAYOUT, REPLICATED_ATTENTION, _TP_GROUP
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    LAYOUT, REPLICATED_ATTENTION, _TP_GROUP = Layout(), False, None


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_tag() -> str:
    """` [rank r/N]` for a message of a multi-process run (empty for one process)."""
    return f" [rank {LAYOUT.rank}/{LAYOUT.world}]" if LAYOUT.world > 1 else ""


def barrier() -> None:
    if LAYOUT.world > 1:
        dist.barrier()


def from_writer(obj):
    """Rank 0's `obj` on every rank (what rank 0 read from the run folder)."""
    if LAYOUT.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def share(obj):
    """The TP root's `obj` on every rank of its TP group (what the root journaled)."""
    if LAYOUT.tp == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=LAYOUT.dp_rank * LAYOUT.tp, group=_TP_GROUP)
    return box[0]


def agree(x: torch.Tensor) -> torch.Tensor:
    """The TP root's `x` on every rank of the TP group: one decision, made once, for every rank (kept
    indices of replicated attention, the next tokens). No-op without tensor parallelism."""
    if LAYOUT.tp == 1:
        return x
    dist.broadcast(x, src=LAYOUT.dp_rank * LAYOUT.tp, group=_TP_GROUP)
    return x


def agree_kept(indices: torch.Tensor) -> torch.Tensor:
    """Where scores become kept positions: under TP with replicated attention (MLA: one kept set per layer on
    every rank) the TP root's choice, broadcast; else `indices` as they are (one process, or per-rank KV heads
    whose choices are each rank's own)."""
    return agree(indices) if REPLICATED_ATTENTION else indices


def owns(index: int) -> bool:
    """This replica generates lm-eval's request `index` (replicas take every dp-th request)."""
    return index % LAYOUT.dp == LAYOUT.dp_rank


# --- models -------------------------------------------------------------------------------------------------
def distributed_config():
    """transformers' DistributedConfig for this layout's tensor parallelism (None: no TP)."""
    if LAYOUT.tp == 1:
        return None
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=LAYOUT.tp)


@contextmanager
def replica_meshes():
    """transformers' TP loading with one TP group per DP replica. `DistributedConfig(tp_size=tp)` alone builds
    a mesh of tp ranks and refuses any other world size; `dp_replicate_size=dp` would build the right mesh but
    also wraps the model in FSDP. Here, for the length of one `from_pretrained`, the mesh it builds is
    (pp=1, dp_replicate=dp, fsdp=1, tp) over every rank, so the model's "tp" sub-mesh (the only one its TP
    plan shards over and communicates on) is this replica's `tp` consecutive ranks; the config keeps
    dp_size 1, so no FSDP. Nothing changes for dp = 1."""
    if LAYOUT.tp == 1 or LAYOUT.dp == 1:
        yield
        return
    from transformers.distributed import mixin

    build = mixin.initialize_distributed_mesh

    def per_replica(config):
        from transformers.distributed.utils import TransformersDeviceMesh, _bind_local_device

        kind = torch._C._get_accelerator().type
        shape, ep = (1, LAYOUT.dp, 1, config.tp_size), (1, LAYOUT.dp, config.efsdp_size, config.ep_size)
        dense = dist.init_device_mesh(kind, shape, mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
        expert = dist.init_device_mesh(kind, ep, mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
        return _bind_local_device(kind, LAYOUT.local_rank), TransformersDeviceMesh(dense, expert)

    mixin.initialize_distributed_mesh = per_replica
    try:
        yield
    finally:
        mixin.initialize_distributed_mesh = build


def replicated_attention(model) -> bool:
    """True when every TP rank computes the same attention heads (transformers' plan shards no attention
    projection: DeepSeek-V3's MLA), so a kept-token choice must be agreed; False when each rank holds its own
    KV heads (Llama: q/k/v colwise), whose choices are its own."""
    plan = getattr(model.config.get_text_config(), "base_model_tp_plan", None) or {}
    return LAYOUT.tp > 1 and not any("self_attn" in key for key in plan)


def note_model(model) -> None:
    """Remember whether the loaded model's attention is replicated over the TP group (see `agree_kept`)."""
    global REPLICATED_ATTENTION
    REPLICATED_ATTENTION = replicated_attention(model)


def device(lay: Layout | None = None) -> str | None:
    """This rank's GPU (`cuda:<local rank>`) under nccl, None on CPU."""
    lay = lay or LAYOUT
    return f"cuda:{lay.local_rank}" if lay.backend == "nccl" else None


def device_map(requested: str | None) -> str | None:
    """Where a DP replica's model goes: its own GPU whole (a conf's `device_map: auto` would spread every
    replica over every GPU of the node); one process or TP (transformers places the shards): `requested`."""
    if LAYOUT.dp > 1 and LAYOUT.backend == "nccl":
        return device()
    return requested


# --- journal shards -----------------------------------------------------------------------------------------
def shard_path(out: Path, replica: int | None = None) -> Path:
    """The journal this replica appends to: replica 0 the run's own `generations.jsonl`."""
    replica = LAYOUT.dp_rank if replica is None else replica
    return out / (JOURNAL if replica == 0 else f"generations.dp{replica}.jsonl")


def sibling_shards(out: Path, own: Path) -> list[Path]:
    """Every journal file of the run folder but `own`, in a fixed order."""
    return [f for f in journal_files(out) if f != own]


def open_journals(plans: list, open_journal) -> None:
    """Each unfinished plan's journal on this rank: a TP root opens its replica's shard (`open_journal(p,
    path)`) and counts every other shard's records as done; a TP peer gets its root's records (`PeerJournal`).
    Every replica sees the same done set at the start, so `owns` splits the rest the same way on each."""
    todo = [p for p in plans if p.state != "done"]
    if LAYOUT.journals:
        for p in todo:
            p.journal = open_journal(p, shard_path(p.out))
    barrier()  # every shard's torn or foreign lines are set aside before the others read it
    if LAYOUT.journals:
        for p in todo:
            adopt_shards(p.journal)
    records = share([p.journal.records if LAYOUT.journals else None for p in todo])
    if not LAYOUT.journals:
        for p, recs in zip(todo, records):
            p.journal = PeerJournal(shard_path(p.out), recs)


def adopt_shards(journal) -> None:
    """Count the other shards' records as done in `journal` (in memory: they stay in their files)."""
    journal.adopted = set()
    for path in sibling_shards(journal.path.parent, journal.path):
        for key, rec in read_records(path)[0].items():
            if key not in journal.records:
                journal.records[key] = rec
                journal.adopted.add(key)


def fold_shards(journal) -> None:
    """Rank 0 before scoring (every replica has finished): the other shards' records appended to its
    `generations.jsonl`, and each shard file whose every line was usable removed, so a finished run folder
    holds one journal whatever layout made it. What another replica generated in this run counts as
    generated now."""
    known = journal.loaded_keys | getattr(journal, "adopted", set())
    written = set(read_records(journal.path)[0]) if journal.path.exists() else set()
    for path in sibling_shards(journal.path.parent, journal.path):
        records, clean = read_records(path)
        for key, rec in records.items():
            if key not in written:
                journal.records.pop(key, None)  # adopted in memory only: now into the file
                journal.append(rec)
                written.add(key)
                if key in known:
                    journal.generated_keys.discard(key)
        if clean:
            path.unlink()


class PeerJournal:
    """A TP peer's view of its root's journal: what is done, in memory; the root writes the file."""

    def __init__(self, path: Path, records: dict):
        self.path, self.records, self.rejected = path, dict(records), []
        self.loaded_keys, self.generated_keys = frozenset(records), set()

    def get(self, key: str) -> dict | None:
        return self.records.get(key)

    def append(self, record: dict) -> None:
        self.generated_keys.add(record["key"])
        self.records.setdefault(record["key"], record)

    def close(self) -> None:
        pass


def provenance() -> dict:
    """What metrics.json records of the layout (`parallel`); it is not part of the result's identity."""
    kv_bytes = KV_BYTES
    lay = LAYOUT
    local = LOCAL_RANKS or range(lay.world)  # each rank's GPU on its own node, rank by rank
    devices = [f"cuda:{i}" for i in local] if lay.backend == "nccl" else ["cpu"] * lay.world
    out = {
        "tp": lay.tp,
        "dp": lay.dp,
        "world_size": lay.world,
        "backend": lay.backend,
        "devices": devices,
    }
    if kv_bytes is not None:
        # the peak tensor bytes of each rank's slot pool: rows x allocated slots, not one request's kept KV
        out["kv_bytes_allocated_per_rank"] = kv_bytes
    return out


KV_PEAK = 0  # the most KV bytes this rank's slot pool held (`note_kv`)
KV_BYTES: list[int] | None = None  # every rank's KV_PEAK, gathered after generation (`gather_kv`)
LOCAL_RANKS: list[int] | None = None  # every rank's local rank (its GPU under nccl), gathered with KV_BYTES


def note_kv(pool) -> None:
    """Remember the bytes this rank's K/V slot pool allocated (its local heads under TP): every row's slots,
    which for full and snapkv hold prompt + max_new_tokens. Not the memory report's per-GPU KV, which is one
    request's kept entries at the budget (docs/parallel.md)."""
    global KV_PEAK
    if pool is not None:
        held = sum(
            x.numel() * x.element_size()
            for lay in pool.layers
            for x in (lay.keys, lay.values)
            if x is not None
        )
        KV_PEAK = max(KV_PEAK, held)


def gather_kv() -> None:
    """Every rank's KV_PEAK into KV_BYTES, and its local rank into LOCAL_RANKS (a collective: every rank
    calls it once generation is over); the next run of a sweep in this process starts from zero."""
    global KV_BYTES, KV_PEAK, LOCAL_RANKS
    KV_BYTES, KV_PEAK = gather_int(KV_PEAK), 0
    LOCAL_RANKS = gather_int(LAYOUT.local_rank)


def gather_int(value: int) -> list[int]:
    """`value` of every rank, on every rank (one process: [value])."""
    if LAYOUT.world == 1:
        return [value]
    t = torch.tensor([value], dtype=torch.long, device=device() or "cpu")
    out = [torch.zeros_like(t) for _ in range(LAYOUT.world)]
    dist.all_gather(out, t)
    return [int(x) for x in out]
