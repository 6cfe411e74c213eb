"""The KV storage axis (conf/kv/, evalkit.kv.storage): each format's round trip stays within its error bound,
int8/int4/int2 equal an independent float64 reference of KIVI's group quantization, the full cache held by a
storage follows KIVI's residual split, the bytes a cache holds equal what evalkit.memory models, a padded row
quantizes as it would alone, and bad settings fail with one line naming the setting."""

import pytest
import torch

from evalkit.config import ConfigError, choices
from evalkit.kv import H2O, Full, SnapKVDecode, SnapStream
from evalkit.kv.storage import Fp8Storage, IntStorage, NoStorage, StoredCache, make_storage
from evalkit.kv.storage.kivi import pack, unpack
from evalkit.memory import kv_geometry
from tests.conftest import TINY, tiny_model

INT_BITS = (8, 4, 2)


def keys_like(shape, seed=0, dtype=torch.float32):
    """Random K/V (B, H, T, D) with a few outlier channels (what makes KIVI quantize keys per channel)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., :: max(shape[-1] // 4, 1)] *= 12  # outlier channels
    return (x + torch.randn(shape[-1], generator=g)).to(dtype)  # a per-channel offset too


# --- the reference: KIVI's group quantization in float64, written from the paper and quant/new_pack.py ------
def kivi_reference(x: torch.Tensor, group: int, bits: int, per_channel: bool):
    """(codes, dequantized, unrounded codes) in float64. Keys (per_channel): KIVI transposes to (B, H, D, T)
    and groups the last axis; values: groups of the channel axis per token. scale = (mx - mn) / (2^bits - 1);
    data = (x - mn) / scale clamped to [0, 2^bits - 1] and rounded; read back as data * scale + mn. Scale and
    mn are held in the input's dtype (KIVI: fp16, the model's)."""
    d = x.double().transpose(-1, -2) if per_channel else x.double()  # groups run along the last axis
    d = d.unflatten(-1, (-1, group))
    mn, mx = d.amin(-1, keepdim=True), d.amax(-1, keepdim=True)
    scale = ((mx - mn) / (2**bits - 1)).to(x.dtype).double()
    mn = mn.to(x.dtype).double()
    exact = (d - mn) / torch.where(scale == 0, 1.0, scale)
    codes = exact.clamp(0, 2**bits - 1).round()
    deq = codes * scale + mn
    back = (lambda t: t.flatten(-2).transpose(-1, -2)) if per_channel else (lambda t: t.flatten(-2))
    return back(codes), back(deq), back(exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", INT_BITS)
def test_int_equals_float64_kivi_reference_per_layer_and_head(bits, dtype):
    storage = IntStorage(bits=bits, group=32, residual=128)
    for layer in range(3):  # (B, H, T, D) per layer; each head's groups compared on their own
        x = keys_like((2, 3, 128, 64), seed=layer, dtype=dtype)
        for side, per_channel in (("keys", True), ("values", False)):
            quantize = storage.quantize_keys if per_channel else storage.quantize_values
            dequantize = storage.dequantize_keys if per_channel else storage.dequantize_values
            held = quantize(x)
            codes = unpack(held.codes, bits).double()
            ref_codes, ref_deq, exact = kivi_reference(x, 32, bits, per_channel)
            # a code may differ only where the float64 value sits on a rounding tie (float32 arithmetic)
            tie = ((exact - exact.floor()) - 0.5).abs() < 1e-3
            assert torch.equal(codes[~tie], ref_codes[~tie]), (side, layer)
            assert (codes != ref_codes).float().mean() < 1e-3, (side, layer)
            deq = dequantize(held, dtype).double()
            # float32 arithmetic: the scale may be one ulp off the float64 one, times a code up to 2^bits - 1
            ulp = 4 * torch.finfo(dtype).eps * x.double().abs().amax()
            close = (deq - ref_deq.to(dtype).double()).abs() <= ulp
            assert close[~tie].all(), (side, layer)


@pytest.mark.parametrize("bits", INT_BITS)
def test_int_round_trip_within_half_a_step(bits):
    """|x - x'| <= scale / 2 in every group: scale = (max - min) / (2^bits - 1) of the group."""
    storage = IntStorage(bits=bits, group=16, residual=16)
    x = keys_like((1, 2, 64, 32), seed=3)
    for per_channel in (True, False):
        held = storage.quantize_keys(x) if per_channel else storage.quantize_values(x)
        if per_channel:  # (B, H, T/G, D) -> per entry
            step = held.scale.repeat_interleave(16, dim=-2)
            back = storage.dequantize_keys(held, x.dtype)
        else:  # (B, H, T, D/G) -> per entry
            step = held.scale.repeat_interleave(16, dim=-1)
            back = storage.dequantize_values(held, x.dtype)
        assert ((x - back).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all()
        assert held.codes.shape[-1] == 32 * bits // 8  # 8 / bits codes per byte


@pytest.mark.parametrize("bits", INT_BITS)
def test_pack_round_trip_and_layout(bits):
    codes = torch.randint(
        0, 2**bits, (2, 3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack(packed, bits), codes)
    first = packed[..., 0].int()  # the first code sits in the lowest bits
    assert torch.equal(first & (2**bits - 1), codes[..., 0].int())


def test_constant_group_reads_back_exactly():
    """KIVI divides by a zero scale (NaN); evalkit codes a constant group 0 and reads back its value."""
    x = torch.full((1, 1, 32, 32), 1.5)
    storage = IntStorage(bits=2, group=32, residual=32)
    assert torch.equal(storage.dequantize_keys(storage.quantize_keys(x), x.dtype), x)
    assert torch.equal(storage.dequantize_values(storage.quantize_values(x), x.dtype), x)


@pytest.mark.parametrize("fmt, mantissa, min_normal_exp", [("e4m3", 3, -6), ("e5m2", 2, -14)])
def test_fp8_round_trip_within_half_an_ulp_and_saturates(fmt, mantissa, min_normal_exp):
    storage = Fp8Storage(format=fmt)
    x = keys_like((2, 3, 40, 64), seed=4)
    scale = storage.calibrate(x)
    assert scale.shape == (2, 3, 1, 1)
    back = storage.decode(storage.encode(x, scale), scale, x.dtype)
    # normal numbers: relative error <= 2^-(mantissa + 1); subnormals: absolute <= half the smallest step
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), scale * 2.0 ** (min_normal_exp - mantissa - 1))
    assert ((x - back).abs() <= bound * (1 + 1e-6)).all()
    # a decode token far beyond the prompt's range saturates at the format's largest value, never inf/NaN
    big = storage.decode(storage.encode(x * 1e4, scale), scale, x.dtype)
    assert big.isfinite().all()
    assert torch.allclose(big.abs().amax(dim=(2, 3), keepdim=True), storage.limit * scale)


