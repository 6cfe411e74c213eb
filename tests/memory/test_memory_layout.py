"""The memory report's GPU layout (parallel.tp_size x dp_size): per-GPU weight and KV bytes as transformers
shards the model. Expected bytes are computed here from the parameter shapes of the model torch builds on the
meta device, with which tensors are split written out by hand (never read from transformers' plan), and the
split sizes taken from `torch.chunk`, the split DTensor uses. CPU only, a few seconds."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from evalkit.config import compose
from evalkit.memory import MemoryReportError, kv_geometry, shard_model, write_report
from evalkit.memory.report import check
from evalkit.memory.sim import GiB
from tests.runs_fixture import SMOL_CONFIG as SMOL

ROOT = Path(__file__).resolve().parents[2]

TINY_LLAMA = dict(
    model_type="llama",
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=101,  # odd: rank 0 holds 51 rows of the embeddings and lm_head at TP2
    attention_bias=True,  # q/k/v biases are split with their weights, o_proj's is on every rank
    tie_word_embeddings=False,
)
TINY_DEEPSEEK = dict(
    model_type="deepseek_v3",
    num_hidden_layers=3,
    first_k_dense_replace=1,  # layer 0 a dense MLP, layers 1-2 MoE
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    vocab_size=128,
    tie_word_embeddings=False,
)

# How each model's tensors are split, by name suffix: (dimension, halves). Written from the facts (Llama:
# q/k/v/o and MLP; DeepseekV3: MLP and experts only; both: embeddings and lm_head by vocabulary), not read
# from transformers. A bias of a row-wise layer (o_proj) is on every rank.
LLAMA_SPLIT = {
    "embed_tokens.weight": (0, 1),
    "q_proj.weight": (0, 1), "q_proj.bias": (0, 1),
    "k_proj.weight": (0, 1), "k_proj.bias": (0, 1),
    "v_proj.weight": (0, 1), "v_proj.bias": (0, 1),
    "o_proj.weight": (1, 1),
    "gate_proj.weight": (0, 1), "up_proj.weight": (0, 1), "down_proj.weight": (1, 1),
    "lm_head.weight": (0, 1),
}  # fmt: skip
DEEPSEEK_SPLIT = {
    "embed_tokens.weight": (0, 1),
    "mlp.gate_proj.weight": (0, 1), "mlp.up_proj.weight": (0, 1), "mlp.down_proj.weight": (1, 1),
    "shared_experts.gate_proj.weight": (0, 1), "shared_experts.up_proj.weight": (0, 1),
    "shared_experts.down_proj.weight": (1, 1),
    "experts.gate_up_proj": (1, 2),  # (experts, 2 x moe_intermediate, hidden): gate and up split alike
    "experts.down_proj": (2, 1),  # (experts, hidden, moe_intermediate)
    "lm_head.weight": (0, 1),
}  # fmt: skip


def meta_params(model_cls, config_cls, fields: dict) -> dict[str, torch.Tensor]:
    fields = {k: v for k, v in fields.items() if k != "model_type"}
    with torch.device("meta"):
        return dict(model_cls(config_cls(**fields)).named_parameters())


def rank0_numel(name: str, p: torch.Tensor, split: dict, tp: int) -> int:
    rule = next((v for k, v in split.items() if name.endswith(k)), None)
    if rule is None:
        return p.numel()
    dim, halves = rule
    return sum(half.chunk(tp, dim)[0].numel() for half in p.chunk(halves, dim))


def expected_gpu_bytes(params: dict, split: dict, tp: int, bytes_of) -> int:
    return sum(rank0_numel(n, p, split, tp) * bytes_of(n, p) for n, p in params.items())


def fp32(name, p) -> int:
    return 4


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_weights_per_gpu_follow_the_split_of_every_tensor(tp):
    params = meta_params(LlamaForCausalLM, LlamaConfig, TINY_LLAMA)
    layout = shard_model(TINY_LLAMA, kv_geometry(TINY_LLAMA, "float32"), tp, 1, 8, "float32", "float32")
    assert layout.weight_bytes_gpu == expected_gpu_bytes(params, LLAMA_SPLIT, tp, fp32)
    assert layout.parameters == sum(p.numel() for p in params.values())
    replicated = sum(4 * p.numel() for n, p in params.items() if "norm" in n or n.endswith("o_proj.bias"))
    assert layout.replicated_bytes == (replicated if tp > 1 else 4 * layout.parameters)


def test_llama_kv_heads_are_split_across_ranks():
    """2 KV heads at TP2: one per rank; the bytes one GPU holds for a request of N cached tokens."""
    layout = shard_model(TINY_LLAMA, kv_geometry(TINY_LLAMA, "bfloat16"), 2, 1, 8, "float32", "float32")
    head_dim = 64 // 4
    assert layout.kv_heads_gpu == 1
    # layers x heads per rank x (K + V) x bf16 bytes x tokens
    assert layout.kv_bytes_gpu(1000) == 2 * 1 * (head_dim + head_dim) * 2 * 1000


def test_deepseek_shards_only_mlp_and_experts_and_replicates_the_mla_latent():
    params = meta_params(DeepseekV3ForCausalLM, DeepseekV3Config, TINY_DEEPSEEK)
    assert "model.layers.1.mlp.experts.gate_up_proj" in params  # experts are 3-D tensors in this version
    layout = shard_model(TINY_DEEPSEEK, kv_geometry(TINY_DEEPSEEK, "float32"), 2, 1, 8, "float32", "float32")
    assert layout.weight_bytes_gpu == expected_gpu_bytes(params, DEEPSEEK_SPLIT, 2, fp32)
    attention = sum(4 * p.numel() for n, p in params.items() if ".self_attn." in n)
    assert attention > 0 and layout.replicated_bytes >= attention  # MLA attention on every rank
    # The latent cache (kv_lora_rank + rope per token and layer) is whole on every rank.
    assert layout.kv_heads_gpu == 1
    assert layout.kv_bytes_gpu(1000) == 3 * (16 + 4) * 4 * 1000


def test_fp8_layer_matrices_and_bf16_embeddings_norms_routers():
    """As DeepSeek-R1's checkpoint stores them: the decoder layers' Linear weights and expert tensors in
    fp8 (1 byte), everything else (embeddings, lm_head, norms, the router) in bf16 (2 bytes)."""
    params = meta_params(DeepseekV3ForCausalLM, DeepseekV3Config, TINY_DEEPSEEK)

    def stored(name, p):
        matrix = name.endswith(("_proj.weight", "_mqa.weight")) or ".experts." in name
        return 1 if ".layers." in name and matrix else 2

    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in params
    assert "model.layers.1.mlp.gate.weight" in params  # the router: bf16
    layout = shard_model(TINY_DEEPSEEK, kv_geometry(TINY_DEEPSEEK, "bf16"), 2, 1, 8, "fp8", "bfloat16")
    assert layout.weight_bytes_gpu == expected_gpu_bytes(params, DEEPSEEK_SPLIT, 2, stored)


def test_data_parallel_replicas_add_gpus_not_bytes():
    kv = kv_geometry(TINY_LLAMA, "float32")
    one, four = (shard_model(TINY_LLAMA, kv, 1, dp, 8, "float32", "float32") for dp in (1, 4))
    assert four.weight_bytes_gpu == one.weight_bytes_gpu and four.kv_bytes_gpu(7) == one.kv_bytes_gpu(7)
    assert (four.world, four.nodes) == (4, 1)
    two_nodes = shard_model(TINY_DEEPSEEK, kv_geometry(TINY_DEEPSEEK, "float32"), 16, 1, 8, "fp8", "bf16")
    assert (two_nodes.world, two_nodes.nodes) == (16, 2)


def test_kv_heads_not_divisible_by_tp_is_refused_as_transformers_would():
    with pytest.raises(MemoryReportError, match=r"parallel.tp_size=4 does not divide num_key_value_heads=2"):
        shard_model(TINY_LLAMA, kv_geometry(TINY_LLAMA, "float32"), 4, 1, 8, "float32", "float32")


def test_a_world_that_is_not_whole_nodes_is_refused():
    with pytest.raises(MemoryReportError, match=r"12 GPUs is not a whole number of 8-GPU nodes"):
        shard_model(TINY_DEEPSEEK, kv_geometry(TINY_DEEPSEEK, "float32"), 12, 1, 8, "float32", "float32")


def test_a_config_without_model_type_names_the_field():
    fields = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    with pytest.raises(MemoryReportError, match="lacks 'model_type'"):
        shard_model(fields, kv_geometry(fields, "float32"), 2, 1, 8, "float32", "float32")


# --- the report -------------------------------------------------------------------------------------


def compose_cfg(*overrides: str) -> dict:
    return OmegaConf.to_container(compose("memory", list(overrides)), resolve=True)


def layout_csv(tmp_path: Path, *overrides: str) -> tuple[list[str], str]:
    cfg = compose_cfg(f"results_dir={tmp_path}", "context_lens=[131072]", "budgets=[32768]", *overrides)
    paths = write_report(cfg)
    return paths["layout"].read_text().splitlines(), paths["md"].read_text()


def test_deepseek_r1_on_one_h200_node_tp8_fits_and_on_h100_does_not(tmp_path):
    """DeepSeek-R1 (fp8 layer matrices, bf16 rest) at TP8: 87.82 GiB of weights per GPU, so one 128k
    request fits an H200 (140.4 GiB) with its 8.58 GiB latent on every GPU, and not an H100 (79.6 GiB)."""
    csv, md = layout_csv(tmp_path / "h200", "hardware=h200", "parallel.tp_size=8")
    assert csv[0].startswith("model,hardware,tp_size,dp_size,world_size,nodes,context")
    full = dict(zip(csv[0].split(","), csv[1].split(",")))
    assert full["method"] == "full" and full["fits"] == "True" and full["kv_heads_gpu"] == "1"
    assert f"{int(full['weight_bytes_gpu']) / GiB:.2f}" == "87.82"
    assert int(full["kv_bytes_gpu"]) == 61 * (512 + 64) * 2 * 131072  # the latent, whole, on every GPU
    assert "## GPU layout: TP8 x DP1" in md and "1 node(s) of 8 GPUs" in md
    csv, md = layout_csv(tmp_path / "h100", "hardware=h100", "parallel.tp_size=8")
    assert all(line.split(",")[-2] == "False" for line in csv[1:]) and "| NO |" in md


def test_tp16_spans_two_nodes_and_halves_the_sharded_weights(tmp_path):
    csv8, _ = layout_csv(tmp_path / "tp8", "hardware=h200", "parallel.tp_size=8")
    csv16, md = layout_csv(tmp_path / "tp16", "hardware=h200", "parallel.tp_size=16")
    row8, row16 = (dict(zip(c[0].split(","), c[1].split(","))) for c in (csv8, csv16))
    assert row16["nodes"] == "2" and "2 node(s) of 8 GPUs" in md
    assert int(row16["weight_bytes_gpu"]) < int(row8["weight_bytes_gpu"])
    assert row16["kv_bytes_gpu"] == row8["kv_bytes_gpu"]  # the latent is not split


def test_one_process_keeps_the_report_without_a_layout(tmp_path):
    paths = write_report(compose_cfg(f"results_dir={tmp_path}", "context_lens=[32768]", "budgets=[8192]"))
    assert "layout" not in paths and "GPU layout" not in paths["md"].read_text()


@pytest.mark.parametrize(
    "override, field",
    [
        ("parallel.tp_size=0", "parallel.tp_size must be a positive integer (GPUs per model copy), got 0"),
        ("parallel.tp_size=null", "model copy), got None"),  # the runtime's null needs a world size
        ("parallel.dp_size=-1", "parallel.dp_size must be a positive integer (model copies), got -1"),
        ("model.other_dtype=fp7", "model.other_dtype: unknown dtype 'fp7'"),
        ("parallel.tp_size=24", "24 GPUs is not a whole number of 16-GPU nodes"),  # default: SN40L-16
    ],
)
def test_entry_point_refuses_a_bad_layout_before_writing(tmp_path, override, field):
    cmd = [sys.executable, "-m", "evalkit.memory", f"results_dir={tmp_path}", override]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("evalkit: error: ") and field in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "memory").exists()


# --- layouts no run can take (issue 31, items 9 and 12) -----------------------------------------------


@pytest.mark.parametrize(
    "overrides, says",
    [
        # DeepSeek-R1 at 7 GPUs said "fits" on every row: its MLP rows (18432) do not split 7 ways
        (
            ["hardware=h200", "parallel.tp_size=7"],
            "parallel.tp_size=7 does not divide model.layers.*.mlp.gate_proj",
        ),
        (["hardware=h200", "parallel.tp_size=6"], "parallel.tp_size=6 does not divide model.layers.*.mlp."),
    ],
)
def test_a_tp_size_the_model_cannot_split_is_refused_never_said_to_fit(tmp_path, overrides, says):
    cfg = compose_cfg(f"results_dir={tmp_path}", "context_lens=[131072]", "budgets=[32768]", *overrides)
    with pytest.raises(MemoryReportError, match=re.escape(says)):
        check(cfg)
    assert not (tmp_path / "memory").exists()


def test_uneven_attention_heads_are_refused_where_the_plan_splits_attention():
    """tiny_llama's 4 attention heads over 8 ranks; tiny_deepseek's MLA attention is not split, its MLP is."""
    with pytest.raises(MemoryReportError, match="does not divide num_key_value_heads=2"):
        shard_model(TINY_LLAMA, kv_geometry(TINY_LLAMA, "float32"), 8, 1, 8, "float32", "float32")
    with pytest.raises(MemoryReportError, match=r"parallel.tp_size=3 does not divide model.layers.\*.mlp"):
        shard_model(TINY_DEEPSEEK, kv_geometry(TINY_DEEPSEEK, "float32"), 3, 1, 8, "float32", "float32")


def test_a_tp_derived_from_the_hardware_is_named_by_the_hardware():
    """hardware=h200 on a 9-head model: parallel.tp defaults to the 8 sockets, a setting never given."""
    cfg = compose_cfg("hardware=h200", "context_lens=[8192]", "budgets=[2048]")
    cfg["model"] |= {"name": "smol", "hf_config": SMOL, "num_parameters": None, "weight_dtype": "bfloat16"}
    with pytest.raises(MemoryReportError) as e:
        check(cfg)
    assert str(e.value) == (
        "parallel.tp=8 (hardware=h200: one per each of its 8 sockets unless set) does not divide "
        "num_attention_heads=9 of smol: set parallel.tp to a divisor of both (e.g. parallel.tp=1)"
    )
