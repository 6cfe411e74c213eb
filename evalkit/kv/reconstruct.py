"""KVzip's reconstruction pass (Kim et al., 2025, arXiv 2505.23416; kvpress 0.5.5 `KVzipPress`), run inside
the engine's prefill before the prompt is compressed.

The prompt is prefilled into a full cache (`ReconstructionCache`, recording what a shared prefill records:
`prefill.PrefillRecord`); then the model is asked to repeat it: for each chunk of `chunk` prompt tokens (after
the chat template's prefix) the input "\\n\\nRepeat the previous context exactly." (later chunks: "...
starting with" and the previous chunk's last 8 tokens), the chat template's end of user turn and assistant
start, then the chunk itself, is run on that cache. Each layer scores the chunk's entries by the attention the
repeating queries pay them, softmaxed over the sinks, the chunk and the repeat input only (kvpress's
`_compute_cross_attention`), the max over the queries and the heads sharing a KV head. The repeat input's
entries are dropped after each chunk. The scores ride in the record (`record.hints`), and the method's cache
is then populated from the record as a replayed budget is (`prefill.populate`): the budgets of a budget list
share the prompt's prefill and its reconstruction pass, since the scores do not depend on the budget.

Where it cannot run (refused before the model loads, `KVzip.refusal`): MLA models (attention rebuilds the
keys from a latent, so there are no per-head keys to record). Under tensor parallelism every rank runs the
pass's forwards in step (the same prompt and repeat inputs) and scores the KV heads it holds. It needs the
tokenizer (the repeat prompt is text) and prefills one prompt at a time, as the engine does.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from evalkit.kv.attention import hand_off
from evalkit.kv.prefill import PrefillRecord, populate

FIRST = "\n\nRepeat the previous context exactly."
NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
OVERLAP = 8  # tokens of the previous chunk that start the next chunk's request (kvpress `prev_postfix_size`)


def template_parts(tokenizer) -> tuple[list[int], list[int]]:
    """(prefix ids, suffix ids): what the chat template puts before a user message and after it up to the
    assistant's answer (kvpress renders a dummy message); no chat template: nothing and a newline."""
    if getattr(tokenizer, "chat_template", None) is None:
        return [], tokenizer.encode("\n", add_special_tokens=False)
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": dummy + separator}],
        add_generation_prompt=True,
        tokenize=False,
        enable_thinking=False,
    )
    context, suffix = text.split(separator)
    prefix = context.split(dummy)[0]
    return tokenizer.encode(prefix, add_special_tokens=False), tokenizer.encode(
        suffix, add_special_tokens=False
    )


def repeat_inputs(tokenizer, ids: list[int], chunk: int) -> list[tuple[int, int, list[int]]]:
    """[(start, end, repeat ids)]: the prompt's columns [start, end) each pass reconstructs, and its input.

    The prompt is reconstructed after the chat template's prefix when it starts with it (kvpress passes the
    context rendered in the template), else from its first token."""
    prefix, suffix = template_parts(tokenizer)
    start = len(prefix) if prefix and ids[: len(prefix)] == prefix else 0
    out, prev = [], None
    for a in range(start, len(ids), chunk):
        part = ids[a : a + chunk]
        ask = tokenizer.encode(FIRST if prev is None else NEXT, add_special_tokens=False)
        ask += [] if prev is None else prev[-OVERLAP:]
        out.append((a, a + len(part), ask + suffix + part))
        prev = part
    return out


class _Layer(DynamicLayer):
    """A full-cache layer that hands itself to attention after every update, so `observe` sees the queries."""

    pending = True  # what the attention hand-off reads: call `compress` with this forward's queries

    def __init__(self, idx: int, owner: ReconstructionCache):
        super().__init__()
        self.layer_idx, self.owner = idx, owner

    def update(self, key_states, value_states, *args, **kwargs):
        hand_off(self)
        return super().update(key_states, value_states, *args, **kwargs)

    def compress(self, query, keys, attention_mask, scaling: float) -> None:
        self.owner.observe(self, query, keys, attention_mask, scaling)


