"""The one documented helper: generate with fresh compressed caches and return their statistics.

It decodes through the engine (`evalkit.engine`), the runner's own decode path: each row of the batch is a
request, prefilled alone into its own compressed cache and decoded in a row of one static slot pool, so the
library call, the demo, the benches and `make eval` share one decode. `compile=True` runs the decode step
through transformers' compiled forward (`compile_config`), compiled once per (rows, slots) shape; the prefill
(and SnapKV's compression) stays eager.
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from evalkit.kv.figures import summed
from evalkit.kv.static import compile_config  # re-exported: how a decode step compiles

# transformers settings the engine does not implement, with the value that means "off"
UNSUPPORTED = dict(
    num_beams=1,
    num_return_sequences=1,
    repetition_penalty=1.0,
    no_repeat_ngram_size=0,
    min_p=None,
    typical_p=1.0,
    epsilon_cutoff=0.0,
    eta_cutoff=0.0,
    bad_words_ids=None,
    suppress_tokens=None,
    begin_suppress_tokens=None,
    stop_strings=None,
    sequence_bias=None,
    forced_bos_token_id=None,
    forced_eos_token_id=None,
    guidance_scale=None,
    exponential_decay_length_penalty=None,
    prefill_chunk_size=None,
    output_scores=False,
    output_attentions=False,
    output_hidden_states=False,
)


def settings(model, gen_kwargs: dict) -> GenerationConfig:
    """`model.generate`'s generation config for these kwargs; settings the engine cannot honour are
    refused."""
    config = copy.deepcopy(gen_kwargs.pop("generation_config", None) or model.generation_config)
    unknown = config.update(**gen_kwargs)
    if unknown:
        raise ValueError(f"evalkit.kv.generate: unknown generation settings {sorted(unknown)}")
    for name, off in UNSUPPORTED.items():
        if getattr(config, name, off) not in (off, None):
            raise ValueError(
                f"evalkit.kv.generate: {name}={getattr(config, name)!r} is not supported (greedy or sampled "
                "decoding, one forward per token after a whole-prompt prefill); leave it unset"
            )
    if not isinstance(config.max_new_tokens, int) or config.max_new_tokens < 1:
        raise ValueError(
            f"evalkit.kv.generate: pass max_new_tokens (a positive integer), got {config.max_new_tokens!r}"
        )
    return config


@torch.inference_mode()
def generate(
    model,
    input_ids: torch.Tensor,
    method,
    attention_mask: torch.Tensor | None = None,
    compile: bool = False,
    tokenizer=None,
    storage=None,
    **gen_kwargs,
):
    """Generate from each row of a (left-padded) batch with its own `method` cache, through the engine;
    returns (sequences (B, T + new), stats).

    Greedy or sampled, as `gen_kwargs` (transformers' settings) say; sampled rows draw their seeds from
    torch's global generator. `return_dict_in_generate=True` returns transformers' output (with `logits` when
    `output_logits=True`: one (B, V) float32 tensor per step, zeros for rows already done). Rows that end
    early are padded with `pad_token_id`. `stats` holds the KV figures (`batch_stats`), `stats["rows"]` each
    row's. `storage`: how the caches hold K/V (`evalkit.kv.storage`, default the model dtype).
    `compile=True`: the decode step compiled (`compile_config` unless `gen_kwargs` has a
    `compile_config`). `tokenizer`: for a method whose prefill runs text of its own (`kvzip`).
    """
    from evalkit.engine import Engine
    from evalkit.turns import ask

    compiled = gen_kwargs.pop("compile_config", None) or compile_config(model)
    if compile and gen_kwargs.get("prefill_chunk_size") is not None:
        raise ValueError("compile: chunked prefill is not supported (the prefill compresses in one forward)")
    config = settings(model, gen_kwargs)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    eos = config.eos_token_id if config.eos_token_id is not None else []
    eos = [eos] if isinstance(eos, int) else list(eos)
    seeds = torch.randint(0, 2**62, (len(input_ids),)).tolist() if config.do_sample else [0] * len(input_ids)
    requests = [
        ask(
            str(r),
            row[mask.bool()].tolist(),
            config.max_new_tokens,
            method,
            config,
            seeds[r],
            min_new=config.min_new_tokens or 0,
            keep_logits=bool(config.output_logits),
            tag=r,
        )
        for r, (row, mask) in enumerate(zip(input_ids, attention_mask))
    ]
    held = (
        {} if storage is None else {"storage": storage}
    )  # an `evalkit.kv.storage` object; None: the model's
    engine = Engine(model, tokenizer, eos, len(requests), compile=compiled if compile else False, **held)
    done = sorted(engine.run(requests), key=lambda d: d.tag)
    pad = config.pad_token_id if config.pad_token_id is not None else (eos or [0])[0]
    sequences = _padded([d.tokens for d in done], pad, input_ids)
    stats = batch_stats(done, engine)
    if not config.return_dict_in_generate:
        return sequences, stats
    logits = None
    if config.output_logits:
        steps = range(sequences.shape[1] - input_ids.shape[1])
        logits = tuple(torch.stack([_logit(d.logits, s) for d in done]) for s in steps)
    return GenerateDecoderOnlyOutput(sequences=sequences, logits=logits), stats


def _logit(logits: list[torch.Tensor], step: int) -> torch.Tensor:
    """A row's (V,) logits at `step`, zeros once it has ended."""
    return logits[step] if step < len(logits) else torch.zeros_like(logits[0])


def _padded(tokens: list[list[int]], pad: int, input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T + longest) the prompts followed by each row's tokens, `pad` after a row's end."""
    width = max(len(t) for t in tokens)
    new = torch.tensor([t + [pad] * (width - len(t)) for t in tokens], dtype=input_ids.dtype)
    return torch.cat([input_ids, new.to(input_ids.device)], 1)


def batch_stats(done: list, engine) -> dict:
    """Tokens seen, kept and evicted and bytes held, totals over the rows, per layer and per row (`rows`), as
    each row stood when it ended. `slots`: the most slots a row held (= budget for ring methods);
    `reserved_bytes`: the engine's whole slot pool; `shapes`: the (rows, slots, visible) shapes its decode
    step ran in (the graphs a compiled step compiled: one per bucket reached)."""
    rows = [
        {
            "seen": d.stats["kv_seen"],
            "kept": d.stats["kv_kept"],
            "evicted": d.stats["kv_seen"] - d.stats["kv_kept"],
            "evicted_generated": d.stats["kv_evicted_generated"],
            "slots": d.stats["kv_slots"],
            "bytes": d.stats["kv_bytes"],
            "ragged_bytes": d.stats["kv_ragged_bytes"],
            "layer_bytes": d.layer_bytes,
        }
        for d in done
    ]
    total, per_layer = summed(
        rows
    )  # each row's bytes of a layer as it ended: its slots, the storage's tensors
    reserved = engine.pool.allocated_bytes() if engine.pool is not None else total["bytes"]
    return {
        **total,
        "slots": max(r["slots"] for r in rows),
        "reserved_bytes": reserved,
        "shapes": sorted(engine.shapes),
        "per_layer": per_layer,
        "rows": rows,
    }
