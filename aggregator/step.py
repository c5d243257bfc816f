"""One fragment's durable state and the pure merge step that moves it from version v to v+1.

:class:`FragmentState` is everything the aggregator must not lose for a fragment: version,
parameters, outer-optimizer state, the applied-set (for exactly-once) and the accepted-norm
history (for outlier checks), plus the keys merged into the current version. It serialises to one
msgpack blob (arrays as :mod:`bus.codec` fp32 blobs) that the service persists in the STATE stream
*before* publishing the global version and acknowledging the contributions.

:func:`merge_step` is deterministic: the crash-loop test replays the recorded merges with it and
must land on exactly the published parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math
import struct

import msgpack
import numpy as np

from aggregator.contribution import Contribution, ContributionKey
from aggregator.influence import norm_bound, norm_caps, outlier_steps
from aggregator.merge import combine_blocks, l2_norm, linear_terms, merge
from aggregator.trust import TrustSettings, TrustState, assess, distrusted_participants
from aggregator.outer_opt import (DelayedNesterovState, NesterovState, RoundNesterov, RoundNesterovState,
                                  make_outer_optimizer, momentum_dtype)
from aggregator.validate import AppliedSet, NormHistory
from aggregator.weights import StalenessPolicy, contribution_weights, rounds_behind, token_weight
from bus import codec
from bus.chunks import Gather


@dataclass(frozen=True)
class MergeSettings:
    method: str = "mean"
    robust: str | None = None
    trim_fraction: float = 0.1
    staleness: StalenessPolicy = field(default_factory=StalenessPolicy)
    optimizer: str = "rounds"
    lr: float = 0.7
    momentum: float = 0.9
    delay_n: int = 1
    downlink_quantiser: str = "fp32"
    # bounded influence (aggregator.influence): clip every contribution to clip_factor x the median
    # applied norm (or, before clip_min_history norms are known, to the geometric bound of
    # min(steps, reference_steps) steps at the manifest's max_inner_lr); cap raw merge weights at
    # max_weight_ratio x their median
    clip_factor: float = 3.0
    clip_min_history: int = 3
    reference_steps: int = 24
    max_inner_lr: float | None = None
    max_weight_ratio: float = 4.0
    # the ``rounds`` momentum takes only contributions whose learner had seen the merge of all but at
    # most this many of its own earlier contributions to the fragment (open-loop backlog work moves
    # the parameters by plain SGD; momentum_part, aggregator.outer_opt.RoundNesterov)
    momentum_open_rounds: int = 1
    # trust across rounds (aggregator.trust): a learner whose outer gradients disagree with the
    # others' merges at a lower weight, down to 0
    trust: TrustSettings = field(default_factory=TrustSettings)
    # the ``rounds`` momentum's dtype at a fragment's start (a merge log record written before it
    # existed replays with float32, what merged then; a state keeps the dtype it was made with)
    momentum_dtype: str = "float32"

    def make_optimizer(self):
        return make_outer_optimizer(self.optimizer, lr=self.lr, momentum=self.momentum, period=self.delay_n,
                                    dtype=self.momentum_dtype)

    @classmethod
    def from_config(cls, cfg) -> "MergeSettings":  # AggregatorConfig
        return cls(method=cfg.merge, robust=None if cfg.robust == "none" else cfg.robust,
                   trim_fraction=cfg.trim_fraction,
                   staleness=StalenessPolicy(cfg.staleness, cfg.staleness_a, cfg.staleness_b),
                   optimizer=cfg.outer_optimizer, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                   delay_n=cfg.delay_n, downlink_quantiser=cfg.downlink_quantiser,
                   clip_factor=cfg.clip_factor, reference_steps=cfg.clip_reference_steps,
                   max_weight_ratio=cfg.max_weight_ratio, momentum_open_rounds=cfg.momentum_open_rounds,
                   trust=TrustSettings(cfg.trust, cfg.trust_rate, cfg.trust_oppose, cfg.trust_nil),
                   momentum_dtype=cfg.outer_momentum_dtype)


@dataclass
class FragmentState:
    fragment: int
    version: int
    params: np.ndarray
    opt: NesterovState | DelayedNesterovState | RoundNesterovState
    applied: AppliedSet
    norms: NormHistory
    last_merge: list[ContributionKey] = field(default_factory=list)
    last_scale: float = 1.0
    last_per_round: int = 1
    applied_norms: NormHistory = field(default_factory=NormHistory)  # the clip reference (whole rounds)
    last_clipped: int = 0  # contributions of the newest merge scaled down to their cap
    # per learner, the newest versions (at most RECENT_KEPT) whose merge held one of its contributions:
    # how many of its own rounds a contribution's base had not seen (open_rounds)
    recent: dict[str, list[int]] = field(default_factory=dict)
    last_grad_norm: float = 0.0  # |outer gradient applied| of the newest merge (scaled, before momentum); not persisted
    trust: TrustState = field(default_factory=TrustState)  # per learner, agreement across rounds (aggregator.trust)
    last_trust: list = field(default_factory=list)  # the newest merge's weight factor per contribution; not persisted

    @classmethod
    def initial(cls, fragment: int, version: int, params: np.ndarray, settings: MergeSettings) -> "FragmentState":
        p = np.array(params, dtype=np.float32).reshape(-1)
        return cls(fragment, version, p, settings.make_optimizer().init(p), AppliedSet(), NormHistory())

    def checkpoint(self) -> Gather:
        """The checkpoint: ``CHECKPOINT_MAGIC``, a u32 length, a msgpack header (everything but the
        arrays, and where each array lies), then the float32 arrays raw, as a :class:`Gather` whose
        arrays are this state's own: no copy (a copy of every array took 8 bytes per value of the
        fragment while it was stored). The state must not change until the blob is stored: the
        service's merges of the fragment wait for it (``MergeLog.blocks``)."""
        opt = self.opt.to_dict()
        arrays = {"params": self.params, **{f"opt.{k}": v for k, v in opt.items() if isinstance(v, np.ndarray)}}
        layout, off = {}, 0
        for k, v in arrays.items():
            layout[k] = [off, int(v.size)]
            off += v.dtype.itemsize * int(v.size)
        # arrays not float32 (a bfloat16 momentum) are named with their dtype; a checkpoint without
        # "dtypes" (every one before) holds float32 only
        dtypes = {k: v.dtype.name for k, v in arrays.items() if v.dtype != np.float32}
        header = msgpack.packb({
            "f": self.fragment, "v": self.version, "layout": layout, **({"dtypes": dtypes} if dtypes else {}),
            "opt_kind": type(self.opt).__name__, "opt_other": {k: v for k, v in opt.items() if not isinstance(v, np.ndarray)},
            "applied": self.applied.to_dict(), "norms": self.norms.to_dict(),
            "last": [list(k) for k in self.last_merge], "scale": self.last_scale, "per_round": self.last_per_round,
            "anorms": self.applied_norms.to_dict(), "clipped": self.last_clipped,
            "recent": self.recent, "trust": self.trust.to_dict(),
        }, use_bin_type=True)
        return Gather([CHECKPOINT_MAGIC + struct.pack("<I", len(header)) + header,
                       *(_raw(v) for v in arrays.values())])

    def array_bytes(self) -> int:
        """The bytes of the arrays a checkpoint holds (its header aside)."""
        return int(self.params.nbytes) + sum(int(v.nbytes) for v in self.opt.to_dict().values()
                                             if isinstance(v, np.ndarray))

    def to_bytes(self) -> bytes:
        """:meth:`checkpoint` as one bytes object (a copy)."""
        return self.checkpoint().tobytes()

    @classmethod
    def from_bytes(cls, data) -> "FragmentState":
        mv = memoryview(data)
        if bytes(mv[:len(CHECKPOINT_MAGIC)]) != CHECKPOINT_MAGIC:
            return cls._from_msgpack(data)  # a checkpoint written before issue 25
        (hl,) = struct.unpack_from("<I", mv, len(CHECKPOINT_MAGIC))
        start = len(CHECKPOINT_MAGIC) + 4 + hl
        d = msgpack.unpackb(mv[len(CHECKPOINT_MAGIC) + 4:start], raw=False, strict_map_key=False)

        dtypes = d.get("dtypes", {})

        def arr(k: str) -> np.ndarray:
            o, n = d["layout"][k]
            if k in dtypes:  # (a bfloat16 momentum: its 2-byte words, viewed as what they are)
                dt = momentum_dtype(dtypes[k])
                return np.frombuffer(mv, dtype=np.uint16, count=n, offset=start + o).copy().view(dt)
            return np.frombuffer(mv, dtype=np.float32, count=n, offset=start + o).copy()

        opt = dict(d["opt_other"])
        opt.update({k[4:]: arr(k) for k in d["layout"] if k.startswith("opt.")})
        return cls._build(d, arr("params"), opt)

    @classmethod
    def _from_msgpack(cls, data: bytes) -> "FragmentState":
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        opt = dict(d["opt_other"])
        opt.update({k: np.array(codec.decode_array(v)) for k, v in d["opt_arrays"].items()})
        return cls._build(d, np.array(codec.decode_array(d["params"])), opt)

    @classmethod
    def _build(cls, d: dict, params: np.ndarray, opt: dict) -> "FragmentState":
        opt_cls = {"NesterovState": NesterovState, "DelayedNesterovState": DelayedNesterovState,
                   "RoundNesterovState": RoundNesterovState}[d["opt_kind"]]
        return cls(int(d["f"]), int(d["v"]), params, opt_cls.from_dict(opt),
                   AppliedSet.from_dict(d["applied"]), NormHistory.from_dict(d["norms"]),
                   [tuple(k) for k in d["last"]], float(d.get("scale", 1.0)), int(d.get("per_round", 1)),
                   NormHistory.from_dict(d["anorms"]) if "anorms" in d else NormHistory(),
                   int(d.get("clipped", 0)),
                   {str(k): [int(x) for x in v] for k, v in d.get("recent", {}).items()},
                   trust=TrustState.from_dict(d.get("trust")))


