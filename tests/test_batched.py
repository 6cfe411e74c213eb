"""Batched generation (left padding, per-row selection and ring positions) equals batch size 1, token for token."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evalkit.kv import Full, KVCache, SnapKV, SnapStream, StreamingLLM, generate
from tests.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]
METHODS = [
    Full(),
    StreamingLLM(budget=48),
    SnapKV(budget=64, window=8),
    SnapStream(budget=64, recent=16, window=8),
    SnapStream(budget=64, recent=16, window=8, spare_slots="ring"),
]


def left_pad(prompts: list[torch.Tensor], pad: int = 0):
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.full((width - len(p),), pad), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in prompts]).long()
    return ids, mask, width


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.name}-{getattr(m, 'spare_slots', '')}")
def test_batch_equals_single_rows(arch, method):
    model = tiny_model(arch, seed=1)
    g = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(0, 256, (n,), generator=g) for n in (150, 97, 40, 123)
    ]  # 40 < budget: padded ring
    ids, mask, width = left_pad(prompts)
    batch_cache = KVCache.for_model(method, model)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, cache=batch_cache, max_new_tokens=30, min_new_tokens=30, do_sample=False
        )
    alone_rows = []
    for r, p in enumerate(prompts):
        alone_cache = KVCache.for_model(method, model)
        with torch.no_grad():
            alone = model.generate(
                p[None], cache=alone_cache, max_new_tokens=30, min_new_tokens=30, do_sample=False
            )
        assert torch.equal(alone[0, len(p) :], out[r, width:]), (method.name, r)
        for layer in range(model.config.num_hidden_layers):  # the same positions, per head, in each row
            got = batch_cache.positions(layer)[r]
            want = alone_cache.positions(layer)[0]
            for h in range(got.shape[0]):
                assert set(got[h][got[h] >= 0].tolist()) == set(want[h][want[h] >= 0].tolist()), (layer, h)
        alone_rows.append(alone_cache.row_stats()[0])
    assert batch_cache.row_stats() == alone_rows  # per-row KV statistics equal a run of that row alone


def test_smollm2_batch_equals_single(smollm2):
    model, tok = smollm2
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("Name three rivers in Europe.", "What is 12 times 11? Explain briefly.",
                  "Write a haiku about autumn leaves.", "Why is the sky blue? Answer in two sentences.")
    ]  # fmt: skip
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    method = SnapStream(budget=64, recent=32, window=16)
    out, _ = generate(
        model,
        enc["input_ids"],
        method,
        attention_mask=enc["attention_mask"],
        max_new_tokens=40,
        do_sample=False,
    )
    width = enc["input_ids"].shape[1]
    for r, text in enumerate(texts):
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        alone, _ = generate(model, ids, method, max_new_tokens=40, do_sample=False)
        n = alone.shape[1] - ids.shape[1]
        assert torch.equal(alone[0, ids.shape[1] :], out[r, width : width + n]), r


def test_runner_batch_size_4_equals_1(tmp_path):
    base = [
        sys.executable,
        "-m",
        "evalkit",
        "model=tiny_llama",
        "task.load.n=2",
        "task.load.lengths=[1024]",
        "method=snapstream",
        "method.budget=64",
    ]
    for bs in (1, 4):
        proc = subprocess.run(
            [*base, f"batch_size={bs}", f"results_dir={tmp_path / str(bs)}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {
        bs: [
            json.loads(x)
            for x in (tmp_path / str(bs) / "runs/ruler/tiny_llama/snapstream/64/samples.jsonl")
            .read_text()
            .splitlines()
        ]  # fmt: skip
        for bs in (1, 4)
    }
    assert [r["predictions"] for r in rows[1]] == [r["predictions"] for r in rows[4]]
    assert [r["scores"] for r in rows[1]] == [r["scores"] for r in rows[4]]
