"""The engine fed while it runs (`Engine.run(feed=...)`, what evalkit.serve drives): conversations that arrive
between steps decode exactly as they would alone, each token reaches the feed as it is chosen (with the logits
it was chosen from), a dropped request releases its row at the next step, and a closed feed ends the run."""

import torch

from evalkit.engine import Engine, Intake
from evalkit.kv import SnapStream
from evalkit.turns import ask
from tests.conftest import tiny_model
from tests.kv.test_engine import NEW, Tok, alone, prompts, settings

METHOD = SnapStream(budget=64, recent=16, window=8)


class Script:
    """A feed that hands over request `i` once the engine has emitted `at[i]` tokens in all, drops the keys
    of `drop` once they have `after` tokens each, and closes when every request was handed over."""

    def __init__(self, reqs, at, drop=(), after=3):
        self.reqs, self.at, self.drop, self.after = list(reqs), list(at), set(drop), after
        self.tokens: dict[str, list[int]] = {}
        self.argmax_ok = True
        self.free_asked: list[int] = []
        self.emitted = 0

    def poll(self, free, idle):
        self.free_asked.append(free)
        new = []
        while self.reqs and len(new) < free and (idle or self.at[0] <= self.emitted):
            self.at.pop(0)
            new.append(self.reqs.pop(0))
        gone = {k for k in self.drop if len(self.tokens.get(k, [])) >= self.after}
        self.drop -= gone
        return Intake(new, gone, closed=not self.reqs)

    def token(self, key, turn, token, logits):
        self.tokens.setdefault(key, []).append(token)
        self.emitted += 1
        self.argmax_ok &= logits.shape == (1, 256) and int(logits.argmax()) == token  # greedy: its argmax


def test_late_requests_decode_as_alone_and_stream_each_token_as_chosen():
    model = tiny_model("llama", seed=3)
    ids = prompts()
    want = [alone(model, x, METHOD, False, i) for i, x in enumerate(ids)]
    reqs = [ask(str(i), x, NEW, METHOD, settings(False), i) for i, x in enumerate(ids)]
    feed = Script(reqs, at=[0, 5, 5, 30, 31])  # later requests join rows already decoding
    done = {d.key: d for d in Engine(model, Tok(), [0], rows=3).run([], feed=feed)}
    assert [done[str(i)].tokens for i in range(len(ids))] == want
    assert {k: feed.tokens[k] for k in done} == {k: d.tokens for k, d in done.items()}  # streamed, in order
    assert feed.argmax_ok
    assert max(feed.free_asked) == 3 and min(feed.free_asked) == 0  # never more than the free rows


def test_a_dropped_request_frees_its_row_at_the_next_step_and_the_others_are_untouched():
    model = tiny_model("llama", seed=3)
    ids = prompts()
    want = [alone(model, x, METHOD, False, i) for i, x in enumerate(ids)]
    reqs = [ask(str(i), x, NEW, METHOD, settings(False), i) for i, x in enumerate(ids)]
    feed = Script(reqs, at=[0, 0, 0, 0, 0], drop={"0", "2"}, after=3)
    engine = Engine(model, Tok(), [0], rows=2)
    done = {d.key: d for d in engine.run([], feed=feed)}
    assert done["0"].ended == done["2"].ended == "cancelled"
    assert len(done["0"].tokens) == len(done["2"].tokens) == 3  # released the step they were dropped at
    assert done["0"].stats["kv_seen"] == len(ids[0]) + 2  # its row's own figures when released
    assert [done[k].tokens for k in ("1", "3", "4")] == [want[1], want[3], want[4]]
    # every row released: no request, one valid slot each (SlotPool.idle_row)
    assert engine.live == [None, None] and engine.pool.rows.valid.sum(1).tolist() == [1, 1]


def test_an_idle_engine_waits_on_its_feed_and_a_closed_feed_ends_the_run():
    model = tiny_model("llama", seed=3)
    polls = []

    class Closed:
        def poll(self, free, idle):
            polls.append((free, idle))
            return Intake([], closed=True)

        def token(self, key, turn, token, logits):
            raise AssertionError("no request ran")

    assert list(Engine(model, Tok(), [0], rows=4).run([], feed=Closed())) == []
    assert polls == [(4, True)]
    with torch.inference_mode():  # the plain path is unchanged: no feed, no polls
        one = [ask("a", prompts()[4], 4, METHOD, settings(False, 4), 0)]
        assert [d.key for d in Engine(model, Tok(), [0], rows=1).run(one)] == ["a"]
