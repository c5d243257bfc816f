"""The merge log: what a merge did, written ahead instead of the fragment's whole state (pure).

A global version v+1 of fragment p is made durable by a small :class:`MergeRecord` (a few hundred
bytes plus about 100 per contribution): the keys of the contributions merged, where their chunks
lie in the GRAD stream (stream sequences), the norms, participation scale and round size the merge
used, the merge settings, and the outlier-reference restarts made since the previous merge. The
fragment's whole state (parameters, optimizer arrays, applied set: 8 bytes per value with the
``rounds`` optimizer, 6 with a bfloat16 momentum) is written only as a periodic **checkpoint**
(:class:`CheckpointPolicy`).

A restarted aggregator loads the newest checkpoint of each fragment and replays the records newer
than it (:func:`replay_one`), reading each contribution back from the GRAD stream, which keeps
every gradient chunk for ``DILOCO_STREAM_MAX_AGE`` whether acknowledged or not (limits retention).
``merge_step`` is deterministic, so the replayed state is the lost one, bit for bit.

Records go to ``diloco.<run>.state.<frag>.log.<slot>`` (``bus.subjects.Subjects.merge_log``),
slot = version mod :func:`log_slots`: the STATE stream keeps the newest messages of each subject,
so the newest ``log_slots`` records of a fragment are always held, and a checkpoint is forced
before the log since the newest one could outgrow them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgpack

from aggregator.contribution import Contribution
from aggregator.step import FragmentState, MergeSettings, merge_step
from aggregator.trust import TrustSettings, clear
from aggregator.weights import StalenessPolicy

LOG_FORMAT = 1


def log_slots(checkpoint_every: int) -> int:
    """Log subjects per fragment: twice the versions a checkpoint may lag behind, plus room for a
    checkpoint that is being written while merges go on."""
    return 2 * int(checkpoint_every) + 4


def settings_to_dict(s: MergeSettings) -> dict:
    d = dataclasses.asdict(s)
    d["staleness"] = dataclasses.asdict(s.staleness)
    return d


def settings_from_dict(d: dict) -> MergeSettings:
    d = dict(d)
    d["staleness"] = StalenessPolicy(**d["staleness"])
    # a record written before trust existed merged without it: replay it so
    # (an earlier rule's settings, low/high: its mode with this rule's defaults)
    names_t = {f.name for f in dataclasses.fields(TrustSettings)}
    d["trust"] = (TrustSettings(**{k: v for k, v in d["trust"].items() if k in names_t}) if "trust" in d
                  else TrustSettings(mode="off"))
    names = {f.name for f in dataclasses.fields(MergeSettings)}
    return MergeSettings(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class LoggedContribution:
    """One merged contribution: its key, its GRAD chunks' stream sequences (in chunk order) and the
    norm the merge used."""

    learner: str
    incarnation: str
    fragment: int
    round: int
    base: int
    seqs: tuple[int, ...]
    norm: float
    nbytes: int = 0  # bytes of its chunks' payload (the GRAD bytes a replay reads)

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.learner, self.incarnation, self.fragment, self.round)


@dataclass(frozen=True)
class MergeRecord:
    """How version ``version`` of ``fragment`` was made from version ``version - 1``."""

    fragment: int
    version: int
    contribs: tuple[LoggedContribution, ...]
    scale: float
    per_round: int
    settings: dict  # settings_to_dict(MergeSettings)
    restarts: tuple[tuple[float, ...], ...] = ()  # outlier-reference restarts, in order, before the merge
    ts: float = 0.0
    # operator clears of trust records (``diloco trust clear``: learner, clear id), applied before the merge
    cleared: tuple[tuple[str, int], ...] = ()

    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "fmt": LOG_FORMAT, "f": self.fragment, "v": self.version,
            "c": [[c.learner, c.incarnation, c.fragment, c.round, c.base, list(c.seqs), c.norm, c.nbytes]
                  for c in self.contribs],
            "scale": self.scale, "per_round": self.per_round, "settings": self.settings,
            "restarts": [list(r) for r in self.restarts], "ts": self.ts,
            **({"cl": [[x, n] for x, n in self.cleared]} if self.cleared else {}),
        }, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> "MergeRecord":
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        if d.get("fmt") != LOG_FORMAT:
            raise ValueError(f"merge record format {d.get('fmt')!r}, expected {LOG_FORMAT}")
        return cls(int(d["f"]), int(d["v"]),
                   tuple(LoggedContribution(str(a), str(b), int(c), int(r), int(v), tuple(int(x) for x in s), float(n),
                                            int(nb)) for a, b, c, r, v, s, n, nb in d["c"]),
                   float(d["scale"]), int(d["per_round"]), dict(d["settings"]),
                   tuple(tuple(float(x) for x in r) for r in d.get("restarts", ())), float(d.get("ts", 0.0)),
                   tuple((str(x), int(n)) for x, n in d.get("cl", ())))


def replay_one(state: FragmentState, record: MergeRecord, contribs: list[Contribution],
               inplace: bool = False) -> FragmentState:
    """The state after ``record``, from the state before it and its contributions (in record order):
    exactly what the merge computed (same inputs to the deterministic :func:`merge_step`; ``inplace``
    as there: ``state``'s arrays become the result's)."""
    if record.version != state.version + 1 or record.fragment != state.fragment:
        raise ValueError(f"record f{record.fragment} v{record.version} does not follow state "
                         f"f{state.fragment} v{state.version}")
    if [c.key for c in contribs] != [c.key for c in record.contribs]:
        raise ValueError(f"contributions of f{record.fragment} v{record.version} do not match its record")
    for r in record.restarts:
        state.norms.restart(state.fragment, list(r))
    state = with_clears(state, record.cleared)
    return merge_step(state, contribs, settings_from_dict(record.settings), [c.norm for c in record.contribs],
                      record.scale, record.per_round, inplace=inplace)


def applied_without_replay(state: FragmentState, record: MergeRecord) -> FragmentState:
    """A record whose contributions are gone from the GRAD stream (expired or evicted past its
    limits): the version advances and its keys count as applied (they were acknowledged: they must
    not be merged again), the parameters stay as they are. The work is lost, loudly (the caller
    logs and counts it)."""
    state = with_clears(state, record.cleared)
    applied = state.applied.copy()
    for c in record.contribs:
        if not applied.is_duplicate(k := _KeyOnly(*c.key, c.base)):  # type: ignore[arg-type]
            applied.record(k)  # type: ignore[arg-type]
    return dataclasses.replace(state, version=record.version, applied=applied,
                               last_merge=[c.key for c in record.contribs], last_scale=record.scale,
                               last_per_round=record.per_round, last_clipped=0)


def with_clears(state: FragmentState, cleared) -> FragmentState:
    """``state`` with the operator's trust clears of a record applied (``aggregator.trust.clear``)."""
    if not cleared:
        return state
    trust = state.trust
    for learner, clear_id in cleared:
        trust = clear(trust, learner, clear_id)
    return dataclasses.replace(state, trust=trust)


