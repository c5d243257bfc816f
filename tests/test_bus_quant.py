import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from bus import codec, quant


def _vec(n, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def _bound(name, x, block=quant.DEFAULT_BLOCK):
    """Per-element error bound of each quantiser (as documented in bus/quant.py)."""
    n = x.size
    nb = -(-n // block)
    padded = np.zeros(nb * block, np.float32)
    padded[:n] = x
    amax = np.abs(padded.reshape(nb, block)).max(axis=1).repeat(block)[:n]
    if name == "fp32":
        return np.zeros(n)
    if name == "bf16":
        return np.abs(x) * 2.0**-8
    if name == "int8":
        return amax / 127 / 2 * (1 + 1e-6)
    if name == "int4":
        return amax / 7 / 2 * (1 + 1e-6)
    if name == "int2":
        return amax / 3 * (1 + 1e-6)
    if name == "e3m0":
        return np.maximum(np.abs(x) / 3, 0.75 * amax * 2.0**-6) * (1 + 1e-6)


@pytest.mark.parametrize("name", quant.QUANTISERS)
@pytest.mark.parametrize("n", [1, 7, 256, 1000, 4096 + 3])
def test_error_bound_holds(name, n):
    x = _vec(n, seed=n) * np.float32(3.0)
    x[::17] *= 100  # spread magnitudes within blocks
    y = quant.roundtrip(x, name)
    assert y.shape == x.shape and y.dtype == np.float32
    err = np.abs(y.astype(np.float64) - x)
    assert np.all(err <= _bound(name, x) + 1e-30), (name, float((err - _bound(name, x)).max()))


@settings(max_examples=60, deadline=None)
@given(
    x=hnp.arrays(np.float32, st.integers(1, 600),
                 elements=st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)),
    name=st.sampled_from(quant.QUANTISERS),
    block=st.sampled_from([2, 16, 64, 256]),
)
def test_error_bound_property(x, name, block):
    y = quant.roundtrip(x, name, block)
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    bound = _bound(name, x, block)
    if name == "bf16":  # subnormals and exact zero: absolute slack at the bottom of the range
        bound = bound + 1e-38
    assert np.all(err <= bound + 1e-30)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_a_block_of_subnormal_values_goes_as_zeros_without_a_warning():
    """A block whose scale is subnormal: 1/scale would overflow (inf, then nan codes cast to int8:
    garbage, and RuntimeWarnings in the learner's log); it is sent as the codes of zero (int2, which
    has no zero level, as a third of the block's largest value); a block beside it is unaffected, and
    the in-place int8 path agrees bit for bit."""
    x = np.zeros(512, np.float32)
    x[:256] = np.linspace(-1e-39, 1e-39, 256, dtype=np.float32)  # subnormal values, scale ~8e-42
    x[256:] = np.linspace(-1.0, 1.0, 256, dtype=np.float32)
    for name in quant.QUANTISERS:
        y = quant.roundtrip(x, name, 256)
        assert np.all(np.abs(y[:256].astype(np.float64) - x[:256]) <= 2 * np.abs(x[:256]).max()), name
        assert np.array_equal(y[256:], quant.roundtrip(x[256:], name, 256)), name
    scales, codes = np.empty(2, np.float32), np.empty(512, np.int8)
    quant.quantise_int8_into(x, scales, codes, np.empty(512, np.float32), 256)
    ref = quant.quantise(x, "int8", 256)
    assert np.array_equal(scales, ref[0]) and np.array_equal(codes, ref[1]) and not codes[:256].any()


def test_int8_and_4bit_are_small_and_e3m0_keeps_sign_and_scale():
    x = _vec(1 << 16)
    sizes = {q: len(codec.encode_array(x, q)) for q in quant.QUANTISERS}
    assert sizes["bf16"] < 0.51 * sizes["fp32"]
    assert sizes["int8"] < 0.27 * sizes["fp32"]
    assert sizes["int4"] < 0.14 * sizes["fp32"] and sizes["e3m0"] < 0.14 * sizes["fp32"]
    y = quant.roundtrip(x, "e3m0")
    nz = y != 0
    assert np.all(np.sign(y[nz]) == np.sign(x[nz]))
    assert np.abs(y).max() == pytest.approx(np.abs(x).max(), rel=1e-6)
    # each level is a power of two times its block scale
    assert set(np.unique(np.round(np.log2(np.abs(y[nz]) / np.abs(x[:256]).max())[:256]))) <= set(range(-6, 1))


def test_all_zero_and_bad_names():
    z = np.zeros(300, np.float32)
    for q in quant.QUANTISERS:
        assert np.array_equal(quant.roundtrip(z, q), z)
    with pytest.raises(quant.QuantError, match="unknown quantiser"):
        quant.quantise(z, "fp8")
    with pytest.raises(quant.QuantError, match="block"):
        quant.quantise(z, "int8", block=3)
    with pytest.raises(quant.QuantError, match="wire parts"):
        quant.dequantise([np.zeros(3, np.float32)], "int8", 300)


@pytest.mark.parametrize("name", quant.QUANTISERS)
def test_codec_round_trip_keeps_shape(name):
    x = _vec(3 * 5 * 7).reshape(3, 5, 7)
    y = codec.decode_array(codec.encode_array(x, name))
    assert y.shape == (3, 5, 7)
    assert np.all(np.abs(y - x) <= _bound(name, x.reshape(-1)).reshape(x.shape) + 1e-30)


def test_fp32_decode_is_zero_copy():
    x = _vec(1024)
    blob = bytes(codec.encode_array(x))
    y = codec.decode_array(blob)
    assert np.array_equal(x, y) and not y.flags.owndata and not y.flags.writeable


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b[:3], "too short"),
        (lambda b: b"\xff\xff\xff\xff" + b[4:], "header length"),
        (lambda b: b[:-1], "needs exactly"),
        (lambda b: b + b"\0", "needs exactly"),
        (lambda b: b[:4] + b"\xc1" * (len(b) - 4), "not msgpack|header"),
        (lambda b: bytes(np.random.default_rng(1).integers(0, 256, 200, dtype=np.uint8)), None),
    ],
)
def test_garbage_gives_codec_error(mutate, match):
    blob = bytes(codec.encode_array(_vec(100), "int8"))
    with pytest.raises(codec.CodecError, match=match):
        codec.decode_array(mutate(blob))


