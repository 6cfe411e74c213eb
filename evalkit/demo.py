"""Needle in a haystack on the embedded model: which KV methods still retrieve a number hidden mid-prompt?

`python -m evalkit.demo [--length 1500] [--budget 256] [-n 3]` prints, per method, what it retrieved, the KV
entries it kept and the bytes its cache held. The prompt follows RULER's niah_single_1 (noise haystack).
"""

from __future__ import annotations

import argparse
import random

import torch

from evalkit.sample import render
from tasks.ruler.constants import NIAH_NEEDLE, NIAH_PREFIX, NIAH_TEMPLATE, NOISE
from tasks.ruler.generate import singular

# RULER's niah_single_1 with one number: its template, answer prefix and needle, upstream's singular rewrite
TEMPLATE = singular(NIAH_TEMPLATE).replace("{type_needle_v}", "number")
PREFIX = singular(NIAH_PREFIX).replace("{type_needle_v}", "number")
KEYS = ["amber-harbor", "quiet-falcon", "silver-meadow", "brisk-lantern", "velvet-canyon", "hollow-orchard"]


def needle_sample(tokenizer, length: int, seed: int) -> tuple[str, str]:
    """(rendered prompt of about `length` tokens, the 7-digit answer) with the needle in the middle."""
    rng = random.Random(seed)
    key, value = rng.choice(KEYS), str(rng.randint(10**6, 10**7 - 1))
    needle = NIAH_NEEDLE.format(type_needle_v="numbers", key=key, value=value)
    per_line = len(tokenizer(NOISE + "\n", add_special_tokens=False)["input_ids"])
    lines = [NOISE] * max(1, (length - 120) // per_line)
    lines.insert(len(lines) // 2, needle)
    return render(
        tokenizer, TEMPLATE.format(context="\n".join(lines), query=key), PREFIX.format(query=key)
    ), value


@torch.inference_mode()
def run(model, tokenizer, methods, length: int = 1500, n: int = 3, max_new_tokens: int = 12) -> list[dict]:
    from evalkit.kv import generate

    prompts = []  # the same n prompts for every method
    for seed in range(n):
        text, value = needle_sample(tokenizer, length, seed)
        prompts.append(
            (seed, tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"], value)
        )
    rows = []
    for method in methods:
        for seed, ids, value in prompts:
            out, stats = generate(model, ids, method, max_new_tokens=max_new_tokens, do_sample=False)
            answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            rows.append(
                {
                    "method": method.name,
                    "budget": getattr(method, "budget", None),
                    "seed": seed,
                    "prompt_tokens": ids.shape[1],
                    "expected": value,
                    "answer": answer.strip(),
                    "retrieved": value in answer,
                    "kept_entries": stats["slots"],
                    "kv_bytes": stats["bytes"],
                }
            )
    return rows


def parse_args(argv: list[str] | None = None):
    """(arguments, methods), every value checked before the model loads: a bad one is a usage error."""
    from evalkit.config import ConfigError, check_choice
    from evalkit.kv.config import make_method

    ap = argparse.ArgumentParser(prog="python -m evalkit.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m", help="a model conf name (conf/model/)")
    ap.add_argument("--length", type=int, default=1500, help="prompt tokens (more than --budget)")
    ap.add_argument("--budget", type=int, default=256, help="KV entries kept per layer and head")
    ap.add_argument("-n", type=int, default=3, help="prompts (needles) per method")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error(f"-n must be at least 1, got {args.n}")
    if args.length <= args.budget:
        ap.error(
            f"--length ({args.length}) must exceed --budget ({args.budget}): a prompt that fits is not "
            "compressed"
        )
    try:
        check_choice("model", args.model)
        methods = [make_method("full")] + [
            make_method(name, budget=args.budget) for name in ("streamingllm", "snapkv", "snapstream")
        ]
    except ConfigError as e:
        ap.error(str(e))
    return args, methods


def main(argv: list[str] | None = None) -> None:
    from evalkit.config import ConfigError, model_spec
    from evalkit.errors import EvalkitError, exit_with
    from evalkit.loading import load_model
    from evalkit.sources import context_length, model_config, resolve_source

    args, methods = parse_args(argv)
    try:
        spec = model_spec(args.model)
        context = context_length(spec, model_config(spec, resolve_source(spec)))
        if args.length > context:  # refused before the weights load, as the runner refuses long lengths
            raise ConfigError(f"--length ({args.length}) exceeds {args.model}'s context of {context} tokens")
        model, tokenizer = load_model(spec)
    except EvalkitError as e:  # missing weights, no hub access: the message says what to do
        exit_with("python -m evalkit.demo", e)
    print(f"{'method':<13}{'budget':>7}  {'expected':>9}  {'answer':<28}{'kept':>6}{'KV bytes':>12}")
    for r in run(model, tokenizer, methods, args.length, args.n):
        mark = "ok  " if r["retrieved"] else "MISS"
        print(
            f"{r['method']:<13}{r['budget'] or '-':>7}  {r['expected']:>9}  {mark} {r['answer'][:23]:<23}"
            f"{r['kept_entries']:>6}{r['kv_bytes']:>12,}"
        )


if __name__ == "__main__":
    main()
