"""Batched long decodes (AIME-style): short prompts, long forced decodes, SnapStream 256 at batch 1, 4, 8."""

from __future__ import annotations

import time

from evalkit.bench.base import Context, Measurement
from evalkit.bench.continuous import aime_like_texts
from evalkit.kv import SnapStream, generate


def bench_batch(model, tok, batches, new_tokens: int) -> list[dict]:
    """The same requests at each batch size through `evalkit.kv.generate` (left padding: one engine row per
    request)."""
    texts = aime_like_texts(tok, max(batches))
    rows = []
    for b in batches:
        start = time.perf_counter()
        for i in range(0, len(texts), b):
            enc = tok(texts[i : i + b], return_tensors="pt", padding=True, add_special_tokens=False)
            generate(
                model,
                enc["input_ids"],
                SnapStream(budget=256),
                attention_mask=enc["attention_mask"],
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
        wall = time.perf_counter() - start
        rows.append(
            {
                "batch_size": b,
                "requests": len(texts),
                "new_tokens": new_tokens,
                "wall_s": round(wall, 2),
                "tokens_per_s": round(len(texts) * new_tokens / wall, 2),
            }
        )
        print(f"batch {b}: {rows[-1]['tokens_per_s']} tok/s", flush=True)
    for r in rows:
        r["gain_vs_batch1"] = round(r["tokens_per_s"] / rows[0]["tokens_per_s"], 2)
    return rows


def run(ctx: Context) -> list[dict]:
    return bench_batch(ctx.model, ctx.tokenizer, [1, 4, 8], ctx.size(16, 128))


def note(rows: list[dict]) -> str:
    return (
        "Left-padded batches through the engine (one row per request); outputs equal batch size 1 "
        "(tests/kv/test_batched.py)."
    )


MEASUREMENT = Measurement(
    "batch", "batch_throughput.csv", "Batched long decodes (AIME-style, SnapStream 256)", run, note
)
