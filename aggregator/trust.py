"""Trust across rounds (pure): which learners' outer gradients agree with everyone else's.

A learner can lie inside every bound (issue 29): the negation of what it trained, a random
direction at an honest norm, its own old rounds sent again, or honest training on corrupted data.
Validation, the norm bound, the outlier check and the norm caps pass all of them by construction.
What gives them away is their *direction* over many rounds: honest learners of one run train the
same model on samples of the same distribution, so each one's outer gradient points, on average,
where the others' do.

Per fragment, for every contribution i of a merge this module measures its **agreement**

    a_i = cos(v_i, r_i),   r_i = sum_{j: another learner} t_j unit(v_j)

the cosine between its vector and the vectors of the merge's other learners (each as a unit vector, weighted by
its learner's current trust t_j, so a distrusted learner is nobody's reference). A merge of one
contribution carries no evidence (the fragment's momentum is no reference: one learner's
consecutive outer gradients are as often opposed as aligned), and its learner's score from earlier
merges sets its weight. ``a_i`` is taken on a fixed strided
sample of at most ``SAMPLE`` coordinates, read as runs of ``RUN`` consecutive values (the cosine of two dense vectors to about 1/sqrt(SAMPLE)).
It is normalised by the typical agreement of trusted contributions to the fragment (the median of
the last ``HISTORY`` of them; of the merge itself before that): ``z_i = a_i / typical``, about 1
for an honest learner whatever the phase of training, about 0 for a random direction, about -1 for
a negation.

Each learner's **score** is the upper confidence bound of its mean ``z``: an exponentially
weighted mean (forgetting rate ``rate``, about 1 / rate merges of memory; each ``z`` clipped to
[-1, 1.5]) plus ``kappa`` standard errors (its weighted spread over the square root of the
effective count). Its **trust** is

    t = clip((score - low) / (high - low), 0, 1)        (defaults: low 0, high 0.1)

and a learner is trusted in full for its first ``MIN_SEEN`` measured merges. So trust is withheld
only on clear evidence: a learner whose outer gradients point against the others' (a negation:
mean -1), or reliably nowhere (a random direction: a mean of 0 with a spread of about
1/sqrt(SAMPLE)) loses its weight; an honest learner whose data differ from the others' keeps it,
although it agrees less and far more noisily (two of eight learners of the reference, whose shards
are other Python sources: median z of 0.1-0.3 against 0.8-0.9, one in twenty below -0.5). A rule
on the mean alone weighed those two down and cost a clean run 1.1% of held-out loss
(``bench.byzantine``). A contribution whose own ``z`` is at most ``cut`` (-0.8: it points straight
against the others) gets weight 0 at once, before the score has moved. An agreement counts only
against at least three trusted others (``MIN_SUPPORT``: in a merge of a liar and one honest
learner, each points against the other, and with two honest ones each one's reference is the
other's vector minus the liar's: noise), so trust needs merges of four learners or more.
A **replay** (its sampled values are bit for bit those of
one of the learner's own last ``HASHES_KEPT`` contributions to the fragment: a digest of the sample
is kept) gets weight 0, and counts as z = -1. Near-copies are not looked for: honest consecutive
rounds of one learner can be nearly parallel (Adam's first steps move every value by about its
learning rate in a persistent direction; a run pulled off course makes every honest learner pull
back the same way: 0.985 measured), and a replay with noise added is an old direction, which the
agreement judges like any other.

Trust is relative to a majority: while the learners known to a fragment do not hold more than
half their trust (``has_majority``), every weight stays whole and everyone is a reference, so the
scores can recover. The merge then leaves the distrusted contributions out of both the mean and the step
(``aggregator.step.merge_step``): a merge of one honest and one distrusted contribution moves the
fragment by the honest one's share, a merge of distrusted ones only does not move it. They are still
*applied* (counted once, acknowledged): a weight is a decision, not a rejection, and a learner that
comes back into agreement regains its weight as its score rises.

Measured in ``bench.byzantine`` (docs/security.md): the figures for every kind and the clean cost.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

SAMPLE = 1 << 16  # coordinates of a fragment the agreement is measured on (strided)
HASHES_KEPT = 64  # digests of a learner's newest contributions to a fragment, to recognise a replay
HISTORY = 64  # agreements of trusted contributions the typical agreement is the median of
MIN_HISTORY = 8
# below this typical agreement the learners do not agree with each other either (outer gradients of
# pure noise, or a run that has converged): nobody can be singled out, and no score moves
MIN_TYPICAL = 0.05
# an agreement is evidence only against at least three trusted others: in a merge of a liar and one
# honest learner each points against the other (under load, the first merges of a run held two:
# an honest learner was scored -1 three times and merged at weight 0 eight times, bench.byzantine's
# system test). Then only the scores from other merges tell them apart
# Three, not two: in a merge of three with a liar still trusted, an honest learner's reference is the
# other honest vector minus the liar's, i.e. noise (bench.byzantine's system test: an honest learner
# averaged z -0.5 there and was cut 4 times)
MIN_SUPPORT = 2.5  # three others, most of them trusted
MODES = ("off", "observe", "weigh")


@dataclass(frozen=True)
class TrustSettings:
    mode: str = "weigh"  # off: nothing measured; observe: scores only; weigh: scores set the weights
    rate: float = 0.05  # forgetting rate of the weighted mean (a memory of about 1 / rate merges)
    low: float = 0.0  # score at and below which a learner merges at weight 0
    high: float = 0.1  # score from which it merges at full weight
    cut: float = -0.8  # a contribution whose own z is at most this merges at weight 0 at once
    kappa: float = 2.0  # the score is the mean z plus kappa standard errors

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"trust mode must be one of {MODES}, got {self.mode!r}")
        if not 0 < self.rate <= 1 or not self.low < self.high:
            raise ValueError("trust needs 0 < rate <= 1 and low < high")


MIN_SEEN = 3  # agreements measured before a learner's score can lower its weight


@dataclass
class LearnerTrust:
    """A learner's agreements on one fragment, as exponentially weighted sums (weight 1 for the
    newest, times 1 - rate per later one): their mean, standard error, and the score."""

    s0: float = 0.0  # sum of weights
    s1: float = 0.0  # weighted sum of z
    s2: float = 0.0  # weighted sum of z^2
    q: float = 0.0  # sum of squared weights (the effective count is s0^2 / q)
    seen: int = 0  # contributions measured
    distrusted: int = 0  # merged at weight 0
    replays: int = 0
    last: float = 1.0  # the newest z
    hashes: list = field(default_factory=list)  # digests of its newest contributions' samples, newest last
    version: int = 0  # the fragment's version its newest contribution was merged into

    def observe(self, z: float, rate: float) -> None:
        d = 1.0 - rate
        self.s0, self.s1, self.s2, self.q = d * self.s0 + 1, d * self.s1 + z, d * self.s2 + z * z, d * d * self.q + 1
        self.seen += 1
        self.last = z

    @property
    def mean(self) -> float:
        return self.s1 / self.s0 if self.s0 > 0 else 1.0

    def score(self, kappa: float = 2.0) -> float:
        """The upper confidence bound of its mean agreement (1 before ``MIN_SEEN``): low only when
        the evidence is clear, so a learner whose agreement is noisy (other data) keeps the doubt's
        benefit and one whose agreement is reliably nil (a random direction) does not."""
        if self.seen < MIN_SEEN or self.s0 <= 0:
            return 1.0
        m = self.mean
        var = max(0.0, self.s2 / self.s0 - m * m)
        n = self.s0 * self.s0 / max(self.q, 1e-12)
        return m + kappa * (var / n) ** 0.5

    def to_dict(self) -> dict:
        return {"s": [self.s0, self.s1, self.s2, self.q], "seen": self.seen, "distrusted": self.distrusted,
                "replays": self.replays, "last": self.last, "h": list(self.hashes), "v": self.version}

    @classmethod
    def from_dict(cls, d: dict) -> "LearnerTrust":
        s0, s1, s2, q = (float(x) for x in d["s"])
        return cls(s0, s1, s2, q, int(d["seen"]), int(d["distrusted"]), int(d["replays"]), float(d["last"]),
                   [bytes(b) for b in d.get("h", [])], int(d.get("v", 0)))

    def copy(self) -> "LearnerTrust":
        return LearnerTrust(self.s0, self.s1, self.s2, self.q, self.seen, self.distrusted, self.replays, self.last,
                            list(self.hashes), self.version)


@dataclass
class TrustState:
    """One fragment's trust record (persisted with its state, :class:`aggregator.step.FragmentState`)."""

    learners: dict = field(default_factory=dict)  # learner id -> LearnerTrust
    agree: list = field(default_factory=list)  # agreements of the last HISTORY trusted contributions

    def to_dict(self) -> dict:
        return {"l": {k: v.to_dict() for k, v in self.learners.items()}, "a": list(self.agree)}

    @classmethod
    def from_dict(cls, d: dict | None) -> "TrustState":
        if not d:
            return cls()
        return cls({str(k): LearnerTrust.from_dict(v) for k, v in d.get("l", {}).items()},
                   [float(x) for x in d.get("a", [])])

    def copy(self) -> "TrustState":
        return TrustState({k: v.copy() for k, v in self.learners.items()}, list(self.agree))


