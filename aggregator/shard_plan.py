"""How many shard workers an aggregator runs, and which fragments each owns (pure).

``diloco aggregator`` sizes itself from the run's manifest (``aggregator.shards``): one shard
worker per ``SHARD_VALUES`` parameters, no more than the machine's usable cores less one or the
run's fragments, each owning a contiguous range of whole fragments with about the same number of values.
A small run gets one: the aggregator then runs in its own process, as it always did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: parameters one shard worker is sized for. One aggregator process kept up with 8 learners of a
#: 50M model and fell behind 4 learners of a 100M one (bench.scale_synth, docs/BENCHMARKS.md)
SHARD_VALUES = 50_000_000
#: DILOCO_AGG_SHARDS=auto
AUTO = 0


def shard_count(sizes: Sequence[int], setting: int, cores: int) -> int:
    """Shard workers for fragments of ``sizes`` values: ``setting`` if >= 1 (never more than the
    fragments), else (``AUTO``) one per ``SHARD_VALUES`` parameters, at most ``cores - 1``: one core
    is left to the broker and the rest of the machine. (On 2 cores beside the nats-server, two
    workers at 4 x 100M took the machine to 1.9 busy cores and accepted 6.4 and 8.4 contributions
    per second, one alone 9.1 and 9.0 at 1.55 cores: docs/BENCHMARKS.md.)"""
    if not sizes:
        return 1
    if setting >= 1:
        n = setting
    else:
        n = min(math.ceil(sum(sizes) / SHARD_VALUES), cores - 1)
    return max(1, min(n, len(sizes)))


def split(sizes: Sequence[int], n: int) -> list[range]:
    """``n`` contiguous, non-empty ranges of fragment indices covering ``sizes`` whose largest sum
    of values is the smallest possible (the slowest shard sets the pace). Ties: earlier cuts."""
    k = len(sizes)
    if not 1 <= n <= k:
        raise ValueError(f"cannot split {k} fragments into {n} shards")
    pre = [0]
    for s in sizes:
        pre.append(pre[-1] + int(s))
    inf = float("inf")
    # best[j][i]: the smallest largest-shard sum of fragments [0, i) in j shards; cut[j][i] its last cut
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for j in range(1, n + 1):
        for i in range(j, k - (n - j) + 1):
            for c in range(j - 1, i):
                v = max(best[j - 1][c], pre[i] - pre[c])
                if v < best[j][i]:
                    best[j][i], cut[j][i] = v, c
    out: list[range] = []
    i = k
    for j in range(n, 0, -1):
        c = cut[j][i]
        out.append(range(c, i))
        i = c
    return out[::-1]


def fragments_text(r: range) -> str:
    """``r`` as DILOCO_AGG_FRAGMENTS reads it (``N`` or ``A-B``)."""
    return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def shard_id(aggregator_id: str, index: int) -> str:
    """The id of shard worker ``index`` of aggregator ``aggregator_id`` (metrics, consumer, logs)."""
    return f"{aggregator_id}-s{index}"
