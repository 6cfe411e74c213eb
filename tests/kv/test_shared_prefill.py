"""One prefill for many budgets gives results identical to separate runs (API level and through the
runner)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from evalkit.kv import KVCache, SnapKV, SnapStream, StreamingLLM
from evalkit.kv.prefill import PrefillRecord, shared_prefill
from tests.conftest import the_run, tiny_model

ROOT = Path(__file__).resolve().parents[2]


def gen(model, ids, cache, sample):
    torch.manual_seed(11)
    with torch.no_grad(), shared_prefill(model):
        return model.generate(
            ids,
            cache=cache,
            max_new_tokens=40,
            min_new_tokens=40,
            do_sample=sample,
            top_k=0,
            output_logits=True,
            return_dict_in_generate=True,
        )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("sample", [False, True])
def test_replayed_prefill_equals_a_separate_prefill(arch, sample):
    model = tiny_model(arch, seed=8)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(9))
    first = SnapStream(budget=48, recent=8, window=8)
    record = PrefillRecord(window=32)
    gen(model, ids, KVCache.for_model(first, model, record=record), sample)
    assert len(record.layers) == model.config.num_hidden_layers and record.logits is not None
    for method in (
        SnapStream(budget=96, recent=16, window=8),
        SnapKV(budget=64, window=16),
        StreamingLLM(budget=40),
    ):
        alone = gen(model, ids, KVCache.for_model(method, model), sample)
        replay_cache = KVCache.for_model(method, model, replay=record)
        replayed = gen(model, ids, replay_cache, sample)
        assert torch.equal(alone.sequences, replayed.sequences), method
        assert all(torch.equal(a, b) for a, b in zip(alone.logits, replayed.logits)), method
        assert replay_cache.stats()["slots"] >= method.budget


def test_a_window_wider_than_32_replays_exactly_and_a_short_record_is_refused():
    """A record keeps the last `window` queries: a method scoring with more of them replays exactly from a
    record that wide, and a narrower record (which would score with other queries) is refused."""
    model = tiny_model("llama", seed=8)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(9))
    wide = SnapKV(budget=96, window=64)
    for recorded in (64, 32):
        record = PrefillRecord(window=recorded)
        gen(
            model,
            ids,
            KVCache.for_model(SnapStream(budget=48, recent=8, window=8), model, record=record),
            False,
        )
        replay_cache = KVCache.for_model(wide, model, replay=record)
        if recorded == 32:
            with pytest.raises(
                ValueError, match=r"snapkv: window=64 .* this prefill record holds 32: record with"
            ):
                gen(model, ids, replay_cache, False)
            continue
        alone_cache = KVCache.for_model(wide, model)
        alone, replayed = gen(model, ids, alone_cache, False), gen(model, ids, replay_cache, False)
        assert torch.equal(alone.sequences, replayed.sequences)
        for layer in range(model.config.num_hidden_layers):  # the same kept positions, head by head
            assert torch.equal(alone_cache.positions(layer), replay_cache.positions(layer)), layer


def test_budget_list_at_batch_size_4_equals_separate_runs_at_batch_size_1(tmp_path):
    """Two invariances of the runner in one set of runs: a budget list (one prefill per prompt, replayed) and
    the batch size (requests decode as rows of one pool) both leave every output and figure unchanged."""
    base = [
        sys.executable,
        "-m",
        "evalkit",
        "model=tiny_llama",
        "task.load.n=1",
        "task.load.lengths=[1024]",
        "method=snapstream",
        "method.window=48",  # wider than the 32 queries a record keeps by default: the record must widen
    ]
    for args, results in (
        (["method.budget=[64,128]", "batch_size=4"], "shared"),
        (["method.budget=64", "batch_size=1"], "alone"),
        (["method.budget=128", "batch_size=1"], "alone"),
    ):
        proc = subprocess.run(
            [*base, *args, f"results_dir={tmp_path / results}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    for budget in ("64", "128"):
        folder = {d: the_run(tmp_path / d, "snapstream", f"{budget}-window48") for d in ("shared", "alone")}
        a, b = (json.loads((folder[d] / "metrics.json").read_text()) for d in ("shared", "alone"))
        assert a["scores"] == b["scores"] and a["n"] == b["n"] == 6
        assert a["kv"] == b["kv"]
        rows = {
            d: [json.loads(x) for x in (folder[d] / "samples.jsonl").read_text().splitlines()] for d in folder
        }
        assert [r["predictions"] for r in rows["shared"]] == [r["predictions"] for r in rows["alone"]]
        config = {d: (folder[d] / "config.yaml").read_text().replace(str(tmp_path / d), "X") for d in folder}
        assert config["shared"].replace("batch_size: 4", "batch_size: 1") == config["alone"]
    replayed = json.loads(
        (the_run(tmp_path / "shared", "snapstream", "128-window48") / "metrics.json").read_text()
    )
    assert replayed["generation"]["prefills_replayed"] == 6


def test_mla_is_not_recorded():
    """DeepSeek-V3's attention reads keys expanded from the latent cache: recording them would cost more than
    re-running the prefill, so the record says it cannot be replayed and budgets prefill separately."""
    model = tiny_model("deepseek_v3", seed=8)
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(9))
    record = PrefillRecord(window=32)
    gen(model, ids, KVCache.for_model(SnapStream(budget=48, recent=8, window=8), model, record=record), False)
    assert not record.usable and record.layers == {}


@pytest.mark.parametrize("ring", [False, True], ids=["expected_attention", "expected_attention_ring"])
def test_an_expected_attention_record_keeps_the_score_not_every_query(ring):
    """Expected attention reads every prompt query, whatever the budget: a budget list's record keeps its
    score per entry (B, H_kv, T) float32 and the default 32 queries, not all of them (before: every prompt
    query, (B, H_q, T, D) per layer), and a larger budget replayed from it keeps what its own prefill keeps,
    head by head, with the same generation."""
    from evalkit.kv import ExpectedAttention, Ringed
    from evalkit.kv.scorers import ExpectedAttentionScore

    def method(budget):
        if ring:
            return Ringed(budget=budget, scorer=ExpectedAttentionScore(future=64))
        return ExpectedAttention(budget=budget, future=64)

    model = tiny_model("llama", seed=8)
    t = 150
    ids = torch.randint(0, 256, (1, t), generator=torch.Generator().manual_seed(9))
    small, large = method(48), method(96)
    record = PrefillRecord(window=max(32, small.window, large.window))  # conversation.py's rule
    gen(model, ids, KVCache.for_model(small, model, record=record), False)
    cfg = model.config
    for i in range(cfg.num_hidden_layers):
        queries = record.layers[i][2]
        assert queries.shape[2] == 32 and record.hints[i].shape == (1, cfg.num_key_value_heads, t)
    alone_cache = KVCache.for_model(large, model)
    replay_cache = KVCache.for_model(large, model, replay=record)
    alone, replayed = gen(model, ids, alone_cache, False), gen(model, ids, replay_cache, False)
    assert torch.equal(alone.sequences, replayed.sequences)
    assert all(torch.equal(a, b) for a, b in zip(alone.logits, replayed.logits))
    for layer in range(cfg.num_hidden_layers):
        assert torch.equal(alone_cache.positions(layer), replay_cache.positions(layer)), layer


def test_an_expected_attention_record_is_scored_when_its_first_budget_keeps_the_whole_prompt():
    """A budget list in the conf's order, not ascending: the first budget keeps the whole 60-token prompt
    (nothing to rank), yet it records the score for the smaller budget after it, which then replays its own
    prefill's selection (it raised: the record held neither the score nor every query)."""
    from evalkit.kv import ExpectedAttention

    model = tiny_model("llama", seed=8)
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(9))
    whole, small = ExpectedAttention(budget=96, future=64), ExpectedAttention(budget=24, future=64)
    record = PrefillRecord(window=max(32, whole.window, small.window))
    gen(model, ids, KVCache.for_model(whole, model, record=record), False)
    assert len(record.hints) == model.config.num_hidden_layers
    alone_cache = KVCache.for_model(small, model)
    replay_cache = KVCache.for_model(small, model, replay=record)
    alone, replayed = gen(model, ids, alone_cache, False), gen(model, ids, replay_cache, False)
    assert torch.equal(alone.sequences, replayed.sequences)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(alone_cache.positions(layer), replay_cache.positions(layer)), layer


