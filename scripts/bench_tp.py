"""Decode speed of one run's model under tensor parallelism vs one process (random weights, no downloads).

Run it as the run itself runs: `python scripts/bench_tp.py ...` (one process) or under torchrun
(`python -m torch.distributed.run --standalone --nproc_per_node N scripts/bench_tp.py ...`: TP=N through
evalkit.team, gloo on CPU, nccl on CUDA). Rank 0 appends one CSV row per method to `--out/tp.csv`:
prefill seconds and decode tokens/s of the engine (evalkit.engine, the path `python -m evalkit` decodes
through), with the layout. Shapes: `cpu` (a small Llama/DeepSeek-V3 for a 2-core machine), or the real
widths of Llama-3.1-8B / DeepSeek-V3 (scripts/gpu_bench.py) with `--layers` of them.

    OMP_NUM_THREADS=2 python scripts/bench_tp.py --arch llama      # one process, both cores
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node 2 scripts/bench_tp.py
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import DEEPSEEK_V3, LLAMA_31_8B  # noqa: E402  (the real configs, one home)

from evalkit.team import Ranks, Team  # noqa: E402

CPU_SHAPES = {  # small enough for a shared 2-core machine, wide enough that TP splits real matmuls
    "llama": dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, vocab_size=8192, num_hidden_layers=4),
    "deepseek_v3": dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=8,
                        vocab_size=8192, num_hidden_layers=4, kv_lora_rank=128, q_lora_rank=256,
                        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, first_k_dense_replace=4),
}  # fmt: skip


def spec_for(args, team: Team):
    from evalkit.models import ModelSpec

    cfg = dict(LLAMA_31_8B if args.arch == "llama" else DEEPSEEK_V3)
    if args.shape == "cpu":
        cfg.update(CPU_SHAPES[args.arch])
    if args.layers:
        cfg.update(num_hidden_layers=args.layers)
        if args.arch == "deepseek_v3":
            cfg.update(first_k_dense_replace=args.layers)  # dense layers: MoE routing is not what is timed
    one_gpu = args.device == "cuda" and team.tp == 1
    return ModelSpec(name=f"{args.arch}_{args.shape}", random=cfg, dtype=args.dtype,
                     device_map=f"cuda:{team.ranks.local_rank}" if one_gpu else None)  # fmt: skip


def load(spec, team: Team):
    from evalkit.kv import attach
    from evalkit.loading import _tensor_parallel, random_model

    model = _tensor_parallel(spec, None, team) if team.tp > 1 else random_model(spec, team.ranks)
    return attach(model.eval())


def measure(model, args, name: str, settings: dict, team: Team) -> dict:
    from transformers import GenerationConfig

    from evalkit.engine import Engine
    from evalkit.kv.config import make_method
    from evalkit.turns import ask

    method = make_method(name, **settings)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    reqs = [
        ask(str(i), torch.randint(3, vocab, (args.tokens,), generator=g).tolist(), args.new, method,
                GenerationConfig(do_sample=False), seed=i)
        for i in range(args.rows)
    ]  # fmt: skip
    engine = Engine(model, None, eos_ids=[], rows=args.rows, team=team)
    start = time.perf_counter()
    for _ in engine.run(reqs):
        pass
    return {
        "method": name,
        "budget": settings.get("budget"),
        "prefill_s": round(engine.prefill_s, 3),
        "decode_tok_s": round(engine.decode_tokens / max(engine.decode_s, 1e-9), 2),
        "wall_s": round(time.perf_counter() - start, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=["llama", "deepseek_v3"], default="llama")
    ap.add_argument("--shape", choices=["cpu", "real"], default="cpu")
    ap.add_argument("--layers", type=int, default=None, help="layers of the shape (default: all of it)")
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=64, help="tokens decoded per request")
    ap.add_argument("--rows", type=int, default=1, help="requests decoded together")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=Path("results/bench"))
    args = ap.parse_args()
    team = Team.start(Ranks.from_config({"parallel": {"tp_size": None, "dp_size": 1, "backend": None}}))
    lay = team.ranks
    model = load(spec_for(args, team), team)
    rows = [
        measure(model, args, "full", {}, team),
        measure(model, args, "snapstream", {"budget": args.budget}, team),
    ]
    if lay.writer:
        threads = torch.get_num_threads()
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / "tp.csv"
        fresh = not path.exists()
        with open(path, "a", newline="") as f:
            w = None
            for r in rows:
                row = {
                    "arch": args.arch, "shape": args.shape, "layers": model.config.num_hidden_layers,
                    "dtype": args.dtype, "tokens": args.tokens, "new": args.new, "rows": args.rows,
                    "tp": lay.tp, "backend": lay.backend or "none", "device": args.device,
                    "threads_per_rank": threads, **r,
                }  # fmt: skip
                w = w or csv.DictWriter(f, fieldnames=list(row))
                if fresh:
                    w.writeheader()
                    fresh = False
                w.writerow(row)
                print(row)
    team.leave()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