def _with_header(h: dict, payload=b"\0" * 400) -> bytes:
    hb = msgpack.packb(h)
    return len(hb).to_bytes(4, "little") + hb + payload


@pytest.mark.parametrize(
    "h, match",
    [
        ({"v": 2, "q": "fp32", "b": 256, "dt": "<f4", "sh": [100]}, "version"),
        ({"v": 1, "q": "zip", "b": 256, "dt": "<f4", "sh": [100]}, "quantiser"),
        ({"v": 1, "q": "fp32", "b": 3, "dt": "<f4", "sh": [100]}, "block"),
        ({"v": 1, "q": "fp32", "b": 256, "dt": "<i4", "sh": [100]}, "dtype"),
        ({"v": 1, "q": "fp32", "b": 256, "dt": "<f4", "sh": [-1]}, "shape"),
        ({"v": 1, "q": "fp32", "b": 256, "dt": "<f4", "sh": [2**40, 2**40]}, "too many"),
        ({"v": 1, "q": "fp32", "b": 256, "dt": "<f4", "sh": [99]}, "needs exactly"),
    ],
)
def test_wrong_dtype_shape_or_header_fields(h, match):
    with pytest.raises(codec.CodecError, match=match):
        codec.decode_array(_with_header(h))


def test_json_helpers():
    assert codec.loads_json(codec.dumps_json({"a": np.float32(1.5), 1: [1]})) == {"a": 1.5, "1": [1]}
    with pytest.raises(codec.CodecError):
        codec.loads_json(b"\x00not json")