def trust_of(score: float, s: TrustSettings) -> float:
    return float(min(1.0, max(0.0, (score - s.low) / (s.high - s.low))))


def has_majority(state: TrustState, s: TrustSettings) -> bool:
    """True while the learners known to the fragment hold more than half their trust in full: a
    minority can be judged by the others. Otherwise the measure itself is in doubt (a run whose
    learners all disagree, a fragment whose learners all restarted on another model) and nobody's
    weight is lowered: without this, a fragment whose every contributor had fallen to weight 0
    compared each contribution with nothing, no score could move again, and every later merge
    applied nothing (bench.soak found four fragments frozen so, for minutes, under an earlier
    rule)."""
    if not state.learners:
        return True
    trust = [trust_of(lt.score(s.kappa), s) for lt in state.learners.values()]
    return float(sum(trust)) > 0.5 * len(trust)


OPPOSES = -0.3  # a mean agreement below this: the learner's outer gradients point against the others'


def reason_of(lt: LearnerTrust, s: TrustSettings) -> str:
    """Why a learner is suspected ("" when it is trusted), for metrics and ``diloco status``."""
    score = lt.score(s.kappa)
    if lt.replays and score < s.high:
        return "replays"
    if score < s.high and lt.mean < OPPOSES:
        return "opposes"
    if score < s.high:
        return "uncorrelated"
    return ""


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
    n = int(np.asarray(vectors[0]).size)
    if n <= SAMPLE:
        return np.stack([np.asarray(v, dtype=np.float32).reshape(-1) for v in vectors])
    stride = sample_stride(n)
    runs = (n - RUN) // stride + 1
    X = np.empty((len(vectors), runs, RUN), dtype=np.float32)
    for i, v in enumerate(vectors):
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
    agreements: list  # a_i (None: nothing to compare with)
    z: list
    replay: list
    state: TrustState