def test_fp8_headroom_and_per_tensor_scale():
    x = keys_like((2, 3, 40, 64), seed=5)
    head, tensor = Fp8Storage(), Fp8Storage(scale="tensor", headroom=2.24)
    assert torch.equal(head.calibrate(x), x.abs().amax(dim=(2, 3), keepdim=True) / 448)
    assert tensor.calibrate(x).shape == (2, 1, 1, 1)  # one per layer and row: rows never share a scale
    assert torch.allclose(tensor.calibrate(x), x.abs().amax(dim=(1, 2, 3), keepdim=True) * 2.24 / 448)


def test_padded_row_quantizes_as_alone():
    """Batch = single: a left-padded row's fp8 scale and KIVI key groups ignore its pad columns."""
    alone = keys_like((1, 2, 32, 32), seed=6)
    pads = 1000 * torch.randn(1, 2, 32, 32)  # pad columns hold garbage K/V
    batch = torch.cat([alone, torch.cat([pads[:, :, :16], alone[:, :, 16:]], 2)])  # row 1: 16 pads
    valid = torch.ones(2, 32, dtype=torch.bool)
    valid[1, :16] = False
    fp8 = Fp8Storage()
    assert torch.equal(fp8.calibrate(batch, valid)[1], fp8.calibrate(alone[:, :, 16:])[0])
    kivi = IntStorage(bits=4, group=16, residual=16)
    held = kivi.quantize_keys(batch, valid[:, None, :].expand(2, 2, 32))
    own = kivi.quantize_keys(alone[:, :, 16:])
    assert torch.equal(held.scale[1, :, 1:], own.scale[0]) and torch.equal(held.zero[1, :, 1:], own.zero[0])
    assert torch.equal(held.codes[1, :, 16:], own.codes[0])


