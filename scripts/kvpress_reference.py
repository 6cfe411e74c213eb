"""The kvpress side of `scripts/kvpress_side_by_side.py`: run in kvpress 0.5.5's own venv (it pins
transformers < 5.3), never imported by evalkit. It reads `request.json` from a work folder (token ids,
settings), runs kvpress's presses on the same model folder and writes the kept sets to `kvpress.pt`.

    /work/wt/kvpress-venv/bin/python scripts/kvpress_reference.py WORK

Prefill (`mode: prefill`): one forward of each prompt with a hook on every attention layer that calls each
press's own `score(module, hidden_states, keys, values, attentions, kwargs)` exactly as `ScorerPress.compress`
does (the prefill presses never change the forward, so one forward serves them all), and the kept sets are
`scores.topk(n_kept)` with kvpress's `compute_n_kept` at the ratio that keeps `budget` entries (checked once
per prompt against a real `with press(model)` prefill). KVzip runs its own `with press(model)` on the same
forward; its kept sets are read from `masked_key_indices` after `compress_post` (kvpress's global choice over
layers and heads), and also as each head's top-`budget` of the same scores (the uniform budget).

Decode (`mode: decode`): `DecodingPress(SnapKVPress)` after a prefill `SnapKVPress` (kvpress's
`PrefillDecodingPress`), greedy, EOS suppressed for `new` tokens, the kept positions recorded at every
compression. `ScorerPress.compress` is replaced by the same lines plus bookkeeping; the options neutralise
evalkit's listed deviations one at a time: `sort` (kept entries in position order, not topk order),
`own_rotation` (each buffered window query rotated at its own position, not the current token's) and
`question_steps` (a query_aware=false question fed one token per forward, each a decode step).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import torch
from kvpress import (
    AdaKVPress,
    DecodingPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    KVzipPress,
    PyramidKVPress,
    SnapKVPress,
    TOVAPress,
)
from kvpress.presses.base_press import is_prefilling
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept, extract_keys_and_values
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.utils import logging as hf_logging


def ratio_for(length: int, keep: int) -> float:
    """The compression ratio at which kvpress keeps exactly `keep` of `length` entries."""
    if keep >= length:
        return 0.0
    r = 1.0 - (keep + 0.5) / length
    assert compute_n_kept(length, r) == keep, (length, keep, r)
    return r


def load(folder: str):
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


# --- prefill ---------------------------------------------------------------------------------------------
def scorer_presses(s: dict) -> dict:
    return {
        "knorm": KnormPress(),
        "keydiff": KeyDiffPress(),
        "tova": TOVAPress(),
        "expected_attention": ExpectedAttentionPress(n_future_positions=s["future"], n_sink=s["sink"]),
        "snapkv": SnapKVPress(window_size=s["window"], kernel_size=s["kernel"]),
    }


class Captured(ScorerPress):
    """A ScorerPress whose `score` is a captured one (layer -> (H_kv, T)): AdaKVPress and PyramidKVPress then
    run their own allocation over exactly the scores their inner press gave in the prefill."""

    def __init__(self, scores: dict, compression_ratio: float):
        super().__init__(compression_ratio=compression_ratio)
        self.scores = scores

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return self.scores[module.layer_idx][None].clone()  # (1, H_kv, T)


def adakv_sets(model, scores: dict, keep: int, length: int, alpha: float) -> list[list[list[int]]]:
    """AdaKVPress(inner).compress on the inner press's captured scores: the kept sets are the complement of
    `masked_key_indices` (its bottom-k over all heads of a layer, after the `alpha_safeguard` floor)."""
    press = AdaKVPress(Captured(scores, ratio_for(length, keep)), alpha_safeguard=alpha)
    out = []
    for layer in model.model.layers:
        press.compress(layer.self_attn, None, None, None, None, {})
        _, heads, cols = layer.self_attn.masked_key_indices
        h_kv = scores[layer.self_attn.layer_idx].shape[0]
        pruned = [set(cols[heads == h].tolist()) for h in range(h_kv)]
        out.append([[j for j in range(length) if j not in p] for p in pruned])
        del layer.self_attn.masked_key_indices
    return out


def pyramid_sets(model, scores: dict, keep: int, length: int, s: dict, beta: int, exact: bool = False):
    """PyramidKVPress.compress: `get_layer_budget(module, k_len)` entries per head by SnapKV's scores, at the
    ratio 1 - keep / length, whose n_kept (q_len x (1 - ratio), a float) is `keep` up to rounding; `exact`:
    the ratio nudged until that float is `keep` or just above (evalkit's exact arithmetic)."""
    ratio = 1 - keep / length
    while exact and length * (1 - ratio) < keep:
        ratio = math.nextafter(ratio, 0.0)
    press = PyramidKVPress(
        compression_ratio=ratio, window_size=s["window"], kernel_size=s["kernel"], beta=beta
    )
    out = []
    for layer in model.model.layers:
        n = press.get_layer_budget(layer.self_attn, length)
        out.append(sorted_rows(scores[layer.self_attn.layer_idx].topk(n, dim=-1).indices))
    return out


def prefill_scores(model, ids: torch.Tensor, s: dict, first_ratio: float):
    """One prefill: every scorer press's scores per layer (hook), and KVzip's scores and press."""
    presses, scores, hooks = scorer_presses(s), {}, []
    decoder = model.model

    def hook(module, inputs, kwargs, output):
        hidden = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden.shape[1]):
            return output  # KVzip's reconstruction forwards
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for name, press in presses.items():
            got = press.score(module, hidden, keys, values, output[1], kwargs)  # (1, H_kv, T)
            scores.setdefault(name, {})[module.layer_idx] = got[0].float().clone()
        return output

    for layer in decoder.layers:
        layer.self_attn.rotary_emb = decoder.rotary_emb  # as BasePress.__call__ sets it
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    kvzip = KVzipPress(compression_ratio=first_ratio, n_sink=s["sink"], chunk_size=s["chunk"])
    saved = {}
    post = kvzip.compress_post

    def keep_scores(m):
        saved["scores"] = kvzip.score_val.clone()  # (L, 1, H_kv, T) before the sinks are raised
        post(m)

    kvzip.compress_post = keep_scores
    try:
        with torch.no_grad(), kvzip(model):
            decoder(input_ids=ids, past_key_values=DynamicCache())  # kvpress pipeline's prefill call
    finally:
        for h in hooks:
            h.remove()
    return scores, kvzip, saved["scores"]


