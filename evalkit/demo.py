"""Needle in a haystack on the embedded model: which KV methods still retrieve a number hidden mid-prompt?

`python -m evalkit.demo [--length 1500] [--budget 256] [-n 3]` prints, per method, what it retrieved, the KV
entries it kept and the bytes its cache held. The prompt follows RULER's niah_single_1 (noise haystack).
"""

from __future__ import annotations

import argparse
import random

import torch

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TEMPLATE = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards.\n{context}\n"
    "What is the special magic number for {key} mentioned in the provided text?"
)
PREFIX = " The special magic number for {key} mentioned in the provided text is"
KEYS = ["amber-harbor", "quiet-falcon", "silver-meadow", "brisk-lantern", "velvet-canyon", "hollow-orchard"]


def render(tokenizer, prompt: str, answer_prefix: str = "") -> str:
    """The text the model sees: its chat template with the user turn, then the assistant prefill."""
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + answer_prefix


def needle_sample(tokenizer, length: int, seed: int, depth: float = 0.5) -> tuple[str, str]:
    """(rendered prompt of about `length` tokens, the 7-digit answer) with the needle at `depth`."""
    rng = random.Random(seed)
    key, value = rng.choice(KEYS), str(rng.randint(10**6, 10**7 - 1))
    needle = f"One of the special magic numbers for {key} is: {value}."
    per_line = len(tokenizer(NOISE + "\n", add_special_tokens=False)["input_ids"])
    lines = [NOISE] * max(1, (length - 120) // per_line)
    lines.insert(int(len(lines) * depth), needle)
    text = render(tokenizer, TEMPLATE.format(context="\n".join(lines), key=key), PREFIX.format(key=key))
    return text, value


@torch.inference_mode()
def run(model, tokenizer, methods, length: int = 1500, n: int = 3, max_new_tokens: int = 12) -> list[dict]:
    from evalkit.kv import generate

    rows = []
    for method in methods:
        for seed in range(n):
            text, value = needle_sample(tokenizer, length, seed)
            ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
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


def main() -> None:
    from evalkit.config import make_method, model_spec
    from evalkit.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--length", type=int, default=1500)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("-n", type=int, default=3)
    args = ap.parse_args()
    model, tokenizer = load_model(model_spec(args.model))
    methods = [make_method("full")] + [
        make_method(name, budget=args.budget) for name in ("streamingllm", "snapkv", "snapstream")
    ]
    print(f"{'method':<13}{'budget':>7}  {'expected':>9}  {'answer':<28}{'kept':>6}{'KV bytes':>12}")
    for r in run(model, tokenizer, methods, args.length, args.n):
        mark = "ok  " if r["retrieved"] else "MISS"
        print(
            f"{r['method']:<13}{r['budget'] or '-':>7}  {r['expected']:>9}  {mark} {r['answer'][:23]:<23}"
            f"{r['kept_entries']:>6}{r['kv_bytes']:>12,}"
        )


if __name__ == "__main__":
    main()
