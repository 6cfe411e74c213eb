"""evalkit's kept sets side by side with kvpress 0.5.5's, on the embedded model's weights (SmolLM2-135M).

kvpress pins transformers < 5.3, so it runs in its own venv (`scripts/kvpress_reference.py`, started here as a
subprocess with that venv's python); both sides load the same converted safetensors folder in float32 and read
the same token ids. Create the venv once (nothing of it is committed):

    python3 -m venv /work/wt/kvpress-venv
    /work/wt/kvpress-venv/bin/pip install kvpress==0.5.5 torch==2.13.0

then (`--kvpress-python` or `$EVALKIT_KVPRESS_PYTHON` names the venv's python):

    .venv/bin/python scripts/kvpress_side_by_side.py prefill --kvpress-python /work/wt/kvpress-venv/bin/python
    .venv/bin/python scripts/kvpress_side_by_side.py decode  --kvpress-python /work/wt/kvpress-venv/bin/python

`prefill`: knorm, keydiff, tova, expected_attention, kvzip, snapkv and the adaptive budgets (adakv over snapkv
and expected_attention, `AdaKVPress`; pyramidkv at beta 20 and 4, `PyramidKVPress`) at three budgets on RULER
needle prompts (niah_single_1 at 1k/2k/4k tokens, niah_multikey_2 at 2k) and natural text (LongBench-v2
documents, 1k and 4k): the context of each (the rendered prompt up to its question, what kvpress's pipeline
compresses). The figure is the mean top-K Jaccard per layer and KV head: |E n K| / |E u K| of the entries each
side keeps, the entries both always keep (sinks, TOVA's last token) left out. `decode`: snapkv_decode against
`DecodingPress(SnapKVPress)` after a prefill SnapKVPress, greedy with EOS suppressed for `--new` tokens, on
~1k-token prompts at three budgets, query-aware and query-agnostic, with kvpress patched to neutralise each
listed deviation in turn; tokens compared, and the kept sets at every re-selection up to the first differing
token. Results: `--out` (default results/kvpress/<mode>.json and .md; kvpress's kept sets beside them,
`<mode>.pt`, reused when the same request runs again, so a change on evalkit's side is re-measured
without running kvpress). `--quick`: one 1k needle prompt and two budgets (the slow test,
tests/kv/test_kvpress_side_by_side.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SINK, FUTURE, CHUNK = 4, 512, 2048  # kvpress defaults for ExpectedAttentionPress and KVzipPress
WINDOW, KERNEL = 32, 7
ALPHA, BETAS = 0.2, (20, 4)  # AdaKVPress's alpha_safeguard; PyramidKVPress's beta: its default, and one whose
# pyramid holds at these budgets (beta 20 keeps the uniform budget below window x beta = 640 entries)


# --- prompts: token ids both sides read -------------------------------------------------------------------
def split(tok, text: str, at: int) -> dict:
    """The prompt's ids split at the character `at` (the token that straddles it goes to the question)."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, ends = enc["input_ids"], [e for _, e in enc["offset_mapping"]]
    cut = next((i for i, e in enumerate(ends) if e > at), len(ids))
    return {"context": ids[:cut], "question": ids[cut:]}


def needle_prompts(tok, specs) -> dict:
    from evalkit.request import question_offset, sample_prompt
    from tasks.ruler import ruler

    out = {}
    for task, length, n in specs:
        loaded = ruler.load(tokenizer=tok, lengths=(length,), tasks=task, n=n)
        for i, sample in enumerate(loaded.samples):
            text = sample_prompt(tok, sample)
            at = question_offset(text, sample, ruler.question_start(sample))
            out[f"{task}_{length // 1024}k_{i}"] = split(tok, text, at)
    return out


def natural_prompts(tok, lengths) -> dict:
    """LongBench-v2's bundled documents, concatenated to `length` tokens, asked one question."""
    docs = json.loads((ROOT / "tasks/longbench_v2/data/sample.json").read_text())
    text = "\n\n".join(d["context"] for d in docs)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = {}
    for length in lengths:
        body = tok.decode(ids[: length - 60])
        message = body + "\n\nQuestion: What are these documents about?"
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        out[f"natural_{length // 1024}k"] = split(tok, rendered, rendered.index("Question:"))
    return out


