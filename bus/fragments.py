"""Fragment plans: split the parameters into P flat float32 vectors, and when each one syncs.

numpy only, pure and deterministic: the aggregator and every learner compute the same plan from
the same shapes, and check it with ``plan_hash()``.

A fragment is the concatenation of element ranges of raveled (C-order) tensors::

    fragment_p = concat( ravel(params[s.path])[s.start:s.stop]  for s in fragments[p].slices )

Packing ("balanced tensor fragmentation"), on element counts (all float32, so bytes = 4 x):

1. ideal = total / P. A tensor with n > ideal elements is cut into k = ceil(n * P / total)
   near-equal pieces; smaller tensors stay whole. This guarantees at least P pieces.
2. Longest-processing-time greedy: pieces, largest first (ties by path, then offset), each go to
   the currently lightest fragment (ties by index). The first P pieces fill the P empty
   fragments, so none is empty.
3. Cap = ceil(max_imbalance * ideal), max_imbalance = 4/3 by default (the published bound). If a
   piece would push its fragment past the cap, the part that fits stays and the rest goes on to
   the next lightest fragment. Hence max size <= cap. ``max_imbalance=1`` gives fragments equal
   to within one element (lowest peak bandwidth) at the cost of more split tensors.

Schedule (Streaming DiLoCo): inner steps are counted from 1 (``step`` = inner steps completed).
Fragment p is due at step t when ``t > 0 and (t - offset_p) % H == 0``, with
``offset_p = floor(p * H / P)``. When H >= P at most one fragment is due per step; when H < P,
at most ceil(P / H). Offsets > 0 make the first sync of fragment p come after only offset_p
steps; the per-sync step and token counters tell the aggregator how much work it carries.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np


@dataclass(frozen=True)
class Slice:
    """Elements ``[start, stop)`` of ``ravel(params[path])``."""

    path: str
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Fragment:
    """Fragment ``index``: the concatenation of its slices, in order."""

    index: int
    slices: tuple[Slice, ...]

    @property
    def size(self) -> int:
        """Number of float32 elements (bytes on the wire before quantisation = 4 x size)."""
        return sum(s.size for s in self.slices)


@dataclass(frozen=True)
class FragmentPlan:
    """P fragments over the tensors in ``shapes`` (sorted by path)."""

    fragments: tuple[Fragment, ...]
    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Element count of each fragment, by index."""
        return tuple(f.size for f in self.fragments)

    @property
    def total_size(self) -> int:
        return sum(math.prod(shape) for _, shape in self.shapes)

    def plan_hash(self) -> str:
        """16 hex chars of sha256 over canonical JSON of shapes and slices."""
        payload = {
            "shapes": [[path, list(shape)] for path, shape in self.shapes],
            "fragments": [[[s.path, s.start, s.stop] for s in f.slices] for f in self.fragments],
        }
        blob = json.dumps(payload, separators=(",", ":")).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()[:16]