@dataclass(frozen=True)
class _KeyOnly:
    learner: str
    incarnation: str
    fragment: int
    round: int
    base_version: int

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.learner, self.incarnation, self.fragment, self.round)


@dataclass(frozen=True)
class CheckpointPolicy:
    """When a fragment's whole state is written: after ``every`` versions since its newest
    checkpoint, or after ``seconds`` with any version since (and at once when the GRAD stream is
    about to drop what its log points to: :func:`stream_overtaking`)."""

    every: int = 32
    seconds: float = 60.0

    def due(self, versions_since: int, seconds_since: float) -> bool:
        if versions_since <= 0:
            return False
        return versions_since >= self.every or seconds_since >= self.seconds


@dataclass
class LogPosition:
    """Per fragment: the newest checkpoint, and what the log holds beyond it."""

    checkpoint_version: int
    checkpoint_time: float
    versions_since: int = 0
    restarts: list = field(default_factory=list)  # outlier-reference restarts since the newest merge
    oldest_seq: int | None = None  # the oldest GRAD sequence the log since the checkpoint points to
    bytes_since: int = 0  # GRAD payload bytes of the contributions merged since the checkpoint


#: an early checkpoint of an aggregator behind its learners is written once the contributions
#: merged since the last hold this many times its bytes: the STATE writes it adds are then at most a
#: quarter of the GRAD bytes merged (what ``bus.streams`` sizes the replay window for)
EARLY_CHECKPOINT_RATIO = 4
#: behind: the contributions not yet delivered to the aggregator are more than this share of its
#: part of the GRAD stream (the stream then drops work nobody merged)
BEHIND_SHARE = 0.25


