"""Shared fixtures: tiny random models of each supported architecture, and the embedded SmolLM2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = {
    "llama": dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    ),
    "qwen3": dict(
        model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    ),
    # MLA: transformers caches the latent (kv_lora_rank wide keys, rope-dim wide values, one head)
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        max_position_embeddings=1024,
    ),
}  # fmt: skip


def tiny_model(arch: str, seed: int = 0):
    """A random model of a real architecture, evalkit attention attached, fp32, eval mode: what the runner
    builds for a `random:` model conf (e.g. tiny_llama)."""
    from evalkit.kv import attach
    from evalkit.loading import random_model
    from evalkit.models import ModelSpec

    return attach(random_model(ModelSpec(name=f"tiny_{arch}", random=TINY[arch], seed=seed)).eval())


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded default (converted once into $EVALKIT_CACHE)."""
    from evalkit.config import model_spec
    from evalkit.loading import load_model

    return load_model(model_spec("smollm2_135m"))


def killed_run(args: list[str], results: Path, after: int) -> subprocess.CompletedProcess:
    """`python -m evalkit` SIGKILLed by itself right after its `after`-th journal append: a kill at an exact
    moment, with no clock involved."""
    hook = (
        "import os, signal, sys\n"
        "import evalkit.journal as r\n"
        "append, count = r.Journal.append, [0]\n"
        "def killing_append(self, rec):\n"
        "    append(self, rec)\n"
        "    count[0] += 1\n"
        f"    if count[0] == {after}: os.kill(os.getpid(), signal.SIGKILL)\n"
        "r.Journal.append = killing_append\n"
        "from evalkit.run import main\n"
        "sys.argv = ['evalkit', *sys.argv[1:]]\n"
        "main()\n"
    )
    cmd = [sys.executable, "-c", hook, *args, f"results_dir={results}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def planned_folder(results, *overrides: str) -> Path:
    """Where `python -m evalkit <overrides> results_dir=<results>` writes: the runner's own plan (the naming
    rule itself is tested literally in tests/runner/test_results.py)."""
    import evalkit.run as runner
    from evalkit.config import compose

    return runner.plan(compose(overrides=[*overrides, f"results_dir={results}"])).out


def fresh_run(*overrides: str, results, team=None):
    """`python -m evalkit <overrides> results_dir=<results>` in this process, as a new process would run it
    (the in-process data memo cleared first); `team`: the run's processes as this one sees them."""
    import evalkit.run as runner
    import evalkit.task
    from evalkit.config import compose

    evalkit.task._MEMO.clear()
    return runner.run(compose(overrides=[*overrides, f"results_dir={results}"]), team)


def the_run(results, method: str, tag: str) -> Path:
    """The one run folder of `method`/`tag` under `results` (task and model folder names carry their
    settings)."""
    (found,) = Path(results).glob(f"runs/*/*/{method}/{tag}")
    return found