CHECKPOINT_MAGIC = b"DLCKPT1\n"


def _raw(v: np.ndarray) -> np.ndarray:
    """A checkpoint array as its bytes are stored: float32 as it is, a bfloat16 one as its 2-byte
    words (a view: no copy of an array of the fragment's size)."""
    v = v.reshape(-1)
    if v.dtype == np.float32:
        return np.ascontiguousarray(v)
    return np.ascontiguousarray(v).view(np.uint16)


def round_work(contribs: list[Contribution]) -> float:
    """The rounds of work a merge holds: the sum of its contributions' ``round_share`` (inner steps /
    the learner's sync period, at most 1 each; 1 each when the period is not declared)."""
    return float(sum(c.round_share for c in contribs))


def run_participants(active: set[str], leavers: set[str], recent: dict[str, float], now: float,
                     window: float, merged: set[str]) -> set[str]:
    """The learners taking part in the run, M of :func:`participation_scale` and of the staleness
    rounds: the active ones, those whose contributions arrived within ``window`` seconds (the
    active set swings with membership: a learner evicted for a moment still counts), and those that
    **left** (their step budget reached, an island closed, a stop: not a failure) with work of theirs
    ``merged`` (held in a fragment's applied set, which checkpoints keep), until the membership
    forgets them (the monitor's DILOCO_FORGET_AFTER, a day by default). A learner that left before
    any of its work was merged (stopped at once, or only a ``leaving`` heartbeat) does not count.

    A learner that left keeps its share of the run: when islands of unequal speeds share one step
    budget, the fast ones finish first, and without their share the last island alone moved every
    fragment a whole round per outer gradient, on its own data: with one learner 2x slower the
    reference's model ended 6.0% (M=4) and 8.6% (M=8) worse than with the leavers' share kept, and
    the real roles 5% at M=4 (docs/BENCHMARKS.md, "Fourteenth round"). A failed learner is not a
    leaver: the survivors take its share once the window passes (goodput under failures).
    """
    return set(active) | (set(leavers) & set(merged)) | {k for k, t in recent.items() if now - t <= window}