def test_a_record_replays_its_scores_only_to_a_method_that_scores_alike():
    """A record holding h2o's attention sums and every query, replayed by expected_attention and by AdaKV
    over it: each keeps what its own prefill keeps (it read h2o's sums as its own score before: the record
    now says whose scores it holds, `PrefillRecord.hints_for`); a record of too few queries and another's
    scores is refused."""
    from evalkit.kv import H2O, AdaKV, ExpectedAttention

    model = tiny_model("llama", seed=8)
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(9))

    def prefill(record):  # h2o decodes only in the engine: its prefill alone records
        with torch.no_grad(), shared_prefill(model):
            model(
                input_ids=ids, cache=KVCache.for_model(H2O(budget=48), model, record=record), use_cache=True
            )

    record = PrefillRecord(window=1 << 30)  # every query: the scorers below can score from it
    prefill(record)
    assert len(record.hints) == model.config.num_hidden_layers  # h2o's sums
    ea = ExpectedAttention(budget=40, future=64)
    for method in (ea, AdaKV(budget=40, inner=ea)):
        alone_cache, replay_cache = (
            KVCache.for_model(method, model),
            KVCache.for_model(method, model, replay=record),
        )
        alone, replayed = gen(model, ids, alone_cache, False), gen(model, ids, replay_cache, False)
        assert torch.equal(alone.sequences, replayed.sequences), method.name
        for layer in range(model.config.num_hidden_layers):
            assert torch.equal(alone_cache.positions(layer), replay_cache.positions(layer)), (
                method.name,
                layer,
            )
    few = PrefillRecord(window=32)
    prefill(few)
    with pytest.raises(ValueError, match="scores the prompt with every query"):
        gen(model, ids, KVCache.for_model(ea, model, replay=few), False)
