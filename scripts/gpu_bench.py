"""32k-token speed check on a GPU with random weights of real architectures (no downloads needed).

Llama-3.1-8B-shaped (all 32 layers, bf16, sdpa) and DeepSeek-V3-shaped MLA (a few dense layers of the real
widths): prefill time with transformers' DynamicCache vs SnapStream, then decode tokens/s for the full cache
vs SnapStream budgets, decode-time eviction (h2o, snapkv_decode; DeepSeek: h2o) beside SnapStream at budget
1024 with its per-step scoring cost (evalkit.bench.eviction), then eager vs compiled decode
(`compile: true`: the static cache through torch.compile, CUDA graphs via mode="reduce-overhead";
evalkit.bench.compiled) with the memory floor, and the bucketed full cache (the engine's slot pool sized for
`--max-new` new tokens, attending over buckets of its filled slots, eager and compiled, against the dynamic
cache and the pool attending over its whole capacity; evalkit.bench.bucketed).
`python scripts/gpu_bench.py [--tokens 32768] [--device cuda] [--layers N] [--no-compile] [--max-new 8192]`;
`--device cpu --tokens 1024 --layers 2 --small` is a CPU smoke run of the script itself.
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from evalkit.bench import decode_speed, prefill_overhead
from evalkit.bench.bucketed import bucketed_full
from evalkit.bench.compiled import ALL_MODES, compiled_decode
from evalkit.bench.eviction import eviction_speed
from evalkit.kv import Full, SnapStream, attach

LLAMA_31_8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
)
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    num_hidden_layers=61,
    first_k_dense_replace=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163840,
)


def build(cfg: dict, layers: int | None, device: str, small: bool):
    cfg = dict(cfg)
    if layers:
        cfg.update(num_hidden_layers=layers)
        if "kv_lora_rank" in cfg:
            cfg.update(first_k_dense_replace=layers)  # every layer dense: MoE routing is not what is timed
    if small:  # CPU smoke: shrink widths, keep the architecture
        cfg.update(hidden_size=256, intermediate_size=512, vocab_size=4096)
        cfg.update(num_attention_heads=4, num_key_value_heads=2 if "head_dim" in cfg else 4, head_dim=64)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return attach(model.eval())


@torch.inference_mode()
def run(
    model,
    tokens: int,
    budgets,
    steps: int,
    device: str,
    compiled: bool,
    evict: int | None = None,
    max_new: int = 8192,
) -> dict:
    """evalkit.bench's interleaved prefill and decode measurements on random token ids; eager vs compiled
    decode of SnapStream (the first budget) and the full cache. `evict`: the decode-time eviction rows' budget
    (default the first); snapkv_decode re-selects every budget/4 steps and the rows decode two re-selections'
    worth, so 1024 costs ~520 steps where 4096 would cost ~2k."""
    evict = evict or budgets[0]
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    model(ids[:, :512], logits_to_keep=1)  # warm-up (kernels, allocator)
    res = {
        "tokens": tokens,
        "prefill": prefill_overhead(model, ids, reps=3),
        "decode": decode_speed(model, ids, budgets, steps, rounds=4),
        # h2o / snapkv_decode decode through the engine's slot pool: their own measurement at one budget
        "eviction": eviction_speed(model, ids, evict, max(steps, 2 * evict // 4 + 8), rounds=4),
    }
    if compiled:
        methods = [SnapStream(budget=budgets[0]), Full()]
        res["compiled_decode"] = compiled_decode(model, ids, methods, steps, rounds=4, modes=ALL_MODES)
        res["bucketed_full"] = [bucketed_full(model, ids, max_new, steps, rounds=4)]
    if device.startswith("cuda"):
        res["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="override layer counts (DeepSeek defaults to 4)")
    ap.add_argument("--steps", type=int, default=64, help="decode steps per configuration (at least 8)")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the eager vs compiled decode")
    ap.add_argument("--max-new", type=int, default=8192, help="the bucketed full cache's answer allowance")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args()
    if args.steps < 8:
        ap.error("--steps must be at least 8 (4 interleaved rounds, the first step of each a warm-up)")
    budgets = [4096, 1024, 8192] if not args.small else [256, 128]
    out = Path(args.out)
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    for name, cfg, layers in (
        ("llama31_8b_shape", LLAMA_31_8B, args.layers),
        ("deepseek_v3_shape", DEEPSEEK_V3, args.layers or 4),
    ):
        model = build(cfg, layers, args.device, args.small)
        report[name] = run(
            model,
            args.tokens,
            budgets,
            args.steps,
            args.device,
            not args.no_compile,
            evict=budgets[1],
            max_new=args.max_new,
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_bench.json").write_text(json.dumps(report, indent=2))  # after each model: nothing lost
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