# --- the kvpress side: a subprocess in kvpress's venv ------------------------------------------------------
def kvpress_python(given: str | None) -> str:
    path = given or os.environ.get("EVALKIT_KVPRESS_PYTHON")
    if not path or not Path(path).exists():
        sys.exit(
            "kvpress's venv is needed: pass --kvpress-python or set EVALKIT_KVPRESS_PYTHON to its python "
            "(python3 -m venv /work/wt/kvpress-venv && /work/wt/kvpress-venv/bin/pip install kvpress==0.5.5 "
            "torch==2.13.0)"
        )
    return path


def run_kvpress(python: str, request: dict, keep: Path) -> dict:
    """kvpress's kept sets for `request`, kept at `keep` and read back when the same request runs again
    (evalkit's side can be re-measured without running kvpress; a decode request that adds kvpress
    configurations runs only those)."""
    saved = torch.load(keep) if keep.exists() else None
    todo = request
    if saved is not None and _without_configs(saved["request"]) == _without_configs(request):
        have = saved["request"]["settings"].get("configs", {})
        missing = {k: v for k, v in request["settings"].get("configs", {}).items() if have.get(k) != v}
        if not missing and saved["request"] == request:
            return saved["result"]
        todo = {**request, "settings": {**request["settings"], "configs": missing}}
    else:
        saved = None
    with tempfile.TemporaryDirectory() as work:
        (Path(work) / "request.json").write_text(json.dumps(todo))
        subprocess.run([python, str(ROOT / "scripts/kvpress_reference.py"), work], check=True)
        result = torch.load(Path(work) / "kvpress.pt")
    if saved is not None:
        result = {**saved["result"], **result}
    torch.save({"request": request, "result": result}, keep)
    return result


def _without_configs(request: dict) -> dict:
    return {**request, "settings": {k: v for k, v in request["settings"].items() if k != "configs"}}


# --- the evalkit side -------------------------------------------------------------------------------------
def rivals(budget: int) -> list:
    from evalkit.kv import TOVA, ExpectedAttention, KeyDiff, KNorm, KVzip

    return [
        KNorm(budget=budget),
        KeyDiff(budget=budget),
        TOVA(budget=budget),
        ExpectedAttention(budget=budget, sink=SINK, future=FUTURE),
        KVzip(budget=budget, sink=SINK, chunk=CHUNK),
    ]


def adaptive(budget: int) -> dict:
    """SnapKV and the head- and layer-adaptive budgets (issue 33 item 3), by the label kvpress's side uses."""
    from evalkit.kv import AdaKV, ExpectedAttention, PyramidKV, SnapKV

    snapkv = SnapKV(budget=budget, window=WINDOW, pool_kernel=KERNEL)
    ea = ExpectedAttention(budget=budget, sink=SINK, future=FUTURE)
    return {
        "snapkv": snapkv,
        "adakv_snapkv": AdaKV(budget=budget, alpha=ALPHA, inner=snapkv),
        "adakv_expected_attention": AdaKV(budget=budget, alpha=ALPHA, inner=ea),
        **{f"pyramidkv_snapkv_beta{b}": PyramidKV(budget=budget, beta=b, inner=snapkv) for b in BETAS},
    }


def methods(budget: int) -> dict:
    return {**{m.name: m for m in rivals(budget)}, **adaptive(budget)}


def kept(cache) -> list[list[list[int]]]:
    """(layer, KV head) -> sorted positions held (batch row 0)."""
    out = []
    for i in range(len(cache.layers)):
        held = cache.positions(i)[0]
        out.append([sorted(h[h >= 0].tolist()) for h in held])
    return out