# --- the full cache held by a storage (StoredCache) ---------------------------------------------------------
class KiviReference:
    """KIVI's cache policy as `models/llama_kivi.py` writes it (float64, not evalkit's code): prefill
    quantizes keys [0, T - T % R) and values [0, T - R); a decode step appends its token to the residuals,
    attention reads quantized + residual, and only then a key residual of R is quantized and the oldest of
    R + 1 values leaves the value residual."""

    def __init__(self, keys, values, group, bits, r):
        self.g, self.b, self.r, t = group, bits, r, keys.shape[-2]
        qk, qv = t - t % r, max(t - r, 0)
        self.kq, self.k_res = self._q(keys[..., :qk, :], True), keys[..., qk:, :].double()
        self.vq, self.v_res = self._q(values[..., :qv, :], False), values[..., qv:, :].double()

    def _q(self, x, per_channel):
        return kivi_reference(x, self.g, self.b, per_channel)[1]

    def step(self, k, v):
        """Append one token; return what attention reads this step; then flush as KIVI does."""
        self.k_res, self.v_res = (
            torch.cat([self.k_res, k.double()], -2),
            torch.cat([self.v_res, v.double()], -2),
        )
        seen = torch.cat([self.kq, self.k_res], -2), torch.cat([self.vq, self.v_res], -2)
        if self.k_res.shape[-2] == self.r:
            self.kq, self.k_res = torch.cat([self.kq, self._q(self.k_res, True)], -2), self.k_res[..., :0, :]
        if self.v_res.shape[-2] > self.r:
            self.vq = torch.cat([self.vq, self._q(self.v_res[..., :1, :], False)], -2)
            self.v_res = self.v_res[..., 1:, :]
        return seen


