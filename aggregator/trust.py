"""Trust across rounds (pure): a learner loses its weight on evidence of hostility, not of difference.

A learner can lie inside every bound (issue 29): the negation of what it trained, a random
direction at an honest norm, its own old rounds sent again, or honest training on corrupted data.
Validation, the norm bound, the outlier check and the norm caps pass all of them by construction.
What gives the first three away is their *direction* over many rounds. What must not give anyone
away is data that differ (issue 39): learners of one run in other regions train on other corpora,
and even contiguous shards of one corpus differ (in the reference's "IID" runs two of eight
learners agree with each other at 0.47 and with the other six at about 0). An earlier rule compared
each learner with the trusted majority's mean and silenced such learners: a whole honest region,
and the "majority" was simply the other region.

So the evidence here is **pairwise and relative**. Per fragment, for every two learners of a merge,
the cosine of their outer gradients (a fixed strided sample of at most ``SAMPLE`` coordinates, read
in runs of ``RUN`` values) feeds an exponentially weighted mean per pair (about ``1 / rate``
merges of memory), and every contribution's cosine with its own learner's previous one on the
fragment (``OWN`` values of it are kept) feeds the learner's **own** mean. The **typical agreement**
``T`` of the fragment is the median, over its learners, of each one's median pair: how much the
typical learner agrees with the typical other. A learner's **best** pair is the partner it agrees with
most; a **loner** is a learner whose best pair is at most ``nil x T``. On the non-IID benchmark
(``bench.noniid``, figures in docs/security.md) every honest learner's best pair stayed well above
that at every merge (an honest learner agrees with the learners of its own data, or with the
typical learner), while a negation's best pair is the negation of its true worst one (about 0 or
below) and a random direction's is about 0. A learner is suspected, once it was measured in ``MIN_SEEN`` merges, when

* **opposes**: the median of its pairs (each at its upper confidence bound, ``kappa`` standard
  errors) is at most ``-oppose x T``, and it is a loner or agrees with no partner more than
  ``PARTNER x T``: it points against the others nearly as strongly as the typical learner points
  with them (a negation of an honest vector). Learners whose data differ point *apart*, and each
  agrees with the learners of its own data; a region of one (no partner but itself) can point
  against all the others late in a run, but less strongly (the benchmark's singleton region: at
  most about two thirds of ``T``, hence ``oppose`` 0.75 and not 0.5);
* **uncorrelated**: it is a loner and its own round-to-round agreement is at most ``nil x T`` too: it
  agrees with nobody, not even with itself (a random direction). An honest learner with data of its
  own agrees at least with itself;
* **replays**: its sample is bit for bit one of its own last ``HASHES_KEPT`` (that contribution gets
  weight 0 at once) in at least ``REPLAY_RATE`` of its recent contributions (one replay does it: a
  copy is never honest).

In mode ``weigh`` a suspected learner's contributions merge at weight 0: they leave the mean and the
step (``aggregator.step.merge_step``), are still applied and acknowledged, and the learner regains its
weight when the evidence fades. Nobody is weighed down while half the judged learners or more are
suspected (the measure itself is then in doubt). Nobody is judged anew while the fragment has fewer
than three learners with a measured pair (of three learners, one opposed by two is indistinguishable
from one opposing two, and ``T`` is 0: trust needs four learners or more), or while ``T`` is within
``NOISE_FLOORS`` of the cosine of two unrelated samples (the outer gradients of a schedule's last
steps are noise): the verdicts then stand as they were.
In mode ``observe`` the same verdicts are reported (metrics, ``diloco status``) and nothing is weighed.
An operator clears a learner's record (``diloco trust clear``: :func:`clear`).

What this cannot see: a liar whose negation looks like another region's honest data (two regions
whose data pull apart as strongly as each agrees within) is not named; a learner training honestly
on corrupted data is an honest learner with other data. Measured in ``bench.noniid`` and
``bench.byzantine`` (docs/security.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from aggregator.int8vec import Int8Vector

SAMPLE = 1 << 16  # coordinates of a fragment the agreement is measured on (strided)
OWN = 4096  # values of a learner's newest sample kept (float16) to compare its next contribution with
HASHES_KEPT = 64  # digests of a learner's newest contributions to a fragment, to recognise a replay
MIN_SEEN = 5  # merges a learner was measured in before it can be suspected
MIN_PAIR = 3  # observations of a pair (or of a learner's own cosine) before it counts as evidence
MIN_JUDGED = 3  # learners with a measured pair before anyone is judged
# below this typical agreement (x 1 / sqrt(values sampled): the cosine of two unrelated samples is
# about that) the learners do not agree with each other either (outer gradients of pure noise, or a
# run that has converged): nobody can be singled out
NOISE_FLOORS = 5.0
# "opposes" by its median needs no partner: a learner that agrees with another one at least this x
# the typical agreement is no negation (late in a run the typical agreement falls while an honest
# learner of a region of two still opposes the other region and agrees with its partner). A
# negation's best pair is the negation of its true worst one
PARTNER = 1.0
REPLAY_RATE = 0.1  # a learner whose recent contributions are replays at this rate or more: "replays"
FORGET_AFTER = 512  # versions of a fragment after which a learner not seen since is forgotten
MODES = ("off", "observe", "weigh")


@dataclass(frozen=True)
class TrustSettings:
    mode: str = "observe"  # off: nothing measured; observe: verdicts only; weigh: a suspect merges at weight 0
    rate: float = 0.05  # forgetting rate of the weighted means (a memory of about 1 / rate observations)
    oppose: float = 0.75  # "opposes": median pair agreement at most -oppose x the typical agreement
    nil: float = 0.25  # a loner: its best pair's mean at most nil x the typical agreement
    kappa: float = 1.0  # standard errors of the upper confidence bound of the median pair

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"trust mode must be one of {MODES}, got {self.mode!r}")
        if not 0 < self.rate <= 1 or not 0 < self.oppose or not 0 <= self.nil < 1 or self.kappa < 0:
            raise ValueError("trust needs 0 < rate <= 1, oppose > 0, 0 <= nil < 1 and kappa >= 0")


def _ew(st: list, x: float, rate: float) -> list:
    """An exponentially weighted record [s0, s1, s2, q, n] with ``x`` added (weight 1, older ones x (1 - rate))."""
    d = 1.0 - rate
    s0, s1, s2, q, n = st if st else (0.0, 0.0, 0.0, 0.0, 0)
    return [d * s0 + 1.0, d * s1 + x, d * s2 + x * x, d * d * q + 1.0, int(n) + 1]


def ew_mean(st: list) -> float:
    return st[1] / st[0] if st and st[0] > 0 else 0.0


def ew_bound(st: list, kappa: float, sign: float = 1.0) -> float:
    """The mean plus (sign=1) or minus (sign=-1) ``kappa`` standard errors of the effective count."""
    m = ew_mean(st)
    var = max(0.0, st[2] / st[0] - m * m)
    n = st[0] * st[0] / max(st[3], 1e-12)
    return m + sign * kappa * (var / n) ** 0.5


@dataclass
class LearnerTrust:
    """A learner's record on one fragment: its own-history agreement, replay rate, counts, the verdict
    after the fragment's newest merge (``trust``, ``reason``) and its evidence."""

    own: list = field(default_factory=list)  # ew record of cos(contribution, its previous one)
    replay: list = field(default_factory=list)  # ew record of "this contribution was a replay" (0/1)
    seen: int = 0  # contributions measured
    distrusted: int = 0  # merged at weight 0 (mode weigh)
    replays: int = 0
    hashes: list = field(default_factory=list)  # digests of its newest contributions' samples, newest last
    prev: bytes = b""  # OWN values of its newest sample (float16, scaled to a max of 1)
    version: int = 0  # the fragment's version its newest contribution was merged into
    trust: float = 1.0
    reason: str = ""
    evidence: dict = field(default_factory=dict)  # median / best pair (and partner), own, relative to typical

    def to_dict(self) -> dict:
        return {"own": list(self.own), "rp": list(self.replay), "seen": self.seen, "distrusted": self.distrusted,
                "replays": self.replays, "h": list(self.hashes), "prev": self.prev, "v": self.version,
                "t": self.trust, "r": self.reason, "e": dict(self.evidence)}

    @classmethod
    def from_dict(cls, d: dict) -> "LearnerTrust":
        return cls([float(x) for x in d.get("own", [])], [float(x) for x in d.get("rp", [])], int(d.get("seen", 0)),
                   int(d.get("distrusted", 0)), int(d.get("replays", 0)), [bytes(b) for b in d.get("h", [])],
                   bytes(d.get("prev", b"")), int(d.get("v", 0)), float(d.get("t", 1.0)), str(d.get("r", "")),
                   dict(d.get("e", {})))

    def copy(self) -> "LearnerTrust":
        return LearnerTrust(list(self.own), list(self.replay), self.seen, self.distrusted, self.replays,
                            list(self.hashes), self.prev, self.version, self.trust, self.reason, dict(self.evidence))


