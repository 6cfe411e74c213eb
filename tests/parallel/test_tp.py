"""Tensor parallel on CPU (gloo, 2 processes spawned here): the same kept positions per layer and KV head and
the same generated tokens as one process, for every method, greedy and seeded sampling; a kept-token choice of
replicated attention (MLA) is the TP root's on every rank by construction."""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp

from tests.parallel.worker import (
    BACKEND,
    COMPILED,
    FP8_METHODS,
    INT4,
    INT_METHODS,
    methods_for,
    observe,
    tp_compiled_main,
    tp_fp8_main,
    tp_main,
)

ARCHS = ("llama", "deepseek_v3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """{arch: [rank 0's, rank 1's observations]} of one TP=2 run over both architectures."""
    folder = tmp_path_factory.mktemp("tp2")
    mp.start_processes(tp_main, args=(2, free_port(), ARCHS, str(folder)), nprocs=2, start_method="spawn")
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    return {arch: [r[arch] for r in ranks] for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_keeps_and_generates_what_one_process_does(arch, tp2):
    one, (r0, r1) = observe(arch), tp2[arch]
    for name in methods_for(arch):
        for sampling in ("greedy", "sampled"):
            assert (
                r0[name]["tokens"][sampling] == r1[name]["tokens"][sampling] == one[name]["tokens"][sampling]
            )
        for prompt, (a, b, c) in enumerate(zip(one[name]["kept"], r0[name]["kept"], r1[name]["kept"])):
            for layer, (heads, heads0, heads1) in enumerate(zip(a, b, c)):
                if arch == "llama":  # q/k/v sharded by head: rank r holds KV head r of the two
                    assert len(heads0) == len(heads1) == 1
                    assert heads == heads0 + heads1, (name, prompt, layer)
                else:  # MLA replicated: one latent "head", the same on every rank
                    assert heads == heads0 == heads1, (name, prompt, layer)
        if arch == "deepseek_v3":  # float32: every greedy step's top-2 margin far above reduction noise
            assert one[name]["margin"] > 1e-5


def test_mla_kept_sets_are_the_roots_even_when_a_rank_scores_differently(tp2):
    """Rank 1's SnapKV scores are perturbed before the top-K: its kept sets are still rank 0's (broadcast
    where scores become kept positions: the cache's `agree`, `select.agree_for`), and so are its tokens."""
    r0, r1 = tp2["deepseek_v3"]
    assert r1["perturbed"]["kept"] == r0["perturbed"]["kept"]
    assert r1["perturbed"]["tokens"] == r0["perturbed"]["tokens"]
    assert r0["perturbed"]["kept"] == r0["snapkv"]["kept"]  # rank 0 was not perturbed


def test_compiled_tp2_decodes_what_one_process_does(tmp_path):
    """A compiled decode step (fullgraph) holds the collectives a step's eviction needs under TP:
    tova_decode's gather of the layer's heads, and on MLA the TP root's choice (an all-gather: a broadcast
    is not traced); greedy and sampled tokens equal one process's, compiled alike."""
    mp.start_processes(tp_compiled_main, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for arch in ARCHS:
        one = observe(arch, COMPILED, compile=BACKEND)
        for name in COMPILED:
            for sampling in ("greedy", "sampled"):
                got = (r0[arch][name]["tokens"][sampling], r1[arch][name]["tokens"][sampling])
                assert got[0] == got[1] == one[name]["tokens"][sampling], (arch, name, sampling)


def test_tp2_in_fp8_generates_what_one_process_does(tmp_path):
    """KV storage fp8_e4m3 (a scale per KV head, calibrated on the prompt): each rank holds and calibrates its
    own heads, and the tokens and kept sets equal one process's."""
    mp.start_processes(tp_fp8_main, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    one, plain = observe("llama", FP8_METHODS, kv="fp8_e4m3"), observe("llama", {"full": {}})
    for name in FP8_METHODS:
        for sampling in ("greedy", "sampled"):
            want = one[name]["tokens"][sampling]
            assert r0[name]["tokens"][sampling] == r1[name]["tokens"][sampling] == want
        for a, b, c in zip(one[name]["kept"], r0[name]["kept"], r1[name]["kept"]):
            assert all(heads == h0 + h1 for heads, h0, h1 in zip(a, b, c)), name
    assert one["full"]["margin"] > 1e-5
    assert plain["full"]["margin"] != one["full"]["margin"]  # the storage was applied: other logits


@pytest.mark.slow  # two spawned processes and the one-process reference: about a minute on 2 cores
def test_tp2_in_int4_generates_what_one_process_does(tmp_path):
    """KV storage int4 (KIVI: per-slot codes, the residual raw in per-row windows): each rank codes the KV
    heads it holds, and the tokens and kept sets equal one process's."""
    args = (2, free_port(), str(tmp_path), INT4, INT_METHODS)
    mp.start_processes(tp_fp8_main, args=args, nprocs=2, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    one = observe("llama", INT_METHODS, kv=INT4[0], kv_settings=INT4[1])
    plain = observe("llama", {"full": {}})
    for name in INT_METHODS:
        for sampling in ("greedy", "sampled"):
            want = one[name]["tokens"][sampling]
            assert r0[name]["tokens"][sampling] == r1[name]["tokens"][sampling] == want
        for a, b, c in zip(one[name]["kept"], r0[name]["kept"], r1[name]["kept"]):
            assert all(heads == h0 + h1 for heads, h0, h1 in zip(a, b, c)), name
    assert plain["full"]["margin"] != one["full"]["margin"]  # the storage was applied: other logits
