"""Sparse low-bit codecs (bus.sparse through bus.codec): exact top-k, error bounds, error feedback
that loses nothing, the wire size, and hostile encodings refused with a named reason."""

import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from bus import codec, sparse

ULP = 2.0**-23


def _vec(n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)


def _check_encoding(x, name, chunk, k):
    blob = codec.encode_array(x, name, chunk, k)
    y = codec.decode_array(blob)
    assert y.shape == x.shape and y.dtype == np.float32
    sel = np.flatnonzero(y)
    for c0 in range(0, x.size, chunk):
        seg = np.abs(x[c0:c0 + chunk])
        mine = np.flatnonzero(y[c0:c0 + chunk])
        # zeros may be picked (and decode to 0): count the chosen set through the codec itself
        _, idx, _ = sparse.encode_parts(x, name, chunk, k)
        chosen = idx[(idx >= c0) & (idx < c0 + chunk)] - c0
        assert chosen.size == min(k, seg.size)
        assert set(mine) <= set(chosen)
        rest = np.delete(seg, chosen)
        if rest.size:
            assert seg[chosen].min() >= rest.max()  # exact top-k by magnitude
        s = seg.max()
        bound = s / (3 if name == "topk2" else 14) * (1 + 1e-6)
        err = np.abs(y[c0:c0 + chunk][chosen].astype(np.float64) - x[c0:c0 + chunk][chosen])
        assert (err <= bound + 1e-30).all()
    return blob, sel


@pytest.mark.parametrize("name", sparse.SPARSE)
@pytest.mark.parametrize("n,chunk,k", [(1, 4096, 64), (100, 4096, 64), (4096, 4096, 64), (10_003, 4096, 64),
                                       (70_000, 4096, 64), (5000, 256, 8), (999, 16, 16), (3000, 1000, 3),
                                       (600, 2, 1)])
def test_top_k_per_chunk_within_the_error_bound(name, n, chunk, k):
    _check_encoding(_vec(n, seed=n), name, chunk, k)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), chunk=st.integers(2, 1024), k=st.integers(1, 64), seed=st.integers(0, 2**16),
       name=st.sampled_from(sparse.SPARSE), ties=st.booleans())
def test_top_k_property(n, chunk, k, seed, name, ties):
    k = min(k, chunk)
    x = _vec(n, seed)
    if ties:  # many equal magnitudes and zeros
        x = np.round(x).astype(np.float32)
    _check_encoding(x, name, chunk, k)


@pytest.mark.parametrize("name", sparse.SPARSE)
def test_wire_size_is_the_documented_bits_per_value(name):
    n = 4096 * 64
    blob = codec.encode_array(_vec(n), name)
    h, off = codec.decode_header(blob)
    assert h["b"] == sparse.DEFAULT_CHUNK and h["k"] == sparse.DEFAULT_K
    assert (len(blob) - off) * 8 == pytest.approx(n * sparse.bits_per_value(name), abs=8)
    assert sparse.bits_per_value("topk2") == pytest.approx(0.2266, abs=1e-4)


@pytest.mark.parametrize("name", sparse.SPARSE)
@pytest.mark.parametrize("with_res", [False, True])
@pytest.mark.parametrize("decay", [1.0, 0.95])
def test_fused_feedback_equals_encode_then_decode(name, with_res, decay):
    n = 3 * 4096 + 77
    d = _vec(n, 1)
    r = _vec(n, 2) * np.float32(0.1) if with_res else None
    corrected = d.copy() if r is None else (d + np.float32(decay) * r).astype(np.float32)
    blob, sent, res, err = codec.encode_with_feedback(d.copy(), None if r is None else r.copy(), name,
                                                      keep_residual=True, decay=decay, chunk=4096)
    assert bytes(blob) == bytes(codec.encode_array(corrected, name))
    assert np.array_equal(sent, codec.decode_array(blob))
    # nothing lost: sent + residual is the corrected vector (exactly where nothing was sent, and to
    # within one float32 rounding of the residual where a value was)
    total = sent.astype(np.float64) + res
    off = sent == 0
    assert np.array_equal(res[off], corrected[off])
    assert np.all(np.abs(total - corrected) <= np.abs(res.astype(np.float64)) * ULP + 1e-45)
    want = np.linalg.norm(corrected.astype(np.float64) - sent) / np.linalg.norm(corrected.astype(np.float64))
    assert err == pytest.approx(want, rel=1e-5)
    # in place: the corrected vector handed over, its memory becomes the residual
    buf = corrected.copy()
    blob2, _, res2, _ = codec.encode_with_feedback(buf, None, name, keep_residual=True, in_place=True,
                                                   want_sent=False)
    assert bytes(blob2) == bytes(blob) and res2 is buf and np.array_equal(res2, res)


