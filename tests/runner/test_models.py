"""Model loading: every conf composes; real loading code runs on saved tiny models; errors say what to do."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from evalkit.config import choices, model_spec
from evalkit.loading import load_model
from evalkit.models import ModelSpec
from evalkit.sources import ModelLoadError
from tests.conftest import TINY


@pytest.mark.parametrize("name", choices("model"))
def test_every_model_conf_instantiates(name):
    spec = model_spec(name)
    assert isinstance(spec, ModelSpec) and spec.name == name
    served = spec.name == "served"  # its files are named by model.tokenizer, resolved when a run checks it
    assert spec.id or spec.gguf or spec.random or served


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_loads_saved_weights_from_a_local_path(arch, tmp_path, smollm2):
    """The path used for Llama-3.1 / Qwen3 / DeepSeek-R1 weights, on tiny random weights of the same
    architecture."""
    cfg = dict(TINY[arch])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    saved = AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path)
    smollm2[1].save_pretrained(tmp_path)  # any tokenizer will do for loading
    model, tok = load_model(ModelSpec(name=f"tiny_{arch}", path=str(tmp_path), dtype="float32"))
    assert model.config._attn_implementation == "evalkit" and tok.padding_side == "left"
    assert model.config.model_type == config.model_type
    want, got = saved.state_dict(), model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)  # the saved weights


def test_missing_local_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="weights not found"):
        load_model(ModelSpec(name="x", path=str(tmp_path / "nope")))


def test_unreachable_hub_says_how_to_fix():
    with pytest.raises(ModelLoadError) as err:
        load_model(model_spec("llama31_8b_instruct"))
    assert "meta-llama/Llama-3.1-8B-Instruct" in str(err.value) and "model.path" in str(err.value)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 't5'"):
        load_model(ModelSpec(name="t5", path=str(tmp_path)))


def test_embedded_model_is_cached_and_uses_its_chat_template(smollm2):
    model, tok = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert model.dtype == torch.float32


def test_fingerprint_records_the_commit_a_hub_revision_resolved_to(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "models--org--m" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text('{"model_type": "llama"}')
    (snap / "tokenizer_config.json").write_text("{}")
    (tmp_path / "models--org--m" / "refs").mkdir()
    (tmp_path / "models--org--m" / "refs" / "main").write_text(commit)
    code = (
        "import json; from evalkit.models import ModelSpec; from evalkit.sources import fingerprint; "
        "print(json.dumps([fingerprint(ModelSpec(name='m', id='org/m')), "
        "fingerprint(ModelSpec(name='m', id='org/m', revision='main'))]))"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == [{"weights": commit, "tokenizer": commit}] * 2  # a branch name resolved


def test_fingerprint_of_local_packaged_and_random_models(tmp_path):
    from evalkit.models import ModelSpec
    from evalkit.sources import fingerprint

    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    local = fingerprint(ModelSpec(name="m", path=str(tmp_path)))
    assert local["weight_file_bytes"] == {"model.safetensors": 10}
    (tmp_path / "config.json").write_text('{"a": 2}')
    assert fingerprint(ModelSpec(name="m", path=str(tmp_path))) != local  # a changed config is seen
    packaged = fingerprint(model_spec("smollm2_135m"))
    assert len(packaged["gguf_sha256"]) == 64
    a, b = (
        fingerprint(ModelSpec(name="t", random={"model_type": "llama", "hidden_size": h})) for h in (64, 32)
    )
    assert a != b and a["seed"] == 0
