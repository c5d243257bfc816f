"""Byte-level token data: corpus loading, a held-out split, and one disjoint shard per learner.

The token stream of N tokens is split once, independently of any learner::

    [ train: 0 .. N - n_heldout )[ held-out: N - n_heldout .. N ),  n_heldout = round(f * N)

and the training part is cut into M contiguous shards, learner i owning
``[floor(i * n_train / M), floor((i + 1) * n_train / M))``. A learner samples windows of
``seq_len + 1`` tokens that lie wholly inside its shard, so no two learners ever see the same
window and nobody trains on held-out tokens.

Sources (``load_corpus``):

- ``None``: the Python standard library's own ``.py`` files (sorted by relative path, test
  directories and site-packages skipped, capped at ``max_bytes``). Always present and offline,
  but it differs between Python versions: compare ``Corpus.fingerprint()`` across processes.
- a text file, or a folder of text files (recursive, sorted, hidden and binary files skipped),
  read as raw bytes (vocab 256).
- a nanoGPT-style ``.bin`` file of ``uint16`` tokens, memory-mapped (not read into RAM); pass
  ``vocab_size`` to match the tokenizer that produced it.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_HELDOUT_FRACTION = 0.05
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


def _stdlib_files(exclude_tests: bool) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = _SKIP_DIRS if exclude_tests else frozenset({"site-packages", "dist-packages", "__pycache__"})
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]  # prune before descending
        files.extend(Path(dirpath) / name for name in filenames if name.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _text_files(folder: Path) -> list[Path]:
    files = []
    for path in folder.rglob("*"):
        rel = path.relative_to(folder).parts
        if any(part.startswith(".") for part in rel) or not path.is_file():
            continue
        with path.open("rb") as fh:
            if b"\x00" in fh.read(8192):  # binary file
                continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _read_capped(files: list[Path], max_bytes: int | None) -> np.ndarray:
    """Concatenate file bytes (separated by a newline) up to ``max_bytes`` in total."""
    parts: list[bytes] = []
    total = 0
    for path in files:
        data = path.read_bytes()
        if parts:
            data = b"\n" + data
        if max_bytes is not None and total + len(data) > max_bytes:
            parts.append(data[: max_bytes - total])
            total = max_bytes
            break
        parts.append(data)
        total += len(data)
    return np.frombuffer(b"".join(parts), dtype=np.uint8)


@dataclass(frozen=True, eq=False)
class Corpus:
    """A 1-D token stream (uint8 or memory-mapped uint16) with its train/held-out split."""

    tokens: np.ndarray
    vocab_size: int = 256
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION
    source: str = "<array>"
    n_heldout: int = field(init=False)

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {self.tokens.shape}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if len(self.tokens) == 0:
            raise ValueError(f"corpus {self.source} is empty")
        object.__setattr__(self, "n_heldout", int(round(self.heldout_fraction * len(self.tokens))))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def train_tokens(self) -> np.ndarray:
        """The first N - n_heldout tokens (a view)."""
        return self.tokens[: len(self.tokens) - self.n_heldout]

    @property
    def heldout_tokens(self) -> np.ndarray:
        """The last n_heldout tokens (a view): never sampled by ``shard``."""
        return self.tokens[len(self.tokens) - self.n_heldout :]

    def shard_bounds(self, index: int, count: int) -> tuple[int, int]:
        """[lo, hi) token offsets of learner ``index``'s shard among ``count`` learners."""
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"need 0 <= index < count, got index={index}, count={count}")
        n = len(self.train_tokens)
        return index * n // count, (index + 1) * n // count

    def shard(self, index: int, count: int, seq_len: int, seed: int) -> "TokenShard":
        """Learner ``index`` of ``count``'s sampler (own shard, own Generator)."""
        lo, hi = self.shard_bounds(index, count)
        return TokenShard(
            self.tokens, lo, hi, seq_len, seed, index=index, vocab_size=self.vocab_size,
            source=self.source,
        )

    def heldout_batches(self, seq_len: int, batch_size: int, n_batches: int) -> np.ndarray:
        """Deterministic evaluation windows: int32 [n_batches, batch_size, seq_len + 1].

        The n_batches * batch_size window starts are spread evenly over the held-out part
        (they overlap only if it is shorter than that many windows). Same arguments, same
        batches: use them to compare global versions against each other.
        """
        if seq_len < 1 or batch_size < 1 or n_batches < 1:
            raise ValueError("seq_len, batch_size and n_batches must be >= 1")
        held = self.heldout_tokens
        length = seq_len + 1
        if len(held) < length:
            raise ValueError(
                f"held-out split of {self.source} has {len(held)} tokens, fewer than "
                f"seq_len + 1 = {length}; raise heldout_fraction or use a bigger corpus"
            )
        count = n_batches * batch_size
        starts = np.linspace(0, len(held) - length, count).round().astype(np.int64)
        windows = _windows(held, starts, length, self.vocab_size, self.source)
        return windows.reshape(n_batches, batch_size, length)

    def fingerprint(self) -> str:
        """16 hex chars of sha256 over the token bytes: equal corpora, equal fingerprints.

        Reads the whole stream (seconds for GB-sized .bin files): do it once at start-up.
        """
        h = hashlib.sha256()
        h.update(f"{self.tokens.dtype.str}:{self.vocab_size}:{self.heldout_fraction}".encode())
        step = 1 << 24
        for i in range(0, len(self.tokens), step):
            h.update(np.ascontiguousarray(self.tokens[i : i + step]).tobytes())
        return h.hexdigest()[:16]