@pytest.mark.parametrize("name", sparse.SPARSE)
def test_error_feedback_over_many_rounds_loses_nothing(name):
    """Sum of what was sent + the final residual == sum of the outer gradients (decay 1)."""
    n = 8192
    rng = np.random.default_rng(5)
    res, sent_sum, delta_sum, slack = None, np.zeros(n), np.zeros(n), np.zeros(n)
    for t in range(60):
        d = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        delta_sum += d
        before = np.zeros(n) if res is None else np.abs(res.astype(np.float64))
        _, sent, res, _ = codec.encode_with_feedback(d.copy(), None if res is None else res.copy(), name,
                                                     keep_residual=True)
        sent_sum += sent
        # two float32 roundings a round (d + r, then corrected - sent), each within 2**-24 of its result
        slack += 2.0**-24 * (np.abs(d) + before + 2 * np.abs(res.astype(np.float64)) + np.abs(sent))
    gap = np.abs(sent_sum + res - delta_sum)
    assert np.all(gap <= slack), float((gap - slack).max())
    # the residual stays bounded: what is not sent now is sent later
    assert np.linalg.norm(res) < 0.5 * np.linalg.norm(delta_sum)


def test_decay_scales_the_residual_before_it_is_added():
    n = 8192
    d = _vec(n, 3)
    _, _, r1, _ = codec.encode_with_feedback(d.copy(), None, "topk2", keep_residual=True)
    blob, s_half, _, _ = codec.encode_with_feedback(d.copy(), r1.copy(), "topk2", keep_residual=True, decay=0.5)
    assert bytes(blob) == bytes(codec.encode_array((d + np.float32(0.5) * r1).astype(np.float32), "topk2"))
    _, s_full, _, _ = codec.encode_with_feedback(d.copy(), r1.copy(), "topk2", keep_residual=True, decay=1.0)
    assert not np.array_equal(s_full, s_half)
    with pytest.raises(codec.CodecError, match="decay"):
        codec.encode_with_feedback(d.copy(), None, "topk2", keep_residual=True, decay=1.5)


def test_decode_into_a_reused_buffer_clears_it():
    x = _vec(10_000)
    blob = codec.encode_array(x, "topk4")
    buf = np.full(10_000, 7.0, np.float32)
    y = codec.decode_array(blob, lambda n: buf)
    assert y.base is buf or y is buf
    assert np.array_equal(y, codec.decode_array(blob))


# -- hostile encodings -----------------------------------------------------------------------------


def _split(blob):
    (hl,) = struct.unpack_from("<I", blob, 0)
    return msgpack.unpackb(bytes(blob[4:4 + hl])), bytes(blob[4 + hl:])


def _join(head, body):
    h = msgpack.packb(head)
    return struct.pack("<I", len(h)) + h + body


def _parts(name, n, chunk, k, body):
    specs = sparse.part_sizes(name, n, chunk, k)
    out, off = [], 0
    for d, c in specs:
        out.append(bytearray(body[off:off + d.itemsize * c]))
        off += d.itemsize * c
    return out


def _hostile(name):
    n, chunk, k = 2 * 4096 + 100, 4096, 64
    x = _vec(n, 9)
    head, body = _split(codec.encode_array(x, name, chunk, k))
    scales, codes, index = _parts(name, n, chunk, k, body)
    cases = {}
    cases["k missing"] = (_join({kk: v for kk, v in head.items() if kk != "k"}, body), "k None")
    cases["k zero"] = (_join({**head, "k": 0}, body), "k 0")
    cases["k above chunk"] = (_join({**head, "k": 5000}, body), "k 5000")
    cases["k bool"] = (_join({**head, "k": True}, body), "k True")
    cases["chunk too big"] = (_join({**head, "b": 1 << 17}, body), "chunk")
    cases["short"] = (_join(head, body[:-1]), "needs exactly")
    cases["long"] = (_join(head, body + b"\0"), "needs exactly")
    loc = sparse.unpack_bits(np.frombuffer(bytes(index), np.uint8), 2 * k + 64, 12)
    dup = loc.copy()
    dup[1] = dup[0]  # a duplicate index in chunk 0
    cases["duplicate index"] = (_join(head, scales + codes + bytes(sparse.pack_bits(dup, 12))), "strictly increasing")
    desc = loc.copy()
    desc[0], desc[1] = loc[1], loc[0]
    cases["unsorted index"] = (_join(head, scales + codes + bytes(sparse.pack_bits(desc, 12))), "strictly increasing")
    past = loc.copy()
    past[-1] = 4000  # the last chunk holds 100 values
    cases["index past the end"] = (_join(head, scales + codes + bytes(sparse.pack_bits(past, 12))), "past the end")
    if name == "topk4":
        c = sparse.unpack_bits(np.frombuffer(bytes(codes), np.uint8), 2 * k + 64, 4)
        c[3] = 15
        cases["code out of range"] = (_join(head, scales + bytes(sparse.pack_bits(c, 4)) + index), "out of range")
    return cases