def topk_sets(scores: dict, keep: int, length: int) -> list[list[list[int]]]:
    """ScorerPress.compress: `indices = scores.topk(n_kept, dim=-1).indices` per layer and KV head."""
    n_kept = compute_n_kept(length, ratio_for(length, keep))
    return [sorted_rows(scores[i].topk(n_kept, dim=-1).indices) for i in range(len(scores))]


def sorted_rows(indices: torch.Tensor) -> list[list[int]]:
    return [sorted(row.tolist()) for row in indices]


def kvzip_sets(model, kvzip, score_val, keep: int, length: int):
    """(kvpress's own kept sets: compress_post's global choice, read from masked_key_indices; each head's
    top-`keep` of the same scores, sinks first, as a uniform budget keeps)."""
    kvzip.score_val, kvzip.compression_ratio = score_val.clone(), ratio_for(length, keep)
    kvzip.compress_post(model)
    own = []
    for layer in model.model.layers:
        _, heads, cols = layer.self_attn.masked_key_indices
        h_kv = score_val.shape[2]
        pruned = [set(cols[heads == h].tolist()) for h in range(h_kv)]
        own.append([[j for j in range(length) if j not in p] for p in pruned])
    raised = score_val.clone()
    raised[..., : kvzip.n_sink] = raised.amax() + 1.0
    uniform = [sorted_rows(raised[i, 0].topk(keep, dim=-1).indices) for i in range(raised.shape[0])]
    return own, uniform


def check_against_press(model, ids, scores, s: dict, keep: int) -> None:
    """The captured scores give what a real `with press(model)` prefill keeps (ExpectedAttention: the
    pruned cache's keys are the full keys at the captured indices)."""
    full = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=full)
    length = ids.shape[1]
    press = ExpectedAttentionPress(
        compression_ratio=ratio_for(length, keep), n_future_positions=s["future"], n_sink=s["sink"]
    )
    pruned = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=pruned)
    sets = topk_sets(scores["expected_attention"], keep, length)
    for i, layer in enumerate(full.layers):
        want = [set(map(tuple, layer.keys[0, h, idx].tolist())) for h, idx in enumerate(sets[i])]
        got = [set(map(tuple, k.tolist())) for k in pruned.layers[i].keys[0]]
        assert want == got, f"captured kept set differs from the press's at layer {i}"


