"""Invalid KV settings fail at construction, naming the setting and the rule."""

import pytest

from evalkit.config import ConfigError
from evalkit.kv.config import make_method


@pytest.mark.parametrize(
    "name, settings, message",
    [
        ("snapstream", dict(budget=0), "budget must be > 0"),
        ("streamingllm", dict(budget=-5), "budget must be > 0"),
        ("snapkv", dict(budget=0), "budget must be > 0"),
        ("snapstream", dict(budget="many"), "budget must be a positive integer"),
        ("snapstream", dict(budget=64, sink=40, recent=32), "sink + recent must be <= budget"),
        ("snapstream", dict(budget=256, recent=16, window=32), "window must be in [1, recent]"),
        ("snapstream", dict(budget=256, pool_kernel=4), "pool_kernel must be odd and >= 1"),
        ("snapkv", dict(budget=256, pool_kernel=0), "pool_kernel must be odd and >= 1"),
        ("snapkv", dict(budget=16, window=32), "window must be in [1, budget]"),
        ("streamingllm", dict(budget=4, sink=4), "sink must be in [0, budget)"),
        ("full", dict(budget=128), "full: budget must be null"),
    ],
)
def test_invalid_settings_fail_at_construction(name, settings, message):
    with pytest.raises(ConfigError) as err:
        make_method(name, **settings)
    assert message in str(err.value)
    assert name in str(err.value)


def test_unknown_method_lists_choices():
    with pytest.raises(
        ConfigError,
        match="unknown method 'pyramidkv'; valid choices: adakv_expected_attention, adakv_snapkv, "
        "expected_attention, expected_attention_ring, full, h2o, keydiff, knorm, kvzip, kvzip_ring, "
        "pyramidkv_snapkv, snapkv, snapkv_decode, snapstream, streamingllm, tova, tova_decode",
    ):
        make_method("pyramidkv")


def test_defaults_follow_the_spec():
    m = make_method("snapstream", budget=1024)
    assert (m.sink, m.recent, m.window, m.pool_kernel) == (4, 128, 32, 7)  # recent = B/8
    assert m.blocks() == (4, 128, 1024 - 4 - 128)
    small = make_method("snapstream", budget=128)
    assert small.recent == 32  # B/8 = 16 is raised to the observation window
    assert make_method("streamingllm", budget=256).blocks() == (4, 252, 0)
    assert make_method("snapkv", budget=256).blocks() == (0, 32, 224)