@torch.no_grad()
def evalkit_prefill(model, tok, prompts: dict, budgets) -> dict:
    """One prefill per prompt (KVzip's, with its reconstruction pass), every method and budget replayed from
    its record (`evalkit.kv.prefill`), as a budget list runs them."""
    from evalkit.kv import KVCache
    from evalkit.kv.prefill import PrefillRecord, populate, shared_prefill

    out = {}
    for name, p in prompts.items():
        ids = torch.tensor([p["context"]])
        fits = [b for b in budgets if b < ids.shape[1]]
        record = PrefillRecord(window=1 << 30)  # every query: expected attention reads them all
        cache = KVCache.for_model(rivals(fits[0])[-1], model, record=record)
        with shared_prefill(model, tok):
            model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True)
        got = {}
        for b in fits:
            for label, method in methods(b).items():
                replayed = KVCache.for_model(method, model, replay=record)
                populate(replayed, record)
                got[f"{label}/{b}"] = kept(replayed)
        out[name] = got
        print(f"evalkit prefill {name}: {ids.shape[1]} tokens", flush=True)
    return out


def protected(method: str, length: int) -> set[int]:
    """Entries both sides always keep: left out of the Jaccard (it measures the scored choice)."""
    if method in ("snapkv", "adakv_snapkv") or method.startswith("pyramidkv"):
        return set(range(length - WINDOW, length))  # the observation window
    sinks = method.startswith("kvzip") or method.endswith("expected_attention")
    return {"tova": {length - 1}}.get(method, set(range(SINK)) if sinks else set())


def jaccard(a, b, skip=frozenset()) -> float:
    a, b = set(a) - skip, set(b) - skip
    return 1.0 if not a | b else len(a & b) / len(a | b)


def compare_prefill(ours: dict, theirs: dict, prompts: dict) -> list[dict]:
    """Per method, budget and kvpress reading: mean / min Jaccard over prompts x layers x KV heads."""
    rows = {}
    for name, got in ours.items():
        length = len(prompts[name]["context"])
        for key, sets in got.items():
            method, b = key.split("/")
            # kvzip: also against each head's top-budget of kvpress's scores; pyramidkv: also at the ratio
            # whose float n_kept is exactly the budget (the listed deviations, neutralised)
            after = {"kvzip": "kvzip_uniform"}.get(
                method, f"{method}_exact" if "pyramidkv" in method else None
            )
            readings = [(method, key)] + ([(after, f"{after}/{b}")] if after else [])
            for label, their_key in readings:
                skip = protected(method, length)
                js = [
                    jaccard(e, k, skip)
                    for el, kl in zip(sets, theirs[name][their_key])
                    for e, k in zip(el, kl)
                ]
                rows.setdefault((label, int(b)), []).extend(js)
    return [
        {
            "method": m,
            "budget": b,
            "jaccard_mean": sum(js) / len(js),
            "jaccard_min": min(js),
            "identical": sum(j == 1.0 for j in js) / len(js),
            "heads": len(js),
        }
        for (m, b), js in sorted(rows.items())
    ]


# --- decode: snapkv_decode --------------------------------------------------------------------------------
def interval(budget: int) -> int:
    from evalkit.kv import SnapKVDecode

    return SnapKVDecode(budget=budget, window=WINDOW, pool_kernel=KERNEL).interval


@torch.no_grad()
def evalkit_decode(model, tok, prompt: dict, budgets, new: int, eos: list[int]) -> dict:
    """One engine run of snapkv_decode at every budget (rows of one batch, the prompt's prefill shared; the
    question, if any, fed as forced tokens, one per step): per budget the tokens and the kept sets at each
    re-selection (`refit_row` observed)."""
    from evalkit.engine import Engine, Request
    from evalkit.kv import SnapKVDecode
    from evalkit.kv import pool as kv_pool
    from evalkit.kv.generate import settings
    from evalkit.kv.prefill import PrefillRecord

    events, refit = {b: [] for b in budgets}, kv_pool.refit_row

    def observed(pool, r):
        refit(pool, r)
        method = pool._methods[r]
        for i, layer in enumerate(pool.layers):
            held = layer.pos[r, :, : method.target]
            events[method.budget].append((i, [sorted(h.tolist()) for h in held], int(pool._qpos[r].max())))

    config = settings(model, {"max_new_tokens": new, "do_sample": False})
    record, reqs = PrefillRecord(window=WINDOW), []
    for b in budgets:
        method = SnapKVDecode(budget=b, window=WINDOW, pool_kernel=KERNEL)
        req = Request(str(b), prompt["context"], new, method, config, 0, forced=list(prompt["question"]))
        req.min_new = new
        req.record, req.replay = (record, None) if not reqs else (None, record)
        reqs.append(req)
    kv_pool.refit_row = observed
    try:
        done = list(Engine(model, tok, eos, rows=len(reqs)).run(reqs))
    finally:
        kv_pool.refit_row = refit
    return {int(d.request.key): {"tokens": d.tokens, "events": events[int(d.request.key)]} for d in done}


