"""From a scored run to its `metrics.json` record (evalkit.metrics) and the table printed after a run."""

from __future__ import annotations

import datetime as dt
import shlex
import statistics

from omegaconf import OmegaConf

from evalkit.identity import identity
from evalkit.metrics import SCHEMA, Metrics
from evalkit.results import git_sha, hardware, versions
from evalkit.sample import aggregate


def resolved_revision(spec) -> dict:
    """What pins the exact weights and tokenizer used (see evalkit.sources.fingerprint)."""
    from evalkit.sources import fingerprint

    return fingerprint(spec)


def _mean(xs):
    xs = list(xs)
    return statistics.fmean(xs) if xs else None


def kv_summary(gens: list[dict], model_config) -> dict:
    """Measured compression and memory over every generation of the run. A served model's cache lives in the
    server: its generations carry no KV statistics, and every figure here is then null (unmeasured), never
    0. `peak_bytes` is the whole cache of the peak request, whatever the layout; `peak_bytes_per_rank` what
    one process held of it (under tensor parallelism its share of the KV heads)."""
    gens = [g for g in gens if g.get("kv_bytes") is not None]
    # the peak request: most entries, and of equal entries (a fixed-size cache) the longest, so
    # peak_prompt_tokens is the longest prompt the cache held at its peak, not whichever request came first;
    # never by bytes, which are a TP rank's share, and of several layouts in a run resumed across them
    peak = max(gens, key=lambda g: (g["kv_slots"], g["kv_seen"] or 0)) if gens else {}
    latent = getattr(model_config, "kv_lora_rank", None) is not None
    return {
        "kept_fraction": _mean(g["kv_kept"] / g["kv_seen"] for g in gens if g["kv_seen"]),
        "mean_kept_entries": _mean(g["kv_kept"] for g in gens),
        "peak_bytes": whole_cache_bytes(peak, cached_heads(model_config)) if gens else None,
        "peak_bytes_per_rank": peak.get("kv_bytes"),
        # the same request's entries as a ragged layout would hold them (heads keeping different counts)
        "peak_ragged_bytes": whole_cache_bytes(peak, cached_heads(model_config), "kv_ragged_bytes")
        if gens and peak.get("kv_ragged_bytes") is not None
        else None,
        "peak_entries": peak.get("kv_slots"),
        "peak_prompt_tokens": peak.get("prompt_tokens"),  # of the request at the peak: lets the memory
        "peak_prefill_tokens": peak.get("prefill_tokens"),  # report predict its entries from lengths alone
        "peak_seen_tokens": peak.get("kv_seen"),
        "evicted_generated_mean": _mean(g["kv_evicted_generated"] for g in gens),
        "cache_layout": ("latent" if latent else "per_head") if gens else None,
    }


def cached_heads(model_config) -> int:
    """KV heads of the model's cache: one latent under MLA, else every KV head."""
    if getattr(model_config, "kv_lora_rank", None) is not None:
        return 1
    return getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads


def whole_cache_bytes(gen: dict, heads: int, figure: str = "kv_bytes") -> int:
    """A generation's KV bytes over all `heads`: its record holds the bytes of the `kv_heads` its process
    cached (a TP rank's share; MLA's latent is replicated, whole on every rank). A record written before
    `kv_heads` was recorded came from one process: whole."""
    return gen[figure] * heads // (gen.get("kv_heads") or heads)


def generation_summary(gens: list[dict]) -> dict:
    """Wall time is the generation time of this run's own requests (a budget sweep shares prefills)."""
    tokens = sum(g["output_tokens"] for g in gens)
    return {
        "requests": len(gens),
        "tokens_generated": tokens,
        "mean_output_tokens": _mean(g["output_tokens"] for g in gens),
        "mean_prompt_tokens": _mean(g["prompt_tokens"] for g in gens),
        "max_prompt_tokens": max((g["prompt_tokens"] for g in gens), default=None),
        "hit_limit": sum(bool(g["hit_limit"]) for g in gens),
        "truncated_prompts": sum(bool(g.get("truncated")) for g in gens),
        "wall_time_s": round(sum(g["wall_s"] for g in gens), 3),
        "prefills_replayed": sum(bool(g.get("prefill_replayed")) for g in gens),
    }


def summarize(plan, loaded, rows: list[dict], model_config, context: int, journal_counts: dict) -> Metrics:
    cfg, method = plan.cfg, plan.method
    gens = [g for r in rows for g in r["generation"]]
    return Metrics(
        schema=SCHEMA,
        task=cfg.task.name,
        task_version=plan.task_module.VERSION,
        scorer_version=plan.task_module.SCORER_VERSION,
        identity=identity(plan, loaded),
        headline=cfg.task.headline,
        model={
            "name": cfg.model.name,
            "source": plan.spec.source_label(),
            "revision": resolved_revision(plan.spec),
            "dtype": plan.spec.dtype,
            "context": context,
            "hf_config": model_config.to_dict(),
        },
        method={
            **method.describe(),
            "conf": plan.out.parent.name.removesuffix(f"+{plan.storage.name}"),
            "tag": plan.out.name,
        },
        storage=plan.storage.describe(),
        budget=method.budget,
        n=len(rows),
        n_skipped=len(loaded.skipped),
        skipped=[{"id": s.id, "reason": s.reason} for s in loaded.skipped],
        data={"source": loaded.source, "hash": loaded.data_hash, "stats": loaded.stats},
        scores=aggregate([r["scores"] for r in rows]),
        kv=kv_summary(gens, model_config.get_text_config()),
        generation={**generation_summary(gens), **journal_counts},
        batch_size=cfg.batch_size,
        provenance={
            "git_sha": git_sha(),
            # a served model computes on its server, which says nothing about its hardware
            "hardware": "the server's" if plan.spec.source_label().startswith("served:") else hardware(),
            "versions": versions(),
            "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "config": OmegaConf.to_container(cfg, resolve=True),
        },
    )


