"""Per-step decode time over hundreds of steps: flat for the ring, growing for the full cache (plus a
plot)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from evalkit.bench.base import Context, Measurement
from evalkit.bench.timing import attention_timer, filled_cache, prompt_ids, recorded_prefill
from evalkit.kv import Full, SnapStream
from evalkit.results import save_figure


@torch.inference_mode()
def bench_steps(model, tok, length: int, steps: int) -> list[dict]:
    """Per-step times of full and SnapStream 512, alternating one step each so both see the same noise.

    `attn_ms` is the attention part of the step (what the cache size drives): the whole step is dominated
    by the model's weights on this CPU, so the cache's growth shows most clearly there."""
    ids = prompt_ids(tok, length)
    record, first = recorded_prefill(model, ids)
    runs = [[m.name, filled_cache(m, model, record, ids), first] for m in (Full(), SnapStream(budget=512))]
    del record
    rows = []
    for i in range(steps):
        for run_ in runs:
            with attention_timer() as attn:
                start = time.perf_counter()
                run_[2] = model(run_[2], cache=run_[1]).logits[:, -1:].argmax(-1)
                wall = time.perf_counter() - start
            rows.append(
                {
                    "config": run_[0],
                    "step": i,
                    "step_ms": round(1000 * wall, 3),
                    "attn_ms": round(1000 * attn.total, 3),
                }
            )
    return rows


def flatness(rows: list[dict]) -> list[dict]:
    """Per config: least-squares slopes (ms per 100 steps) of the whole step and of its attention part, after
    an 8-step warm-up."""
    out = []
    for config in sorted({r["config"] for r in rows}):
        pts = [r for r in rows if r["config"] == config and r["step"] >= 8]
        xs = [r["step"] for r in pts]
        row = {"config": config, "steps": len(pts)}
        for key in ("step_ms", "attn_ms"):
            ys = [r[key] for r in pts]
            row[f"median_{key}"] = round(statistics.median(ys), 2)
            row[f"{key}_slope_per_100_steps"] = round(100 * statistics.linear_regression(xs, ys).slope, 3)
            row[f"{key}_first64_last64"] = (
                f"{statistics.mean(ys[:64]):.2f} -> {statistics.mean(ys[-64:]):.2f}"
            )
        out.append(row)
    return out


def plot_steps(rows: list[dict], path: Path, length: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    for ax, key, title in zip(
        axes, ("step_ms", "attn_ms"), ("whole decode step", "attention part of the step")
    ):
        for config in sorted({r["config"] for r in rows}):
            pts = [(r["step"], r[key]) for r in rows if r["config"] == config]
            ax.plot(*zip(*pts), lw=0.8, label=config)
        ax.set(xlabel="decode step", ylabel="ms", title=f"{title} (SmolLM2, {length} prompt tokens)")
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def run(ctx: Context) -> list[dict]:
    length = ctx.size(1024, 4096)
    rows = bench_steps(ctx.model, ctx.tokenizer, length, ctx.size(80, 512))
    plot_steps(rows, ctx.out / "decode_steps.png", length)
    return rows


def note(rows: list[dict]) -> str:
    steps = max(r["step"] for r in rows) + 1
    return (
        f"{steps} steps per configuration after a 4096-token prompt (1024 with --quick). Target: flat for "
        "the ring (slope ~0), growing for full (its cache grows one entry per step). On 2 CPU cores the "
        "model's weights dominate the step and machine noise is +-20 ms, so the cache-driven part is also "
        "timed alone (attn_ms). Plot: `decode_steps.png`."
    )


MEASUREMENT = Measurement("steps", "decode_steps.csv", "Per-step decode time", run, note, table=flatness)