def assess(state: TrustState, learners: list[str], vectors: list[np.ndarray], settings: TrustSettings,
           version: int = 0) -> Assessment:
    """Measure one merge's contributions (``learners[i]`` sent ``vectors[i]``) against each other;
    return each one's weight factor and the updated record. Pure: ``state`` is not modified."""
    k = len(vectors)
    new = state.copy()
    if settings.mode == "off" or k == 0:
        return Assessment(np.ones(k), [None] * k, [None] * k, [False] * k, new)
    X = samples(vectors)
    t_prev = np.array([trust_of(new.learners[x].score(settings.kappa), settings) if x in new.learners else 1.0
                       for x in learners])
    majority = has_majority(new, settings)
    if not majority:  # nobody to judge by: everyone is a reference again, and no weight is lowered
        t_prev = np.ones(k)
    G = cosines(X)
    agreements: list = []
    support = []  # the trust of the others each contribution is compared with
    for i in range(k):
        # the others are other learners: a merge can hold two rounds of one learner (a backlog, a
        # learner out of step), and its own earlier round is no witness for it
        # and each other learner counts once: its rounds in the merge are averaged (a liar's two
        # rounds in one merge outweighed two honest learners in an honest one's reference)
        others = [j for j in range(k) if learners[j] != learners[i]]
        per: dict[str, int] = {}
        for j in others:
            per[learners[j]] = per.get(learners[j], 0) + 1
        t = np.array([t_prev[j] / per[learners[j]] for j in others])
        support.append(float(sum({learners[j]: t_prev[j] for j in others}.values())))
        if not others:
            agreements.append(None)
            continue
        dot = float(t @ G[i, others])
        rr = float(t @ G[np.ix_(others, others)] @ t)
        agreements.append(dot / np.sqrt(rr) if rr > 1e-12 else None)
    digests = [hashlib.blake2b(x.data, digest_size=8).digest() for x in X]
    replay = []
    for i, x in enumerate(learners):
        lt = new.learners.get(x)
        # an all-zero sample (a learner that did not move) is the same every time, and no replay
        replay.append(bool(lt is not None and digests[i] in lt.hashes and bool(np.any(X[i]))))
    known = [a for a in new.agree]
    current = [a for a, r in zip(agreements, replay) if a is not None and not r]
    ref = float(np.median(known)) if len(known) >= MIN_HISTORY else (float(np.median(current)) if current else 0.0)
    factors = np.ones(k)
    zs: list = []
    for i, x in enumerate(learners):
        lt = new.learners.setdefault(x, LearnerTrust())
        a = agreements[i]
        if replay[i]:
            z: float | None = -1.0
            lt.replays += 1
        elif a is None or ref < MIN_TYPICAL or support[i] < MIN_SUPPORT:
            # nothing to compare with (a lone contribution, noise), or one other only: in a merge of
            # a liar and one honest learner each points against the other, so neither is evidence
            z = None
        else:
            z = float(min(1.5, max(-1.0, a / ref)))
        zs.append(z)
        if z is not None:
            lt.observe(z, settings.rate)
        weight = trust_of(lt.score(settings.kappa), settings)
        if z is not None and z <= settings.cut:
            weight = 0.0
        factors[i] = weight
        if weight <= 0:
            lt.distrusted += 1
        lt.hashes = (lt.hashes + [digests[i]])[-HASHES_KEPT:]
        lt.version = version
    if not majority:
        factors = np.ones(k)
    for i in range(k):
        if factors[i] >= 1.0 and agreements[i] is not None and not replay[i]:
            new.agree.append(float(agreements[i]))
    new.agree = new.agree[-HISTORY:]
    return Assessment(factors, agreements, zs, replay, new)