def grad_backlog_behind(undelivered: int, stream_messages: int, owned: int, fragments: int) -> bool:
    """The GRAD stream holds mostly work the aggregator has not read: ``undelivered`` messages of
    its durable consumer against its fragments' share of the stream's messages."""
    return undelivered > BEHIND_SHARE * stream_messages * owned / max(1, fragments)


#: checkpoints being stored at once (each is written from its fragment's arrays, whose merges wait
#: until it is stored): the others wait for a later pass of the aggregator's loop
CHECKPOINTS_IN_FLIGHT = 2
#: ... and their bytes: a second starts only if both fit (one always may). At 100M parameters in 8
#: fragments two of 100 MB are stored at once; at 1B, one of 1 GB (the broker's disk, and the
#: fragments whose merges wait, bounded)
CHECKPOINT_BYTES_IN_FLIGHT = 256 * 1024 * 1024


def checkpoint_may_start(in_flight: list[int], nbytes: int) -> bool:
    """May a checkpoint of ``nbytes`` start while checkpoints of ``in_flight`` bytes are being
    stored? Yes when none is; else while fewer than ``CHECKPOINTS_IN_FLIGHT`` are and all of them
    with this one hold at most ``CHECKPOINT_BYTES_IN_FLIGHT``."""
    if not in_flight:
        return True
    return len(in_flight) < CHECKPOINTS_IN_FLIGHT and sum(in_flight) + nbytes <= CHECKPOINT_BYTES_IN_FLIGHT


def early_checkpoint_pays(bytes_since: int, checkpoint_bytes: int, share_bytes: int, behind: bool) -> bool:
    """An early checkpoint (the GRAD stream about to drop what the log points to) is written only
    once the contributions merged since the last one hold enough bytes.

    * Keeping up: a quarter of ``share_bytes``, the fragment's share of the stream's byte limit
      (the limit x its values / every fragment's values: a small fragment's contributions are a
      small part of what the stream holds) (or
      ``EARLY_CHECKPOINT_RATIO`` checkpoints, if less). The stream then holds merged contributions,
      and the log of a fragment reaches the old end of the stream when it spans about half the
      stream or more: well past that, so the checkpoint is written and a restart replays every
      merge, as before.
    * Behind (:func:`grad_backlog_behind`): ``EARLY_CHECKPOINT_RATIO`` checkpoints' bytes. The
      stream is then full of contributions not merged yet, and the log of every fragment is always
      at its old end after one or two merges: each fragment was checkpointed again as soon as its
      last checkpoint was stored (at 4 x 100M, 16-22 checkpoints of 100 MB per 20 s, the broker's
      disk and CPU taken from the merges, and the aggregator never caught up; docs/BENCHMARKS.md).
      What that costs: a crash while the aggregator is behind may find up to that many bytes of
      merged contributions gone from the stream (``replay_lost``, said and counted), while the
      stream drops work nobody merged anyway."""
    ratio = EARLY_CHECKPOINT_RATIO * checkpoint_bytes
    if behind or share_bytes <= 0:
        return bytes_since >= (ratio if behind else 1)
    return bytes_since >= min(ratio, share_bytes // 4)


def stream_overtaking(oldest_seq: int | None, first_seq: int, last_seq: int, stored_bytes: int, max_bytes: int,
                      margin: float = 0.25) -> bool:
    """The GRAD stream is about to drop what a replay needs: it is filled to 1 - ``margin`` of its
    byte limit (beyond it, it drops its oldest messages) and the oldest chunk the log points to lies
    in the oldest ``margin`` of what it holds, or that chunk is gone already. Then the fragment is
    checkpointed at once. (Its age limit is kept by ``DILOCO_CHECKPOINT_SECONDS``, at most a quarter
    of it.)"""
    if oldest_seq is None:
        return False
    if oldest_seq < first_seq:
        return True
    full = max_bytes > 0 and stored_bytes >= (1.0 - margin) * max_bytes
    return full and oldest_seq < first_seq + max(1, int((last_seq - first_seq) * margin))