class ReconstructionCache(Cache):
    """The prompt's full cache: its first forward records the prompt (`record`), each later one scores the
    chunk `span` = (start, end) into `scores` (L, B, H_kv, T) and is then dropped."""

    def __init__(self, num_layers: int, record: PrefillRecord, sink: int):
        self.record, self.sink = record, sink
        self.span: tuple[int, int] | None = None  # None: the prompt's own forward
        self.scores: list[torch.Tensor] = []
        super().__init__(layers=[_Layer(i, self) for i in range(num_layers)])

    def observe(self, layer: _Layer, query, keys, attention_mask, scaling: float) -> None:
        if self.span is None:
            self.record.add(layer.layer_idx, layer.keys, layer.values, query, keys, attention_mask, scaling)
            if not self.record.usable:
                raise ValueError("kvzip: this model's attention rebuilds its keys (MLA): nothing to score")
            self.scores.append(keys.new_zeros(keys.shape[:3], dtype=torch.float32))  # (B, H_kv, T)
            return
        start, end = self.span
        self.scores[layer.layer_idx][:, :, start:end] = chunk_scores(
            query, keys, start, end, self.sink, scaling
        )

    def drop_repeat(self, t: int) -> None:
        """Back to the prompt's t columns after a reconstruction forward."""
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[:, :, :t], layer.values[:, :, :t]


def chunk_scores(query, keys, start: int, end: int, sink: int, scaling: float) -> torch.Tensor:
    """(B, H_kv, end - start): the max attention the repeating queries pay each entry of the chunk.

    query (B, H_q, q, D) post-RoPE, the repeat input; keys (B, H_kv, T + q, D): the prompt then the input. The
    softmax runs over the first min(sink, start) entries, the chunk and the input (causal among the input)."""
    b, h_q, q, d = query.shape
    h_kv = keys.shape[1]
    s = min(sink, start)
    sub = torch.cat([keys[:, :, :s], keys[:, :, start:end], keys[:, :, -q:]], dim=2).float()  # (B, H, n, D)
    qs = query.float().view(b, h_kv, h_q // h_kv, q, d)
    logits = torch.matmul(qs, sub.unsqueeze(2).transpose(-1, -2)) * scaling  # (B, H, g, q, n)
    later = torch.ones(q, q, dtype=torch.bool, device=query.device).triu(1)  # input key after input query
    logits[..., -q:] = logits[..., -q:].masked_fill(later, float("-inf"))
    probs = torch.softmax(logits, dim=-1)[..., s : s + end - start]
    return probs.amax(dim=(2, 3))


@torch.inference_mode()
def prefill_with_reconstruction(method, forward, cache, tokenizer, kwargs: dict):
    """The prompt's forward into a full cache, the reconstruction passes, then `cache` populated from the
    record with the scores (`KVzip.prefill`)."""
    ids = kwargs["input_ids"]
    if ids.shape[0] != 1:
        raise ValueError("kvzip: the reconstruction pass prefills one prompt at a time (as the engine does)")
    if tokenizer is None:
        raise ValueError(
            "kvzip: the reconstruction prompt is text, so the engine needs the tokenizer "
            "(evalkit.kv.generate(..., tokenizer=tok))"
        )
    record = cache.record if cache.record is not None else PrefillRecord(window=1)
    full = ReconstructionCache(len(cache.layers), record, method.sink)
    key = "cache" if "cache" in kwargs else "past_key_values"
    out = forward(**{**kwargs, key: full})
    t = ids.shape[1]
    for start, end, repeat in repeat_inputs(tokenizer, ids[0].tolist(), method.chunk):
        full.span = (start, end)
        forward(input_ids=torch.tensor([repeat], device=ids.device), **{key: full}, use_cache=True)
        full.drop_repeat(t)
    record.keep_scores(cache.method, dict(enumerate(full.scores)))
    record.logits = out.logits[:, -1:].clone()
    populate(cache, record)
    return CausalLMOutputWithPast(logits=out.logits, cache=cache)
