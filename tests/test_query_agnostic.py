"""query_aware=false: the context is prefilled and compressed before the question exists, then the question
and answer prefix are fed on the compressed cache as decoded tokens are (docs/query-agnostic.md)."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf

import evalkit.run as runner
from evalkit.config import ConfigError, compose
from evalkit.engine import Engine
from evalkit.identity import hashes
from evalkit.kv import Full, KVCache, SnapKV, SnapStream
from evalkit.request import Prompt, generation_config, question_tokens
from evalkit.turns import Conversation, ask
from tests.conftest import fresh_run, planned_folder, tiny_model

RULER = [
    "model=tiny_llama",
    "task.load.n=1",
    "task.load.lengths=[1024]",
    "task.load.tasks=[niah_single_1,vt]",
]


run = fresh_run  # conftest: one call stands for one process


def journal(folder) -> dict:
    lines = (folder / "generations.jsonl").read_text().splitlines()
    return {r["key"]: r for r in map(json.loads, lines)}


def request(ids, method, forced=(), max_new=6) -> Conversation:
    cfg = generation_config({}, max_new, eos=[], pad=0)
    return ask("k", list(ids), max_new, method, cfg, 0, keep_logits=True, forced=list(forced))


# --- the engine feeds forced tokens as decoded ones -----------------------------------------------------
def test_a_full_cache_decodes_the_same_whether_the_question_is_prefilled_or_fed():
    model = tiny_model("llama")
    ids = torch.randint(3, 250, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    engine = Engine(model, None, [], rows=2)
    aware, agnostic = engine.run([request(ids, Full()), request(ids[:70], Full(), forced=ids[70:])])
    assert aware.tokens == agnostic.tokens
    for a, b in zip(aware.logits, agnostic.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert agnostic.stats["question_tokens"] == 20 and agnostic.stats["prompt_tokens"] == 90
    assert "question_tokens" not in aware.stats


@pytest.mark.parametrize("method", [SnapStream(budget=48), SnapKV(budget=48)])
def test_fed_question_tokens_land_where_decoded_tokens_do(method):
    """Feeding the question is decoding it teacher-forced: a request that generated the question's tokens
    itself (its prompt = the context, its output forced to them) holds the same cache and continues the
    same: compared through the engine's kept logits after the last question token."""
    model = tiny_model("llama")
    ids = torch.randint(3, 250, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    engine = Engine(model, None, [], rows=1)
    (fed,) = engine.run([request(ids[:100], method, forced=ids[100:], max_new=4)])
    # the reference: the same context, then one forward per question token on the one-row dynamic cache
    cache = KVCache.for_model(method, model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids[:100]]), cache=cache, use_cache=True)
        for t in ids[100:]:
            out = model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
    torch.testing.assert_close(fed.logits[0], out.logits[0, -1].float(), rtol=1e-4, atol=1e-4)
    # a ring stays its budget; an append cache holds the kept context, the 20 question tokens and the 3
    # generated tokens fed back (the last one is never fed)
    assert fed.stats["kv_slots"] == (48 if method.ring else 48 + 20 + 3)


# --- the runner -------------------------------------------------------------------------------------
def test_query_agnostic_full_cache_equals_query_aware_and_lands_in_its_own_folder(tmp_path):
    default = planned_folder(tmp_path, *RULER, "method=full")
    agnostic = planned_folder(tmp_path, *RULER, "method=full", "query_aware=false")
    assert "query_aware" not in str(default)  # the default run's folder and identity are today's
    assert agnostic.parts[-4].endswith("-query_awarefalse") and agnostic != default
    run(*RULER, "method=full", results=tmp_path)
    run(*RULER, "method=full", "query_aware=false", results=tmp_path)
    a, b = journal(default), journal(agnostic)
    assert {k: r["text"] for k, r in a.items()} == {k: r["text"] for k, r in b.items()}
    assert {k: r["prompt_hash"] for k, r in a.items()} == {k: r["prompt_hash"] for k, r in b.items()}
    assert all(r["stats"]["question_tokens"] > 5 for r in b.values())
    assert "query_aware: true" in (default / "config.yaml").read_text()  # recorded, for the report to pair
    assert "query_aware: false" in (agnostic / "config.yaml").read_text()
    # a run made before the setting existed (no key) keeps its identity and is skipped, not refused
    saved = OmegaConf.load(default / "config.yaml")
    older = OmegaConf.masked_copy(saved, [k for k in saved if k != "query_aware"])
    assert (
        hashes(older, 1, "d", 1)
        == hashes(saved, 1, "d", 1)
        != hashes(OmegaConf.load(agnostic / "config.yaml"), 1, "d", 1)
    )
    (default / "config.yaml").write_text(OmegaConf.to_yaml(older))
    run(*RULER, "method=full", results=tmp_path)  # checks the folder against the older config: no refusal


