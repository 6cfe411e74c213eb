"""32k-token speed check on a GPU with random weights of real architectures (no downloads needed).

Llama-3.1-8B-shaped (all 32 layers, bf16, sdpa) and DeepSeek-V3-shaped MLA (a few dense layers of the real
widths): prefill time with transformers' DynamicCache vs SnapStream, then decode tokens/s for the full cache
vs SnapStream budgets. `python scripts/gpu_bench.py [--tokens 32768] [--device cuda] [--layers N]`;
`--device cpu --tokens 1024 --layers 2 --small` is a CPU smoke run of the script itself.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from evalkit.kv import Full, KVCache, SnapStream, attach
from evalkit.kv.prefill import PrefillRecord, populate

LLAMA_31_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                   max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5)  # fmt: skip
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   num_hidden_layers=61, first_k_dense_replace=61, num_attention_heads=128, num_key_value_heads=128,
                   kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   n_routed_experts=256, moe_intermediate_size=2048, max_position_embeddings=163840)  # fmt: skip


def build(cfg: dict, layers: int | None, device: str, small: bool):
    cfg = dict(cfg)
    if layers:
        cfg.update(
            num_hidden_layers=layers, first_k_dense_replace=layers
        ) if "kv_lora_rank" in cfg else cfg.update(num_hidden_layers=layers)
    if small:  # CPU smoke: shrink widths, keep the architecture
        cfg.update(hidden_size=256, intermediate_size=512, vocab_size=4096)
        cfg.update(num_attention_heads=4, num_key_value_heads=2 if "head_dim" in cfg else 4, head_dim=64)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return attach(model.eval())


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def run(model, tokens: int, budgets, steps: int, device: str) -> dict:
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    res = {"tokens": tokens, "prefill_s": {}, "decode_tok_s": {}}
    for name, cache in (
        ("dynamic_cache", DynamicCache()),
        ("snapstream", KVCache.for_model(SnapStream(budget=budgets[0]), model)),
    ):
        sync(device), model(ids[:, :512], cache=DynamicCache(), logits_to_keep=1)  # warm-up
        sync(device)
        start = time.perf_counter()
        model(ids, cache=cache, logits_to_keep=1)
        sync(device)
        res["prefill_s"][name] = round(time.perf_counter() - start, 4)
        del cache
    record = PrefillRecord(window=32)
    first = model(ids, cache=KVCache.for_model(Full(), model, record=record), logits_to_keep=1).logits.argmax(
        -1
    )
    for method in [Full()] + [SnapStream(budget=b) for b in budgets]:
        cache = KVCache.for_model(method, model)
        populate(cache, record)
        token, times = first, []
        for _ in range(steps):
            sync(device)
            start = time.perf_counter()
            token = model(token, cache=cache).logits[:, -1:].argmax(-1)
            sync(device)
            times.append(time.perf_counter() - start)
        label = "full" if method.name == "full" else f"snapstream_{method.budget}"
        res["decode_tok_s"][label] = round(1 / statistics.median(times[3:]), 2)
        del cache
    res["prefill_overhead_pct"] = round(
        100 * (res["prefill_s"]["snapstream"] / res["prefill_s"]["dynamic_cache"] - 1), 2
    )
    full = res["decode_tok_s"]["full"]
    res["decode_speedup_vs_full"] = {k: round(v / full, 2) for k, v in res["decode_tok_s"].items()}
    if device.startswith("cuda"):
        res["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=None, help="override layer counts (DeepSeek defaults to 4)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args()
    budgets = [4096, 1024, 8192] if not args.small else [256, 128]
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    for name, cfg, layers in (
        ("llama31_8b_shape", LLAMA_31_8B, args.layers),
        ("deepseek_v3_shape", DEEPSEEK_V3, args.layers or 4),
    ):
        model = build(cfg, layers, args.device, args.small)
        report[name] = run(model, args.tokens, budgets, args.steps, args.device)
        print(name, json.dumps(report[name]), flush=True)
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