def pair_key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


@dataclass
class TrustState:
    """One fragment's trust record (persisted with its state, :class:`aggregator.step.FragmentState`)."""

    learners: dict = field(default_factory=dict)  # learner id -> LearnerTrust
    pairs: dict = field(default_factory=dict)  # (a, b), a < b -> ew record of cos(a's, b's) in merges of both
    typical: float = 0.0  # T after the newest merge
    cleared: dict = field(default_factory=dict)  # learner -> id of the newest operator clear applied
    judging: bool = False  # the newest merge judged anew (enough learners, T above the noise floor)

    def to_dict(self) -> dict:
        return {"fmt": 2, "l": {k: v.to_dict() for k, v in self.learners.items()},
                "p": [[a, b, *v] for (a, b), v in self.pairs.items()], "T": self.typical, "c": dict(self.cleared),
                "j": bool(self.judging)}

    @classmethod
    def from_dict(cls, d: dict | None) -> "TrustState":
        if not d or d.get("fmt") != 2:  # none, or an earlier rule's record (agreement with the mean): start over
            return cls()
        return cls({str(k): LearnerTrust.from_dict(v) for k, v in d.get("l", {}).items()},
                   {(str(r[0]), str(r[1])): [float(x) for x in r[2:6]] + [int(r[6])] for r in d.get("p", [])},
                   float(d.get("T", 0.0)), {str(k): int(v) for k, v in d.get("c", {}).items()}, bool(d.get("j", False)))

    def copy(self) -> "TrustState":
        return TrustState({k: v.copy() for k, v in self.learners.items()}, {k: list(v) for k, v in self.pairs.items()},
                          self.typical, dict(self.cleared), self.judging)


