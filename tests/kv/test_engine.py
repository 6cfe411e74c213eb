"""Continuous batching (`evalkit.engine`): every request decodes exactly as `model.generate` would alone
(greedy and sampled, every method, any row count), finished rows are refilled at once, a prompt's budgets
share one prefill and decode as rows of one batch, and the compiled step is one graph across refills."""

import gc
import weakref

import pytest
import torch

from evalkit.engine import Engine
from evalkit.kv import Full, KVCache, SnapKV, SnapStream, StreamingLLM, generate
from evalkit.kv.prefill import PrefillRecord
from evalkit.request import generation_config
from evalkit.turns import Inbox, ask
from tests.conftest import tiny_model
from tests.kv.test_compile import Counting

METHODS = [
    Full(),
    StreamingLLM(budget=48),
    SnapKV(budget=64, window=16),
    SnapStream(budget=64, recent=16, window=8),
    SnapStream(budget=48, recent=16, window=8, spare_slots="ring"),
]
LENGTHS = (150, 40, 90, 200, 20)  # longer and shorter than the budgets
NEW = 24


class Tok:
    """A token is one letter (id % 26): enough for lm-eval's stop-string criteria."""

    def batch_decode(self, ids):
        return ["".join(chr(97 + t % 26) for t in row) for row in ids.tolist()]

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 97 for c in text]


def prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]


def settings(sample: bool, new: int = NEW):
    return generation_config({"temperature": 0.8, "top_p": 0.9} if sample else {}, new, [0], 0)


def alone(model, ids, method, sample, seed, new=NEW):
    """What `model.generate` makes of one request by itself with a one-row cache of its own (the reference:
    transformers' decode loop, not the engine's)."""
    torch.manual_seed(seed)
    with torch.inference_mode():
        cache = KVCache.for_model(method, model)
        out = model.generate(torch.tensor([ids]), cache=cache, generation_config=settings(sample, new))
    return out[0, len(ids) :].tolist()


def engine_run(model, requests, rows, **kw):
    engine = Engine(model, Tok(), [0], rows, **kw)
    return {d.key: d for d in engine.run(requests)}, engine


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("sample", [False, True])
def test_every_request_decodes_as_generate_alone(arch, sample):
    model = tiny_model(arch, seed=3)
    ids = prompts()
    for method in METHODS:
        want = [alone(model, x, method, sample, 100 + i) for i, x in enumerate(ids)]
        for rows in (1, 3):
            reqs = [ask(str(i), x, NEW, method, settings(sample), 100 + i) for i, x in enumerate(ids)]
            got, _ = engine_run(model, reqs, rows)
            assert [got[str(i)].tokens for i in range(len(ids))] == want, (method, rows)


def test_min_new_tokens_and_logits_as_transformers():
    """A request keeps EOS out until `min_new` tokens and keeps each step's raw float32 logits: the tokens and
    logits of `model.generate(min_new_tokens=..., output_logits=True)` alone; without `min_new` it ends at
    EOS."""
    model = tiny_model("llama", seed=3)
    ids, method = prompts()[0], SnapStream(budget=64, recent=16, window=8)
    free = alone(model, ids, method, False, 0)
    at = next(i for i in range(2, NEW) if free[i] not in free[:i])  # greedy emits this token first at `at`
    config = generation_config({}, NEW, [free[at]], 0)
    with torch.inference_mode():
        want = model.generate(
            torch.tensor([ids]),
            cache=KVCache.for_model(method, model),
            generation_config=config,
            min_new_tokens=12,
            output_logits=True,
            return_dict_in_generate=True,
        )
    engine = Engine(model, Tok(), [free[at]], 2)
    reqs = [ask("min", ids, NEW, method, config, 0, min_new=12, keep_logits=True)]
    reqs.append(ask("free", ids, NEW, method, config, 0))
    got = {d.key: d for d in engine.run(reqs)}
    assert got["free"].tokens == free[: at + 1] and got["free"].ended == "eos" and got["free"].logits is None
    assert got["min"].tokens == want.sequences[0, len(ids) :].tolist() and len(got["min"].tokens) >= 12
    assert len(got["min"].logits) == len(want.logits)
    assert max((a - b[0]).abs().max().item() for a, b in zip(got["min"].logits, want.logits)) <= 1e-5