def _windows(tokens: np.ndarray, starts: np.ndarray, length: int, vocab: int, source: str) -> np.ndarray:
    out = tokens[starts[:, None] + np.arange(length)[None, :]].astype(np.int32)
    if out.size and int(out.max()) >= vocab:
        raise ValueError(f"token {int(out.max())} in {source} is >= vocab_size {vocab}")
    return out


class TokenShard:
    """Random windows of ``seq_len + 1`` tokens from ``tokens[lo:hi]`` only.

    The Generator is seeded with ``SeedSequence(seed, spawn_key=(index,))``: give every learner
    the run seed and its own index and their streams are independent and reproducible.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        lo: int,
        hi: int,
        seq_len: int,
        seed: int,
        *,
        index: int = 0,
        vocab_size: int = 256,
        source: str = "<array>",
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not 0 <= lo <= hi <= len(tokens):
            raise ValueError(f"bad shard bounds [{lo}, {hi}) for {len(tokens)} tokens")
        if hi - lo < seq_len + 1:
            raise ValueError(
                f"shard {index} of {source} has {hi - lo} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}; use fewer learners, a shorter seq_len or a bigger corpus"
            )
        self.tokens, self.lo, self.hi, self.seq_len = tokens, lo, hi, seq_len
        self.vocab_size, self.source, self.index, self.seed = vocab_size, source, index, seed
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(index,))))

    def __len__(self) -> int:
        return self.hi - self.lo

    def batch(self, batch_size: int) -> np.ndarray:
        """int32 [batch_size, seq_len + 1]; starts uniform over the shard's valid positions (one
        Generator for the shard's whole stream; :meth:`batch_at` is the learner's, by step)."""
        return self._draw(self.rng, batch_size)

    def batch_at(self, step: int, batch_size: int) -> np.ndarray:
        """The batch of inner step ``step`` (0-based): a function of (seed, index, step) alone, so a
        learner restarted at step S draws exactly the batches one that never stopped would have
        drawn from S on, and none it trained on before (``bus.progress``). Its own Generator per
        step (``SeedSequence(seed, spawn_key=(index, step))``, ~20 us)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(self.seed, spawn_key=(self.index, int(step)))))
        return self._draw(rng, batch_size)

    def _draw(self, rng: np.random.Generator, batch_size: int) -> np.ndarray:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        length = self.seq_len + 1
        starts = self.lo + rng.integers(0, self.hi - self.lo - length + 1, size=batch_size)
        return _windows(self.tokens, starts, length, self.vocab_size, self.source)


def load_corpus(
    source: str | Path | None = None,
    *,
    vocab_size: int | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    exclude_tests: bool = True,
) -> Corpus:
    """Load a token stream; see the module docstring for the sources.

    ``max_bytes`` caps text sources (None: no cap); .bin files are memory-mapped whole.
    ``vocab_size`` defaults to 256 for text and 65536 for .bin (set it to the tokenizer's).
    """
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
    if source is None:
        files = _stdlib_files(exclude_tests)
        if not files:
            raise ValueError("no .py files found in the standard library directory")
        tokens = _read_capped(files, max_bytes)
        name = f"stdlib:{sysconfig.get_paths()['stdlib']}"
        return Corpus(tokens, vocab_size or 256, heldout_fraction, name)
    path = Path(source)
    if not path.exists():
        raise ValueError(f"corpus path {path} does not exist")
    if path.is_file() and path.suffix == ".bin":
        if path.stat().st_size < 2 or path.stat().st_size % 2:
            raise ValueError(f"{path} is not a uint16 token file (size {path.stat().st_size} bytes)")
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        return Corpus(tokens, vocab_size or 65536, heldout_fraction, str(path))
    files = [path] if path.is_file() else _text_files(path)
    if not files:
        raise ValueError(f"no text files found under {path}")
    tokens = _read_capped(files, max_bytes)
    if len(tokens) == 0:
        raise ValueError(f"corpus {path} is empty")
    return Corpus(tokens, vocab_size or 256, heldout_fraction, str(path))