def clear(state: TrustState, learner: str, clear_id: int) -> TrustState:
    """``state`` without anything known of ``learner`` (an operator's ``diloco trust clear``): its
    record and its pairs are dropped, as for a learner never seen; ``clear_id`` is remembered so a
    clear is applied once. Pure."""
    new = state.copy()
    new.learners.pop(learner, None)
    new.pairs = {k: v for k, v in new.pairs.items() if learner not in k}
    new.cleared[learner] = max(int(clear_id), new.cleared.get(learner, 0))
    return new


def suspected(state: TrustState) -> list[str]:
    return sorted(x for x, lt in state.learners.items() if lt.reason)


def has_majority(state: TrustState) -> bool:
    """True while fewer than half the judged learners of the fragment are suspected: a minority can be
    judged by the others. Otherwise the measure itself is in doubt (a run whose learners all disagree,
    a fragment whose learners all restarted on another model) and nobody's weight is lowered (an
    earlier rule without this froze four fragments for minutes in bench.soak)."""
    judged = [lt for lt in state.learners.values() if lt.evidence]
    return 2 * sum(1 for lt in judged if lt.reason) < max(1, len(judged))



#: the sample is read in runs of this many consecutive values (one 64-byte cache line of float32): a
#: sample of single values at a stride of 16 or more reads every cache line of the fragment
RUN = 16