def test_generate_refuses_settings_the_engine_cannot_honour():
    """`evalkit.kv.generate` decodes through the engine: beams, penalties, unknown or missing settings are
    refused by name before any forward."""
    model, ids = tiny_model("llama"), torch.tensor([prompts()[4]])
    for kw, why in (
        (dict(max_new_tokens=4, num_beams=2), "num_beams=2 is not supported"),
        (dict(max_new_tokens=4, repetition_penalty=1.3), "repetition_penalty=1.3 is not supported"),
        (dict(max_new_tokens=4, prefill_chunk_size=8), "prefill_chunk_size=8 is not supported"),
        (dict(max_new_tokens=4, beam_width=2), r"unknown generation settings \['beam_width'\]"),
        (dict(max_new_tokens=None), "pass max_new_tokens"),
    ):
        with pytest.raises(ValueError, match=why):
            generate(model, ids, Full(), **kw)


def test_finished_rows_are_refilled_at_once_and_static_batching_idles():
    model = tiny_model("llama", seed=3)
    ids = prompts() * 2
    limits = [4, 30, 8, 30, 6, 30, 5, 30, 7, 30]  # an AIME-like mix of short and long generations

    def reqs():
        return [
            ask(str(i), x, n, SnapStream(budget=64, recent=16, window=8), settings(False, n), i)  # noqa: E731
            for i, (x, n) in enumerate(zip(ids, limits))
        ]

    cont, c = engine_run(model, reqs(), rows=4)
    stat, s = engine_run(model, reqs(), rows=4, continuous=False)
    assert {k: d.tokens for k, d in cont.items()} == {k: d.tokens for k, d in stat.items()}
    assert all(len(cont[str(i)].tokens) <= n for i, n in enumerate(limits))
    assert c.steps < s.steps and c.idle_fraction() < s.idle_fraction()
    # continuously batched, a row idles only once the queue is empty: at most rows-1 rows x the longest tail
    assert c.idle_row_steps <= 3 * 30


def test_a_prompts_budgets_share_one_prefill_and_decode_side_by_side(monkeypatch):
    model = tiny_model("llama", seed=3)
    ids = prompts()[3]  # 200 tokens
    budgets = [SnapStream(budget=b, recent=16, window=8) for b in (48, 64, 96)] + [
        SnapKV(budget=80, window=16)
    ]
    want = [alone(model, ids, m, True, 7) for m in budgets]
    forwards = []
    real = model.forward

    def counting(*args, **kwargs):
        forwards.append(kwargs["input_ids"].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    record = PrefillRecord(window=32)
    reqs = [
        ask(
            str(n),
            ids,
            NEW,
            m,
            settings(True),
            7,
            record=record if n == 0 else None,
            replay=record if n else None,
        )
        for n, m in enumerate(budgets)
    ]
    held = weakref.ref(record)
    del record
    got, engine = engine_run(model, reqs, rows=4)
    gc.collect()
    assert held() is None  # the prompt's K/V record is freed once its budgets are in, not kept to the end
    assert [got[str(n)].tokens for n in range(4)] == want  # each budget as if run alone
    assert [got[str(n)].stats["prefill_replayed"] for n in range(4)] == [False, True, True, True]
    assert [s[1] for s in forwards].count(200) == 1  # one prefill forward for the four budgets
    assert engine.steps == NEW - 1  # the four decoded together: one step per token, not four
    assert [got[str(n)].stats["kv_slots"] for n in range(3)] == [48, 64, 96]


def compiled_equals_eager(arch: str, limits: list[int], min_steps: int):
    torch._dynamo.reset()
    model = tiny_model(arch, seed=3)
    ids = (prompts() * 4)[: len(limits)]
    methods = [SnapStream(budget=32, recent=16, window=8), StreamingLLM(budget=24)]

    def reqs():
        return [
            ask(str(i), x, n, methods[i % 2], settings(False, n), i)  # noqa: E731
            for i, (x, n) in enumerate(zip(ids, limits))
        ]

    eager, _ = engine_run(model, reqs(), rows=3)
    backend = Counting()
    compiled, engine = engine_run(model, reqs(), rows=3, compile=backend)
    assert {k: d.tokens for k, d in compiled.items()} == {k: d.tokens for k, d in eager.items()}
    assert engine.steps >= min_steps and backend.compiled == 1 and backend.runs == engine.steps
    torch._dynamo.reset()


def test_compiled_step_is_one_graph_over_512_steps_across_refills_and_equals_eager():
    compiled_equals_eager(
        "llama", [40, 200, 60, 250, 30] * 4, min_steps=512
    )  # 16-slot rings wrap, rows refill


def test_compiled_mla_step_is_one_graph_across_refills_and_equals_eager():
    compiled_equals_eager("deepseek_v3", [40, 90, 30, 60, 20, 50], min_steps=80)


def test_a_stop_string_ends_the_request_where_it_first_appears():
    model = tiny_model("llama", seed=3)
    ids = prompts()[0]
    method = SnapStream(budget=64, recent=16, window=8)
    free = alone(model, ids, method, False, 0, new=40)
    text = Tok().batch_decode(torch.tensor([free]))[0]
    stop = text[12:15]  # three letters the free generation spells at tokens 12-14 (or earlier)
    end = text.index(stop) + len(stop)
    req = ask("s", ids, 40, method, settings(False, 40), 0, until=[stop])
    got, _ = engine_run(model, [req], rows=2)
    assert got["s"].ended == "stop" and got["s"].tokens == free[:end]


def test_a_request_ends_at_the_first_eos_it_emits_of_the_merged_ids():
    """The EOS ids are the model's (two here) merged with the tokenizer's; greedy decoding ends at the first
    one it emits, that token included, and says so."""
    from types import SimpleNamespace

    from evalkit.lm import EvalkitLM

    model = tiny_model("llama", seed=3)
    ids = prompts()[0]
    method = SnapStream(budget=64, recent=16, window=8)
    free = alone(model, ids, method, False, 0, new=40)
    step = next(k for k in range(8, 40) if free[k] not in free[:k])  # the token's first appearance
    later = next(t for k, t in enumerate(free) if k > step and t not in free[:k])  # first emitted after it
    never = next(t for t in range(3, 256) if t not in free)
    holder = SimpleNamespace(
        model=SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[later, never])),
        tokenizer=SimpleNamespace(eos_token_id=free[step]),
    )
    eos = EvalkitLM._eos_ids(holder)
    assert eos == sorted({later, never, free[step]})
    for rows in (1, 2):
        reqs = [
            ask("e", ids, 40, method, settings(False, 40), 0),
            ask("f", ids[:90], 40, method, settings(False, 40), 1),
        ]
        got = {d.key: d for d in Engine(model, Tok(), eos, rows).run(reqs)}
        assert got["e"].ended == "eos" and got["e"].tokens == free[: step + 1], rows
        assert got["e"].stats["output_tokens"] == step + 1 and not got["e"].stats["hit_limit"]


