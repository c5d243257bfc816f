import random

import numpy as np
import pytest

from bus.chunks import Assembled, Assembler, Dropped, Gather, blob_size, checksum, chunk_headers, parse_chunk, split


def _chunks(blob, max_chunk, obj="run.l.0.1", meta=None):
    parts = split(blob, max_chunk)
    out = []
    for i, p in enumerate(parts):
        h = chunk_headers(obj, i, len(parts), len(blob), checksum(blob), meta or {"learner": "l"})
        out.append(parse_chunk(h, bytes(p), token=(obj, i)))
    return out


def test_split_sizes_and_empty():
    blob = bytes(range(256)) * 10
    parts = split(blob, 1000)
    assert [len(p) for p in parts] == [1000, 1000, 560] and b"".join(parts) == blob
    assert len(split(b"", 10)) == 1
    with pytest.raises(ValueError):
        split(blob, 0)


def test_split_of_float_view_is_in_bytes():
    a = np.arange(1000, dtype=np.float32)
    parts = split(memoryview(a), 1000)
    assert sum(len(p) for p in parts) == 4000 and all(p.itemsize == 1 for p in parts)


def test_a_gather_splits_and_checksums_as_its_parts_joined():
    """A Gather (the aggregator's checkpoint: a header and the fragment's live arrays) gives the
    chunks and crc of its parts joined; a chunk within one part is a view on it, not a copy."""
    rng = random.Random(5)
    for _ in range(2000):
        parts = [bytes(rng.randrange(256) for _ in range(rng.randrange(40))) for _ in range(rng.randrange(5))]
        g, whole, mc = Gather(parts), b"".join(parts), rng.randrange(1, 20)
        assert [bytes(c) for c in split(g, mc)] == [bytes(c) for c in split(whole, mc)], (parts, mc)
        assert checksum(g) == checksum(whole) and blob_size(g) == len(whole) == len(g) and g.tobytes() == whole
    arr = np.arange(1000, dtype=np.float32)
    chunks = split(Gather([b"head", arr]), 1000)
    assert len(chunks) == 5 and [len(c) for c in chunks] == [1000, 1000, 1000, 1000, 4]
    arr[300] = -1.0  # chunks 1-3 lie within the array: views on it
    assert bytes(chunks[1]) == bytes(memoryview(arr).cast("B")[996:1996])


def test_reordered_and_duplicated_chunks_assemble_once():
    blob = np.random.default_rng(0).bytes(10_000)
    cs = _chunks(blob, 999)
    shuffled = cs + cs[:3]
    random.Random(1).shuffle(shuffled)
    a = Assembler()
    results = [r for c in shuffled if (r := a.add(c, 0.0)) is not None]
    done = [r for r in results if isinstance(r, Assembled)]
    assert len(done) == 1 and done[0].blob == blob
    late = a.add(cs[0], 1.0)  # redelivery after completion
    assert isinstance(late, Dropped) and late.reason == "duplicate"
    assert a.pending == 0 and a.pending_bytes == 0


def test_missing_chunk_expires_and_is_never_delivered():
    blob = b"x" * 5000
    a = Assembler(max_age=10)
    for c in _chunks(blob, 1000)[:-1]:
        assert a.add(c, 0.0) is None
    assert a.expire(5.0) == []
    (d,) = a.expire(10.5)
    assert d.reason == "expired" and len(d.tokens) == 4 and a.pending == 0


def test_checksum_mismatch_and_header_disagreement():
    blob = b"abcdef" * 1000
    cs = _chunks(blob, 1000)
    a = Assembler()
    bad = [cs[0].__class__(**{**c.__dict__, "data": c.data[::-1]}) if c.index == 2 else c for c in cs]
    res = [a.add(c, 0) for c in bad]
    assert isinstance(res[-1], Dropped) and res[-1].reason == "checksum"
    other = _chunks(blob, 1000, meta={"learner": "forged"})
    a2 = Assembler()
    assert a2.add(cs[0], 0) is None
    r = a2.add(other[1], 0)
    assert isinstance(r, Dropped) and r.reason == "mismatch"


def test_oversized_chunks_and_pending_limit():
    blob = b"y" * 3000
    cs = _chunks(blob, 1000)
    a = Assembler()
    big = cs[0].__class__(**{**cs[1].__dict__, "data": b"z" * 2500})
    assert a.add(cs[0], 0) is None
    r = a.add(big, 0)
    assert isinstance(r, Dropped) and r.reason == "size"
    small = Assembler(max_pending_bytes=2000)
    r = small.add(cs[0], 0)
    assert isinstance(r, Dropped) and r.reason == "too_large"


@pytest.mark.parametrize(
    "headers",
    [None, {}, {"Diloco-Chunk": "not json"}, {"Diloco-Chunk": '{"o":"a","i":3,"n":2,"s":1,"c":0,"m":{}}'},
     {"Diloco-Chunk": '{"o":"a","i":0,"n":0,"s":1,"c":0,"m":{}}'},
     {"Diloco-Chunk": '{"o":"a","i":0,"n":1,"s":-1,"c":0,"m":{}}'},
     {"Diloco-Chunk": '{"o":"","i":0,"n":1,"s":1,"c":0,"m":{}}'},
     {"Diloco-Chunk": '{"o":"a","i":true,"n":1,"s":1,"c":0,"m":{}}'}],
)
def test_bad_headers_are_reported(headers):
    with pytest.raises(ValueError, match="bad_header"):
        parse_chunk(headers, b"data")
