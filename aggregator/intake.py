"""The aggregator's intake of outer gradients: decode, check the subject, validate, then buffer
for the merge, hold until the learner is admitted (``aggregator.admission``), or reject (counted,
logged, and published as an ``events.reject`` audit event before the messages are terminated).

The first stage of a fragment's pipeline (:class:`Intake`, an object with its own state): its
output is a buffer per fragment, which the merge stage (``aggregator.versions``) empties at each
merge of that fragment; its other state is the admission hold, the rejections whose audit events
are not stored yet, the notices to learners, the decode buffers (:class:`VectorPool`) and the
arrival statistics the quorum's grace window reads. The checks themselves are
``aggregator.validate``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from aggregator.admission import AdmissionHold
from aggregator.contribution import Contribution, from_grad_message
from aggregator.feedback import FeedbackQueue
from aggregator.influence import outlier_steps
from aggregator.merge import l2_norm
from aggregator.quorum import ArrivalStats
from aggregator.step import FragmentState
from aggregator.validate import OutlierWatch, Reason, ValidationContext, validate
from bus import codec
from bus.chunks import Assembled, Dropped
from bus.subjects import Subjects
from bus.transport import term_all

_AUDIT = ("learner", "incarnation", "fragment", "round", "base", "obj", "subject", "claimed", "detail")


@dataclass
class Pending:
    c: Contribution
    norm: float
    tokens: list
    arrived: float
    seqs: tuple[int, ...] = ()  # its chunks' GRAD stream sequences, in chunk order (the merge log's pointer)
    nbytes: int = 0  # its blob's bytes
    pooled: np.ndarray | None = None  # the VectorPool buffer its vector was decoded into


class VectorPool:
    """Float32 buffers of fragment sizes, reused: a contribution is decoded into one, which goes
    back here once its merge is committed. A fresh array of millions of values costs page faults
    (the kernel zeroes every page) that took longer than decoding into it: at 100M parameters the
    int8 decode was 27% of the aggregator's time, 3.5x its cost into a warm buffer."""

    def __init__(self, per_size: int = 16):
        self.per_size = per_size
        self.free: dict[int, list[np.ndarray]] = {}

    def take(self, n: int) -> np.ndarray:
        got = self.free.get(n)
        return got.pop() if got else np.empty(n, dtype=np.float32)

    def give(self, a: np.ndarray | None) -> None:
        if a is not None:
            lst = self.free.setdefault(a.size, [])
            if len(lst) < self.per_size:
                lst.append(a)


def chunk_seqs(tokens: list) -> tuple[int, ...]:
    """The GRAD stream sequence of each chunk of an object, in chunk order, from its message handles
    (redeliveries of a chunk share its sequence; ``Nats-Msg-Id`` is ``<object id>.<index>``)."""
    by_index: dict[int, int] = {}
    for m in tokens:
        try:
            idx = int(str((m.headers or {}).get("Nats-Msg-Id", "")).rpartition(".")[2])
            by_index.setdefault(idx, int(m.metadata.sequence.stream))
        except Exception:  # not a JetStream message (a test's token): no pointer, no replay
            continue
    return tuple(by_index[i] for i in sorted(by_index))