def test_a_pools_row_figures_are_each_requests_own():
    """The pool reports each row as that request's own cache would (its method's ring or append footprint),
    after loading and after decode steps, whatever method the pool was shaped from."""
    from evalkit.kv import KVCache
    from evalkit.kv.pool import SlotPool

    model = tiny_model("llama", seed=3)
    ids = prompts()
    methods = [SnapKV(budget=64, window=16), SnapStream(budget=48, recent=16, window=8), Full()]
    alone = [KVCache.for_model(m, model, max_new_tokens=12) for m in methods]
    with torch.inference_mode():
        for cache, x in zip(alone, ids):
            model(torch.tensor([x]), cache=cache)
        pool = SlotPool.shaped_like(alone[0], len(alone), 256)
        for r, cache in enumerate(alone):
            pool.load_row(r, cache)
        assert pool.row_stats() == [c.row_stats()[0] for c in alone]
        token = torch.tensor([[5]])
        for _ in range(12):  # the same token into every row and into each request's own cache
            model(token.expand(len(alone), 1), position_ids=pool.rows.next_pos.clone()[:, None], cache=pool)
            for cache in alone:
                model(token, cache=cache)
    assert pool.row_stats() == [c.row_stats()[0] for c in alone]


def test_a_conversation_put_while_the_engine_decodes_takes_a_free_row_and_decodes_as_alone():
    """The engine takes conversations from its inbox between decode steps: one that arrives while others
    decode (as a server's requests would) takes the next free row and decodes as it would alone."""
    model = tiny_model("llama", seed=3)
    ids = prompts()
    method = SnapStream(budget=64, recent=16, window=8)
    inbox = Inbox(
        [
            ask("long", ids[0], NEW, method, settings(False), 0),
            ask("short", ids[1], 6, method, settings(False, 6), 1),
        ]
    )
    engine = Engine(model, Tok(), [0], rows=2)
    got = {}
    for done in engine.run(inbox):
        got[done.key] = done
        if done.key == "short":  # "long" is mid-decode: the new one takes the row "short" left
            inbox.put(ask("late", ids[2], 8, method, settings(False, 8), 2))
    assert got["late"].tokens == alone(model, ids[2], method, False, 2, new=8)
    assert got["long"].tokens == alone(model, ids[0], method, False, 0)
    assert engine.steps < NEW + 8  # "late" decoded beside "long", not after it
