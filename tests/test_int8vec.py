"""An int8 contribution kept as it came (aggregator.int8vec): every reader sees bitwise what the
decoded array would give, and nothing fragment-sized is decoded."""

import numpy as np
import pytest

from aggregator.contribution import from_grad_message
from aggregator.int8vec import Int8Vector, all_finite
from aggregator.merge import DEFAULT_BLOCK, l2_norm, merge
from aggregator.trust import SAMPLE, samples
from aggregator.validate import Reason
from bus import codec
from bus.protocol import grad_meta

META = grad_meta(run="r", model="h", learner="l", incarnation="i", fragment=0, round_=0, base_version=0,
                 inner_steps=1, tokens=1, region="x")


def _pair(n: int, seed: int = 0, scale: float = 1.0, block: int = 256):
    """(Int8Vector, the same blob decoded whole)."""
    x = (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)
    blob = codec.encode_array(x, "int8", block=block)
    c = from_grad_message(META, blob)
    assert isinstance(c.vector, Int8Vector)
    return c.vector, np.asarray(codec.decode_array(blob))


def test_reads_are_the_decoded_values_at_any_offset():
    v, full = _pair(256 * 41 + 0, block=256)
    out = np.empty(v.size, np.float32)
    for a, b in [(0, v.size), (3, 300), (256, 1024), (100, 9000), (9000, v.size), (511, 512), (7, 7)]:
        assert np.array_equal(v.read(slice(a, b), out), full[a:b]), (a, b)
    assert np.array_equal(v.decoded(), full) and np.array_equal(np.asarray(v), full)
    assert v.nbytes == v.size + 4 * v.size // 256  # a quarter of the decoded vector, and the scales


def test_a_blob_that_is_not_whole_blocks_is_decoded_whole():
    x = np.ones(300, np.float32)
    c = from_grad_message(META, codec.encode_array(x, "int8", block=256))
    assert isinstance(c.vector, np.ndarray) and c.vector.size == 300


@pytest.mark.parametrize("n", [1000 * 256, DEFAULT_BLOCK * 3 + 256 * 5])
def test_norm_merge_and_sample_equal_the_decoded_bit_for_bit(n):
    pairs = [_pair(n, seed=s, scale=1 + s) for s in range(4)]
    lazy, full = [p[0] for p in pairs], [p[1] for p in pairs]
    assert [l2_norm(v) for v in lazy] == [l2_norm(f) for f in full]
    w = [1.0, 2.0, 0.5, 1.5]
    for method, robust, caps in [("mean", None, None), ("rda", None, None), ("mean", "clip", None),
                                 ("mean", "trim", None), ("mean", None, [np.inf, 1.0, np.inf, 2.0])]:
        a = merge(lazy, w, method, robust, caps=caps)
        b = merge(full, w, method, robust, caps=caps)
        assert np.array_equal(a, b), (method, robust, caps)
    assert np.array_equal(samples(lazy), samples(full))
    assert n <= SAMPLE or samples(lazy).shape[1] <= SAMPLE


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a forged scale is rejected, not warned about on stderr
def test_a_non_finite_scale_is_caught_as_the_decoded_array_would_be():
    from aggregator.validate import validate
    from tests.test_aggregator_validate import context, make

    v, _ = _pair(4096)
    assert all_finite(v)
    bad = Int8Vector(np.array(v.scales), v.codes, v.qblock)
    bad.scales[3] = np.inf
    assert not all_finite(bad) and not np.isfinite(l2_norm(bad)) and not np.isfinite(bad.decoded()).all()
    # a finite scale whose product with a code overflows float32 is not finite either (review)
    big = Int8Vector(np.full(1, 1e38, np.float32), np.full(256, 127, np.int8), 256)
    assert not all_finite(big) and not np.isfinite(l2_norm(big))
    assert validate(make(vector=big), context(fragment_sizes={0: 256}, max_inner_lr=None,
                                              norm_outlier_factor=None)) == Reason.non_finite
    with pytest.raises(ValueError):
        v.read(slice(0, 512, 2), np.empty(512, np.float32))
    nan = Int8Vector(np.full(1, np.nan, np.float32), np.zeros(256, np.int8), 256)
    assert validate(make(vector=nan), context(fragment_sizes={0: 256}, max_inner_lr=None)) == Reason.non_finite
    # the eager decode of the other codecs (and of int8 that is not whole blocks) is as quiet
    from aggregator.contribution import from_grad_message
    from bus import codec
    from bus.protocol import grad_meta

    meta = grad_meta(run="r", model="h", learner="l", incarnation="i", fragment=0, round_=0, base_version=0,
                     inner_steps=1, tokens=1, region="x")
    for q in ("int4", "e3m0", "int2", "int8"):
        blob = codec.encode_array(np.linspace(-1, 1, 300, dtype=np.float32), q)
        _, off = codec.decode_header(blob)
        blob[off:off + 4] = np.float32(np.inf).tobytes()  # the first block's scale
        vec = from_grad_message(meta, blob).vector
        assert isinstance(vec, np.ndarray) and not np.isfinite(vec).all(), q
        assert validate(make(vector=vec), context(fragment_sizes={0: 300}, max_inner_lr=None,
                                                  norm_outlier_factor=None)) == Reason.non_finite, q
    ok = Int8Vector(np.full(1, 1e-3, np.float32), np.ones(256, np.int8), 256)
    assert validate(make(vector=ok), context(fragment_sizes={0: 256}, norm_outlier_factor=None)) is None
