"""The algorithm in one process: M learners and one aggregator on a virtual clock (issue 14).

A reference for the system: the same run (model, data shards, version 0, inner optimizer, fragment
plan, sync schedule, quantisers, merge, outer optimizer) without NATS, processes or wall-clock
timing, so a loss measured here is the algorithm's and the same loss measured through the real
roles shows what the system adds. It makes no copy of the math. Every decision is the services'
own pure function:

- a learner's compute is the island API's run-it-for-me backend (``learner.backends.TrainBackend``
  over ``learner.builtin``'s jitted AdamW step, or any model's ``train_step``, ``batches``, tree);
- its schedule, rounds, base versions and fetch policy: ``learner.loop.Bookkeeper``;
- its outer gradient, error feedback and quantiser: ``learner.outer.outer_gradient`` and
  ``bus.codec.encode_with_feedback`` (what ``learner.service`` sends), decoded by
  ``bus.codec.decode_array`` (what the aggregator reads); arrival: ``learner.outer.rebase``/``mix``;
- the aggregator's validation (``aggregator.validate``), quorum and grace
  (``aggregator.quorum.decide``), participation scale and merge step (``aggregator.step``: token
  and staleness weights, norm caps, mean/RDA, outer optimizer), downlink quantiser and keyframes
  (``bus.downlink``);
- the held-out loss: the evaluator's batches (``Corpus.heldout_batches``) and loss function.

Modes (``RefConfig.mode``):

- ``dp``: data-parallel, one AdamW on batches of M x b (b from each learner's shard), as
  ``bench.dp``;
- ``sync``: synchronous DiLoCo: every fragment every H steps (not staggered; P=1 is the paper's
  DiLoCo), K = M, each learner waits for the merge of its outer gradient (``DILOCO_MODE=sync``);
- ``streaming``: Streaming DiLoCo: P staggered fragments, K = M, learners never wait; a merged
  fragment is downloaded ``fetch_delay`` steps after the learner's sync and rebased in;
- ``decoupled``: like ``streaming`` with any quorum K, grace window, per-learner step times,
  upload/download delays and failures (learner down from t0 to t1, then it rejoins from the newest
  global versions, as a resync), and aggregator outages (``agg_outages``: down from t0 to t1, the
  learners train on alone, and the backlog that waited in the stream arrives at t1, in order).

Time is virtual (seconds of ``step_times``, 1.0 per step by default); the inner steps run for real
in the order the clock gives. Events at the same virtual time are taken in a fixed order
(arrivals at the aggregator, its timers, deliveries to learners, learners' step boundaries; then
by learner index), so one configuration gives the same losses bit for bit
(``tests/test_reference.py``).

Choices the system does not force and the reference states: the active set is the learners that
are up (a monitor's view, without its detection delay); the participants of a merge are the learners
that are up, those that finished their steps included (the aggregator's leavers,
``aggregator.step.run_participants``), and the merge's contributors (``DILOCO_PARTICIPATION_WINDOW``
is not modelled: a failed learner leaves at once); a global version reaches every learner
``down_delay`` after its merge (download included).

    python -m simulation.reference --mode decoupled --M 2 --steps 200     (one run, one JSON line)

The run's configuration is ``simulation.reference_config``, the model and data it runs
``simulation.reference_setup``; this module is the simulation (both re-exported here).
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python simulation/NAME.py` as well as `python -m simulation.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import heapq
import itertools
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from simulation.reference_config import MODES, SMALL_MODEL, TINY_MODEL, RefConfig, failure_trace, quorum, run_steps  # noqa: F401
from simulation.reference_setup import Setup, TreeSetup  # noqa: F401 (public names)


@dataclass
class _Learner:
    i: int
    name: str
    backend: Any
    book: Any
    base: list
    residual: list
    step_time: float
    pending: dict = field(default_factory=dict)  # p -> (version, vector): downloaded, not mixed in
    downloading: dict = field(default_factory=dict)  # p -> (version, vector): started at a step boundary
    candidate: dict = field(default_factory=dict)  # p -> (version, vector): heard of, not downloaded
    awaiting: set = field(default_factory=set)  # sync mode: (p, round) not yet in a merge we hold
    applied_in: dict = field(default_factory=dict)
    blocked: bool = False
    up: bool = True
    done: bool = False
    epoch: int = 0  # a failure ends the current life: its pending step event is stale
    incarnation: str = "r0"
    losses: list = field(default_factory=list)
    byzantine: str = ""  # RefConfig.byzantine, for a lying learner
    kept: dict = field(default_factory=dict)  # p -> its earlier whole-round vectors (a replaying learner)
    rng: Any = None
    steps: int = 0  # its inner steps (RefConfig.learner_steps, or steps)
    holds: int = 0  # the sync window's holds so far (the newest one's timer is the live one)


@dataclass
class _Pending:
    c: Any
    norm: float
    arrived: float


class Reference:
    """One run (see the module docstring). ``run()`` returns the result dict."""

    def __init__(self, cfg: RefConfig, setup: Setup | None = None, progress: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.setup = setup or Setup(cfg)
        self.progress = progress
        self._seq = itertools.count()
        self._events: list = []
        self.now = 0.0

    # -- the event queue ----------------------------------------------------------------------------
    # priority at equal times: arrivals at the aggregator (0), its timers (1), deliveries to learners
    # (2), failures and returns (3), learners' step boundaries (4); then the order they were queued

    def _at(self, t: float, prio: int, fn, *args) -> None:
        heapq.heappush(self._events, (t, prio, next(self._seq), fn, args))

    # -- run ----------------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg, s = self.cfg, self.setup
        t0 = time.perf_counter()
        result = self._run_dp() if cfg.mode == "dp" else self._run_diloco()
        wall = time.perf_counter() - t0
        tokens = run_steps(cfg) * (cfg.M if cfg.mode == "dp" else 1) * s.tokens_per_step
        result.update({"mode": cfg.mode, "M": cfg.M, "params": s.params, "tokens": tokens,
                       "tokens_per_param": round(tokens / s.params, 2), "wall_s": round(wall, 2),
                       "tokens_per_s": round(tokens / wall, 1)})
        return result

    def _eval_marks(self) -> list[int]:
        """Total inner steps (over all learners) after which to evaluate the global model."""
        cfg = self.cfg
        total = run_steps(cfg)
        n = max(1, cfg.eval_points)
        return sorted({max(1, round(total * k / n)) for k in range(1, n + 1)})

    def _run_dp(self) -> dict:
        cfg, s = self.cfg, self.setup
        be = s.backend(s.dp_batches())
        be.load(s.v0_fragments())
        marks = self._eval_marks()
        curve, losses = [], []
        for t in range(1, cfg.steps + 1):
            losses.append(be.step())
            if t in marks:
                ev = s.evaluate(be.params.tree())
                curve.append([t * cfg.M * s.tokens_per_step, ev])
                if self.progress:
                    self.progress(f"dp step {t}/{cfg.steps} held-out {ev:.4f}")
        return {"eval_loss": curve[-1][1], "curve": curve, "train_losses": losses}

    # -- DiLoCo modes -------------------------------------------------------------------------------

    def _run_diloco(self) -> dict:
        from aggregator.step import FragmentState, MergeSettings
        from aggregator.trust import TrustSettings
        from aggregator.validate import OutlierWatch
        from aggregator.weights import StalenessPolicy
        from aggregator.quorum import ArrivalStats, GracePolicy
        from learner.loop import Bookkeeper

        cfg, s = self.cfg, self.setup
        self.P = s.plan.num_fragments  # P, or fewer for a tree with fewer parameters
        self.K = quorum(cfg)
        self.grace = GracePolicy(mode="fixed", grace=cfg.grace, max_grace=max(cfg.grace, 10.0))
        self.arrivals = ArrivalStats()  # the learners' pace and arrivals (the on-time quorum, K = AUTO)
        # one stream per learner: a learner's step times do not depend on the order of events (the
        # phase lock on or off draws the same steps)
        self.jitter = ([np.random.default_rng([cfg.data_seed, 7919, m]) for m in range(cfg.M)]
                       if cfg.step_jitter > 0 else None)
        self.jitter_sigma = float(np.sqrt(np.log1p(cfg.step_jitter ** 2)))
        # cfg.staleness is the aggregator's setting, a str (StalenessPolicy checks it)
        staleness = StalenessPolicy(cfg.staleness, cfg.staleness_a, cfg.staleness_b)  # type: ignore[arg-type]
        self.settings = MergeSettings(method=cfg.merge, staleness=staleness,
                                      optimizer=cfg.outer_optimizer, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                                      delay_n=cfg.delay_n, downlink_quantiser=cfg.downlink,
                                      clip_factor=cfg.clip_factor, max_inner_lr=s.model.max_inner_lr,
                                      momentum_open_rounds=cfg.momentum_open_rounds,
                                      trust=TrustSettings(cfg.trust, cfg.trust_rate, cfg.trust_oppose, cfg.trust_nil),
                                      momentum_dtype=cfg.outer_momentum_dtype)
        v0 = s.v0_fragments()
        self.states = [FragmentState.initial(p, 0, v0[p], self.settings) for p in range(self.P)]
        self.trust_trace: list[dict] = []  # cfg.record_trust
        self._prev_sample: dict = {}
        self.buffers: list[list[_Pending]] = [[] for _ in range(self.P)]
        self.keys: list = [None] * self.P
        from bus.downlink import View

        # the chained downlink's views (cfg.downlink_chain): every learner starts from version 0
        self.views: list = [View(0, v.copy()) for v in v0] if cfg.downlink_chain else []
        self.bytes_up = 0  # every contribution's blob
        self.bytes_down = 0  # every global version's blob (one learner's download of each)
        self.published: list[tuple[int, np.ndarray]] = [(0, v.copy()) for v in v0]  # newest (version, params)
        self.timers: dict[int, float] = {}
        self.rejected: dict[str, int] = {}
        self.outliers = OutlierWatch()
        self.reference_restarts = 0
        self.merges = 0
        self.staleness_hist: dict[int, int] = {}
        staggered = cfg.mode != "sync"
        times = cfg.step_times or (1.0,) * cfg.M
        self.learners = []
        for m in range(cfg.M):
            inc = cfg.incarnations[m] if cfg.incarnations else None
            byz = cfg.byzantine if m in cfg.byzantine_learners else ""
            batches = s.learner_batches(m, inc)
            if byz == "corrupt":
                from simulation.byzantine_attacks import corrupted

                batches = corrupted(batches, cfg.byzantine_seed * 1000 + m)
            own = cfg.learner_steps[m] if cfg.learner_steps else None
            be = s.backend(batches, own)
            be.load(v0)
            book = Bookkeeper(self.P, cfg.H, s.tokens_per_step, staggered=staggered,
                              **({"window": cfg.sync_window, "hold": cfg.sync_hold} if cfg.mode != "sync" else {}))
            if cfg.learner_periods:  # (a real number of steps: Bookkeeper.set_period)
                book.set_period(cfg.learner_periods[m])
            for p in range(self.P):
                book.on_merged(p, 0)
            self.learners.append(_Learner(m, f"learner-{m}", be, book, [v.copy() for v in v0], [None] * self.P,
                                          float(times[m]), incarnation=inc or "r0", byzantine=byz,
                                          rng=np.random.Generator(np.random.PCG64(cfg.byzantine_seed * 1000 + m)),
                                          steps=own or cfg.steps))
        for m, down, back in cfg.failures:
            self._at(down, 3, self._fail, m)
            self._at(back, 3, self._return, m)
        self.agg_backlog: list = []
        for down, back in cfg.agg_outages:
            self._at(back, 1, self._agg_back)
        for ln in self.learners:
            self._start_step(ln)
        self.marks = self._eval_marks()
        self.curve: list = []
        self.total_steps = 0
        while self._events:
            t, _, _, fn, args = heapq.heappop(self._events)
            if fn == self._hold_expired and not self._hold_live(*args):
                continue  # a hold that ended: its timer moves no clock (virtual_s)
            self.now = t
            fn(*args)
        for p in range(self.P):  # anything still buffered (K not reached at the very end): merge it
            if self.buffers[p]:
                self._merge(p, "end of run")
        final = s.evaluate_fragments([st.params for st in self.states])
        # what the system's evaluator reads: each fragment's newest version as a reader rebuilds it
        # (the same as the aggregator's parameters with a whole fp32 downlink)
        quantised = cfg.downlink != "fp32" or cfg.downlink_chain
        published = s.evaluate_fragments([vec for _, vec in self.published]) if quantised else final
        if not self.curve or self.curve[-1][0] != run_steps(cfg) * s.tokens_per_step:
            self.curve.append([run_steps(cfg) * s.tokens_per_step, final])
        else:
            self.curve[-1][1] = final
        return {"eval_loss": final, "eval_loss_published": published, "curve": self.curve, "merges": self.merges,
                "rejected": self.rejected,
                "reference_restarts": self.reference_restarts,
                "versions": [st.version for st in self.states], "virtual_s": round(self.now, 3),
                "staleness_hist": {str(k): v for k, v in sorted(self.staleness_hist.items())},
                "learner_steps": [ln.book.step for ln in self.learners],
                "holds": sum(ln.holds for ln in self.learners),
                "deferrals": sum(ln.book.deferrals for ln in self.learners),
                "bytes_per_learner": {"up": self.bytes_up // cfg.M, "down": self.bytes_down},
                "train_losses": [ln.losses for ln in self.learners]}

    # -- a learner ----------------------------------------------------------------------------------

    def _alive(self) -> set[str]:
        return {ln.name for ln in self.learners if ln.up and not (self.cfg.byzantine_oracle and ln.byzantine)}

    def _start_step(self, ln: _Learner) -> None:
        """At a step boundary: mix in what was downloaded, then run the inner step (for real);
        it ends ``step_time`` later on the clock."""
        if ln.pending:
            self._apply_pending(ln)
        ln.losses.append(ln.backend.step())
        self._at(self.now + ln.step_time * self._jitter(ln), 4, self._step_done, ln, ln.epoch)

    def _jitter(self, ln: _Learner) -> float:
        """A step's time as a share of its learner's (RefConfig.step_jitter): log-normal, mean 1."""
        if self.jitter is None:
            return 1.0
        sigma = self.jitter_sigma
        return float(self.jitter[ln.i].lognormal(-sigma * sigma / 2, sigma))

    def _step_done(self, ln: _Learner, epoch: int) -> None:
        if epoch != ln.epoch or not ln.up:
            return  # the learner failed during this step: its work is lost with the process
        cfg = self.cfg
        for p, (v, vec) in ln.downloading.items():  # downloads started at the previous boundary are in
            if v > ln.pending.get(p, (-1,))[0]:
                ln.pending[p] = (v, vec)
        ln.downloading = {}
        due = ln.book.on_step(ln.step_time)
        self.total_steps += 1
        for p in due:
            self._contribute(ln, p)
        if ln.book.step >= ln.steps:
            ln.done = True
            if cfg.final_sync:
                for p in ln.book.unsent_fragments():
                    self._contribute(ln, p)
        self._mark()
        if ln.done:
            return
        if cfg.fetch == "round" and cfg.mode != "sync":
            # learner.service._fetch_candidates: a download started here runs while the next step
            # does, so the version is mixed in at the boundary after it (one step later than a
            # version whose head arrived during a step)
            for p, (v, vec) in list(ln.candidate.items()):
                if ln.book.fetch_due(p, v, self._fetch_delay(ln)):
                    self._download(ln, p, v, vec, into=ln.downloading)
        if cfg.mode == "sync" and ln.awaiting:
            ln.blocked = True
            return
        if cfg.mode != "sync" and self._held(ln):  # learner.core._hold
            ln.blocked = True
            ln.holds += 1
            self._at(self.now + cfg.sync_timeout, 3, self._hold_expired, ln, ln.epoch, ln.holds)
            return
        self._start_step(ln)

    def _held(self, ln: _Learner) -> bool:
        """The sync window's hold (learner.core._hold): a fragment's deferred sync waited its periods
        for the merge of this learner's previous round; its downloaded version, if here, is mixed in
        now, and the hold lasts while a fragment is still held."""
        held = ln.book.holding()
        if not held:
            return False
        for p in held:  # (a download started at this boundary is here: the service's hold applies it)
            if p in ln.downloading:
                ln.pending[p] = ln.downloading.pop(p)
        if any(p in ln.pending for p in held):
            self._apply_pending(ln)
            return bool(ln.book.holding())
        return True

    @staticmethod
    def _hold_live(ln: _Learner, epoch: int, hold: int) -> bool:
        return epoch == ln.epoch and hold == ln.holds and ln.blocked and not ln.done

    def _hold_expired(self, ln: _Learner, epoch: int, hold: int) -> None:
        """DILOCO_SYNC_TIMEOUT: train on without the merge (Bookkeeper.give_up_hold)."""
        if not self._hold_live(ln, epoch, hold):
            return
        for p in ln.book.holding():
            ln.book.give_up_hold(p)
        ln.blocked = False
        self._start_step(ln)

    def _fetch_delay(self, ln: _Learner) -> int:
        return self.cfg.fetch_delay if self.cfg.fetch_delay >= 0 else max(1, int(ln.book.period) // 4)

    def _contribute(self, ln: _Learner, p: int) -> None:
        """learner.service._prepare: Delta = base - theta (+ residual), quantised; base <- theta."""
        from aggregator.contribution import Contribution
        from bus import codec
        from learner.outer import outer_gradient

        cfg = self.cfg
        c = ln.book.begin_sync(p)
        if c is None:  # cannot happen here (a publish completes at once), kept as the service has it
            return
        theta = ln.backend.get_fragment(p)
        delta = outer_gradient(ln.base[p], theta)
        ln.base[p] = theta
        if ln.byzantine in ("sign", "random"):
            from simulation.byzantine_attacks import random_direction, sign_flip

            if ln.byzantine == "sign":
                delta = sign_flip(delta)
            else:
                st = self.states[p]
                med = st.applied_norms.median(p) if st.applied_norms.count(p) else None
                delta = random_direction(delta.size, float(med) if med else float(np.linalg.norm(delta)), ln.rng)
        ef = cfg.error_feedback and cfg.quantiser != "fp32"
        blob, _, residual, _ = codec.encode_with_feedback(delta, ln.residual[p] if ef else None, cfg.quantiser,
                                                          keep_residual=ef, want_sent=False, decay=cfg.feedback_decay,
                                                          residual_dtype=codec.residual_dtype_for(cfg.residual_dtype,
                                                                                                  cfg.quantiser,
                                                                                                  self.setup.plan.sizes),
                                                          **codec.codec_args(cfg.quantiser, cfg.topk_chunk, cfg.topk_k))
        if ef:
            ln.residual[p] = residual
        self.bytes_up += len(blob)
        ln.book.end_sync(c, True)
        vec = np.array(codec.decode_array(blob), dtype=np.float32).reshape(-1)
        if ln.byzantine == "replay":
            from simulation.byzantine_attacks import keep_for_replay, replay_pick

            old = replay_pick(ln.kept.get(p, []), ln.rng)
            if c.steps >= c.period:  # it keeps what it really trained in whole rounds
                ln.kept[p] = keep_for_replay(ln.kept.get(p, []), vec)
            if old is not None:
                vec = old
        contrib = Contribution(run="reference", model_hash="reference", learner=ln.name, incarnation=ln.incarnation,
                               fragment=p, round=c.round, base_version=c.base_version, inner_steps=c.steps,
                               tokens=c.tokens, vector=vec, period=c.period, step_s=c.step_s)
        if cfg.mode == "sync":
            ln.awaiting.add((p, c.round))
        self._at(self.now + cfg.up_delay, 0, self._arrive, contrib)

    def _download(self, ln: _Learner, p: int, v: int, vec: np.ndarray, into: dict | None = None) -> None:
        (ln.pending if into is None else into)[p] = (v, vec)
        ln.book.on_downloaded(p, v)
        if ln.candidate.get(p, (None,))[0] == v:
            del ln.candidate[p]

    def _apply_pending(self, ln: _Learner) -> None:
        """learner.service._apply: rebase (or mix) each downloaded version in; it becomes the base."""
        from learner.outer import mix, rebase

        items, ln.pending = ln.pending, {}
        for p, (v, vec) in sorted(items.items()):
            if v <= ln.book.frags[p].base_version:
                continue
            if self.cfg.on_arrival == "rebase":
                ln.backend.set_fragment(p, rebase(ln.backend.get_fragment(p), ln.base[p], vec))
            elif self.cfg.mix_alpha == 0.0:
                ln.backend.set_fragment(p, vec)
            else:
                ln.backend.set_fragment(p, mix(ln.backend.get_fragment(p), vec, self.cfg.mix_alpha))
            ln.base[p] = vec
            ln.book.on_merged(p, v)

    def _deliver(self, ln: _Learner, p: int, v: int, vec: np.ndarray, applied: list, leads: list | None = None) -> None:
        """A global version reaches a learner (learner.service._on_head)."""
        from learner import loop as lp

        if not ln.up or ln.done:
            return
        lead = lp.lead_of({"lead": leads or []}, ln.name, ln.incarnation)
        if lead is not None and self.cfg.mode != "sync":
            ln.book.shift_phase(lp.phase_shift(lead, ln.step_time, ln.book.period, self.P, self.cfg.phase_lock))
        fetch_all = self.cfg.fetch == "every" or self.cfg.mode == "sync"
        ln.book.on_applied(p, lp.applied_rounds({"applied": applied}, ln.name, ln.incarnation, p), v)
        if fetch_all:
            if ln.book.wants(p, v):
                self._download(ln, p, v, vec)
        else:
            if v > ln.book.frags[p].base_version:
                ln.candidate[p] = (v, vec)
            if ln.book.fetch_due(p, v, self._fetch_delay(ln)):
                self._download(ln, p, v, vec)
        ln.book.on_head(p, v)
        for r in lp.applied_rounds({"applied": applied}, ln.name, ln.incarnation, p):
            if (p, r) in ln.awaiting:
                ln.applied_in[(p, r)] = min(ln.applied_in.get((p, r), v), v)
        if ln.blocked and self.cfg.mode != "sync":
            if not self._held(ln):
                ln.blocked = False
                self._start_step(ln)
            return
        if ln.blocked:
            for key in list(ln.awaiting):
                f = ln.book.frags[key[0]]
                if lp.sync_satisfied(ln.applied_in.get(key), max(f.base_version, f.pending_version)):
                    ln.awaiting.discard(key)
                    ln.applied_in.pop(key, None)
            if not ln.awaiting:
                ln.blocked = False
                self._start_step(ln)

    def _fail(self, m: int) -> None:
        ln = self.learners[m]
        if not ln.up or ln.done:
            return
        ln.up, ln.blocked = False, False
        ln.epoch += 1
        for p in range(self.P):  # an active set shrank: fragments waiting for this learner may merge
            self._consider_merge(p)

    def _return(self, m: int) -> None:
        """Back from a failure: a new process that starts from the newest global versions (its inner
        optimizer state is kept, as a restarted island that kept it would; the service's resync)."""
        ln = self.learners[m]
        if ln.up or ln.done:
            return
        ln.up = True
        ln.incarnation = f"r{ln.epoch}"
        vectors = [vec.copy() for _, vec in self.published]
        ln.backend.load(vectors)
        ln.base = [v.copy() for v in vectors]
        ln.residual = [None] * self.P
        ln.pending, ln.downloading, ln.candidate, ln.awaiting, ln.applied_in = {}, {}, {}, set(), {}
        ln.book.on_resync({p: v for p, (v, _) in enumerate(self.published)})
        self._start_step(ln)

    def _mark(self) -> None:
        """Evaluate the global model when the learners' total steps pass the next mark."""
        s = self.setup
        while self.marks and self.total_steps >= self.marks[0]:
            self.marks.pop(0)
            ev = s.evaluate_fragments([st.params for st in self.states])
            self.curve.append([self.total_steps * s.tokens_per_step, ev])
            if self.progress:
                self.progress(f"{self.cfg.mode} steps {self.total_steps}/{run_steps(self.cfg)} "
                              f"held-out {ev:.4f} (global, t={self.now:.1f})")

    # -- the aggregator -----------------------------------------------------------------------------

    def _agg_down(self) -> bool:
        return any(down <= self.now < back for down, back in self.cfg.agg_outages)

    def _agg_back(self) -> None:
        """The aggregator is back: the contributions that waited in the stream arrive in order."""
        if self._agg_down():
            return
        backlog, self.agg_backlog = self.agg_backlog, []
        for c in backlog:
            self._arrive(c)
        for p in range(self.P):
            self._consider_merge(p)

    def _arrive(self, c) -> None:
        """aggregator.service._consider: validate, then buffer (or reject by reason)."""
        from aggregator.influence import outlier_steps
        from aggregator.merge import l2_norm
        from aggregator.validate import Reason, ValidationContext, validate

        if self._agg_down():
            self.agg_backlog.append(c)
            return
        if self.cfg.byzantine_oracle and self.learners[int(c.learner.rsplit("-", 1)[1])].byzantine:
            self.rejected["oracle"] = self.rejected.get("oracle", 0) + 1
            return
        s, p = self.setup, c.fragment
        st = self.states[p]
        alive = self._alive()
        participants = alive | {x.c.learner for x in self.buffers[p]}
        ctx = ValidationContext(
            run="reference", model_hash="reference", fragment_sizes={q: s.plan.sizes[q] for q in range(self.P)},
            current_version={q: self.states[q].version for q in range(self.P)},
            active=alive | {c.learner}, known={ln.name for ln in self.learners}, applied=st.applied,
            pending={x.c.key for x in self.buffers[p]}, norms=st.norms, max_staleness=self.cfg.max_staleness,
            per_round=max(1, len(participants)), norm_outlier_factor=self.cfg.norm_outlier_factor,
            norm_min_history=self.cfg.norm_min_history, max_tokens_per_step=s.model.max_tokens_per_step,
            max_inner_lr=s.model.max_inner_lr)
        norm = l2_norm(c.vector)
        reason = validate(c, ctx, norm=norm)
        if reason == Reason.norm_outlier:  # aggregator.service._watch_outliers
            restart = self.outliers.refused(p, c.learner, norm / outlier_steps(c.inner_steps, c.period),
                                            alive | {c.learner})
            if restart is not None:
                st.norms.restart(p, restart)
                self.reference_restarts += 1
        if reason is not None:
            r = str(getattr(reason, "value", reason))
            self.rejected[r] = self.rejected.get(r, 0) + 1
            return
        self.buffers[p].append(_Pending(c, norm, self.now))
        self.arrivals = self.arrivals.observe_arrival(c.learner, c.incarnation, self.now, c.inner_steps, p, c.step_s,
                                                      c.period)
        self._consider_merge(p)

    def _consider_merge(self, p: int) -> None:
        """aggregator.versions._decide: the quorum rule decides, a timer for the grace window (the
        lock-step pairing of fragments, aggregator.rounds, is not modelled here)."""
        from aggregator.quorum import decide

        buf = self.buffers[p]
        if not buf or self._agg_down():
            return
        contributors: dict[str, float] = {}
        for x in buf:
            contributors[x.c.learner] = min(contributors.get(x.c.learner, x.arrived), x.arrived)
        first = min(x.arrived for x in buf)
        active = self._alive() - {ln.name for ln in self.learners if ln.done and ln.name not in contributors}
        d = decide(self.now, first, contributors, active, self.K, self.grace, self.arrivals, p)
        if d.merge or not active:
            self._merge(p, d.reason)
        elif d.wait_until is not None and self.timers.get(p) != d.wait_until:
            self.timers[p] = d.wait_until
            self._at(d.wait_until, 1, self._timer, p, d.wait_until)

    def _timer(self, p: int, when: float) -> None:
        if self.timers.get(p) == when:
            del self.timers[p]
            self._consider_merge(p)

    def _merge(self, p: int, reason: str) -> None:
        """aggregator.service._merge and _publish_global: merge_step, encode the version, deliver it."""
        from aggregator.quorum import arrival_leads, round_phases
        from aggregator.step import merge_step, participation_scale, round_work
        from bus.downlink import decode_version, encode_version

        cfg = self.cfg
        items, self.buffers[p] = self.buffers[p], []
        self.timers.pop(p, None)
        st = self.states[p]
        learners = {x.c.learner for x in items}
        participants = self._alive() | learners
        scale = (participation_scale(round_work([x.c for x in items]), len(participants))
                 if cfg.scale_by_participation else 1.0)
        new = merge_step(st, [x.c for x in items], self.settings, [x.norm for x in items], scale,
                         max(1, len(participants)))
        if cfg.record_trust:
            self._record_trust(p, st.version, items, new)
        self.states[p] = new
        self.merges += 1
        for x in items:
            d = st.version - x.c.base_version
            self.staleness_hist[d] = self.staleness_hist.get(d, 0) + 1
        if cfg.downlink_chain:
            from bus import codec
            from bus.downlink import encode_chain

            blob, _, self.views[p] = encode_chain(new.params, new.version, self.views[p], cfg.downlink,
                                                  **codec.codec_args(cfg.downlink, cfg.topk_chunk, cfg.down_k))
            vec = self.views[p].params
        else:
            key_before = self.keys[p]
            blob, extra, key = encode_version(new.params, new.version, key_before, cfg.downlink, cfg.keyframe_every)
            if key is not None:
                self.keys[p] = key
            vec = np.array(decode_version(blob, extra, self.keys[p] if key is not None else key_before),
                           dtype=np.float32).reshape(-1)
        self.bytes_down += len(blob)
        self.published[p] = (new.version, vec)
        applied = [list(k) for k in new.last_merge]
        leads = []
        if cfg.phase_lock:
            phases, round_s = round_phases(self.arrivals, p, learners | self._alive(),
                                           max((x.arrived for x in items), default=self.now))
            leads = arrival_leads([(x.c.learner, x.c.incarnation, x.arrived) for x in items], phases=phases,
                                  round_s=round_s)
        for ln in self.learners:
            self._at(self.now + cfg.down_delay, 2, self._deliver, ln, p, new.version, vec, applied, leads)


    def _record_trust(self, p: int, version: int, items: list, new) -> None:
        """What the trust check saw in this merge (cfg.record_trust): the learners, the cosines of their
        contributions' samples, the digests of those samples (a replay is a repeated digest) and the
        weight factors the merge used."""
        import hashlib

        from aggregator.trust import cosines, samples

        X = samples([x.c.vector for x in items])
        own = []  # each one's cosine with its learner's previous contribution to the fragment
        for x, row in zip(items, X):
            prev = self._prev_sample.get((p, x.c.learner))
            own.append(None if prev is None else round(float(cosines(np.stack([row, prev]))[0, 1]), 5))
            self._prev_sample[(p, x.c.learner)] = row
        self.trust_trace.append({"p": p, "v": version, "learners": [x.c.learner for x in items],
                                 "G": cosines(X).round(5).tolist(), "own": own,
                                 "m": [bool(np.any(r)) for r in X],
                                 "d": [hashlib.blake2b(x.data, digest_size=8).hexdigest() for x in X],
                                 "factors": [round(float(f), 4) for f in new.last_trust]})


def run_reference(cfg: RefConfig, setup: Setup | None = None, progress=None) -> dict:
    return Reference(cfg, setup, progress).run()


def same_setup(a: RefConfig, b: RefConfig) -> bool:
    """True when two configurations can share one :class:`Setup` (model, data and inner optimizer)."""
    keys = ("M", "steps", "batch", "model", "seed", "corpus", "corpora", "data_seed", "lr", "warmup", "total_steps", "weight_decay",
            "clip_norm", "inner_optimizer", "muon_rms", "P", "eval_batches", "eval_batch_size")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def main() -> None:
    import argparse

    import orjson

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in RefConfig.__dataclass_fields__.values():
        if f.name in ("model", "step_times", "failures", "agg_outages"):
            continue
        default = getattr(RefConfig(), f.name)
        typ = type(default) if default is not None else int
        if typ is bool:
            p.add_argument(f"--{f.name}", type=lambda x: x.lower() in ("1", "true", "yes"), default=default)
        else:
            p.add_argument(f"--{f.name}", type=typ, default=default)
    p.add_argument("--step_times", type=str, default="", help="comma-separated virtual seconds per step")
    p.add_argument("--agg_outages", type=str, default="", help="aggregator down: comma-separated DOWN-BACK virtual seconds")
    a = vars(p.parse_args())
    st, ao = a.pop("step_times"), a.pop("agg_outages")
    outages = tuple(tuple(float(x) for x in w.split("-")) for w in ao.split(",")) if ao else ()
    cfg = RefConfig(**a, step_times=tuple(float(x) for x in st.split(",")) if st else None,
                    agg_outages=outages)  # type: ignore[arg-type]
    r = run_reference(cfg, progress=lambda m: print(m, flush=True))
    r.pop("train_losses", None)
    print(orjson.dumps({**r, "config": {k: v for k, v in asdict(cfg).items()}}).decode())


if __name__ == "__main__":
    main()