def distrusted_participants(state: TrustState, version: int, per_round: int, settings: TrustSettings,
                            merged: dict | None = None) -> float:
    """How many of a round's participants the trust leaves out: the sum of ``1 - trust`` over the
    learners whose newest contribution to the fragment was merged within the last two rounds
    (``2 x per_round`` versions). The merge counts the round without them (``merge_step``): a
    distrusted learner's share is not applied, and the others' steps are not shrunk by its absence.
    0 without a trusted majority (nobody's weight is lowered then)."""
    if settings.mode != "weigh" or not has_majority(state, settings):
        return 0.0
    merged = merged or {}  # this merge's weight factor per learner (an instant cut counts as out)
    return float(sum(1.0 - min(trust_of(lt.score(settings.kappa), settings), merged.get(x, 1.0))
                     for x, lt in state.learners.items() if version - lt.version <= 2 * max(1, per_round)))


def summary(states: list[TrustState], settings: TrustSettings) -> dict:
    """Per learner over a process's fragments: the lowest score (and that fragment's mean agreement
    and reason), the trust it gives and the counts, for metrics and ``diloco status``."""
    out: dict[str, dict] = {}
    for st in states:
        for x, lt in st.learners.items():
            score = lt.score(settings.kappa)
            o = out.setdefault(x, {"score": score, "mean": lt.mean, "seen": 0, "distrusted": 0, "replays": 0,
                                   "reason": reason_of(lt, settings)})
            if score < o["score"]:
                o.update(score=score, mean=lt.mean, reason=reason_of(lt, settings))
            o["seen"] += lt.seen
            o["distrusted"] += lt.distrusted
            o["replays"] += lt.replays
    for o in out.values():
        o["trust"] = round(trust_of(o["score"], settings), 3)
        o["score"] = round(o["score"], 3)
        o["mean"] = round(o["mean"], 3)
    return out
