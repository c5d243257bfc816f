"""The learner's island core: the training loop and everything it does at a step boundary.

A mixin of ``learner.service.Learner`` (which holds the state and the process shell): inner steps
in the worker thread, the sync schedule, outer gradients prepared (Delta = base - theta, error
feedback, quantised) and published in the background, the sync-mode wait for merged versions, the
final sync; global versions taken in (the head watch, the once-per-sync download, checks) and
rebased or mixed in; the resync after an eviction.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from nats.js.errors import NotFoundError

from bus import codec
from bus.protocol import grad_meta, grad_obj_id
from bus.transport import Head, follow_heads, transient
from learner import loop as lp
from learner import swap
from learner.outer import mix, outer_gradient, rebase
from learner.startup import HEAD_POLL_INTERVAL, StartupError, fetch_newest

#: Seconds a stopping learner waits for its in-flight outer gradients.
DRAIN_TIMEOUT = 10.0


def _owned(a) -> bool:
    """A float32 numpy vector the learner may write into (not a read-only view of a blob)."""
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 1 and a.flags.writeable


class IslandCore:
    """The training loop, outer-gradient publishing and global-version intake of a ``Learner``."""

    if TYPE_CHECKING:  # the state is the Learner's (set in its __init__)
        def __getattr__(self, name: str) -> Any: ...
        base: list[np.ndarray | None]
        residual: list[np.ndarray | None]
        residual_dtype: str
        unsent: list[np.ndarray | None]
        pending: dict[int, tuple[int, np.ndarray]]
        applied_in: dict[tuple[int, int], int]
        loss: float
        quant_error: float
        blocked_s: float
        held_s: float
        _finishing: bool
        admitted: bool
        member_state: str | None
        sync_timeouts: int
        _resync_requested: bool

    @property
    def merges_reach(self) -> bool:
        """The aggregator merges this learner's work now (``learner.loop.merges_reach``): admitted,
        or in a run without a monitor once a round of it was merged. Holds and the wait for the
        own round's version apply only then."""
        return lp.merges_reach(self.admitted, self.member_state, self.book.merged_any())

    # -- the training loop --------------------------------------------------------------------------

    async def _train(self) -> None:
        cfg = self.cfg
        total = cfg.steps_to_run
        hook = getattr(self.backend, "serves_early", False)
        while not self._halt.is_set() and self.book.step < total:
            if self._side_error is not None:  # the side thread failed (a bug): as if the worker had
                raise self._side_error
            # an island's hook (``hook``): the parameters held here were handed back to the user
            # already, and the next deposit replaces them; arrivals and a resync are applied to
            # that deposit instead (below), or they would be lost with the base moved on
            if self._resync_requested and not hook:
                await self._resync()
            if self.pending and not hook:
                await self._apply_pending()
            t0 = time.monotonic()
            loss = await self._in_worker(self.backend.step)
            if loss is None:  # the backend has no step to take: an island closing (learner.island)
                break
            if self._halt.is_set() and cfg.synthetic:
                break  # the synthetic sleep was cut short: do not count a partial step
            if not self.backend.slowdown_included and (cfg.slowdown > 1.0 or cfg.min_step_time > 0):
                await self._sleep(lp.extra_sleep(time.monotonic() - t0, cfg.slowdown, cfg.min_step_time))
            deferrals = self.book.deferrals
            step_s = time.monotonic() - t0
            due = self.book.on_step(step_s)
            if self.book.deferrals > deferrals and (self.admitted or self.member_state is None):
                # (a learner the monitor has not admitted yet defers because its work is held for the
                # admission, not because the aggregator is slow: not counted)
                self._behind += self.book.deferrals - deferrals
                if self._behind >= self.P and not self._told_behind:
                    self._tell_behind()
            if self.merges_reach and self.book.holding():
                await self._hold(hook)
            self.loss = loss
            now = time.monotonic()
            self.rate.add(now, self.tokens_per_step)
            # (an island's step is the user's, timed in the user's thread: the core's own work runs
            # beside it, so its wait for the deposit is not the step's length)
            user_s = getattr(self.backend, "user_step_s", None)
            self.pace.add(now, self.tokens_per_step, step_s if user_s is None else user_s)
            if hook:
                # mix arrivals (or a resync) into the parameters just taken and hand them back to
                # the user now; the outer gradients below are computed while the user's next inner
                # step runs (JAX arrays are immutable, so the taken tree stays as it was). A step
                # the user's thread served itself (nothing to mix in then) is back with the user
                # already: what arrived since waits for the next deposit
                if not self.backend.took_early():
                    if self._resync_requested:
                        await self._resync()
                        due = []  # the step's work is dropped with the rest: nothing to send
                    if self.pending:
                        await self._apply_pending()
                    await self._in_worker(self.backend.serve)
            waits = []
            for p in due:
                c = self.book.begin_sync(p)
                if c is None:
                    self.log.debug("sync_skipped", fragment=p, reason="previous publish in flight")
                    continue
                if self._side is not None:
                    # an island: the outer gradient is computed in the side thread from this step's
                    # leaves while the user's next steps run (the user's thread never waits for it:
                    # bench.island's hook_s at a sync step)
                    self._base_moves[p] += 1  # (queued: a swap prepared before it is prepared again)
                    prepared = self._side.submit(self._prepare, c, self.backend.params.fragment_leaves(p))
                    task = asyncio.create_task(self._publish_prepared(c, prepared))
                else:
                    blob, meta = await self._in_worker(self._prepare, c)
                    task = asyncio.create_task(self._publish(c, blob, meta))
                self._publishes.add(task)
                task.add_done_callback(self._publishes.discard)
                if cfg.mode == "sync":
                    self._awaiting.add((c.fragment, c.round))
                    waits.append((c, task))
            if cfg.mode == "sync" and waits:
                await self._sync_wait(waits)
            self._fetch_candidates()
        if self._side_error is not None:
            raise self._side_error
        if cfg.final_sync and not self._halt.is_set():
            await self._final_sync()
        c = self.book.counters()
        step_mean, step_cv = self.book.step_spread()
        self.log.info("training_done", step=self.book.step, step_s_mean=round(step_mean, 4), step_cv=round(step_cv, 3), halted=self._halt.is_set(), deferred_syncs=c["deferred"], window_valve=c["valve"],
                      holds=c["holds"], holds_expired=c["holds_expired"], held_s=round(self.held_s, 3),
                      steps_per_sync=round(self.book.steps_sent / max(1, self.book.contributions), 2),
                      phase_shifted=round(self.book.phase_shifted, 3))

    async def _hold(self, hook: bool) -> None:
        """The sync window's hold (``Bookkeeper.holding``): a fragment's deferred sync has waited
        DILOCO_SYNC_HOLD periods for the merge of this learner's previous round. Hold the next inner
        step (an island's user waits in ``island.step``) until the version holding that round is
        here: mixed in now, or, on an island, into the deposit the user's step hands over (the hook
        path below). Heartbeats and downloads go on meanwhile. At most DILOCO_SYNC_TIMEOUT seconds:
        then train on (``hold_expired``, once per hold) until the sync goes out. Only while its work
        is merged (``merges_reach``: admitted, or merged in a run without a monitor):
        the work of a learner the monitor has not admitted (a restart rejoining) is held by the
        aggregator until it is, and admission needs current versions, which a held learner would not
        take (it waited for its own round's merge: a deadlock that the held work's rejection ended)."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.sync_timeout
        self.book.holds += 1
        while not self._halt.is_set() and self.merges_reach:
            held = self.book.holding()
            if not held:
                break
            if any(p in self.pending for p in held):
                if not hook:
                    await self._apply_pending()
                    continue
                if not self._swapping() or any(self._swap_ready(p) for p in held):
                    break  # applied to the user's next deposit (its step is not served early now)
                # (its swap is still being prepared in the side thread: its end sets the news)
            self._fetch_candidates()  # (a step boundary's downloads: a head that came before it was due)
            rest = deadline - time.monotonic()
            if rest <= 0:
                for p in held:
                    self.book.give_up_hold(p)
                why = ("the store is full (store_full): the aggregator merges nothing until it takes writes"
                       if self.store_watch.faulted else
                       "is the aggregator up? does its merge wait for a learner that does not step: another island "
                       "driven from this thread, or one done training and not closed? docs/learner.md")
                self.log.warning("hold_expired", fragments=held, waited=round(time.monotonic() - t0, 3),
                                 state={p: self.book.hold_state(p) for p in held},
                                 candidate={p: self._candidate[p].version for p in held if p in self._candidate},
                                 message="the aggregator merged none of this learner's held rounds within "
                                         f"DILOCO_SYNC_TIMEOUT s: training on without it ({why})")
                break
            self._news.clear()
            try:
                await asyncio.wait_for(self._news.wait(), min(rest, 0.5))
            except asyncio.TimeoutError:
                pass
        waited = time.monotonic() - t0
        self.blocked_s += waited
        self.held_s += waited

    def _tell_behind(self) -> None:
        """Once per process: as many syncs as there are fragments were deferred while admitted (or
        with no monitor) because the aggregator had not merged the previous round of their fragment
        yet (learner.loop.Bookkeeper.window_open). One or two deferrals are the normal jitter of a
        busy machine; a ``diloco up`` warned in every run when the first one did."""
        self._told_behind = True
        p = self.book.deferred()[0] if self.book.deferred() else -1
        self.log.warning("aggregator_behind", fragment=p, period=round(self.book.period, 2), window=self.book.window,
                         message=f"the aggregator has not merged this learner's last {self.book.window} round(s) of "
                         f"fragment {p} a whole sync period ({round(self.book.period, 2):g} steps) after sending: its syncs are "
                         "deferred until it has (no work is lost: each outer gradient then holds more inner steps, "
                         "and the run syncs less often), and after a whole period deferred this learner's steps wait "
                         "for the merge (DILOCO_SYNC_HOLD). A merge's round trip is longer than this learner's "
                         f"sync period ({round(self.book.period, 2):g} steps): if the aggregator logged aggregator_saturated "
                         "it is too slow for the run; if not, the steps are short for the round trip (a small "
                         "model: raise DILOCO_SYNC_EVERY to about the round trip in steps; the run syncs that seldom "
                         "anyway, without the holds). "
                         "docs/aggregator.md, 'When the aggregator falls behind'")

    async def _final_sync(self) -> None:
        """The step budget is reached: send the steps every fragment holds since its last sync.

        Without it about H/2 inner steps per fragment of every learner never reach the global model.
        """
        if self._side is not None:  # an island's outer gradients queued in its side thread, done first
            await self._in_side(lambda: None)
        await self._drain()  # a publish still in flight would make begin_sync skip its fragment
        if self._side_error is not None:
            raise self._side_error
        self._finishing = True  # they say so: a run without a monitor stops waiting for this learner
        tasks = []
        for p in self.book.unsent_fragments():
            c = self.book.begin_sync(p)
            if c is None:
                continue
            self._base_moves[p] += 1
            blob, meta = await self._in_side(self._prepare, c)
            tasks.append(asyncio.create_task(self._publish(c, blob, meta)))
        if tasks:
            done = await asyncio.gather(*tasks, return_exceptions=True)
            self.log.info("final_sync", fragments=len(tasks), published=sum(1 for d in done if d is True))

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            try:
                await asyncio.wait_for(self._halt.wait(), seconds)
            except asyncio.TimeoutError:
                pass

    def _prepare(self, c: lp.Contribution, leaves: dict | None = None) -> tuple[bytearray, dict]:
        """Worker thread (an island's side thread): Delta = base - theta (+ residual), quantised,
        and its metadata. ``leaves``: the snapshot of theta's leaves taken at the sync step (an
        island's parameters have moved on meanwhile).

        The reference then moves to theta: base_p <- theta_p. The next outer gradient of p holds only
        progress made after this one, so work is never sent twice when no new global version arrives
        in between (the aggregator down, a slow merge, a network cut): without this, every later
        delta would repeat this one and the aggregator would apply it again and again.
        """
        p, q = c.fragment, self.cfg.quantiser
        ef = self.cfg.error_feedback and q != "fp32"
        snap = {} if leaves is None else {"leaves": leaves}
        base, res = self.base[p], self.residual[p]
        folds = hasattr(self.backend, "fold_progress") and _owned(base)
        if ef and res is not None and folds and res.dtype != np.float32 and res.flags.writeable:
            # a bfloat16 residual (DILOCO_RESIDUAL_DTYPE): base - theta folded into one float32
            # scratch of the largest fragment, reused, and base <- theta; the residual is added and
            # the new one rounded into its memory chunk by chunk (bus.codec.encode_with_feedback)
            acc = self._scratch(base.size)
            self.backend.fold_progress(p, base, acc, overwrite=True, **snap)
            if self.unsent[p] is not None:
                acc += self.unsent[p]
                self.unsent[p] = None
            blob, _, _, self.quant_error = codec.encode_with_feedback(
                acc, res, q, keep_residual=True, want_sent=False, decay=self.cfg.feedback_decay,
                **codec.codec_args(q, self.cfg.topk_chunk, self.cfg.topk_k))
            return self._finish_prepare(c, blob)
        if ef and res is not None and folds and _owned(res):
            # residual += base - theta and base <- theta, chunk by chunk from the parameters; the
            # new residual is then written over the corrected vector: a sync allocates nothing of
            # the fragment's size but its blob (bench.island; bitwise the path below without unsent
            # work, since r + d == d + r)
            if self.cfg.feedback_decay != 1.0:
                res *= np.float32(self.cfg.feedback_decay)
            self.backend.fold_progress(p, base, res, **snap)
            if self.unsent[p] is not None:
                res += self.unsent[p]
                self.unsent[p] = None
            blob, _, _, self.quant_error = codec.encode_with_feedback(  # the new residual is in res
                res, None, q, keep_residual=True, want_sent=False, in_place=True,
            **codec.codec_args(q, self.cfg.topk_chunk, self.cfg.topk_k))
            return self._finish_prepare(c, blob)
        theta = self.backend.get_fragment(p, **snap)  # a new float32 array (every backend's contract)
        # the base is ours alone (never an alias of the parameters or a keyframe) and replaced
        # below: the delta goes into its memory, one fragment-sized array less at the peak of a sync
        delta = outer_gradient(base, theta, out=base if _owned(base) and base.shape == theta.shape else None)
        if self.unsent[p] is not None:  # a publish that failed for good: its work goes out now
            delta += self.unsent[p]
            self.unsent[p] = None
        self.base[p] = theta
        # error feedback, quantisation and the decoded copy in one chunked pass (bitwise the
        # unfused encode / decode / feedback_step, tests/test_codec_feedback.py)
        blob, _, residual, self.quant_error = codec.encode_with_feedback(
            delta, self.residual[p] if ef else None, q, keep_residual=ef, want_sent=False,
            decay=self.cfg.feedback_decay, residual_dtype=self.residual_dtype,
            **codec.codec_args(q, self.cfg.topk_chunk, self.cfg.topk_k))
        if ef:
            self.residual[p] = residual
        return self._finish_prepare(c, blob)

    def _scratch(self, n: int) -> np.ndarray:
        """Worker thread: ``n`` float32 values (garbage until written), in one buffer of the largest
        fragment kept for every sync (``_prepare`` runs one at a time, in one thread)."""
        if self._acc is None or self._acc.size < n:
            self._acc = np.empty(max(self.plan.sizes), dtype=np.float32)
        return self._acc[:n]

    def _finish_prepare(self, c: lp.Contribution, blob: bytearray) -> tuple[bytearray, dict]:
        p = c.fragment
        meta = grad_meta(run=self.common.run, model=self.model_hash, learner=self.id,
                         incarnation=self.incarnation, fragment=p, round_=c.round,
                         base_version=c.base_version, inner_steps=c.steps, tokens=c.tokens,
                         region=self.common.region, period=c.period, lockstep=self.cfg.mode == "sync",
                         step_s=c.step_s, final=self._finishing)
        self._sent[(p, c.round)] = blob  # what was sent is decode(blob), rebuilt only if the publish fails
        return blob, meta

    async def _publish_prepared(self, c: lp.Contribution, prepared) -> bool:
        """An island's sync: publish once the side thread has prepared the outer gradient."""
        try:
            blob, meta = await asyncio.wrap_future(prepared)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug: the training loop raises it at its next step
            self._side_error = self._side_error or e
            self.book.end_sync(c, False)
            self._news.set()
            return False
        return await self._publish(c, blob, meta)

    async def _publish(self, c: lp.Contribution, blob, meta: dict) -> bool:
        ok = False
        try:
            await self.publisher.publish(self.s.grad(c.fragment, self.id),
                                         grad_obj_id(self.common.run, self.id, self.incarnation, c.fragment,
                                                     c.round) + "." + self._nonce,
                                         blob, meta)
            ok = True
            self.fate.on_sent(c.fragment, c.round, time.monotonic())
            self.log.debug("contributed", fragment=c.fragment, round=c.round, base=c.base_version,
                           steps=c.steps, bytes=len(blob))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a full store was said once already (store_full): this one quietly
            (self.log.debug if self.store_watch.faulted else self.log.warning)(
                "publish_failed", fragment=c.fragment, round=c.round, error=repr(e))
        finally:
            sent_blob = self._sent.pop((c.fragment, c.round), None)
            if not ok and sent_blob is not None:  # give the work back: it joins the next outer gradient
                p = c.fragment
                sent = np.array(codec.decode_array(sent_blob), dtype=np.float32).reshape(-1)
                self.unsent[p] = sent if self.unsent[p] is None else self.unsent[p] + sent
            self.book.end_sync(c, ok)
            if ok:
                self._progress_moved()
        return ok

    async def _sync_wait(self, waits: list) -> None:
        """Sync mode: wait until a merged global version includes each contribution (or timeout)."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.sync_timeout
        for c, task in waits:
            key = (c.fragment, c.round)
            try:
                done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - time.monotonic()))
                published = task in done and not task.cancelled() and task.result()
            except Exception:
                published = False
            while published and not self._halt.is_set():
                self._news.clear()
                f = self.book.frags[c.fragment]
                if lp.sync_satisfied(self.applied_in.get(key), max(f.base_version, f.pending_version)):
                    break
                self._fetch_candidates()  # (a download of the merged version that failed for the link)
                rest = deadline - time.monotonic()
                if rest <= 0:
                    self.sync_timeouts += 1
                    self.log.warning("sync_timeout", fragment=c.fragment, round=c.round,
                                     waited=round(time.monotonic() - t0, 3))
                    break
                try:
                    await asyncio.wait_for(self._news.wait(), min(rest, 1.0))
                except asyncio.TimeoutError:
                    pass
            self.applied_in.pop(key, None)
            self._awaiting.discard(key)
        self.blocked_s += time.monotonic() - t0
        # an island's parameters were handed back already: the merged version is rebased into the
        # user's next deposit (the hook path of _train), not into parameters that deposit replaces
        if self.pending and not getattr(self.backend, "serves_early", False):
            await self._apply_pending()

    async def _apply_pending(self) -> None:
        if self._swapping():
            merged = await self._swap_in()
        else:
            items, self.pending = self.pending, {}
            merged = await self._apply_plain(items)
        for p, v in merged:
            self.book.on_merged(p, v)
        if merged:
            self.log.debug("merged", versions=dict(merged))

    # -- an island's arrivals: prepared in the side thread, swapped in at a step boundary -----------

    def _swapping(self) -> bool:
        """Arrivals are swapped in (learner.swap): an island's hook, rebase on arrival, async mode."""
        return self._side is not None and self.cfg.on_arrival == "rebase" and self.cfg.mode != "sync"

    def _swap_ready(self, p: int) -> bool:
        f = self._swaps.get(p)
        return f is not None and f.done()

    def arrivals_ready(self) -> bool:
        """Something to mix into the next step (any thread: an island's fast path asks): an
        arrival whose swap is prepared, or, without swaps, any arrival."""
        if not self._swapping():
            return bool(self.pending)
        # (an arrival without a swap queued is queued by the core at the next deposit)
        return any(f.done() for f in list(self._swaps.values())) or any(p not in self._swaps for p in list(self.pending))

    def _side_submit(self, fn, *args):
        """Queue ``fn`` on the side thread; a failure is raised by the training loop (at its next
        step, or before the final sync)."""
        fut = self._side.submit(fn, *args)

        def done(f) -> None:
            if not f.cancelled() and f.exception() is not None and self._side_error is None:
                self._side_error = f.exception()
        fut.add_done_callback(done)
        return fut

    def _queue_swap(self, p: int) -> None:
        """Prepare the swap of fragment p's pending version in the side thread, against the base
        as it will be once everything queued before has run (``_base_moves`` at this moment: if
        more base-moving work is queued before the swap lands, it is prepared again)."""
        if not self._swapping() or p not in self.pending:
            return
        v, vec = self.pending[p]
        old = self._swaps.get(p)
        if old is not None:
            old.cancel()  # (a replaced version not started yet is not prepared)
        fut = self._side_submit(self._prepare_swap, p, v, vec, self._base_moves[p])
        self._swaps[p] = fut
        loop = asyncio.get_running_loop()

        def done(_f) -> None:
            try:
                loop.call_soon_threadsafe(self._news.set)
            except RuntimeError:  # the loop is closed: the learner stopped
                pass
        fut.add_done_callback(done)

    def _prepare_swap(self, p: int, v: int, vec: np.ndarray, moves: int) -> swap.Swap:
        tp = self.backend.params
        return swap.prepare(self.plan.fragments[p], v, vec, self.base[p], moves,
                            dict(tp.placement), tp.shapes, tp.dtypes)

    def _commit_swap(self, sw: swap.Swap) -> None:
        """Side thread: the base follows a swap (queued before the swap's adds are dispatched, so
        whatever is queued after it sees the new base)."""
        self.base[sw.fragment] = sw.vector

    async def _swap_in(self) -> list[tuple[int, int]]:
        """At a step boundary (an island's deposit taken, not yet served): dispatch the adds of
        every arrival whose swap is prepared against the base it will land on; the others wait for
        a later step (prepared again if the base was moved by work queued after the preparation:
        an outer gradient of that fragment, which moves the base to theta_k, so D would carry the
        progress just sent)."""
        ready: list[swap.Swap] = []
        for p, (v, _) in list(self.pending.items()):
            f = self._swaps.get(p)
            if f is not None and not f.done():
                continue
            if f is None or f.cancelled() or (f.exception() is None and (
                    f.result().version != v or f.result().gen != self._base_moves[p])):
                self._queue_swap(p)  # (never queued, replaced since, or the base moved meanwhile)
                continue
            sw = f.result()  # a failed preparation is raised here
            del self.pending[p], self._swaps[p]
            if v > self.book.frags[p].base_version:
                ready.append(sw)
        fast = [sw for sw in ready if sw.parts is not None]
        plain = {sw.fragment: (sw.version, sw.vector) for sw in ready if sw.parts is None}
        merged = []
        if fast:
            for sw in fast:  # the bases first (in order: a newer version is prepared against it)
                self._base_moves[sw.fragment] += 1
                self._side_submit(self._commit_swap, sw)
            await self._in_worker(self._add_swaps, fast)
            merged += [(sw.fragment, sw.version) for sw in fast]
        if plain:
            merged += await self._apply_plain(plain)
        return merged

    async def _apply_plain(self, items: dict[int, tuple[int, np.ndarray]]) -> list[tuple[int, int]]:
        """The plain rebase (or mix) of ``items``, where bases are written (``_in_side``)."""
        for p in items:
            self._base_moves[p] += 1
        return await self._in_side(self._apply, items)

    def _add_swaps(self, swaps: list[swap.Swap]) -> None:
        for sw in swaps:
            self.backend.params.add_to_slices(sw.parts)

    def _apply(self, items: dict[int, tuple[int, np.ndarray]]) -> list[tuple[int, int]]:
        """Worker thread (an island's side thread), at a step boundary: theta_p <- Theta_p +
        (theta_p - base_p) (rebase) or mix(theta_p, Theta_p, alpha) (mix); then base_p <- Theta_p."""
        alpha = self.cfg.mix_alpha
        merged = []
        for p, (v, vec) in sorted(items.items()):
            if v <= self.book.frags[p].base_version:
                continue
            if self.cfg.on_arrival == "rebase":
                self.backend.set_fragment(p, rebase(self.backend.get_fragment(p), self.base[p], vec))
            elif alpha == 0.0:
                self.backend.set_fragment(p, vec)
            else:
                self.backend.set_fragment(p, mix(self.backend.get_fragment(p), vec, alpha))
            self.base[p] = vec
            merged.append((p, v))
        return merged

    async def _resync(self) -> None:
        """Evicted while alive: take the newest version of every fragment, drop local state."""
        self._resync_requested = False
        t0 = time.monotonic()
        try:
            vectors, versions = await fetch_newest(self.store, self.plan,
                                                   t0 + max(30.0, self.cfg.sync_timeout), self.log)
        except StartupError as e:
            self.log.warning("resync_failed", reason=str(e))
            self._resync_requested = True
            return
        finally:
            self.blocked_s += time.monotonic() - t0
        if self._side is not None:
            await self._in_side(lambda: None)  # the outer gradients in preparation are done with the bases
        await self._in_worker(self.backend.load, vectors)
        self.base = vectors
        self._base_moves = [g + 1 for g in self._base_moves]
        self.residual = [None] * self.P
        self.unsent = [None] * self.P
        self.pending = {p: pv for p, pv in self.pending.items() if pv[0] > versions[p]}
        self._swaps = {}
        for p in self.pending:
            self._queue_swap(p)
        self.book.on_resync(versions)
        self.log.warning("resynced", versions=versions, step=self.book.step)

    async def _drain(self) -> None:
        if self._publishes:
            await asyncio.wait(set(self._publishes), timeout=DRAIN_TIMEOUT)

    # -- global versions ----------------------------------------------------------------------------

    def _every_version(self, head: Head) -> bool:
        """Download every version of this head's fragment (fetch=every, synchronous mode, a chained
        downlink: every version, so the next one is a small delta against it), not once per sync."""
        return self._fetch_all or bool(head.meta.get("chain"))

    def _fetch_candidates(self) -> None:
        """At a step boundary or a pass of a wait: start the downloads that became due (fetch=round),
        and those that failed for the link or the server (every policy)."""
        for p, head in list(self._candidate.items()):
            if self._every_version(head):
                due = self.book.wants(p, head.version)
                if not due:  # a newer version came meanwhile
                    self._drop_candidate(head)
            else:
                due = self.book.fetch_due(p, head.version, self.cfg.fetch_delay_for(self.book.period), self.merges_reach)
            if due and not any(t.get_name() == f"fetch-{p}" for t in self._fetches):
                task = asyncio.create_task(self._on_head(head), name=f"fetch-{p}")
                self._fetches.add(task)
                task.add_done_callback(self._fetches.discard)

    def _lock_phase(self, head: Head) -> None:
        """The phase lock (DILOCO_PHASE_LOCK, ``learner.loop.phase_shift``): move this learner's
        syncs by its share of its lead in the merge this head made, once per version."""
        p = head.fragment
        if self.cfg.phase_lock <= 0 or self.cfg.mode == "sync" or head.version <= self._phase_seen.get(p, -1):
            return
        self._phase_seen[p] = head.version
        lead = lp.lead_of(head.meta, self.id, self.incarnation)
        if lead is None:
            return
        # seconds per step: the pace, or before it is known (its first window) the mean so far
        pace = self.pace.pace(time.monotonic())
        done = self.book.step - self.book.start_step
        step_s = self.tokens_per_step / pace if pace > 0 else self.book.step_seconds_total / max(1, done)
        self.book.shift_phase(lp.phase_shift(lead, step_s, self.book.period, self.P, self.cfg.phase_lock))

    async def _on_head(self, head: Head) -> None:
        p = head.fragment
        if not 0 <= p < self.P:
            self._reject_global("wrong_fragment", head)
            return
        async with self._head_lock:
            if self._refused.get(p) == head:
                # refused already: the watch and a step boundary's fetch of the same candidate can
                # both hand it here (test_hostile counted a forged head twice, about 1 run in 10)
                return
            # which of our rounds this version's merge held (the fetch policy waits for our own)
            ours = lp.applied_rounds(head.meta, self.id, self.incarnation, p)
            upto = lp.merged_upto(head.meta, self.id, self.incarnation)  # merged here or earlier
            self.book.on_applied(p, ours if upto is None else [*ours, upto], head.version)
            self._lock_phase(head)
            if upto is not None:  # rounds whose own head was missed are merged too (work fate)
                ours = sorted({*ours, *(r for f, r in self.fate.outstanding if f == p and r <= upto)})
            self.fate.on_head(p, head.version, ours, time.monotonic())
            if self._every_version(head):
                due = self.book.wants(p, head.version)
            else:
                # download later, once per own sync: remember the newest head (the latest received,
                # so a forged huge version is replaced by the next genuine one)
                if head.version > self.book.frags[p].base_version:
                    self._candidate[p] = head
                due = self.book.fetch_due(p, head.version, self.cfg.fetch_delay_for(self.book.period), self.merges_reach)
                if not due:
                    return
            if due:
                # fetch and check the blob before believing the head: a forged or broken head must
                # not advance what we think the newest version is
                try:
                    vec = await self.store.read(head)
                except NotFoundError:
                    # replaced by a newer version meanwhile (its head follows), or a head whose
                    # sequences hold something else (forged)
                    self._reject_global("unreadable", head)
                    self._drop_candidate(head)
                    self._news.set()
                    return
                except Exception as e:
                    if transient(e) and self.fetch_retries.failed(head, e):
                        # the link or the server, not the version (a server restarting): keep the
                        # candidate, fetched again at the next step boundary or pass of a wait.
                        # Refused, it stalled every learner held for that version's merge until
                        # DILOCO_SYNC_TIMEOUT (chaos quick's server kill, once in a loaded suite);
                        # every policy alike (fetch=every or synchronous mode skipped the version
                        # until the next head, and a synchronous learner waited DILOCO_SYNC_TIMEOUT)
                        current = self._candidate.get(p)
                        if current is None or current.version <= head.version:
                            self._candidate[p] = head
                        return
                    # (one that failed for DILOCO_SYNC_TIMEOUT seconds is refused: a head no
                    # server answers for, a forged one say, is not tried for the whole run)
                    self._reject_global("unfetchable" if transient(e) else "bad_blob", head, error=repr(e))
                    self._drop_candidate(head)
                    self._news.set()
                    return
                self.pending[p] = (head.version, vec)
                self._queue_swap(p)
                self.book.on_downloaded(p, head.version)
                self._drop_candidate(head)
            self._verified[p] = max(self._verified.get(p, -1), head.version)
            self.book.on_head(p, head.version)
            for r in lp.applied_rounds(head.meta, self.id, self.incarnation, p):
                key = (p, r)
                if key in self._awaiting:
                    self.applied_in[key] = min(self.applied_in.get(key, head.version), head.version)
            self._news.set()

    def _drop_candidate(self, head: Head) -> None:
        if self._candidate.get(head.fragment) is head:
            del self._candidate[head.fragment]

    def _reject_global(self, reason: str, head: Head, **kw) -> None:
        if 0 <= head.fragment < self.P:
            self._refused[head.fragment] = head
        self.rejected_globals[reason] = self.rejected_globals.get(reason, 0) + 1
        self.log.warning("global_version_rejected", reason=reason, fragment=head.fragment, version=head.version, **kw)

    async def _follow_globals(self) -> None:
        await follow_heads(self.store.store, self._halt, self._on_head, lambda p: self.book.frags[p].known_version,
                           self.P, self.log, self._verified, HEAD_POLL_INTERVAL)