def participation_scale(merged: float, participants: int) -> float:
    """The share of a synchronous round this merge holds: n / M, for n rounds of work merged (the
    contributions, or :func:`round_work`) and M learners taking part in the run (the active ones
    and recent contributors).

    Synchronous DiLoCo applies one outer step per round to the mean of M learners' outer
    gradients. With the mean merge, n/M x mean(n contributions) = (sum of the n) / M, so every
    contribution moves the fragment by lr/M x its outer gradient whichever merge it lands in: M
    per-arrival merges (K=1) make exactly the progress of one synchronous round, and a merge that
    holds a backlog of several rounds (an aggregator catching up) makes the progress of those
    rounds instead of one round's worth (the server learning-rate scaling of FedBuff). n counts
    contributions, not learners: two rounds of one learner are two rounds of work. Each vector is
    norm-capped before it is merged (:mod:`aggregator.influence`), so n/M > 1 adds no risk.

    A contribution of fewer steps than its learner's period (a final sync at the step budget, a
    staggered fragment's first sync) counts for its share of a round only (:func:`round_work`). The
    token weights give it that share of the mean already; counting it as a whole round made a
    merge of two full rounds and a 2-step final sync move the model 1.5 rounds' worth, and advance
    the ``rounds`` momentum by a whole step (``simulation.reference`` found both: the global model of a
    short run ended 0.3 to 1.1 nats worse than every learner's own parameters).
    """
    n = float(merged) if merged > 0 else 1.0
    return n / max(1, int(participants))