def sample_stride(n: int) -> int:
    """Runs of RUN values, one every ``sample_stride(n)`` values: at most SAMPLE values in all."""
    return max(RUN, RUN * -(-n // SAMPLE))


def sample_index(n: int) -> np.ndarray:
    """The coordinates the agreement is measured on: the whole fragment up to SAMPLE values; else
    the first RUN values of every ``sample_stride(n)``."""
    if n <= SAMPLE:
        return np.arange(n)
    starts = np.arange(0, n - RUN + 1, sample_stride(n))
    return (starts[:, None] + np.arange(RUN)[None, :]).reshape(-1)


def samples(vectors: list[np.ndarray]) -> np.ndarray:
    """The float32 samples of ``vectors`` (one row each, the coordinates of :func:`sample_index`),
    read through a strided view: no index array, no gather, a sixteenth of the fragment's cache
    lines (issue 37: the trust check was most of a small fragment's merge time)."""
    n = int(vectors[0].size)
    if n <= SAMPLE:
        return np.stack([np.asarray(v, dtype=np.float32).reshape(-1) for v in vectors])
    stride = sample_stride(n)
    runs = (n - RUN) // stride + 1
    X = np.empty((len(vectors), runs, RUN), dtype=np.float32)
    for i, v in enumerate(vectors):
        if isinstance(v, Int8Vector):  # its codes read the same way, times each value's block scale
            codes = np.lib.stride_tricks.as_strided(v.codes, shape=(runs, RUN), strides=(stride, 1), writeable=False)
            first = np.arange(runs) * stride
            X[i] = codes
            X[i] *= v.scales[(first[:, None] + np.arange(RUN)[None, :]) // v.qblock]
            continue
        flat = np.asarray(v, dtype=np.float32).reshape(-1)
        view = np.lib.stride_tricks.as_strided(flat, shape=(runs, RUN), strides=(stride * flat.strides[0], flat.strides[0]),
                                               writeable=False)
        X[i] = view
    return X.reshape(len(vectors), runs * RUN)


def cosines(X: np.ndarray) -> np.ndarray:
    """The matrix of cosines of the rows of X (float64; a zero row has cosine 0 with every row)."""
    X64 = X.astype(np.float64)
    G = X64 @ X64.T
    d = np.sqrt(np.maximum(np.diag(G), 0.0))
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    return G * inv[:, None] * inv[None, :]


@dataclass
class Assessment:
    """The trust decision of one merge: a weight factor per contribution (in order; the merge applies
    them in mode ``weigh`` only) and the state after."""

    factors: np.ndarray
    replay: list
    state: TrustState


def own_sample(x: np.ndarray) -> bytes:
    """The OWN values of a sample kept to compare the learner's next contribution with (float16 bytes,
    scaled to a max of 1: a cosine does not see the scale)."""
    v = np.asarray(x, dtype=np.float32)[:: max(1, x.size // OWN)][:OWN]
    m = float(np.max(np.abs(v))) if v.size else 0.0
    return (v / m if m > 0 else v).astype(np.float16).tobytes()


def own_cosine(prev: bytes, now: bytes) -> float | None:
    """The cosine of two kept samples (:func:`own_sample`; None: nothing kept, or of another size)."""
    if not prev or len(prev) != len(now):
        return None
    a = np.frombuffer(prev, dtype=np.float16).astype(np.float32)
    b = np.frombuffer(now, dtype=np.float16).astype(np.float32)
    na, nb = float(np.dot(a, a)), float(np.dot(b, b))
    return float(np.dot(a, b)) / (na * nb) ** 0.5 if na > 0 and nb > 0 else 0.0


def assess(state: TrustState, learners: list[str], vectors: list[np.ndarray], settings: TrustSettings,
           version: int = 0) -> Assessment:
    """Measure one merge's contributions (``learners[i]`` sent ``vectors[i]``); return each one's weight
    factor and the updated record. Pure: ``state`` is not modified."""
    k = len(vectors)
    if settings.mode == "off" or k == 0:
        return Assessment(np.ones(k), [False] * k, state.copy())
    X = samples(vectors)
    digests = [hashlib.blake2b(x.data, digest_size=8).digest() for x in X]
    own: list[float | None] = []
    kept: dict[str, bytes] = {}
    for x, row in zip(learners, X):  # a learner's second round in one merge is compared with its first
        lt = state.learners.get(x)
        now = own_sample(row)
        own.append(own_cosine(kept.get(x, lt.prev if lt else b""), now))
        kept[x] = now
    a = judge(state, learners, cosines(X), digests, [bool(np.any(x)) for x in X], own, settings, version,
              sampled=X.shape[1])
    for x, b in kept.items():
        a.state.learners[x].prev = b
    return a


def judge(state: TrustState, learners: list[str], G: np.ndarray, digests: list[bytes], moved: list[bool],
          own: list, settings: TrustSettings, version: int = 0, sampled: int = SAMPLE) -> Assessment:
    """The decision of :func:`assess` from what it measured: the cosines ``G`` of the contributions'
    samples, their digests, whether each sample is nonzero (``moved``) and each one's cosine with its
    learner's previous contribution (``own``, None for a first). Pure."""
    k = len(learners)
    new = state.copy()
    replay = []
    for i, x in enumerate(learners):
        lt = new.learners.setdefault(x, LearnerTrust())
        # an all-zero sample (a learner that did not move) is the same every time, and no replay
        r = bool(digests[i] in lt.hashes and moved[i])
        replay.append(r)
        lt.replay = _ew(lt.replay, 1.0 if r else 0.0, settings.rate)
        lt.replays += int(r)
        lt.seen += 1
        lt.hashes = (lt.hashes + [digests[i]])[-HASHES_KEPT:]
        lt.version = version
        if not r and own[i] is not None:
            lt.own = _ew(lt.own, float(own[i]), settings.rate)
    # one observation per pair of learners per merge (a learner's two rounds in one merge averaged);
    # a replay is an old direction: no evidence of how its learner relates to the others now
    obs: dict[tuple[str, str], list[float]] = {}
    for i in range(k):
        for j in range(i + 1, k):
            if learners[i] != learners[j] and not replay[i] and not replay[j] and moved[i] and moved[j]:
                obs.setdefault(pair_key(learners[i], learners[j]), []).append(float(G[i, j]))
    for key, cs in obs.items():
        new.pairs[key] = _ew(new.pairs.get(key, []), float(np.mean(cs)), settings.rate)
    _forget(new, version)
    _verdicts(new, settings, float(NOISE_FLOORS / np.sqrt(max(1, sampled))))
    factors = np.ones(k)
    if settings.mode == "weigh":
        majority = has_majority(new)
        for i, x in enumerate(learners):
            lt = new.learners[x]
            if replay[i] or (majority and lt.reason):
                factors[i] = 0.0
                lt.distrusted += 1
    return Assessment(factors, replay, new)


def _forget(st: TrustState, version: int) -> None:
    """Learners not seen for FORGET_AFTER versions leave the record (and their pairs)."""
    gone = {x for x, lt in st.learners.items() if version - lt.version > FORGET_AFTER}
    for x in gone:
        del st.learners[x]
    if gone:
        st.pairs = {key: v for key, v in st.pairs.items() if key[0] not in gone and key[1] not in gone}


def _verdicts(st: TrustState, s: TrustSettings, min_typical: float) -> None:
    """Every learner's verdict from the fragment's pair and own records (see the module docstring)."""
    means: dict[str, dict[str, list]] = {x: {} for x in st.learners}
    for (a, b), rec in st.pairs.items():
        if rec[4] >= MIN_PAIR and a in means and b in means:
            means[a][b] = rec
            means[b][a] = rec
    # the typical agreement: the median over learners of each one's median pair
    typ = {x: float(np.median([ew_mean(r) for r in m.values()])) for x, m in means.items() if m}
    T = float(np.median(list(typ.values()))) if typ else 0.0
    st.typical = T
    st.judging = bool(len(typ) >= MIN_JUDGED and T >= min_typical)
    if not st.judging:
        # nobody can be singled out now: too few learners, or the typical learner agrees with the
        # typical other no more than noise does (late in a run, the cosine schedule's last steps; or
        # a run where a liar leaves its region's honest learner without a partner, and that learner
        # cannot be told from it by direction): the verdicts stand as they were
        return
    for x, lt in st.learners.items():
        lt.trust, lt.reason, lt.evidence = 1.0, "", {}
        m = means[x]
        if len(m) < 2:
            continue
        med = float(np.median([ew_bound(r, s.kappa, 1.0) for r in m.values()]))
        partner = max(m, key=lambda y: ew_mean(m[y]))
        own_ok = len(lt.own) == 5 and lt.own[4] >= MIN_PAIR
        med_mean = float(np.median([ew_mean(r) for r in m.values()]))
        lt.evidence = {"median": round(med_mean / T, 3), "best": round(ew_mean(m[partner]) / T, 3), "partner": partner,
                       "own": round(ew_mean(lt.own) / T, 3) if own_ok else None, "pairs": len(m)}
        if lt.seen < MIN_SEEN:
            continue
        best = ew_mean(m[partner])
        loner = best <= s.nil * T  # it agrees with no other learner
        if len(lt.replay) == 5 and ew_mean(lt.replay) >= REPLAY_RATE:
            lt.reason = "replays"
        elif med <= -s.oppose * T and (loner or best <= PARTNER * T):
            lt.reason = "opposes"
        elif loner and own_ok and abs(ew_mean(lt.own)) <= s.nil * T:
            lt.reason = "uncorrelated"
        lt.trust = 0.0 if lt.reason else 1.0


def distrusted_participants(state: TrustState, version: int, per_round: int, settings: TrustSettings,
                            merged: dict | None = None) -> float:
    """How many of a round's participants the trust leaves out: the suspects (and this merge's replays,
    ``merged``: its weight factor per learner) whose newest contribution to the fragment was merged
    within the last two rounds (``2 x per_round`` versions). The merge counts the round without them
    (``merge_step``): a distrusted learner's share is not applied, and the others' steps are not
    shrunk by its absence. 0 without a majority of unsuspected learners (nobody is weighed down then)."""
    if settings.mode != "weigh" or not has_majority(state):
        return 0.0
    merged = merged or {}
    return float(sum(1.0 - min(lt.trust, merged.get(x, 1.0)) for x, lt in state.learners.items()
                     if version - lt.version <= 2 * max(1, per_round)))


def summary(states: list[TrustState], settings: TrustSettings) -> dict:
    """Per learner over a process's fragments: its verdict where it is trusted least (the reason and the
    evidence there, relative to that fragment's typical agreement), on how many fragments it is
    suspected, and the counts, for metrics and ``diloco status``."""
    out: dict[str, dict] = {}
    for st in states:
        for x, lt in st.learners.items():
            o = out.setdefault(x, {"trust": 1.0, "reason": "", "evidence": {}, "suspected_on": 0, "fragments": 0,
                                   "seen": 0, "distrusted": 0, "replays": 0})
            if lt.reason:
                o["suspected_on"] += 1
            if lt.evidence and (not o["evidence"] or (lt.trust, lt.evidence.get("median", 1.0))
                                < (o["trust"], o["evidence"].get("median", 1.0))):
                o.update(trust=lt.trust, reason=lt.reason, evidence=dict(lt.evidence))
            o["fragments"] += 1
            o["seen"] += lt.seen
            o["distrusted"] += lt.distrusted
            o["replays"] += lt.replays
    for o in out.values():
        o["score"] = o["evidence"].get("median")  # the median pair agreement over the typical one
        o["weighed"] = settings.mode == "weigh"  # observe: a verdict only
    return out
