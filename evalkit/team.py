"""The processes of one run: tensor parallel (TP) and data parallel (DP) under torchrun or SLURM.

`make eval NPROC=N` starts N processes (`python -m torch.distributed.run --standalone --nproc_per_node N -m
evalkit ...`); `parallel.tp_size` x `parallel.dp_size` must equal that world size. Ranks are laid out
`rank = dp_rank * tp + tp_rank`: a TP group is `tp` consecutive ranks that load one model sharded by
transformers (`DistributedConfig(tp_size=tp)`) and run the same requests in the same order; the `dp` groups
(replicas) split the requests between them (`Team.owns`, whole conversations: `Team.take`).

Where this process sits is `Ranks` (a value, read from the config and the environment); the `Team` is made
once from it (`Team.start`, `Team.single()` for one process) and handed to what needs it: the runner, the
model loader, the LM, the engine, and through the engine each KV cache (an `agree` callable). The rules:
- one writer: only rank 0 reads and writes the run folder (lock, config, samples, metrics); each replica's
  TP root (tp_rank 0) appends to its own journal shard (evalkit.journal), and rank 0 folds the shards into
  `generations.jsonl` when it scores. TP peers learn what is journaled from their root (`share`).
- identical decisions: a choice every rank of a TP group must make alike (a kept-token set of replicated
  attention, MLA; the next token) is taken on the TP root and broadcast (`agree`; a cache's kept set through
  an all-gather, which a compiled step traces), never trusted to equal floating point.
- bounded failure: the process group has a timeout (`EVALKIT_DIST_TIMEOUT_S`, default 600 s), torchrun ends
  every rank when one exits non-zero, and every rank dies with its launcher (a parent-death signal), so a
  `kill -9` of torchrun leaves no orphan holding the run folder's lock.
"""

from __future__ import annotations

import atexit
import math
import os
import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT_ENV = "EVALKIT_DIST_TIMEOUT_S"


@dataclass(frozen=True)
class Ranks:
    """Where this process sits: `tp` x `dp` ranks in all, this one `rank` (its device `local_rank`)."""

    tp: int = 1
    dp: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: str | None = None  # None: one process, no process group
    timeout_s: float = 600.0  # the process group's timeout (EVALKIT_DIST_TIMEOUT_S)

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
    def tp_root(self) -> int:
        """The first rank of this rank's TP group: where its decisions are made."""
        return self.dp_rank * self.tp

    @property
    def writer(self) -> bool:
        """Rank 0: the one process that reads and writes the run folder."""
        return self.rank == 0

    @property
    def journals(self) -> bool:
        """A TP root: appends its replica's journal shard."""
        return self.tp_rank == 0

    @property
    def device(self) -> str | None:
        """This rank's GPU (`cuda:<local rank>`) under nccl, None on CPU."""
        return f"cuda:{self.local_rank}" if self.backend == "nccl" else None

    @classmethod
    def from_config(cls, cfg, env=os.environ) -> Ranks:
        """The ranks `cfg.parallel` asks for in this environment; a ConfigError before any model loads when
        the keys or EVALKIT_DIST_TIMEOUT_S are malformed, or tp x dp is not the world size."""
        from evalkit.config import ConfigError

        block = cfg.get("parallel") or {}
        rank, world, local_rank = world_from_env(env)
        tp, dp, backend = block.get("tp_size"), block.get("dp_size", 1), block.get("backend")
        for key, value in (("tp_size", tp), ("dp_size", dp)):
            if value is not None and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= 1
            ):
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
                f"parallel.tp_size={tp} x parallel.dp_size={dp} = {tp * dp} processes, but {world} were "
                f"started (NPROC={world}): set NPROC={tp * dp}, or tp_size x dp_size = {world}"
            )
        if backend not in (None, "nccl", "gloo"):
            raise ConfigError(f"parallel.backend must be null, nccl or gloo, got {backend!r}")
        if world > 1:
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        timeout = timeout_from_env(env)
        return cls(tp, dp, rank, local_rank, backend if world > 1 else None, timeout)


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