RECENT_KEPT = 8


def open_rounds(state: FragmentState, c: Contribution) -> int:
    """How many of its learner's own earlier contributions to this fragment were merged into versions
    newer than ``c``'s base: 0 when the learner trained from the result of its previous round, 1 when
    it ran one round ahead (an out-of-step learner, the last of a round), n for the n-th round of
    work it did alone (learners training on while the aggregator or the server was down)."""
    return sum(1 for u in state.recent.get(c.learner, ()) if u > c.base_version)


def fuses(settings: MergeSettings) -> bool:
    """Does :func:`merge_step` apply the merged outer gradient block by block (no buffer of the
    fragment's size)? For the mean merge (no trimming: a linear combination of the contributions)
    into the ``rounds`` optimizer: the defaults."""
    return settings.method == "mean" and settings.robust in (None, "clip") and settings.optimizer in ("rounds", "round_nesterov")


def momentum_part(state: FragmentState, contribs: list[Contribution], settings: MergeSettings,
                  w: np.ndarray, norms: list[float], caps: np.ndarray, total: float,
                  scale: float) -> tuple[np.ndarray | float | None, float]:
    """What of a merge's outer gradient g feeds the ``rounds`` momentum, and the share of a round
    it holds: the *closed-loop* contributions only, whose :func:`open_rounds` is at most
    ``settings.momentum_open_rounds``. Open-loop work (rounds a learner computed without seeing the
    merge of its earlier ones: an outage's backlog) is applied as plain SGD and counts no work.

    Returns (None, scale) when every contribution is closed-loop (the usual case), (0.0, 0.0) when
    none is, else the closed-loop part exactly for the linear merge (mean without a robust mode:
    the same weights, caps and discount on the subset) or the factor of g that is its weight share otherwise.
    """
    fresh = [open_rounds(state, c) <= settings.momentum_open_rounds for c in contribs]
    if all(fresh):
        return None, scale
    if not any(fresh):
        return 0.0, 0.0
    idx = [i for i, f in enumerate(fresh) if f]
    share = float(sum(contribs[i].round_share for i in idx)) / max(round_work(contribs), 1e-12)
    wa = np.asarray(w, dtype=np.float64)
    wf = float(wa[idx].sum())
    if settings.method == "mean" and settings.robust is None and wf > 0:
        part = merge([contribs[i].vector for i in idx], wa[idx], "mean", None,
                     norms=np.asarray(norms, dtype=np.float64)[idx], caps=np.asarray(caps)[idx],
                     gain=total * wf / float(wa.sum()))
        return part, scale * share
    return wf / float(wa.sum()), scale * share