def print_table(m: Metrics) -> None:
    """The run's scores (headline first) and its KV and generation figures."""
    head = m.headline
    budget = m.budget if m.budget is not None else "-"
    print(f"\n{m.task} | {m.model['name']} | {m.method['name']} budget={budget} | n={m.n} ({m.data_source})")
    # headline first, then one level of breakdown; task@length cells and the rest stay in metrics.json
    keys = sorted(
        (k for k in m.scores if "@" not in k.partition("/")[2]), key=lambda k: (k != head, k.count("/"), k)
    )
    width = max(len(k) for k in keys) if keys else 10
    for k in keys:
        v = m.scores[k]
        print(f"  {k:<{width}}  {v['mean']:8.2f} ± {v['stderr']:6.2f}  (n={v['n']})")
    kv, gen = m.kv, m.generation
    kept = kv.get("kept_fraction")
    ratio = f"{kept:.3f} ({1 / kept:.1f}x compression)" if kept else "-"
    cache = "not measured (a served model: the server keeps it)"
    if kv["peak_bytes"] is not None:
        cache = f"kept/seen {ratio}, peak {kv['peak_entries']} entries = {kv['peak_bytes']:,} bytes"
    print(
        f"  kv: {cache};"
        f" generated {gen['tokens_generated']} tokens in {gen['wall_time_s']:.0f} s"
        f" (hit limit {gen['hit_limit']}, truncated prompts {gen['truncated_prompts']})"
    )


# --- what a run says before and after -----------------------------------------------------------------------
def announce(plans, loaded, n_samples: int, missing: dict) -> None:
    """Before any model loads: what is evaluated, on what, and where it lands (and what each folder holds)."""
    cfg = plans[0].cfg
    settings = OmegaConf.to_container(cfg.task.load, resolve=True).items()
    load = ", ".join(f"{k}={v}" for k, v in settings if v is not None)
    repeats = int(cfg.task.repeats)
    print(
        f"evalkit: {cfg.task.name}: {n_samples} problems x {repeats} repeat{'s' * (repeats > 1)} "
        f"({loaded.source}; {load}) on {cfg.model.name}, method {plans[0].method.name}"
    )
    if (
        loaded.skipped
    ):  # a malformed or duplicate row is reported, never dropped silently (also in metrics.json)
        shown = "; ".join(f"{r.id}: {r.reason}" for r in loaded.skipped[:10])
        more = (
            f" (and {len(loaded.skipped) - 10} more: metrics.json lists all)"
            if len(loaded.skipped) > 10
            else ""
        )
        print(f"evalkit: {len(loaded.skipped)} row(s) of {loaded.source} skipped: {shown}{more}")
    total = n_samples * repeats
    for p in plans:
        state = {
            "done": "complete: skipped",
            "rescore": "re-scored from its journal (no model)",
            "rebuild": "samples.jsonl rebuilt from its journal (no model)",
        }.get(p.state)
        if state is None:
            todo = missing.get(p.out, total)
            state = "new" if todo == total else f"resuming: {total - todo} of {total} generations journaled"
        print(f"  -> {p.out}  ({state})")


def next_step(plans, world: int = 1) -> None:
    """After the table: where it went, and the step that gives a verdict (a compressed run needs the full run
    on the same problems; then `make report`). Each printed command runs as printed (`make_args`)."""
    cfg = plans[0].cfg
    args = _nproc(world) + _same_args()
    for p in plans:
        print(f"evalkit: results in {p.out}/ (metrics.json, samples.jsonl, generations.jsonl)")
    compressed = plans[0].method.name != "full"
    full = plans[0].out.parents[1] / "full" / "none" / "metrics.json"
    report = "make report" + make_args([f"results_dir={cfg.results_dir}"])
    if compressed and not full.exists():
        print(f"next: the full-cache reference on the same problems: make eval METHOD=full{args}")
        print(f"      then compressed vs full, problem by problem: {report}")
    elif compressed:
        print(f"next: compressed vs full, problem by problem: {report}")
    else:
        print(f"next: a compressed run on the same problems (make eval METHOD=snapstream BUDGET=256{args}),")
        print(f"      then {report}")


def make_args(overrides: list[str]) -> str:
    """` ARGS=...` handing `overrides` to a make target's command exactly as given (the Makefile forwards
    only ARGS): each quoted for the shell that runs the recipe, `$` doubled for make, and the whole quoted for
    the shell the line is pasted into, so nothing in a value (a `$(...)`, a glob, a space) runs or splits."""
    if not overrides:
        return ""
    inner = " ".join(shlex.quote(o) for o in overrides).replace("$", "$$")
    return f" ARGS={_pasted(inner)}"


def _pasted(text: str) -> str:
    """`text` as one word of the shell it is pasted into: in double quotes where nothing in it expands
    there (readable), else in single quotes."""
    return f'"{text}"' if not set(text) & set('"$`\\!') else shlex.quote(text)


def _nproc(world: int) -> str:
    """` NPROC=N` when this run spans N processes: its `parallel.*` overrides need as many to run again."""
    return f" NPROC={world}" if world > 1 else ""


def _same_args() -> str:
    """` ARGS=...` with the command line's overrides but the method's (empty outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return ""
    keep = [
        o for o in HydraConfig.get().overrides.task if not o.split("=")[0].lstrip("+~").startswith("method")
    ]
    return make_args(keep)