@pytest.mark.parametrize("name", sparse.SPARSE)
def test_hostile_sparse_encodings_are_refused_with_a_named_reason(name):
    for what, (blob, reason) in _hostile(name).items():
        with pytest.raises(codec.CodecError, match=reason):
            codec.decode_array(blob)


def test_a_non_finite_value_poisons_the_whole_vector():
    """A NaN or inf anywhere (sent or not) decodes to non-finite values: the aggregator's finiteness
    check refuses it, as it would a dense blob."""
    for bad in (np.nan, np.inf, -np.inf):
        x = _vec(3 * 4096)
        x[5000] = bad
        y = codec.decode_array(codec.encode_array(x, "topk2"))
        assert not np.isfinite(y).all()
    x = _vec(3 * 4096)
    x[7] = 3e38  # finite and huge: not poisoned (the norm bound refuses it)
    assert np.isfinite(codec.decode_array(codec.encode_array(x, "topk4"))).all()


def test_structured_magnitudes_that_defeat_the_sample_still_give_the_exact_top_k():
    """Only the sampled positions (every 8th) are large: the sample's threshold leaves fewer than k
    candidates in a chunk, and the full partition takes over (a learner crashed on this once)."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(4 * 4096) * 1e-6).astype(np.float32)
    x[: 4096: 8][:20] = 1.0 + np.arange(20, dtype=np.float32)
    x[2 * 4096:3 * 4096] = 0.0  # an all-zero chunk too
    _check_encoding(x, "topk2", 4096, 64)
    for c in range(4):  # every chunk so: no row has k candidates
        x[c * 4096:(c + 1) * 4096: 8][:20] = 1.0 + np.arange(20, dtype=np.float32)
    _check_encoding(x, "topk4", 4096, 64)


def test_padding_bits_must_be_zero():
    n, chunk, k = 4096 + 3, 4096, 64  # 67 selected: 804 index bits, 134 code bits
    head, body = _split(codec.encode_array(_vec(n), "topk2", chunk, k))
    scales, codes, index = _parts("topk2", n, chunk, k, body)
    index[-1] |= 0x80
    with pytest.raises(codec.CodecError, match="index padding"):
        codec.decode_array(_join(head, scales + codes + index))
    scales, codes, index = _parts("topk2", n, chunk, k, body)
    codes[-1] |= 0x80
    with pytest.raises(codec.CodecError, match="code padding"):
        codec.decode_array(_join(head, scales + codes + index))


def test_a_sparse_header_cannot_declare_a_huge_vector():
    """A sparse blob's size does not grow with its length: 1.6 MB could declare 2**34 values. The
    codec refuses more than MAX_SPARSE_ELEMENTS, and the aggregator bounds it by its fragments."""
    nc = 2**34 // 65536
    head = {"v": 1, "q": "topk2", "b": 65536, "dt": "<f4", "sh": [2**34], "k": 1}
    body = bytes(4 * nc) + bytes(-(-nc * 2 // 8)) + bytes(-(-nc * 16 // 8))
    with pytest.raises(codec.CodecError, match="too many elements for a sparse blob"):
        codec.decode_array(_join(head, body))


def test_empty_and_int2_chunked_encodings():
    for name in sparse.SPARSE:
        blob = codec.encode_array(np.zeros(0, np.float32), name)
        assert codec.decode_array(blob).size == 0
    # int2 packs four codes a byte: a chunked encode whose chunks are not whole bytes must still
    # equal the one-shot one (block 10, chunk 65536: 65530-value chunks before the fix)
    x = _vec(200_000, 8)
    blob, sent, _, _ = codec.encode_with_feedback(x.copy(), None, "int2", keep_residual=True, block=10)
    assert bytes(blob) == bytes(codec.encode_array(x, "int2", 10))
    assert np.array_equal(sent, codec.decode_array(blob))
    ref = _vec(200_000, 9)
    assert bytes(codec.encode_delta(x, ref, "int2", block=10)) == bytes(codec.encode_array(x - ref, "int2", 10))