def run_prefill(model, req: dict) -> dict:
    s, out = req["settings"], {}
    for name, prompt in req["prompts"].items():
        ids = torch.tensor([prompt["context"]])
        length = ids.shape[1]
        budgets = [b for b in s["budgets"] if b < length]
        scores, kvzip, score_val = prefill_scores(model, ids, s, ratio_for(length, budgets[0]))
        if s.get("check") and not out:  # the first prompt: the capture equals a real press prefill
            check_against_press(model, ids, scores, s, budgets[0])
        got = {}
        for b in budgets:
            for method in scores:
                got[f"{method}/{b}"] = topk_sets(scores[method], b, length)
            got[f"kvzip/{b}"], got[f"kvzip_uniform/{b}"] = kvzip_sets(model, kvzip, score_val, b, length)
            for inner in ("snapkv", "expected_attention"):
                got[f"adakv_{inner}/{b}"] = adakv_sets(model, scores[inner], b, length, s["alpha"])
            for beta in s["betas"]:
                label, snap = f"pyramidkv_snapkv_beta{beta}", scores["snapkv"]
                got[f"{label}/{b}"] = pyramid_sets(model, snap, b, length, s, beta)
                got[f"{label}_exact/{b}"] = pyramid_sets(model, snap, b, length, s, beta, exact=True)
        out[name] = got
        print(f"kvpress prefill {name}: {length} tokens", flush=True)
    return out


# --- decode: DecodingPress(SnapKVPress) -------------------------------------------------------------------
class Tracker:
    """Storage-order positions of each layer's cache and the kept sets at every compression."""

    def __init__(self, sort: bool, own_rotation: bool):
        self.sort, self.own_rotation = sort, own_rotation
        self.pos: dict[int, torch.Tensor] = {}  # layer -> (H, n) positions in storage order
        self.events: list[
            tuple[int, list[list[int]]]
        ] = []  # (layer, kept positions per head) per compression
        self.cur = 0  # position of the current forward's last token

    def compress(self, press, module, hidden_states, keys, values, attentions, kwargs):
        """ScorerPress.compress with bookkeeping (and, with `sort`, the kept entries in position order)."""
        if press.compression_ratio == 0:
            return keys, values
        self.cur = int(kwargs["position_ids"][0, -1])
        scores = press.score(module, hidden_states, keys, values, attentions, kwargs)
        k_len = keys.shape[2]
        indices = scores.topk(compute_n_kept(k_len, press.compression_ratio), dim=-1).indices
        if self.sort:
            indices = indices.sort(dim=-1).values
        layer = module.layer_idx
        pos = self.pos.get(layer, torch.arange(0).expand(keys.shape[1], 0))
        new = k_len - pos.shape[1]  # appended since the last compression: consecutive up to `cur`
        pos = torch.cat([pos, torch.arange(self.cur - new + 1, self.cur + 1).expand(keys.shape[1], new)], 1)
        self.pos[layer] = pos.gather(1, indices[0])
        self.events.append((layer, sorted_rows(self.pos[layer])))
        gather = indices.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
        return keys.gather(2, gather).contiguous(), values.gather(2, gather).contiguous()

    def window_attention(self, original, module, hidden_states, keys, window_size, position_embeddings):
        """SnapKVPress.compute_window_attention; with `own_rotation`, a decode window's queries rotated at
        their own positions (kvpress rotates them all at the current token's)."""
        cos, _ = position_embeddings
        if self.own_rotation and cos.shape[1] < window_size:
            positions = torch.arange(self.cur - window_size + 1, self.cur + 1)[None]
            position_embeddings = module.rotary_emb(hidden_states, positions)
        return original(module, hidden_states, keys, window_size, position_embeddings)