def merge_step(state: FragmentState, contribs: list[Contribution], settings: MergeSettings,
               norms: list[float] | None = None, scale: float = 1.0,
               per_round: int = 1, inplace: bool = False, out: np.ndarray | None = None,
               fused: bool | None = None) -> FragmentState:
    """Version v -> v+1: weight (tokens x staleness), merge, scale, outer step. The global version
    is encoded for the downlink when it is published (:func:`bus.downlink.encode_version`).
    ``scale`` multiplies the merged outer gradient (see :func:`participation_scale`).

    The merged outer gradient is multiplied by ``scale`` and by the token-weighted mean staleness
    factor of the contributions; staleness is counted in rounds of ``per_round`` versions (the
    active learners; see :func:`aggregator.weights.rounds_behind`). Returns the new state; ``state``
    is not modified, unless ``inplace``: then its arrays and sets become the new state's (no copy of
    the parameters or the optimizer state: the service's merge, and a replay), with bitwise the same
    result. ``out``: a float32 buffer of the fragment's size for the merged outer gradient when the
    merge is not applied block by block (``fused`` False; by default :func:`fuses`): the service
    keeps one, no allocation and no page faults per merge; it is scratch once this returns.
    ``contribs`` must already be validated (and not duplicates).
    """
    if not contribs:
        raise ValueError("merge_step needs at least one contribution")
    if norms is None:
        norms = [l2_norm(c.vector) for c in contribs]
    w = contribution_weights(contribs, state.version, settings.staleness, per_round=per_round,
                             max_weight_ratio=settings.max_weight_ratio)
    # weights are relative (they sum to 1), so a lone stale contribution would get a full step:
    # also discount the merge by the token-weighted mean staleness factor, as FedAsync does
    q = np.array([token_weight(c.tokens, c.inner_steps) for c in contribs])
    f = np.array([settings.staleness.factor(rounds_behind(state.version, c.base_version, per_round))
                  for c in contribs])
    total = scale * float((q * f).sum() / q.sum())
    # trust (aggregator.trust): a distrusted contribution leaves the mean and the step (its share of
    # the round is not applied), so a merge of distrusted ones only does not move the fragment
    tr = assess(state.trust, [c.learner for c in contribs], [c.vector for c in contribs], settings.trust,
                state.version + 1)
    out_of_round = distrusted_participants(tr.state, state.version + 1, per_round, settings.trust,
                                           merged={c.learner: float(f) for c, f in zip(contribs, tr.factors)})
    if settings.trust.mode == "weigh" and (float(tr.factors.min()) < 1.0 or out_of_round > 0):
        # the round is counted without the distrusted learners: their share leaves the mean and the
        # step, and the participation scale counts per_round - out_of_round learners (one honest
        # learner of a per-arrival round moves the fragment by 1/7 of a round, not 1/8, when the
        # eighth is distrusted: the round's progress is the 7 honest ones' whole). The share kept is
        # counted in rounds of work, not in the weights: a liar's claimed tokens must not set how far
        # the honest learners move
        w = np.asarray(w, dtype=np.float64)
        wt = w * tr.factors
        work = np.array([c.round_share for c in contribs], dtype=np.float64)
        kept = float((work * tr.factors).sum() / max(work.sum(), 1e-12))
        total *= kept * per_round / max(1.0, per_round - out_of_round)
        w = wt / wt.sum() if wt.sum() > 0 else w
    caps = norm_caps(norms, [c.inner_steps for c in contribs], size=state.params.size,
                     history_median=state.applied_norms.median(state.fragment),
                     history_count=state.applied_norms.count(state.fragment), clip_factor=settings.clip_factor,
                     min_history=settings.clip_min_history, max_inner_lr=settings.max_inner_lr,
                     reference_steps=settings.reference_steps)
    optimizer = settings.make_optimizer()
    if fused is None:
        fused = fuses(settings)
    if fused and not isinstance(optimizer, RoundNesterov):
        raise ValueError(f"the merge is applied block by block by the rounds optimizer only, not {settings.optimizer}")
    if fused:
        # the merged outer gradient made one block at a time and applied while in cache: no
        # buffer of the fragment's size (bit for bit the parameters and momentum of the merge and
        # step below; its norm, for the log line, too, unless float32 over- or underflows: a block
        # whose sum of squares overflows is summed in float64, where l2_norm redoes the whole vector)
        rows, coeffs, n = linear_terms([c.vector for c in contribs], w, settings.robust,
                                       norms=np.asarray(norms, dtype=np.float64), caps=caps, gain=total)
        mg, work = momentum_part(state, contribs, settings, w, norms, caps, total, scale)
        sq = [0.0]

        def blocks():
            for sl, gb, s in combine_blocks(rows, coeffs, n):
                sq[0] += s if math.isfinite(s) else float(np.dot(gb.astype(np.float64), gb.astype(np.float64)))
                yield sl, gb

        params, opt = optimizer.step_blocks(state.params, blocks(), state.opt, work=work, momentum_grad=mg,
                                            inplace=inplace)
        grad_norm = math.sqrt(sq[0])
    else:
        g = merge([c.vector for c in contribs], w, settings.method, settings.robust,
                  trim_fraction=settings.trim_fraction, norms=np.asarray(norms, dtype=np.float64), caps=caps,
                  gain=total, out=out)
        grad_norm = l2_norm(g)
        if isinstance(optimizer, RoundNesterov):
            # momentum once per round of closed-loop work (scale = the share of a round this merge holds)
            mg, work = momentum_part(state, contribs, settings, w, norms, caps, total, scale)
            params, opt = optimizer.step(state.params, g, state.opt, work=work, momentum_grad=mg, inplace=inplace)
        else:
            params, opt = optimizer.step(state.params, g, state.opt, inplace=inplace)
    applied = state.applied if inplace else state.applied.copy()
    hist = state.norms if inplace else NormHistory.from_dict(state.norms.to_dict())
    anorms = state.applied_norms if inplace else NormHistory.from_dict(state.applied_norms.to_dict())
    for c, n, cap in zip(contribs, norms, caps):
        applied.record(c)
        # the clip reference: whole rounds only, each norm as sent (it passed the bound and the
        # outlier check) up to the geometric bound of reference_steps steps. Recording partial rounds
        # (a staggered fragment's first sync: a few steps at a tiny warm-up learning rate) and clipped
        # norms could lock the reference to its warm-up scale: the next rounds were all clipped to 3x
        # it (docs/aggregator.md)
        if c.round_share >= 1.0:
            anorms.add(state.fragment, float(n) if settings.max_inner_lr is None else min(float(n), norm_bound(
                settings.max_inner_lr, state.params.size, min(max(1, c.inner_steps), settings.reference_steps))))
        n = min(float(n), float(cap))  # the outlier reference: as applied
        hist.add(state.fragment, n / outlier_steps(c.inner_steps, c.period))  # norm per inner step
    clipped = int(np.sum(np.asarray(norms, dtype=np.float64) > caps))
    recent = {k: list(v) for k, v in state.recent.items()}
    for learner in sorted({c.learner for c in contribs}):
        recent[learner] = (recent.get(learner, []) + [state.version + 1])[-RECENT_KEPT:]
    return FragmentState(state.fragment, state.version + 1, params, opt, applied, hist, [c.key for c in contribs],
                         float(scale), max(1, int(per_round)), anorms, clipped, recent, grad_norm, tr.state,
                         [float(x) for x in tr.factors] if settings.trust.mode == "weigh" else [1.0] * len(contribs))
