"""The fused error-feedback encoder is bitwise the unfused path (encode, decode, residual)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus import codec, quant
from learner.outer import feedback_step, relative_error


def _reference(delta, residual, q, keep):
    out = {}

    def roundtrip(x):
        out["x"], out["blob"] = x, codec.encode_array(x, q)
        return codec.decode_array(out["blob"])

    if keep:
        sent, res = feedback_step(delta, residual, roundtrip)
    else:
        sent, res = roundtrip(delta if residual is None else delta + residual), None
    return out["blob"], sent, res, relative_error(out["x"], sent)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), q=st.sampled_from(quant.QUANTISERS), chunk=st.sampled_from([256, 512, 1 << 16]),
       with_res=st.booleans(), keep=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_fused_equals_the_reference_bitwise(n, q, chunk, with_res, keep, seed):
    rng = np.random.default_rng(seed)
    delta = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 2)).astype(np.float32)
    residual = (rng.standard_normal(n) * 1e-4).astype(np.float32) if with_res else None
    blob, sent, res, err = _reference(delta.copy(), None if residual is None else residual.copy(), q, keep)
    fblob, fsent, fres, ferr = codec.encode_with_feedback(delta.copy(), None if residual is None else residual.copy(),
                                                          q, keep_residual=keep, chunk=chunk)
    assert bytes(fblob) == bytes(blob)
    assert np.array_equal(fsent, sent)
    assert (fres is None) == (not keep)
    if keep:
        assert np.array_equal(fres, res)
    assert ferr == pytest.approx(err, rel=1e-4, abs=1e-12)
    # without ``sent``: the same blob and residual, and decoding the blob gives ``sent`` bitwise
    gblob, gsent, gres, _ = codec.encode_with_feedback(delta.copy(), None if residual is None else residual.copy(),
                                                       q, keep_residual=keep, chunk=chunk, want_sent=False)
    assert gsent is None and bytes(gblob) == bytes(blob)
    assert np.array_equal(np.asarray(codec.decode_array(gblob)).reshape(-1), sent)
    if keep:
        assert np.array_equal(gres, res)
        # in place: the corrected vector (delta + residual) in one array, the new residual over it
        corrected = delta.copy()
        if residual is not None:
            corrected += residual
        hblob, _, hres, herr = codec.encode_with_feedback(corrected, None, q, keep_residual=True, chunk=chunk,
                                                          want_sent=False, in_place=True)
        assert bytes(hblob) == bytes(blob) and hres is corrected and np.array_equal(hres, res)
        assert herr == pytest.approx(err, rel=1e-4, abs=1e-12)


def test_bad_input_is_refused():
    with pytest.raises(codec.CodecError):
        codec.encode_with_feedback(np.zeros(4, np.float64), None, "int8", keep_residual=True)
    with pytest.raises(codec.CodecError):
        codec.encode_with_feedback(np.zeros(4, np.float32), np.zeros(5, np.float32), "int8", keep_residual=True)
