"""`python -m evalkit.serve kv=...`: the server takes the KV storage setting as a run does (conf/kv/, checked
before the model loads), its slot pool holds K/V that way, and its model card says so (a served run's
`kv=` is matched against it: evalkit.served_kv)."""

import pytest
import requests

from evalkit.config import ConfigError, compose
from evalkit.kv.storage import make_storage
from evalkit.serve.__main__ import checked
from evalkit.serve.live import engine_service
from tests.serve.conftest import post

INT4 = ["kv=int4", "kv.group=8", "kv.residual=16"]  # tiny_llama's heads are 16 wide


def test_serve_takes_the_kv_setting_before_the_model_loads():
    *_, storage = checked(compose("serve", ["model=tiny_llama", *INT4]))
    assert storage == make_storage("int4", group=8, residual=16)
    *_, plain = checked(compose("serve", ["model=tiny_llama"]))
    assert plain.name == "none"
    with pytest.raises(ConfigError, match="group=32 must divide the value head width 16"):
        checked(compose("serve", ["model=tiny_llama", "kv=int4"]))
    with pytest.raises(ConfigError, match="h2o overwrites single cache entries"):
        checked(compose("serve", ["model=tiny_llama", "method=h2o", *INT4]))


def test_the_card_reports_the_storage_and_the_pool_holds_it(serve, tiny_llama, one_thread):
    storage = make_storage("int4", group=8, residual=16)
    svc = engine_service(*tiny_llama, "tiny", "snapstream", rows=2, queue_limit=4, budget=64, storage=storage)
    url, _ = serve(svc)
    entry = requests.get(url + "/v1/models", timeout=60).json()["data"][0]
    assert entry["evalkit"]["kv_storage"] == {
        "dtype": "float32",
        "name": "int4",
        "bits": 4,
        "group": 8,
        "residual": 16,
    }
    body = {"model": "tiny", "prompt": "The lamp by the window", "temperature": 0, "max_tokens": 6}
    answer = post(url, "/v1/completions", body).json()
    assert answer["usage"]["kv"]["storage"]["name"] == "int4"
    pool = svc.backend.engine.pool
    layer = pool.layers[0]
    assert str(layer.keys.dtype) == "torch.uint8" and len(layer.scales) == 3  # codes + raw windows
    text = requests.get(url + "/metrics", timeout=30).text
    gauge = next(line for line in text.splitlines() if line.startswith("evalkit_kv_pool_bytes "))
    codes = sum(x.numel() for lay in pool.layers for x in (lay.keys, lay.values))  # uint8: a byte each
    windows = sum(x.numel() * x.element_size() for lay in pool.layers for x in lay.scales)
    assert windows > 0 and int(float(gauge.split()[1])) == codes + windows  # it counted the codes alone


def test_a_request_budget_the_storage_refuses_is_a_400(serve, tokenizer):
    """A request's own budget is checked against the server's storage as a run's is: a ring budget int KV
    cannot group is the client's error (400 naming the rule), never an engine crash."""
    from omegaconf import OmegaConf

    from evalkit.config import group_config
    from evalkit.kv.config import make_method
    from evalkit.serve.service import Card, Service
    from tests.serve.conftest import FakeBackend

    conf = OmegaConf.merge(group_config("method", "snapstream"), {"budget": 64})
    card = Card("fake", 256, make_method(conf), conf, {}, "fake", None, 4, kv=make_storage("int4", group=8))
    url, _ = serve(Service(card, tokenizer, FakeBackend(tokenizer)))
    body = {"model": "fake", "prompt": "The lamp", "max_tokens": 2, "temperature": 0}
    bad = post(url, "/v1/completions", {**body, "budget": 60})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "budget"
    assert "must be a multiple of group=8" in bad.json()["error"]["message"]
    assert post(url, "/v1/completions", {**body, "budget": 48}).status_code == 200