def timeout_from_env(env=os.environ) -> float:
    """EVALKIT_DIST_TIMEOUT_S as seconds (600 unset): a positive, finite number, else a ConfigError."""
    from evalkit.config import ConfigError

    text = env.get(TIMEOUT_ENV)
    if text is None:
        return 600.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(
            f"{TIMEOUT_ENV} must be a positive number of seconds (how long a rank waits for the others in a "
            f"collective), got {text!r}"
        )
    return value


def die_with_launcher(env=os.environ) -> None:
    """Under torchrun, SIGKILL this rank when its launcher dies, as the sandbox does: torchrun starts each
    rank in a session of its own, so a `kill -9` of torchrun would leave the ranks running as orphans that
    hold the run folder's lock. A launcher already gone before the signal was set ends this rank now. (srun
    tears its tasks down itself.)"""
    import ctypes

    if "TORCHELASTIC_RUN_ID" not in env:  # not torchrun's worker (srun, a test's spawned processes)
        return
    parent = os.getppid()
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    pr_set_pdeathsig = 1
    if prctl is None or prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:  # not Linux
        return
    if os.getppid() != parent:
        os._exit(1)


# --- the team -----------------------------------------------------------------------------------------------
class Team:
    """The processes of one run and what they decide together. One process: `Team.single()`, every
    collective a no-op. Made once per run (`Team.start`) and handed down; it holds no module state."""

    def __init__(self, ranks: Ranks, tp_group=None, local_ranks: list[int] | None = None):
        self.ranks = ranks
        self._tp_group = tp_group  # this rank's TP group (None: the whole world is the one group, or no TP)
        self.local_ranks = local_ranks or list(range(ranks.world))  # each rank's GPU on its own node
        self._kv_peak = 0  # the most KV bytes this rank's slot pools allocated (`note_kv`)
        self.kv_bytes: list[int] | None = None  # every rank's peak, gathered after generation (`gather_kv`)

    @classmethod
    def single(cls) -> Team:
        return cls(Ranks())

    @classmethod
    def start(cls, ranks: Ranks) -> Team:
        """Join the process group of a multi-process layout (collective: every rank calls it); one process:
        the single team."""
        if ranks.world == 1:
            return cls(ranks)
        die_with_launcher()
        if ranks.backend == "nccl":
            torch.cuda.set_device(ranks.local_rank)
        if not dist.is_initialized():
            timeout = timedelta(seconds=ranks.timeout_s)
            dist.init_process_group(ranks.backend, rank=ranks.rank, world_size=ranks.world, timeout=timeout)
            atexit.register(_leave)  # no barrier at exit: a rank that failed must not hold the others
        team = cls(ranks, _tp_group(ranks))
        team.local_ranks = team.gather(ranks.local_rank)
        return team

    def leave(self) -> None:
        """Leave the process group once the run's last collective is over on every rank (collective; the
        writer scores after it alone). A rank that fails leaves at exit, without a barrier."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # --- who does what --------------------------------------------------------------------------------------
    @property
    def writer(self) -> bool:
        return self.ranks.writer

    @property
    def journals(self) -> bool:
        return self.ranks.journals

    @property
    def tp(self) -> int:
        return self.ranks.tp

    @property
    def dp(self) -> int:
        return self.ranks.dp

    @property
    def world(self) -> int:
        return self.ranks.world

    def owns(self, index: int) -> bool:
        """This replica generates lm-eval's request `index` (replicas take every dp-th request)."""
        return index % self.dp == self.ranks.dp_rank

    def take(self, groups: Sequence[Sequence]) -> list:
        """The groups this replica generates, each kept whole (a conversation's questions share one cache):
        each group in turn goes to the replica with the fewest items so far, the lowest on a tie. Groups of
        one are dealt as `owns` deals requests; every replica computes the same deal from the same list."""
        load, mine = [0] * self.dp, []
        for group in groups:
            replica = load.index(min(load))
            load[replica] += len(group)
            if replica == self.ranks.dp_rank:
                mine.append(group)
        return mine

    def rank_tag(self) -> str:
        """` [rank r/N]` for a message of a multi-process run (empty for one process)."""
        return f" [rank {self.ranks.rank}/{self.world}]" if self.world > 1 else ""

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def from_writer(self, obj):
        """Rank 0's `obj` on every rank (what rank 0 read from the run folder)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share(self, obj):
        """The TP root's `obj` on every rank of its TP group (what the root journaled)."""
        if self.tp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks.tp_root, group=self._tp_group)
        return box[0]

    def agree(self, x: torch.Tensor) -> torch.Tensor:
        """The TP root's `x` on every rank of the TP group: one decision, made once, for every rank (the next
        tokens' logits; kept indices of replicated attention). No-op without tensor parallelism."""
        if self.tp == 1:
            return x
        dist.broadcast(x, src=self.ranks.tp_root, group=self._tp_group)
        return x

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H_here, ...) of every rank of this TP group, concatenated in rank order on dim 1: the layer's
        heads as one process holds them (transformers shards heads contiguously)."""
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x.contiguous(), group=self._tp_group)
        return torch.cat(parts, dim=1)

    def replicated(self, model) -> bool:
        """Whether every rank of this TP group computes the same attention heads of `model` (MLA): a kept
        set must then be agreed (`evalkit.kv.select.agree_for` picks the cache's `agree` from it)."""
        return replicated_attention(model, self.tp)

    def gather(self, value: int) -> list[int]:
        """`value` of every rank, on every rank (one process: [value])."""
        if self.world == 1:
            return [value]
        t = torch.tensor([value], dtype=torch.long, device=self.ranks.device or "cpu")
        out = [torch.zeros_like(t) for _ in range(self.world)]
        dist.all_gather(out, t)
        return [int(x) for x in out]

    # --- what metrics.json records of the processes ---------------------------------------------------------
    def note_kv(self, pool) -> None:
        """Remember the bytes this rank's K/V slot pool allocated (its local heads under TP): every row's
        slots, which for full and snapkv hold prompt + max_new_tokens. Not the memory report's per-GPU KV,
        which is one request's kept entries at the budget (docs/parallel.md)."""
        if pool is not None:
            self._kv_peak = max(self._kv_peak, pool.allocated_bytes())

    def gather_kv(self) -> list[int]:
        """Every rank's KV peak (a collective: every rank calls it once generation is over), kept for
        `provenance`; the next run of this team starts from zero."""
        self.kv_bytes, self._kv_peak = self.gather(self._kv_peak), 0
        return self.kv_bytes

    def provenance(self) -> dict:
        """What metrics.json records of the layout (`parallel`); it is not part of the result's identity."""
        r = self.ranks
        devices = [f"cuda:{i}" for i in self.local_ranks] if r.backend == "nccl" else ["cpu"] * r.world
        out = {"tp": r.tp, "dp": r.dp, "world_size": r.world, "backend": r.backend, "devices": devices}
        if self.kv_bytes is not None:
            # the peak tensor bytes of each rank's slot pool: rows x allocated slots, not one request's KV
            out["kv_bytes_allocated_per_rank"] = self.kv_bytes
        return out


def replicated_attention(model, tp: int) -> bool:
    """True when every TP rank computes the same attention heads (transformers' plan shards no attention
    projection: DeepSeek-V3's MLA), so a kept-token choice must be agreed; False when each rank holds its own
    KV heads (Llama: q/k/v colwise), whose choices are its own, or without TP."""
    if tp == 1:
        return False
    plan = getattr(model.config.get_text_config(), "base_model_tp_plan", None) or {}
    return not any("self_attn" in key for key in plan)


def _tp_group(ranks: Ranks):
    """This rank's TP group when there are several (tp > 1 and dp > 1), else None (the world is the one TP
    group, or there is no TP). Every rank creates every group in the same order: `new_group` is collective."""
    if ranks.tp == 1 or ranks.dp == 1:
        return None
    groups = [dist.new_group(list(range(d * ranks.tp, (d + 1) * ranks.tp))) for d in range(ranks.dp)]
    return groups[ranks.dp_rank]


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