def patched(tracker: Tracker):
    """Route ScorerPress.compress and SnapKVPress.compute_window_attention through the tracker."""
    original = SnapKVPress.compute_window_attention
    ScorerPress.compress = lambda self, *a: tracker.compress(self, *a)
    SnapKVPress.compute_window_attention = staticmethod(lambda *a: tracker.window_attention(original, *a))
    return original


def reorder(cache, tracker: Tracker) -> None:
    """Put every layer's prefill-kept entries in position order (the cache and the tracker alike)."""
    for i, layer in enumerate(cache.layers):
        if i not in tracker.pos:
            continue
        perm = tracker.pos[i].argsort(dim=-1)  # (H, n)
        tracker.pos[i] = tracker.pos[i].gather(1, perm)
        g = perm[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
        layer.keys, layer.values = layer.keys.gather(2, g), layer.values.gather(2, g)


def prefilled(model, ids, s: dict, budget: int):
    """kvpress's prefill SnapKVPress down to the decode target: (cache, last logits, kept positions)."""
    target, length = budget - s["interval"][str(budget)], ids.shape[1]
    tracker = Tracker(sort=False, own_rotation=False)
    original = patched(tracker)
    try:
        press = SnapKVPress(ratio_for(length, target), window_size=s["window"], kernel_size=s["kernel"])
        cache = DynamicCache()
        with torch.no_grad(), press(model):
            logits = model(input_ids=ids, past_key_values=cache, logits_to_keep=1).logits
    finally:
        SnapKVPress.compute_window_attention = staticmethod(original)
    return cache, logits, tracker.pos


def decode_run(model, start, question: list[int], s: dict, budget: int, config: dict) -> dict:
    """Greedy decode under DecodingPress(SnapKVPress) from a copy of the prefilled `start`: the tokens and
    the kept sets at every compression."""
    interval, window, kernel = s["interval"][str(budget)], s["window"], s["kernel"]
    cache, logits, pos = copy.deepcopy(start)
    tracker = Tracker(sort=False, own_rotation=config["own_rotation"])
    tracker.pos = pos
    if config["sort"]:
        reorder(cache, tracker)
    tracker.sort = config["sort"]
    original = patched(tracker)
    press = DecodingPress(
        SnapKVPress(window_size=window, kernel_size=kernel),
        compression_interval=interval,
        target_size=budget - interval,
    )
    tokens, at, eos = [], s["length"], s["eos"]
    feed = [[t] for t in question] if config["question_steps"] else [question] if question else []
    try:
        with torch.no_grad(), press(model):
            for chunk in feed:  # the question: one forward, or one per token (each a decode step)
                positions = torch.arange(at, at + len(chunk))[None]
                logits = model(
                    input_ids=torch.tensor([chunk]), past_key_values=cache, position_ids=positions
                ).logits
                at += len(chunk)
            while True:
                step = logits[0, -1].clone()
                step[eos] = float("-inf")  # the run's length is fixed: EOS suppressed, as evalkit's min_new
                tokens.append(int(step.argmax()))
                if len(tokens) == s["new"]:
                    break
                ids = torch.tensor([[tokens[-1]]])
                logits = model(input_ids=ids, past_key_values=cache, position_ids=torch.tensor([[at]])).logits
                at += 1
    finally:
        SnapKVPress.compute_window_attention = staticmethod(original)
    return {"tokens": tokens, "events": tracker.events}


def run_decode(model, req: dict) -> dict:
    s, out = req["settings"], {}
    compress = ScorerPress.compress
    try:
        for name, prompt in req["prompts"].items():
            ids = torch.tensor([prompt["context"]])
            for budget in s["budgets"]:
                start = prefilled(model, ids, s, budget)
                for label, config in s["configs"].items():
                    settings = {**s, "length": ids.shape[1]}
                    out[f"{name}/{budget}/{label}"] = decode_run(
                        model, start, prompt["question"], settings, budget, config
                    )
                print(f"kvpress decode {name} budget {budget}", flush=True)
    finally:
        ScorerPress.compress = compress
    return out


def main(work: str) -> None:
    req = json.loads((Path(work) / "request.json").read_text())
    torch.manual_seed(0)
    model = load(req["model"])
    out = run_prefill(model, req) if req["mode"] == "prefill" else run_decode(model, req)
    torch.save(out, Path(work) / "kvpress.pt")


if __name__ == "__main__":
    main(sys.argv[1])
