"""Token data: sources, held-out split, disjoint per-learner shards, reproducible sampling."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest

from learner.data import Corpus, TokenShard, load_corpus


def _positional_bin(tmp_path: Path, n: int) -> Path:
    """A .bin whose token at offset i is i: every window reveals where it was cut from."""
    path = tmp_path / "train.bin"
    np.arange(n, dtype=np.uint16).tofile(path)
    return path


def test_default_corpus_is_stdlib_source_capped_and_deterministic():
    a = load_corpus(max_bytes=200_000)
    b = load_corpus(max_bytes=200_000)
    assert len(a) == 200_000 and a.tokens.dtype == np.uint8
    assert a.vocab_size == 256
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.fingerprint() == b.fingerprint()
    text = a.tokens.tobytes()
    assert b"def " in text and b"import " in text
    # starts with the alphabetically first stdlib module, sorted by relative path
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    first = sorted(p.name for p in stdlib.glob("*.py"))[0]
    assert text.startswith((stdlib / first).read_bytes()[:1000])
    assert a.source.startswith("stdlib:")


def test_text_file_and_folder(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes(b"hello world\n" * 10)
    c = load_corpus(f)
    assert c.tokens.tobytes() == b"hello world\n" * 10
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_bytes(b"BBB")
    (folder / "sub" / "a.md").write_bytes(b"AAA")
    (folder / ".hidden").write_bytes(b"HIDDEN")
    (folder / "blob.dat").write_bytes(b"\x00\x01\x02")
    c = load_corpus(folder)
    assert c.tokens.tobytes() == b"BBB\nAAA"  # sorted by relative path: b.txt < sub/a.md
    capped = load_corpus(folder, max_bytes=5)
    assert capped.tokens.tobytes() == b"BBB\nA"


def test_bin_file_is_memory_mapped(tmp_path):
    path = _positional_bin(tmp_path, 1000)
    c = load_corpus(path)
    assert isinstance(c.tokens, np.memmap) and c.tokens.dtype == np.uint16
    assert len(c) == 1000 and c.vocab_size == 65536
    shard = c.shard(0, 1, seq_len=7, seed=0)
    assert shard.batch(3).dtype == np.int32


def test_missing_path_and_bad_inputs_raise(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "nope.txt")
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="uint16"):
        load_corpus(tmp_path / "odd.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        load_corpus(tmp_path / "empty")
    (tmp_path / "e.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "e.txt")
    with pytest.raises(ValueError, match="heldout_fraction"):
        Corpus(np.zeros(10, np.uint8), heldout_fraction=1.0)


def test_corpus_too_small_for_seq_len_raises():
    c = Corpus(np.arange(100, dtype=np.uint8), heldout_fraction=0.1)
    with pytest.raises(ValueError, match="seq_len"):
        c.shard(0, 4, seq_len=30, seed=0)  # 90 train tokens / 4 = 22 per shard < 31
    with pytest.raises(ValueError, match="held-out"):
        c.heldout_batches(seq_len=10, batch_size=1, n_batches=1)  # 10 held-out < 11
    c.shard(0, 2, seq_len=30, seed=0)  # 45 per shard is enough


def test_split_and_shard_bounds():
    c = Corpus(np.zeros(1000, np.uint8), heldout_fraction=0.05)
    assert c.n_heldout == 50 and len(c.train_tokens) == 950 and len(c.heldout_tokens) == 50
    bounds = [c.shard_bounds(i, 3) for i in range(3)]
    assert bounds == [(0, 316), (316, 633), (633, 950)]
    with pytest.raises(ValueError):
        c.shard_bounds(3, 3)


@pytest.mark.parametrize("count", [1, 3, 5])
def test_learners_sample_only_their_own_shard(tmp_path, count):
    n, seq_len = 20_000, 15
    c = load_corpus(_positional_bin(tmp_path, n), heldout_fraction=0.1)
    held_lo = n - c.n_heldout
    seen = []
    for i in range(count):
        lo, hi = c.shard_bounds(i, count)
        shard = c.shard(i, count, seq_len, seed=123)
        for _ in range(20):
            b = shard.batch(16)
            assert b.shape == (16, seq_len + 1) and b.dtype == np.int32
            # windows are contiguous runs of the stream
            np.testing.assert_array_equal(np.diff(b, axis=1), 1)
            assert b.min() >= lo and b.max() < hi
            assert b.max() < held_lo
        seen.append((lo, hi))
    # shards tile the training split without overlap
    assert seen[0][0] == 0 and seen[-1][1] == held_lo
    assert all(seen[i][1] == seen[i + 1][0] for i in range(count - 1))


def test_sampling_reaches_both_ends_of_a_shard(tmp_path):
    c = load_corpus(_positional_bin(tmp_path, 200), heldout_fraction=0.0)
    shard = c.shard(1, 2, seq_len=9, seed=0)  # tokens [100, 200): 91 valid starts
    starts = np.concatenate([shard.batch(64)[:, 0] for _ in range(20)])
    assert starts.min() == 100 and starts.max() == 190


def test_same_seed_same_batches_and_learners_differ():
    c = Corpus(np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8))
    a = c.shard(0, 2, 16, seed=7)
    b = c.shard(0, 2, 16, seed=7)
    np.testing.assert_array_equal(a.batch(4), b.batch(4))
    other_seed = c.shard(0, 2, 16, seed=8)
    assert not np.array_equal(a.batch(4), other_seed.batch(4))
    # same seed, different learner index and same bounds: the streams must still differ
    t = c.tokens
    s0 = TokenShard(t, 0, 5000, 16, seed=7, index=0)
    s1 = TokenShard(t, 0, 5000, 16, seed=7, index=1)
    assert not np.array_equal(s0.batch(8), s1.batch(8))


def test_heldout_batches_are_deterministic_and_held_out(tmp_path):
    n = 10_000
    c = load_corpus(_positional_bin(tmp_path, n), heldout_fraction=0.05)
    held = c.heldout_batches(seq_len=31, batch_size=4, n_batches=3)
    assert held.shape == (3, 4, 32) and held.dtype == np.int32
    np.testing.assert_array_equal(held, c.heldout_batches(seq_len=31, batch_size=4, n_batches=3))
    assert held.min() == n - c.n_heldout  # spread from the start of the held-out part ...
    assert held.max() == n - 1  # ... to its very end
    np.testing.assert_array_equal(np.diff(held, axis=-1), 1)


def test_tokens_beyond_vocab_raise(tmp_path):
    c = load_corpus(_positional_bin(tmp_path, 1000), vocab_size=256, heldout_fraction=0.0)
    shard = c.shard(0, 1, seq_len=7, seed=0)
    with pytest.raises(ValueError, match="vocab_size"):
        for _ in range(50):
            shard.batch(8)


def test_fingerprint_distinguishes_corpora():
    a = Corpus(np.frombuffer(b"abc" * 100, dtype=np.uint8))
    b = Corpus(np.frombuffer(b"abd" * 100, dtype=np.uint8))
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == Corpus(np.frombuffer(b"abc" * 100, dtype=np.uint8)).fingerprint()
