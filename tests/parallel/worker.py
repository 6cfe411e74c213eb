"""What each process of a 2-process test runs (spawned by the tests, gloo on CPU), and the one-process
reference: kept positions per layer and KV head after prefill, and the generated tokens, per method."""

from __future__ import annotations

import json
import os
import sys

import torch

from tests.conftest import TINY
from tests.kv.test_rivals import StubTokenizer

METHODS = {
    "full": {},
    "streamingllm": {"budget": 24},
    "snapkv": {"budget": 24, "window": 8},
    "snapstream": {"budget": 24, "window": 8},
    "h2o": {"budget": 24},  # decode-time eviction: 40/57-token prompts + 12 new tokens evict at every step
    "snapkv_decode": {"budget": 24, "window": 4, "interval": 6},
    "expected_attention_ring": {
        "budget": 24,
        "recent": 8,
        "scorer": {"future": 64},
    },  # per KV head: TP splits
    # a choice across a layer's KV heads: each TP rank reads every rank's (gathered) and keeps its own share
    "tova": {"budget": 24},  # the last query's attention averaged over every head
    "adakv_snapkv": {"budget": 24, "alpha": 0.2, "inner": {"window": 8}},  # one top-k over every head
    "pyramidkv_snapkv": {"budget": 24, "beta": 2, "inner": {"window": 8}},  # per-layer budgets
    "tova_decode": {"budget": 24},  # evicts every step by the step's attention averaged over every head
    "kvzip": {"budget": 24, "chunk": 32},  # a reconstruction pass (every rank's forward) before the prefill
}
# snapkv_decode re-scores cached keys, expected attention undoes RoPE per head, kvzip rescores the keys in a
# second pass: refused on an MLA latent
NOT_ON = {"deepseek_v3": {"snapkv_decode", "expected_attention_ring", "kvzip"}}


def methods_for(arch: str, methods: dict = METHODS) -> dict:
    return {name: settings for name, settings in methods.items() if name not in NOT_ON.get(arch, ())}


SAMPLING = {"greedy": dict(do_sample=False), "sampled": dict(do_sample=True, temperature=0.8, top_k=20)}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in (40, 57)]


# float64 where the model runs in it (no argmax near-tie can flip between one process's and TP's reduction
# order); DeepSeek-V3's grouped expert matmul takes no float64, so it runs float32 and records the smallest
# top-2 logit margin of every greedy step (the tests require it far above float32 reduction noise)
DTYPE = {"llama": "float64", "deepseek_v3": "float32"}
# small buckets: the pool's rows cross a bucket while they decode (41..52 and 58..69 filled slots)
BUCKETS = dict(floor=16, per_octave=4)


def observe(
    arch: str, methods: dict = METHODS, team=None, kv: str = "none", kv_settings=None, compile=False
) -> dict:
    """{method: {"kept": [[layer][head] positions] per prompt, "tokens": {sampling: [tokens per prompt]},
    "margin": smallest greedy top-2 logit margin}} on this process of `team` (one process by default), the
    caches held by KV storage `kv` (a conf/kv name, with `kv_settings` overridden), the decode step compiled
    with `compile` (the engine's argument)."""
    from transformers import GenerationConfig

    from evalkit.engine import Engine
    from evalkit.kv import KVCache
    from evalkit.kv.config import make_method
    from evalkit.kv.pool import Buckets
    from evalkit.kv.prefill import shared_prefill
    from evalkit.kv.select import agree_for
    from evalkit.kv.storage import make_storage
    from evalkit.loading import load_model
    from evalkit.models import ModelSpec
    from evalkit.team import Team
    from evalkit.turns import ask

    team = team or Team.single()
    spec = ModelSpec(name=f"tiny_{arch}", random=TINY[arch], tokenizer="smollm2_135m", dtype=DTYPE[arch])
    model, _ = load_model(spec, team)
    tokenizer = StubTokenizer()  # kvzip's repeat prompt in the tiny models' 256 ids
    agree = agree_for(team, model)
    storage = make_storage(kv, **(kv_settings or {}))
    out = {}
    for name, settings in methods_for(arch, methods).items():
        method = make_method(name, **settings)
        kept = []
        for ids in prompts():
            cache = KVCache.for_model(method, model, agree=agree, storage=storage)
            with torch.inference_mode(), shared_prefill(model, tokenizer):  # kvzip's pass needs the tokenizer
                model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
            kept.append([cache.positions(i)[0].tolist() for i in range(len(cache.layers))])
        tokens, margin = {}, float("inf")
        for mode, gen in SAMPLING.items():
            engine = Engine(
                model,
                tokenizer,
                eos_ids=[],
                rows=2,
                team=team,
                buckets=Buckets(**BUCKETS),
                storage=storage,
                compile=compile,
            )
            reqs = [
                ask(str(i), ids, 12, method, GenerationConfig(**gen), seed=100 + i, keep_logits=True)
                for i, ids in enumerate(prompts())
            ]
            done = sorted(engine.run(reqs), key=lambda d: d.key)
            tokens[mode] = [d.tokens for d in done]
            if mode == "greedy":
                top2 = [x.topk(2).values for d in done for x in d.logits]
                margin = min(margin, *(float(v[0] - v[1]) for v in top2))
        out[name] = {"kept": kept, "tokens": tokens, "margin": margin}
    return out


