"""Where decode time goes: torch.profiler on one decode step, full cache vs SnapStream 512."""

from __future__ import annotations

from evalkit.bench.base import Context, Measurement
from evalkit.bench.timing import decode_steps, filled_cache, prompt_ids, recorded_prefill
from evalkit.kv import Full, SnapStream

TOP = 12  # operators kept per configuration


def profile_step(model, tok, length: int) -> tuple[list[dict], str]:
    """(the top operators by self CPU time per configuration, the profiler's tables as text)."""
    from torch.profiler import ProfilerActivity, profile

    ids = prompt_ids(tok, length)
    record, first = recorded_prefill(model, ids)
    rows, text = [], []
    for method in (Full(), SnapStream(budget=512)):
        cache = filled_cache(method, model, record, ids)
        decode_steps(model, cache, first, 3)  # warm up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode_steps(model, cache, first, 1)
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:TOP]:
            rows.append(
                {
                    "prompt_tokens": length,
                    "config": method.name,
                    "op": e.key,
                    "calls": e.count,
                    "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                    "self_cpu_pct": round(100 * e.self_cpu_time_total / total, 1),
                }
            )
        table = events.table(sort_by="self_cpu_time_total", row_limit=TOP)
        budget = getattr(method, "budget", "-")
        text.append(
            f"== one decode step after {length} prompt tokens: {method.name} (budget {budget})\n{table}"
        )
    return rows, "\n".join(text)


def run(ctx: Context) -> list[dict]:
    rows, text = profile_step(ctx.model, ctx.tokenizer, ctx.size(2048, 16384))
    (ctx.out / "profile.txt").write_text(text)
    return rows


def note(rows: list[dict]) -> str:
    return (
        f"torch.profiler on one decode step, the top {TOP} operators by self CPU time per configuration; the "
        "full tables are in `profile.txt`."
    )


MEASUREMENT = Measurement("profile", "profile.csv", "Where decode time goes", run, note)