def compare_decode(ours: dict, theirs: dict, prompts: dict) -> dict:
    """Per kvpress configuration: runs with identical tokens, and the kept-set Jaccard (window left out) at
    the re-selections both made before the first differing token, per run."""
    table = {}
    for key, mine in ours.items():
        name = key.split("/")[0]
        start = len(prompts[name]["context"]) + len(prompts[name]["question"])
        for label in [k.split("/")[-1] for k in theirs if k.startswith(key + "/")]:
            other = theirs[f"{key}/{label}"]
            same = next((i for i, (a, b) in enumerate(zip(mine["tokens"], other["tokens"])) if a != b), None)
            limit = start + (len(mine["tokens"]) if same is None else same)
            js = []
            for (layer, sets, cur), (layer2, sets2) in zip(mine["events"], other["events"]):
                if cur >= limit:
                    break
                assert layer == layer2, (key, label)
                window = frozenset(range(cur - WINDOW + 1, cur + 1))
                js += [jaccard(a, b, window) for a, b in zip(sets, sets2)]
            row = table.setdefault(label, {"runs": 0, "identical_tokens": 0, "per_run": []})
            row["runs"] += 1
            row["identical_tokens"] += same is None
            row["per_run"].append(
                {
                    "run": key,
                    "first_diff": same,
                    "reselections": len(js) // len(mine["events"][0][1]) if js else 0,  # layer x head sets
                    "jaccard": sum(js) / len(js) if js else None,
                }
            )
    return table


DECODE_CONFIGS = {  # kvpress patched to neutralise evalkit's listed deviations, all or all but one
    "neutralised": {"sort": True, "own_rotation": True, "question_steps": True},
    "rotation_left": {"sort": True, "own_rotation": False, "question_steps": True},
    "order_left": {"sort": False, "own_rotation": True, "question_steps": True},
    "question_left": {"sort": True, "own_rotation": True, "question_steps": False},
    "as_is": {"sort": False, "own_rotation": False, "question_steps": False},
}
QUERY_AWARE = ("neutralised", "rotation_left", "order_left", "as_is")  # no question fed: no question_steps
QUERY_AGNOSTIC = ("neutralised", "question_left")


def decode_mode(model, tok, folder: str, python: str, args) -> dict:
    """~1k-token prompts (RULER niah_single_1 x3, niah_multikey_2, natural text; --quick: one), query-aware
    (the whole prompt prefilled) and query-agnostic (the needle prompts' questions fed after the context)."""
    prompts = needle_prompts(tok, [("niah_single_1", 1024, 1 if args.quick else 3)])
    if not args.quick:
        prompts.update(needle_prompts(tok, [("niah_multikey_2", 1024, 1)]))
        prompts.update(natural_prompts(tok, [1024]))
    eos = sorted({model.generation_config.eos_token_id, tok.eos_token_id} - {None})
    out = {}
    for aware, labels in ((True, QUERY_AWARE), (False, QUERY_AGNOSTIC)):
        if aware:
            runs = {n: {"context": p["context"] + p["question"], "question": []} for n, p in prompts.items()}
        else:  # a question long enough to hold a re-selection: the needle prompts'
            runs = {n: p for n, p in prompts.items() if n.startswith("niah")}
        configs = {k: DECODE_CONFIGS[k] for k in (labels[:1] if args.quick else labels)}
        s = {
            "budgets": args.budgets, "window": WINDOW, "kernel": KERNEL, "new": args.new, "eos": eos,
            "interval": {str(b): interval(b) for b in args.budgets}, "configs": configs,
        }  # fmt: skip
        request = {"mode": "decode", "model": folder, "settings": s, "prompts": runs}
        theirs = run_kvpress(
            python, request, args.kept.with_suffix(f".{'aware' if aware else 'agnostic'}.pt")
        )
        ours = {}
        for name, p in runs.items():
            for b, got in evalkit_decode(model, tok, p, args.budgets, args.new, eos).items():
                ours[f"{name}/{b}"] = got
            print(f"evalkit decode {name}", flush=True)
        out["query_aware" if aware else "query_agnostic"] = compare_decode(ours, theirs, runs)
    return out