def perturbed(arch: str, team) -> dict:
    """SnapKV's kept positions and tokens with this rank's scores perturbed (rank 0's left as they are)."""
    import evalkit.kv.cache as cache

    mean = cache.group_mean
    if team.ranks.rank:
        cache.group_mean = lambda scores, h: mean(scores, h) + torch.rand_like(mean(scores, h))
    try:
        got = observe(arch, {"snapkv": METHODS["snapkv"]}, team)["snapkv"]
    finally:
        cache.group_mean = mean
    return {"kept": got["kept"], "tokens": got["tokens"]}


def as_rank(rank: int, world: int, port: int, folder: str, work) -> None:
    """Run `work(team)` as one rank of a TP=world group (gloo, joined through evalkit.team) and write what it
    returned to `folder`/rank<r>.json."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from evalkit.team import Ranks, Team

    team = Team.start(Ranks.from_config({"parallel": {"tp_size": world, "dp_size": 1}}))
    try:
        result = work(team)
    finally:
        team.leave()
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def tp_main(rank: int, world: int, port: int, archs: tuple, folder: str) -> None:
    """One rank of a TP=world run: what it observed of each architecture, and SnapKV with rank 1 perturbed."""

    def work(team):
        result = {arch: observe(arch, team=team) for arch in archs}
        result["deepseek_v3"]["perturbed"] = perturbed("deepseek_v3", team)
        return result

    as_rank(rank, world, port, folder, work)


# a compiled step's collectives: tova_decode gathers the layer's heads, an MLA eviction takes the root's
# choice (aot_eager traces the one graph as inductor does, fullgraph, without its C++ build)
COMPILED = {name: METHODS[name] for name in ("h2o", "tova_decode")}
BACKEND = "aot_eager"


def tp_compiled_main(rank: int, world: int, port: int, folder: str) -> None:
    """One rank of a TP=world run of both architectures, each decode step compiled (`COMPILED` methods)."""

    def work(team):
        return {arch: observe(arch, COMPILED, team, compile=BACKEND) for arch in ("llama", "deepseek_v3")}

    as_rank(rank, world, port, folder, work)


FP8_METHODS = {name: METHODS[name] for name in ("full", "snapstream", "h2o")}


def tp_fp8_main(rank: int, world: int, port: int, folder: str, kv="fp8_e4m3", methods=FP8_METHODS) -> None:
    """One rank of a TP=world run of the llama model with its caches in fp8 (a scale per KV head: each rank
    calibrates the heads it holds), or in another storage `kv` (a conf name, or (name, settings))."""
    name, settings = (kv, None) if isinstance(kv, str) else kv

    def work(team):
        return observe("llama", methods, team, kv=name, kv_settings=settings)

    as_rank(rank, world, port, folder, work)


# int4 (KIVI) on the tiny llama's 16-wide heads: groups of 8, a residual of 16 (40/57-token prompts + 12 new
# tokens cross key blocks); snapstream's budget 24 is whole key groups
INT4 = ("int4", {"group": 8, "residual": 16})
INT_METHODS = {name: METHODS[name] for name in ("full", "snapstream")}


if __name__ == "__main__":
    print(json.dumps(observe(sys.argv[1])))