def test_a_budget_list_replays_the_contexts_prefill_and_equals_separate_runs(tmp_path):
    run(*RULER, "method.budget=[64,128]", "query_aware=false", "batch_size=2", results=tmp_path / "list")
    for b in (64, 128):
        run(*RULER, f"method.budget={b}", "query_aware=false", results=tmp_path / "one")
        together = journal(
            planned_folder(tmp_path / "list", *RULER, f"method.budget={b}", "query_aware=false")
        )
        alone = journal(planned_folder(tmp_path / "one", *RULER, f"method.budget={b}", "query_aware=false"))
        assert {k: r["text"] for k, r in together.items()} == {k: r["text"] for k, r in alone.items()}
        assert any(r["stats"]["prefill_replayed"] for r in together.values()) == (b == 128)


@pytest.mark.parametrize(
    "task, why",
    [
        ("aime24", "the problem statement is the whole prompt"),
        (
            "livecodebench",
            "the problem statement (with its examples and starter code) is the question itself",
        ),
        (
            "livecodebench_r1",
            "the problem statement (with its examples and starter code) is the question itself",
        ),
    ],
)
def test_tasks_without_a_context_refuse_query_agnostic_with_the_reason(task, why, tmp_path):
    cfg = compose(
        overrides=["model=tiny_llama", f"task={task}", "query_aware=false", f"results_dir={tmp_path}"]
    )
    message = f"query_aware=false: task {task} cannot compress its context before the question: {why}"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        runner.plan(cfg)


def test_query_aware_must_be_a_boolean(tmp_path):
    cfg = compose(overrides=[*RULER, "query_aware=maybe", f"results_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="query_aware must be true or false, got 'maybe'"):
        runner.plan(cfg)


# --- what compression keeps ----------------------------------------------------------------------------
def kept_needle(model, ids: list[int], needle: set[int]) -> tuple[float, list[set[int]]]:
    """(share of the needle's (token, layer, head) entries SnapKV keeps, the kept positions per layer and
    head) after prefilling `ids` into a budget of 96."""
    cache = KVCache.for_model(SnapKV(budget=96), model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    heads = [set(h.tolist()) for i in range(len(cache.layers)) for h in cache.positions(i)[0]]
    return sum(len(h & needle) for h in heads) / (len(heads) * len(needle)), heads


@pytest.mark.parametrize("seed", [0, 1])
def test_query_agnostic_snapkv_keeps_less_of_the_needle_the_question_names(smollm2, seed):
    """SnapKV scores the prompt with its last 32 queries. Query-aware, they are the question naming the
    needle's key: about half of the needle's entries are kept (0.51-0.53 over seeds 0-2). Query-agnostic, the
    window is the haystack's end: about a fifth (0.21-0.22), and no layer or head keeps the same set."""
    from evalkit.demo import needle_sample

    model, tok = smollm2
    text, value = needle_sample(tok, 1000, seed)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, spans = enc["input_ids"], enc["offset_mapping"]
    at = text.rfind("\nWhat is the special magic number for ") + 1  # where RULER's niah question starts
    context = len(ids) - question_tokens(tok, Prompt("k", text, 8, {}, question_at=at), ids)  # the LM's split
    start, end = text.find("One of the special magic"), text.find(value) + len(value) + 1
    needle = {i for i, (s, e) in enumerate(spans) if s >= start and e <= end}
    assert len(needle) > 15 and max(needle) < context
    aware, aware_heads = kept_needle(model, ids, needle)
    agnostic, agnostic_heads = kept_needle(model, ids[:context], needle)
    assert aware > 0.45 and agnostic < 0.3
    assert all(a != b for a, b in zip(aware_heads, agnostic_heads, strict=True))


def test_the_compiled_step_feeds_the_question_as_the_eager_one():
    """Forced tokens go through the pool's one decode step: compiled (one graph, no recompilation per fed
    token) it decodes what eager does, at batch 3 with rows of different methods."""
    from tests.kv.test_compile import Counting

    model = tiny_model("llama")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (80, 95, 110)]
    methods = [SnapStream(budget=48), SnapKV(budget=48), Full()]

    def reqs():
        return [request(ids[:-15], m, forced=ids[-15:], max_new=5) for ids, m in zip(prompts, methods)]

    eager = {d.key + str(i): d.tokens for i, d in enumerate(Engine(model, None, [], rows=3).run(reqs()))}
    backend = Counting()
    compiled = Engine(model, None, [], rows=3, compile=backend).run(reqs())
    assert {d.key + str(i): d.tokens for i, d in enumerate(compiled)} == eager
    assert backend.compiled == 1