def plan_fragments(
    shapes: Mapping[str, Sequence[int]], num_fragments: int, max_imbalance: float = 4 / 3
) -> FragmentPlan:
    """Greedy balanced bin-packing of the tensors into ``num_fragments`` fragments.

    See the module docstring for the algorithm and its guarantees (every element in exactly
    one fragment once, no empty fragment, max size <= ceil(max_imbalance * total / P)). The
    result does not depend on the mapping's iteration order. Every process of a run must use
    the same arguments: compare ``plan_hash()``.
    """
    canon = tuple(sorted((str(k), tuple(int(d) for d in v)) for k, v in shapes.items()))
    for path, shape in canon:
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape of {path}: {shape}")
    sizes = {path: math.prod(shape) for path, shape in canon}
    total = sum(sizes.values())
    p_count = num_fragments
    if isinstance(p_count, bool) or not isinstance(p_count, (int, np.integer)) or p_count < 1:
        raise ValueError(f"num_fragments must be an int >= 1, got {num_fragments!r}")
    if p_count > total:
        raise ValueError(
            f"num_fragments ({p_count}) exceeds the number of parameters ({total}): "
            "some fragment would be empty"
        )
    if not max_imbalance >= 1.0:
        raise ValueError(f"max_imbalance must be >= 1, got {max_imbalance}")
    if max_imbalance == 4 / 3:
        cap = -(-4 * total // (3 * p_count))  # exact integer ceil(4/3 * total / P)
    else:
        cap = max(-(-total // p_count), math.ceil(max_imbalance * total / p_count))

    # 1. pieces: (size, path, start) with tensors above the ideal cut into k near-equal parts.
    pieces: list[tuple[int, str, int]] = []
    for path, n in sizes.items():
        if n == 0:
            continue
        k = max(1, -(-n * p_count // total))
        bounds = [i * n // k for i in range(k + 1)]
        pieces.extend((bounds[i + 1] - bounds[i], path, bounds[i]) for i in range(k))
    pieces.sort(key=lambda t: (-t[0], t[1], t[2]))

    # 2-3. LPT into the lightest fragment, spilling over the cap.
    heap = [(0, p) for p in range(p_count)]
    contents: list[list[Slice]] = [[] for _ in range(p_count)]
    for size, path, start in pieces:
        remaining, offset = size, start
        while remaining:
            load, p = heapq.heappop(heap)
            take = min(remaining, cap - load)  # > 0: the lightest load is below the mean < cap
            contents[p].append(Slice(path, offset, offset + take))
            heapq.heappush(heap, (load + take, p))
            remaining, offset = remaining - take, offset + take

    order = {path: i for i, (path, _) in enumerate(canon)}
    fragments = tuple(
        Fragment(p, tuple(sorted(_merge(c), key=lambda s: (order[s.path], s.start))))
        for p, c in enumerate(contents)
    )
    return FragmentPlan(fragments, canon)


def _merge(slices: list[Slice]) -> list[Slice]:
    """Join adjacent slices of the same tensor (fewer, longer copies)."""
    out: list[Slice] = []
    for s in sorted(slices, key=lambda s: (s.path, s.start)):
        if out and out[-1].path == s.path and out[-1].stop == s.start:
            out[-1] = Slice(s.path, out[-1].start, s.stop)
        else:
            out.append(s)
    return out


def _check(plan: FragmentPlan, params: Mapping[str, np.ndarray], p: int) -> Fragment:
    if not 0 <= p < plan.num_fragments:
        raise ValueError(f"fragment index {p} out of range [0, {plan.num_fragments})")
    frag = plan.fragments[p]
    shapes = dict(plan.shapes)
    for path in {s.path for s in frag.slices}:
        if path not in params:
            raise ValueError(f"parameter {path!r} of fragment {p} is missing")
        if tuple(np.shape(params[path])) != shapes[path]:
            raise ValueError(
                f"parameter {path!r} has shape {tuple(np.shape(params[path]))}, "
                f"the plan expects {shapes[path]}"
            )
    return frag


def gather(plan: FragmentPlan, params: Mapping[str, np.ndarray], p: int) -> np.ndarray:
    """Fragment p as a new float32 1-D array of ``plan.sizes[p]`` elements."""
    frag = _check(plan, params, p)
    out = np.empty(frag.size, dtype=np.float32)
    pos = 0
    for s in frag.slices:
        flat = np.asarray(params[s.path]).reshape(-1)
        out[pos : pos + s.size] = flat[s.start : s.stop]
        pos += s.size
    return out


def gather_all(plan: FragmentPlan, params: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Every fragment, by index."""
    return [gather(plan, params, p) for p in range(plan.num_fragments)]


def scatter(
    plan: FragmentPlan, params: Mapping[str, np.ndarray], p: int, vector: np.ndarray
) -> dict[str, np.ndarray]:
    """A new dict equal to ``params`` with fragment p replaced by ``vector``.

    Inputs are not mutated: tensors touched by fragment p are copied (as float32) before the
    write; untouched tensors are shared with ``params`` by reference.
    """
    frag = _check(plan, params, p)
    vector = np.asarray(vector)
    if vector.shape != (frag.size,):
        raise ValueError(f"fragment {p} needs a vector of shape ({frag.size},), got {vector.shape}")
    out = dict(params)
    copied: dict[str, np.ndarray] = {}
    pos = 0
    for s in frag.slices:
        if s.path not in copied:
            copied[s.path] = np.array(params[s.path], dtype=np.float32, copy=True)
        copied[s.path].reshape(-1)[s.start : s.stop] = vector[pos : pos + s.size]
        pos += s.size
    out.update(copied)
    return out


def sync_offsets(num_fragments: int, H: int) -> tuple[int, ...]:
    """offset_p = floor(p * H / P): P offsets spread evenly over [0, H)."""
    if num_fragments < 1 or H < 1:
        raise ValueError(f"need num_fragments >= 1 and H >= 1, got {num_fragments}, {H}")
    return tuple(p * H // num_fragments for p in range(num_fragments))


def due_fragments(step: int, offsets: Sequence[int], H: int) -> list[int]:
    """Fragments to sync after inner step ``step`` (counted from 1): (step - offset_p) % H == 0."""
    if H < 1:
        raise ValueError(f"H must be >= 1, got {H}")
    if step <= 0:
        return []
    return [p for p, off in enumerate(offsets) if (step - off) % H == 0]