def prefill_mode(model, tok, folder: str, python: str, args) -> list[dict]:
    if args.quick:
        prompts = needle_prompts(tok, [("niah_single_1", 1024, 1)])
    else:
        prompts = needle_prompts(tok, [("niah_single_1", n, 1) for n in (1024, 2048, 4096)])
        prompts.update(needle_prompts(tok, [("niah_multikey_2", 2048, 1)]))
        prompts.update(natural_prompts(tok, [1024, 4096]))
    s = {"budgets": args.budgets, "sink": SINK, "future": FUTURE, "chunk": CHUNK, "check": True}
    s.update(window=WINDOW, kernel=KERNEL, alpha=ALPHA, betas=list(BETAS))
    request = {"mode": "prefill", "model": folder, "settings": s, "prompts": prompts}
    theirs = run_kvpress(python, request, args.kept.with_suffix(".pt"))
    ours = evalkit_prefill(model, tok, prompts, args.budgets)
    return compare_prefill(ours, theirs, prompts)


def markdown(mode: str, result) -> str:
    if mode == "prefill":
        lines = ["| method | budget | mean Jaccard | min | heads identical |", "|---|---|---|---|---|"]
        lines += [
            f"| {r['method']} | {r['budget']} | {r['jaccard_mean']:.4f} | {r['jaccard_min']:.3f} | "
            f"{r['identical']:.1%} |"
            for r in result
        ]
        return "\n".join(lines) + "\n"
    lines = []
    for setting, table in result.items():
        lines += [
            f"{setting}:",
            "| kvpress | identical tokens | Jaccard per run: min-max (mean) | layer re-selections compared |",
            "|---|---|---|---|",
        ]
        for label, row in table.items():
            js = [r["jaccard"] for r in row["per_run"] if r["jaccard"] is not None]
            span = f"{min(js):.3f}-{max(js):.3f} ({sum(js) / len(js):.3f})" if js else "-"
            n = sum(r["reselections"] for r in row["per_run"])
            lines.append(f"| {label} | {row['identical_tokens']}/{row['runs']} | {span} | {n} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["prefill", "decode"])
    ap.add_argument("--kvpress-python", default=None)
    ap.add_argument("--budgets", type=lambda v: [int(x) for x in v.split(",")], default=None)
    ap.add_argument("--new", type=int, default=100, help="decode: tokens generated per run")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    python = kvpress_python(args.kvpress_python)
    if args.budgets is None:  # decode: budgets whose interval (max(budget / 4, window + 1)) fits --new often
        full, quick = ([128, 256, 512], [128, 256]) if args.mode == "prefill" else ([96, 128, 192], [128])
        args.budgets = quick if args.quick else full
    from transformers.utils import logging as hf_logging

    from evalkit.config import model_spec
    from evalkit.loading import load_model
    from evalkit.sources import resolve_source

    hf_logging.disable_progress_bar()
    spec = model_spec("smollm2_135m")
    model, tok = load_model(spec)
    folder = resolve_source(spec)
    out = args.out or ROOT / "results/kvpress" / args.mode
    out.parent.mkdir(parents=True, exist_ok=True)
    args.kept = out.with_name(out.name + ".kvpress")  # kvpress's kept sets, reused for the same request
    result = (prefill_mode if args.mode == "prefill" else decode_mode)(model, tok, folder, python, args)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(args.mode, result))
    print(markdown(args.mode, result))
    return result


if __name__ == "__main__":
    main()
