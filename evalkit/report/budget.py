"""What a budget buys: the memory model (evalkit.memory) at the task's context length, method vs full.

The context is the full run's typical request: the median one by cache length (prompt + generated) over the
generations in its samples.jsonl, or its longest one (`kv.peak_prompt_tokens`, `kv.peak_seen_tokens`) when the
run recorded no per-request lengths, and said so. At the longest request the ratios are the largest and
least typical. Cache slots follow evalkit's cache (`evalkit.memory.report.run_entries`: fixed-size methods
hold `budget` slots even for a shorter prompt, snapkv keeps min(prefill, budget) of what its prefill
compressed and appends the rest: a question fed after compression, a conversation's later questions and
answers, each output). Per hardware: the largest batch whose KV fits in HBM beside the weights, and the
modelled decode tok/s at that batch: both memory-bound upper bounds (KV capacity and bytes read), never
predictions of measured speed. Beside them,
where `make bench` measured the same model, method and budget (results/bench/decode_speed.csv: the embedded
model, batch 1, CPU), the measured decode speedup over the full cache at the nearest prompt length.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from omegaconf import OmegaConf

from evalkit.config import CONF_DIR, group_config
from evalkit.memory.model import MemoryReportError, ModelSpec, model_spec
from evalkit.memory.report import record_storage, run_entries
from evalkit.memory.sim import Deployment, Hardware, method_of, ring_entries
from evalkit.report.runs import Run


def hardware_cfg(name: str) -> dict:
    """conf/hardware/<name>.yaml with the files its `defaults` list names merged under it (h100 <- h200)."""
    path = Path(CONF_DIR) / "hardware" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise MemoryReportError(f"hardware: unknown {name!r} (known: {', '.join(known)})")
    node = OmegaConf.load(path)
    parents = [d for d in node.pop("defaults", []) if d != "_self_"]
    merged = OmegaConf.merge(*[hardware_cfg(p) for p in parents], node) if parents else node
    return OmegaConf.to_container(merged)


def spec_of(run: Run, deploy: dict, storage=None) -> ModelSpec:
    """The run's model from its recorded HF config, stored in the deployment's dtypes; its KV held by
    `storage` (None: in `deploy.kv_dtype`)."""
    hf_config = run.metrics.model.get("hf_config")
    if not hf_config:
        raise MemoryReportError(f"{run.rel}: metrics.json has no model.hf_config")
    return model_spec(run.model, hf_config, deploy["weight_dtype"], deploy["kv_dtype"], storage=storage)


def storage_of(run: Run):
    """The run's KV storage as its saved config made it (`kv`: its settings, group and residual included),
    or by its recorded name; None for `none` (the deployment's kv_dtype)."""
    return None if run.in_model_dtype else record_storage(run.metrics)


def ring_of(run: Run) -> int:
    """Entries of the run's cache that decode overwrites in place (a ring method's recent block: a
    quantized storage keeps it in the model dtype); 0 for an appending cache."""
    if run.budget is None:
        return 0
    return ring_entries(method_of(conf_name(run), run.budget, method_node(run)))


def conf_name(run: Run) -> str:
    """The run's method conf (its folder under conf/method/)."""
    return str(run.metrics.method.get("conf") or run.method)


def method_node(run: Run) -> dict:
    """The method node the run was built from: its saved config's, or (a metrics.json without one) its conf
    with the plain settings it recorded (a nested record, a ring's scorer, is a description, not a node)."""
    node = run.config.get("method") if run.config else None
    if isinstance(node, dict) and node.get("_target_"):
        return node
    conf = OmegaConf.to_container(group_config("method", conf_name(run)))
    recorded = run.metrics.method.items()
    return conf | {k: v for k, v in recorded if k in conf and k != "_target_" and not isinstance(v, dict)}


def deployment(spec: ModelSpec, hw: Hardware, deploy: dict, ring: int = 0) -> Deployment:
    """`spec` on `hw`; tp `auto` = the largest degree dividing both the sockets and the attention heads (the
    memory report's default, tp = sockets, whenever that is legal)."""
    tp = math.gcd(hw.sockets, spec.kv.heads) if deploy["tp"] == "auto" else int(deploy["tp"])
    if hw.sockets % tp or spec.kv.heads % tp:  # said in the report's own setting, not the memory report's
        raise MemoryReportError(
            f"deploy.tp={tp} does not divide both {hw.name}'s {hw.sockets} sockets and the "
            f"{spec.kv.heads} attention heads of {spec.name}: set deploy.tp=auto (the largest that does)"
        )
    return Deployment(spec, hw, tp, deploy["attention"], float(deploy["mtp_factor"]), ring)


def _prefill(g: dict) -> int:
    """Tokens a generation's prefill compressed; a record from before `prefill_tokens` was recorded fed its
    question (`question_tokens`, query_aware=false) after the prefill."""
    return g.get("prefill_tokens", g["prompt_tokens"] - (g.get("question_tokens") or 0))


def cache_lengths(rows: dict) -> dict[tuple[str, int], tuple[int, int, int]]:
    """(prefill, prompt, seen) of every request of a run by (sample id, repeat), from its samples.jsonl
    generations: the tokens its prefill compressed, every token before its answer, every token its cache
    saw. An older record of a conversation's later turn counted only its own question as its prompt: its
    cache holds the first turn's context and everything since."""
    recs = {
        (sid, r): g
        for sid, row in rows.items()
        for r, g in enumerate(row.get("generation") or [])
        if isinstance(g, dict) and g.get("kv_seen") and g.get("prompt_tokens")
    }
    first = {(g.get("conversation"), r): _prefill(g) for (_, r), g in recs.items() if g.get("turn") == 0}
    out = {}
    for (sid, r), g in recs.items():
        prefill, prompt, seen = _prefill(g), g["prompt_tokens"], g["kv_seen"]
        if "prefill_tokens" not in g and g.get("turn"):
            prefill = first.get((g.get("conversation"), r))
            prompt = seen - g.get("output_tokens", 1) + 1  # the last output token is not in the cache
        if prefill is not None:
            out[(sid, r)] = (int(prefill), int(prompt), int(seen))
    return out


def context_of(full: Run, rows: dict | None = None, comp: dict | None = None) -> tuple[int, int, int, str]:
    """(prefill, prompt, seen, basis) of the full run's median request by cache length, from its samples.jsonl
    generations; its longest request (metrics.json kv.peak_*) when those lack the lengths. `prefill` is what
    the compressed run's own prefill compressed of that request (`comp`: its cache_lengths): its context
    alone when it fed the question after compression, whatever the full run did."""
    lengths = cache_lengths(rows or {})
    if lengths:
        order = sorted(lengths, key=lambda k: (lengths[k][2], lengths[k][1]))
        key = order[(len(order) - 1) // 2]  # the lower median: a request that ran
        prefill, prompt, seen = lengths[key]
        prefill = (comp or {}).get(key, (prefill,))[0]
        return prefill, prompt, seen, f"median request of {len(order)}"
    kv = full.metrics.kv
    prompt, seen = kv.get("peak_prompt_tokens"), kv.get("peak_seen_tokens")
    if not prompt or not seen:
        raise MemoryReportError(f"{full.rel}: metrics.json has no kv.peak_prompt_tokens/peak_seen_tokens")
    prefill = kv.get("peak_prefill_tokens") or prompt
    return (
        int(prefill),
        int(prompt),
        int(seen),
        "longest request (samples.jsonl holds no per-request lengths)",
    )


BENCH_MODEL = "smollm2_135m"  # what `make bench` measures (evalkit.bench.base.Context.model_name)


def bench_speedup(bench_dirs: list[Path], model: str, method: str, budget, context: int) -> dict:
    """The measured decode speedup over the full cache for this model, method and budget at the bench's
    prompt length nearest `context` (log scale); {} where no bench measured it."""
    if model != BENCH_MODEL or budget is None:
        return {}
    path = next((d / "decode_speed.csv" for d in bench_dirs if (d / "decode_speed.csv").is_file()), None)
    if path is None:
        return {}
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("config") == f"{method}_{int(budget)}"]
    if not rows:
        return {}
    best = min(rows, key=lambda r: abs(math.log(int(r["prompt_tokens"]) / context)))
    return {
        "bench_speedup": float(best["speedup_vs_full"]),
        "bench_prompt_tokens": int(best["prompt_tokens"]),
    }


def _at_max_batch(dep: Deployment, entries: int) -> tuple[int, float]:
    batch = dep.max_batch(entries)
    return batch, dep.step(batch, entries)["tok_s"] if batch else 0.0


def memory_row(
    comp: Run,
    full: Run,
    hardware: dict[str, Hardware],
    deploy: dict,
    full_rows: dict | None = None,
    comp_lengths: dict | None = None,
) -> dict:
    """KV bytes per sequence (method and full, modelled in the deployment's dtypes), saving, and per hardware
    max batch and tok/s gain (memory-bound upper bounds); the run's measured peak bytes in its own dtype.
    `comp_lengths`: the compressed run's cache_lengths (what its prefill compressed of each request)."""
    prefill, prompt, seen, basis = context_of(full, full_rows, comp_lengths)
    spec, spec_full = spec_of(full, deploy, storage_of(comp)), spec_of(full, deploy)
    # adaptive budgets hold their largest head's slots: the model's KV heads and layers size them
    # the settings it ran with: an adaptive budget's alpha or beta sizes its slots
    entries = run_entries(conf_name(comp), comp.budget, prefill, seen, spec.kv.shape, method_node(comp))
    ring = ring_of(comp)
    kv = comp.metrics.kv
    row = {
        "context_tokens": seen,
        "context_prompt_tokens": prompt,
        "context_prefill_tokens": prefill,
        "context_basis": basis,
        "kv_dtype_modelled": deploy["kv_dtype"],
        "kv_peak_bytes_measured": kv.get("peak_bytes"),
        "dtype_measured": comp.metrics.model.get("dtype"),
        "kv_entries": entries,
        "kv_entries_full": seen,
        "kv_bytes_seq": spec.kv.sequence_bytes(entries, min(ring, entries)),  # codes, scales, residual
        "kv_bytes_seq_full": spec_full.kv.sequence_bytes(seen),
        "memory_saving": None,
        "tp": {},
    }
    row["memory_saving"] = 1 - row["kv_bytes_seq"] / row["kv_bytes_seq_full"]
    for name, hw in hardware.items():
        dep = deployment(spec, hw, deploy, min(ring, entries))
        b, tok = _at_max_batch(dep, entries)
        b_full, tok_full = _at_max_batch(deployment(spec_full, hw, deploy), seen)
        row |= {
            f"max_batch_{name}": b,
            f"max_batch_full_{name}": b_full,
            f"tok_s_gain_{name}": tok / tok_full if tok_full else None,
        }
        row["tp"][name] = dep.tp
    return row


def load_hardware(names: list[str]) -> dict[str, Hardware]:
    return {n: Hardware.from_cfg(hardware_cfg(n)) for n in names}