@pytest.mark.parametrize("bits", INT_BITS)
@pytest.mark.parametrize("prompt", [32, 45, 64, 100])  # T % R == 0 and not, T < R + 1 and above
def test_full_cache_reads_what_kivi_attends_to(bits, prompt):
    storage = IntStorage(bits=bits, group=8, residual=32)
    stream = keys_like((1, 2, prompt + 80, 16), seed=prompt), keys_like((1, 2, prompt + 80, 16), seed=99)
    keys, values = stream
    held = storage.hold(keys[:, :, :prompt], values[:, :, :prompt])
    ref = KiviReference(keys[:, :, :prompt], values[:, :, :prompt], 8, bits, 32)
    for t in range(prompt, prompt + 80):
        held.append(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        want = ref.step(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        for ours, theirs in zip(held.read(), want):
            assert ours.shape == theirs.shape
            assert torch.allclose(ours.double(), theirs, rtol=0, atol=1e-5), t


STORAGES = {
    "none": NoStorage(),
    "fp8_e4m3": Fp8Storage(),
    "fp8_e5m2_tensor": Fp8Storage(format="e5m2", scale="tensor"),
    "int8": IntStorage(bits=8, group=8, residual=16),
    "int4": IntStorage(bits=4, group=8, residual=16),
    "int2": IntStorage(bits=2, group=8, residual=32),
}


@pytest.mark.parametrize("name", STORAGES)
@pytest.mark.parametrize("prompt, new", [(30, 19), (48, 1), (5, 30)])
def test_bytes_held_equal_modelled(name, prompt, new):
    """What the full cache really holds (every tensor's bytes) = the storage's model of it (`hold_bytes`:
    KIVI's ragged layout; the slot caches' `layer_bytes` for the others)."""
    storage = STORAGES[name]
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, prompt), generator=torch.Generator().manual_seed(prompt))
    cache = StoredCache.for_model(storage, model)
    model.generate(ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    entries = prompt + new - 1  # the last token is generated, never fed
    assert cache.layers[0].length == entries
    g = kv_geometry(TINY["llama"], "float32", storage=storage)
    held = g.layers * storage.hold_bytes(entries, 0, g.cached_heads, g.key_width, g.value_width, g.kv_bits)
    assert cache.nbytes() == 2 * held


def test_modelled_bytes_by_hand():
    """Llama-3.1-8B-like head (8 KV heads of 128), bf16, int4 G=32 R=128, 1000 entries per layer and head."""
    heads, d = 8, 128
    int4 = IntStorage(bits=4, group=32, residual=128)
    qk, qv = 896, 1000 - 129  # keys: whole blocks of 128 before the last entry; values: all but 129
    keys = qk * d * 4 / 8 + qk // 32 * d * 2 * 2 + (1000 - qk) * d * 2
    values = qv * d * 4 / 8 + qv * (d // 32) * 2 * 2 + (1000 - qv) * d * 2
    assert int4.hold_bytes(1000, 0, heads, d, d, 16) == heads * (keys + values)
    # a ring row: sinks and top-K quantized once, the ring (residual) in bf16
    ring = 128
    q = 1000 - ring
    per_side = q * d * 4 / 8 + ring * d * 2
    assert int4.hold_bytes(1000, ring, heads, d, d, 16) == heads * (
        2 * per_side + -(-q // 32) * d * 2 * 2 + q * (d // 32) * 2 * 2
    )
    # the slot caches (kivi_slots): every slot's codes + its 1/32 of a key group's (scale, zero) + its value
    # (scale, zero) per 32 channels; the raw window: 128 keys and 129 values (append), the ring (ring row)
    per_slot = d * 4 // 8 + 2 * d * 2 // 32 + d * 4 // 8 + 2 * (d // 32) * 2
    assert int4.layer_bytes(1000, 0, heads, d, d, 16) == heads * (1000 * per_slot + (128 + 129) * d * 2)
    assert int4.layer_bytes(1000, ring, heads, d, d, 16) == heads * (1000 * per_slot + 2 * ring * d * 2)
    assert Fp8Storage().layer_bytes(1000, 0, heads, d, d, 16) == heads * 1000 * 2 * d + 2 * heads * 4
    assert NoStorage().layer_bytes(1000, 0, heads, d, d, 16) == heads * 1000 * 2 * d * 2


def test_memory_geometry_with_storage():
    config = dict(TINY["llama"], num_hidden_layers=32)
    plain = kv_geometry(config, "bf16")
    fp8 = kv_geometry(config, "bf16", storage=Fp8Storage())
    assert plain.sequence_bytes(4096) == plain.bytes_per_entry * 4096  # no storage: today's formula
    assert fp8.sequence_bytes(4096) == 32 * (2 * 4096 * 32 + 2 * 2 * 4)  # 2 heads x (16 + 16) wide, + scales
    assert fp8.sequence_bytes(4096, heads=1) == 32 * (4096 * 32 + 2 * 4)  # one TP rank's head


# --- the conf group and what a storage refuses -------------------------------------------------------------
def test_every_conf_makes_its_storage():
    assert choices("kv") == ["fp8_e4m3", "fp8_e5m2", "int2", "int4", "int8", "none"]
    for name in choices("kv"):
        assert make_storage(name).name == name


@pytest.mark.parametrize(
    "name, overrides, setting",
    [
        ("int4", {"bits": 3}, "bits"),
        ("int4", {"residual": 100}, "residual must be a multiple of group"),
        ("int4", {"group": 0}, "group"),
        ("int2", {"residual": "x"}, "residual"),
        ("int8", {"scale": "head"}, "unknown setting 'scale'"),
        ("fp8_e4m3", {"scale": "channel"}, "scale"),
        ("fp8_e4m3", {"headroom": 0.5}, "headroom"),
        ("fp8_e5m2", {"format": "e3m4"}, "format"),
        ("none", {"bits": 4}, "unknown setting 'bits'"),
    ],
)
def test_bad_settings_name_the_setting(name, overrides, setting):
    with pytest.raises(ConfigError, match=setting):
        make_storage(name, **overrides)


def test_target_must_be_a_storage():
    with pytest.raises(ConfigError, match="kv._target_"):
        make_storage({"_target_": "os.system"})


def test_value_group_must_divide_the_head():
    with pytest.raises(ValueError, match="group=32 must divide the value head width 16"):
        IntStorage().check_widths(16, 16)


class Facts:
    def __init__(self, tp=1, mla=False):
        self.tp, self.mla = tp, mla


def test_refusals():
    int4 = IntStorage()
    for method in (H2O(budget=64), SnapKVDecode(budget=128)):  # decode-time eviction overwrites single slots
        assert "overwrites single cache entries" in int4.refusal(method, Facts())
        assert Fp8Storage().refusal(method, Facts()) is None  # fp8 codes each element alone
    for method in (Full(), SnapStream(budget=64)):
        assert int4.refusal(method, Facts()) is None
    assert "MLA" in int4.refusal(Full(), Facts(mla=True))
    assert "tensor parallelism" in Fp8Storage(scale="tensor").refusal(Full(), Facts(tp=2))
    assert Fp8Storage().refusal(Full(), Facts(tp=2)) is None


@pytest.mark.parametrize("name", ["fp8_e4m3", "int4", "int2"])
def test_codec_traces_as_one_graph(name):
    """What the compiled decode step will run (quantize a write, dequantize for attention) has no graph
    break and no host sync: torch.compile(fullgraph=True) captures it and equals eager."""
    storage = make_storage(name)
    x = keys_like((2, 3, 64, 64), seed=7)
    valid = torch.ones(2, 3, 64, dtype=torch.bool)
    valid[1, :, :20] = False

    def round_trip(x, valid):
        if isinstance(storage, Fp8Storage):
            scale = storage.calibrate(x, valid[:, 0])
            return storage.decode(storage.encode(x, scale), scale, x.dtype), scale
        keys = storage.dequantize_keys(storage.quantize_keys(x, valid), x.dtype)
        return keys, storage.dequantize_values(storage.quantize_values(x), x.dtype)

    compiled = torch.compile(round_trip, fullgraph=True, backend="eager", dynamic=False)
    for ours, eager in zip(compiled(x, valid), round_trip(x, valid)):
        assert torch.equal(ours, eager)