class Intake:
    """Contributions into an aggregator: buffered per fragment for the merge, held, or rejected."""

    def __init__(self, cfg: Any, run: str, log: Any, stats: Any, membership: Any, states: dict[int, FragmentState],
                 store_watch: Any):
        self.cfg, self.run, self.s, self.log, self.stats = cfg, run, Subjects(run), log, stats
        self.membership = membership
        self.states = states  # the merge stage's, read here (versions, applied sets, norm references)
        self.store_watch = store_watch
        self.buffers: dict[int, list[Pending]] = {}  # fragment -> accepted, not merged yet (the merge's input)
        # contributions whose learner the monitor has not admitted yet (aggregator/admission.py)
        self.hold = AdmissionHold(cfg.admission_wait, int(cfg.admission_hold_mb * 2**20))
        self.outliers = OutlierWatch()
        self.audit: list[tuple[dict, list]] = []  # (rejection event, its messages): published, then terminated
        self.feedback = FeedbackQueue()  # notices to learners of their work rejected or held
        self.pool = VectorPool()  # decoded contributions' buffers, reused; back here once merged
        self.arrivals = ArrivalStats()  # what the quorum's grace window reads (and the merges' times)
        self.plan: Any = None
        self.owned: range = range(0)
        self.model_hash = ""
        self.manifest: Any = None
        self.nc: Any = None
        self.js: Any = None
        self.merge_log: Any = None

    def use(self, plan: Any, owned: range, model_hash: str, manifest: Any) -> None:
        """The model whose fragments ``owned`` this intake takes in (a buffer each)."""
        self.plan, self.owned, self.model_hash, self.manifest = plan, owned, model_hash, manifest
        self.buffers = {p: [] for p in owned}

    def bind(self, nc: Any, js: Any, merge_log: Any) -> None:
        """The connection (notices, audit events) and the merge-log stage (outlier-reference restarts
        are logged with the fragment's next merge)."""
        self.nc, self.js, self.merge_log = nc, js, merge_log

    def take(self, p: int) -> list[Pending]:
        """Everything buffered for fragment p, for its merge (the buffer is empty after)."""
        items, self.buffers[p] = self.buffers[p], []
        return items

    def put_back(self, p: int, items: list[Pending]) -> None:
        """Contributions of a merge undone or not committed, ahead of what arrived since."""
        self.buffers[p] = list(items) + self.buffers[p]

    def merged(self, items: list[Pending]) -> None:
        """Their merge is committed: their decode buffers serve the next contributions."""
        for x in items:
            self.pool.give(x.pooled)

    def note_sync(self, seconds: float) -> None:
        """A merge took ``seconds`` from its start to its record stored (the grace window's input)."""
        self.arrivals = self.arrivals.observe_sync(seconds)

    # -- contributions ----------------------------------------------------------------------------

    def reject(self, reason: str, tokens=(), **kw) -> None:
        """Count, log and queue the audit event; the rejected messages (``tokens``) are terminated
        only once their event is stored (:meth:`publish_audit`)."""
        self.stats.rejected[reason] += 1
        self.log.warning("contribution_rejected", reason=reason, **kw)
        if kw.get("learner") and "incarnation" in kw:  # the learner is told too (aggregator.feedback)
            self.feedback.rejected(str(kw["learner"]), str(kw["incarnation"]), reason, kw.get("fragment"),
                                   kw.get("round"))
        self.audit.append(({"reason": reason, "ts": time.time(), **{k: v for k, v in kw.items() if k in _AUDIT}},
                           list(tokens)))

    async def handle(self, r: Assembled | Dropped, now: float) -> None:
        if isinstance(r, Dropped):
            if r.reason == "duplicate":
                return  # a redelivery of something held or done: its original handle settles it
            self.reject(f"transport_{r.reason}", r.tokens, obj=r.obj_id, detail=r.detail)
            return
        taken: list[np.ndarray] = []

        def into(n: int) -> np.ndarray:
            # a sparse blob declares its length in a header of a few bytes: never allocate past the
            # run's largest fragment for it (a 1.6 MB blob could claim 2**34 values)
            largest = max(self.plan.sizes)
            if n > largest:
                raise codec.CodecError(f"{n} values: more than the run's largest fragment ({largest})")
            taken.append(self.pool.take(n))
            return taken[-1]

        try:
            c = from_grad_message(r.meta, r.blob, into)
        except (ValueError, codec.CodecError) as e:
            self.reject("malformed", r.tokens, obj=r.obj_id, detail=str(e)[:200])
            return
        vec = c.vector
        subject = getattr(r.tokens[0], "subject", "") if r.tokens else ""
        parts = subject.split(".")
        if len(parts) == 5 and (parts[4] != c.learner or parts[3] != str(c.fragment)):
            # the subject is what NATS permissions bind to a learner's credentials: metadata that
            # names another learner or fragment than the subject it came on is forged
            self.reject("forged_subject", r.tokens, obj=r.obj_id, subject=subject, claimed=c.learner)
            return
        if c.run == self.run:
            self.membership.saw(c.learner, c.incarnation, c.final)
        norm = l2_norm(vec) if vec.dtype == np.float32 and vec.ndim == 1 else float("nan")
        self.consider(Pending(c, norm, r.tokens, now, chunk_seqs(r.tokens), len(r.blob),
                              taken[0] if taken else None), now)

    def consider(self, x: Pending, now: float, since: float | None = None) -> None:
        """Validate a contribution: buffer it for the merge, hold it until its learner is admitted,
        or reject it. ``since``: when it was first held (an item handed back by the hold)."""
        c = x.c
        p = c.fragment
        st = self.states.get(p)
        pending = {b.c.key for b in self.buffers.get(p, [])}
        m = self.membership
        ctx = ValidationContext(
            run=self.run, model_hash=self.model_hash,
            fragment_sizes={q: self.plan.sizes[q] for q in self.owned},
            current_version={q: self.states[q].version for q in self.owned},
            active=m.active() | m.leavers(), known=m.known(),
            applied=st.applied, pending=pending,
            norms=st.norms, max_staleness=self.cfg.max_staleness,
            per_round=max(1, len(m.participants(now))),  # as the merge counts rounds
            norm_outlier_factor=self.cfg.norm_outlier_factor, norm_min_history=self.cfg.norm_min_history,
            max_tokens_per_step=self.manifest.max_tokens_per_step, max_inner_lr=self.manifest.max_inner_lr,
        ) if st else None
        reason = "wrong_fragment" if ctx is None else validate(c, ctx, norm=x.norm)
        if (reason in (Reason.unknown_learner, Reason.inactive_learner) and self.cfg.require_membership
                and self.hold.offer(x, c.learner, m.state(c.learner), getattr(c.vector, "nbytes", 0),
                                    now, since)):
            if since is None:
                self.feedback.held(c.learner, c.incarnation)
                self.log.info("contribution_held", learner=c.learner, state=m.state(c.learner),
                              fragment=p, round=c.round, held=len(self.hold))
            return
        if reason == Reason.norm_outlier and st is not None:
            self._watch_outliers(st, c, x.norm)
        if reason is not None:
            self.reject(str(getattr(reason, "value", reason)), x.tokens, learner=c.learner, incarnation=c.incarnation,
                        fragment=p, round=c.round, base=c.base_version, version=st.version if st else None,
                        **({"held_s": round(now - since, 3)} if since is not None else {}))
            return
        if since is not None:
            self.log.info("contribution_admitted", learner=c.learner, fragment=p, round=c.round,
                          held_s=round(now - since, 3))
        self.buffers[p].append(dataclasses.replace(x, arrived=now))
        m.heard(c.learner, now)
        self.arrivals = self.arrivals.observe_arrival(c.learner, c.incarnation, now, c.inner_steps, c.fragment,
                                                      c.step_s, c.period)
        self.stats.accepted += 1

    def _watch_outliers(self, st: FragmentState, c: Contribution, norm: float) -> None:
        """Most learners refused as outliers on a fragment: its norm reference is stale (OutlierWatch)."""
        restart = self.outliers.refused(st.fragment, c.learner, norm / outlier_steps(c.inner_steps, c.period),
                                        self.membership.active())
        if restart is not None:
            st.norms.restart(st.fragment, restart)  # logged with the fragment's next merge (replayed)
            self.merge_log.note_restart(st.fragment, restart)
            self.stats.reference_restarts += 1
            self.log.warning("norm_reference_restarted", fragment=st.fragment, refused_learners=len(restart),
                             norms=[round(x, 6) for x in restart])

    def release_held(self, now: float) -> None:
        """Decide the held contributions whose learner was admitted, evicted, or waited too long."""
        if len(self.hold):
            for h in self.hold.sweep(self.membership.state, now):
                self.consider(h.item, now, since=h.since)

    async def keep_alive(self) -> None:
        """Tell JetStream we still work on buffered and held chunks so they are not redelivered."""
        now = time.monotonic()
        for buf in [*self.buffers.values(), [h.item for h in self.hold.items]]:
            for x in buf:
                if now - x.arrived > self.cfg.ack_wait / 3:
                    for m in x.tokens:
                        try:
                            await m.in_progress()
                        except Exception:
                            pass

    async def send_feedback(self) -> None:
        """Each learner's notices of this pass on its feedback subject (core NATS: best effort)."""
        for learner, msg in self.feedback.take(time.time()):
            try:
                await self.nc.publish(self.s.feedback(learner), orjson.dumps(msg))
            except Exception as e:
                self.log.debug("feedback_failed", learner=learner, error=repr(e))
                return

    async def publish_audit(self, limit: int = 256) -> None:
        """Rejections as JetStream events (``events.reject``): an audit trail that survives restarts.

        Each rejected contribution is terminated only after its event is stored. Before, it was
        terminated at once and its event queued: an aggregator killed in between lost the record
        of an acknowledged contribution (the chaos run's ``none_lost``, 2 runs in 12: five
        rejections logged 3 s before the kill, none in the stream). Now a crash in between
        redelivers the contribution, which is judged again. A failed publish keeps the rest queued
        for the next round (it used to drop them)."""
        if not self.store_watch.may_write():  # the store is full: one write every few seconds
            return
        for _ in range(min(limit, len(self.audit))):
            event, tokens = self.audit[0]
            try:
                await self.js.publish(self.s.event("reject"), orjson.dumps(event), timeout=2)
            except Exception as e:
                if not await self.store_watch.failed(e):  # a full store is said once (store_full)
                    self.log.warning("audit_publish_failed", error=repr(e), queued=len(self.audit))
                return
            self.store_watch.stored()
            self.audit.pop(0)
            await term_all(tokens)
