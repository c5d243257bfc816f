"""Compute backends of the learner core over a JAX pytree: the two ways to use an island.

A backend is what the core (``learner.service.Learner``) drives from its single worker thread:
``load`` (every fragment, at join and resync), ``step`` (one inner step, returning its loss, or
:data:`NO_STEP` when there is none to take), ``get_fragment`` / ``set_fragment`` (float32 host
vectors of the run's fragment plan).

* :class:`HookBackend`: *hook in my loop*. The user's thread runs the inner step and calls
  ``Island.step``; the core takes the new parameters, mixes in arrived versions, hands them back
  at once and computes the due outer gradients while the user's next step runs.
* :class:`TrainBackend`: *run it for me*. The core's worker thread runs the user's
  ``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` over a batch iterator;
  fragments are read between two steps in the same thread, so the step may donate its inputs.
  ``diloco learner`` is this backend with the built-in transformer's step, optimizer and data
  (``learner.builtin.builtin_backend``).
* :class:`SyntheticBackend`: no JAX (``DILOCO_SYNTHETIC``): numpy fragment vectors, a
  deterministic pseudo-gradient and a sleep per step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from bus.fragments import FragmentPlan
from bus.tree import TreeSpec
from learner import loop as lp
from learner.config import LearnerConfig
from learner.malloc import trim
from learner.pytree import TreeParams

#: returned by a backend's ``step`` when no inner step happened (the island is closing)
NO_STEP = None


class IslandClosed(RuntimeError):
    """The island was closed (or its learner stopped): no more steps."""


class _TreeBackend:
    """Fragments read from and written into a :class:`TreeParams` (the current parameters)."""

    slowdown_included = True
    #: seconds of the step just taken as its own thread timed it (HookBackend: the user's); None:
    #: the core times it (its wait for the step)
    user_step_s: float | None = None

    def __init__(self, params: TreeParams):
        self.params = params

    def load(self, vectors: list[np.ndarray]) -> None:
        for p, v in enumerate(vectors):
            self.params.set_fragment(p, v)

    def get_fragment(self, p: int, leaves: dict | None = None) -> np.ndarray:
        return self.params.get_fragment(p, leaves)

    def set_fragment(self, p: int, vector: np.ndarray) -> None:
        self.params.set_fragment(p, vector)

    def fold_progress(self, p: int, base: np.ndarray, acc: np.ndarray, leaves: dict | None = None,
                      overwrite: bool = False) -> None:
        """``acc += base - theta_p`` (``overwrite``: ``=``), ``base <- theta_p``, in chunks
        (``TreeParams.fold_progress``; ``leaves``: a snapshot of the step's leaves)."""
        self.params.fold_progress(p, base, acc, leaves=leaves, overwrite=overwrite)


def _as_float(loss: Any) -> float:
    """The user's loss as a float, in the worker thread: ``float()`` of a JAX scalar waits for the
    device and costs tens of microseconds, which the user's thread does not pay."""
    try:
        return float(loss)
    except (TypeError, ValueError):
        return float("nan")


class HookBackend(_TreeBackend):
    """The user's loop drives: ``step`` waits for the user's next parameters (``Island.step``);
    once arrivals are mixed in, ``serve`` hands them back, and the learner core computes the due
    outer gradients while the user's next inner step runs."""

    serves_early = True

    def __init__(self, params: TreeParams, cancel: threading.Event):
        super().__init__(params)
        self.cancel = cancel
        self._cv = threading.Condition()
        self._deposit: tuple[Any, float] | None = None
        self._served = 0  # parameter sets handed to the user (the first: the run's, on joining)
        self._previous = None  # the leaves the last step replaced, freed in serve()
        self.closing = False
        self._parked = False  # the core waits in step() for the next deposit
        self._taken: Any = None  # a step the user's thread handed over and served itself
        self.served_early = False  # the step step() returned was served already (nothing to mix in)
        self.fast_steps = 0  # steps taken by the fast path (exchange)
        self._handed_at: float | None = None  # user thread: when exchange() last gave parameters back
        self._deposit_s = 0.0  # the user's step that the deposit (or the step taken early) ended
        # returning freed pages to the system (learner.malloc.trim) pays for big trees only
        self._big = params is not None and 4 * params.spec.num_params >= 16 * 2**20

    def took_early(self) -> bool:
        """Core: was the step just taken served in the user's thread (then no serve() follows)?"""
        with self._cv:
            early, self.served_early = self.served_early, False
            return early

    def _free_previous(self) -> None:
        if self._previous is not None:
            self._previous = None
            if self._big:
                trim()

    def serve(self) -> None:
        with self._cv:
            self._served += 1
            self._cv.notify_all()
        # the previous step's parameters are freed here, in the worker thread, while the user's
        # next step runs (freeing 200 MB of buffers took 35 ms inside island.step, bench.island);
        # then their pages go back to the system (learner.malloc.trim): without, the heap kept
        # them, 2.8-2.9x the parameter bytes over the user's loop alone against 2.1-2.9x with
        # (what remains depends on whether the user's next step allocates before they are freed)
        self._free_previous()

    def step(self):
        # a step served in the user's thread left its predecessor's leaves here: freed in this
        # (worker) thread before parking for the next one
        self._free_previous()
        with self._cv:
            if self._served == 0:  # joined: the run's current parameters are the user's first
                self._served = 1
                self._cv.notify_all()
            # the user's thread may also be gone (an exception ended the script without close():
            # the interpreter's exit then waits for this worker thread)
            self._parked = True
            try:
                while (self._deposit is None and self._taken is None and not self.closing
                       and not self.cancel.is_set() and threading.main_thread().is_alive()):
                    self._cv.wait(0.1)
            finally:
                self._parked = False
            if self._taken is not None:  # the user's thread took the step and served it (exchange)
                loss, self._taken = self._taken, None
                early = True
            else:
                early = False
            self.user_step_s = self._deposit_s
        if early:
            # the parameters that step replaced are freed now, while the user's next step is being
            # dispatched, rather than after the core has counted this one (then the user's step had
            # mostly allocated its outputs first: three parameter sets alive, 2.9x in bench.island)
            self._free_previous()
            return _as_float(loss)
        with self._cv:
            if self._deposit is None:
                return NO_STEP
            tree, loss = self._deposit
            self._deposit = None
        self._previous = self.params.set_tree(tree, checked=True)  # checked in the user's thread (exchange)
        return _as_float(loss)

    def exchange(self, tree: Any, loss: float, alive: Callable[[], bool], why: Callable[[], str | None] = lambda: None,
                 quiet: Callable[[], bool] = lambda: False) -> Any:
        """User thread: deposit this step's parameters, wait until the learner took them and mixed
        in any arrived global version, return the parameters.

        The fast path: when the core is parked waiting for this step and has nothing to mix in
        (``quiet``: no arrival, no resync), the step is taken and served here, under the lock, and
        ``tree`` itself comes back at once (no thread hand-off on the user's critical path); the core
        then counts the step, and computes any due outer gradient, while the user's next step runs.
        An arrival that lands meanwhile waits for the next step (``served_early``)."""
        self.params.check(tree)  # a wrong tree is the user's error, not the learner's
        # the user's step: from the parameters handed back to this deposit (0 for the first, whose
        # start the island does not see: left out of the pace)
        t = time.monotonic()
        step_s = t - self._handed_at if self._handed_at is not None else 0.0
        with self._cv:
            self._deposit_s = step_s
            if (self._parked and self._deposit is None and self._taken is None and self._served >= 1
                    and self._previous is None and quiet()):
                self._previous = self.params.set_tree(tree, checked=True)  # freed by serve(), in the worker
                self._taken = loss
                self.served_early = True
                self.fast_steps += 1
                self._served += 1
                self._cv.notify_all()
                self._handed_at = time.monotonic()
                return tree
            target = self._served + 1
            self._deposit = (tree, loss)
            self._cv.notify_all()
            while self._served < target:
                if not alive():
                    raise IslandClosed(f"the island's learner stopped: {why() or 'see its log'}")
                self._cv.wait(0.1)
            tree = self.params.tree()
        self._handed_at = time.monotonic()
        return tree

    def close(self) -> None:
        with self._cv:
            self.closing = True
            self._cv.notify_all()


class TrainBackend(_TreeBackend):
    """Run it for me: ``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` over
    ``batches``, in the learner core's worker thread. The loop ends when ``batches`` does.

    ``params``: the parameter tree, or None to build it at the first :meth:`load` with
    ``build(vectors)`` (a learner that downloads version 0 has no tree before). ``opt_state``, or
    None to make it with ``init_opt(params)`` after the first load; it is kept through merges and
    resyncs (DiLoCo's inner optimizer state is local). The step may donate its inputs
    (``donate_argnums=(0, 1)``): nothing else holds them. The core adds the slowdown
    (``DILOCO_SLOWDOWN``) after the step."""

    slowdown_included = False

    def __init__(self, train_step: Callable, batches: Iterator, spec: TreeSpec, plan: FragmentPlan, *,
                 params: Any = None, opt_state: Any = None, build: Callable[[list[np.ndarray]], Any] | None = None,
                 init_opt: Callable[[Any], Any] | None = None):
        if params is None and build is None:
            raise ValueError("TrainBackend needs params or build")
        if opt_state is None and init_opt is None:
            raise ValueError("TrainBackend needs opt_state or init_opt")
        super().__init__(TreeParams(params, spec, plan) if params is not None else None)
        self.train_step, self.batches = train_step, iter(batches)
        self.spec, self.plan = spec, plan
        self.opt_state, self._build, self._init_opt = opt_state, build, init_opt
        self._next_batch: Any = None  # a batch taken to compile the step, used by the first step

    def load(self, vectors: list[np.ndarray]) -> None:
        if self.params is None:
            self.params = TreeParams(self._build(vectors), self.spec, self.plan)
        else:
            super().load(vectors)
        if self.opt_state is None:
            self.opt_state = self._init_opt(self.params.tree())

    def _batch(self) -> Any:
        if self._next_batch is not None:
            batch, self._next_batch = self._next_batch, None
            return batch
        return next(self.batches)

    def compile(self) -> float:
        """Compile a jitted step ahead of time (its first call is then not the compile); the batch
        it takes is the first step's. 0 for a step that is not a ``jax.jit`` function."""
        if not hasattr(self.train_step, "lower"):
            return 0.0
        t0 = time.monotonic()
        try:
            self._next_batch = next(self.batches)
        except StopIteration:
            return 0.0
        self.train_step = self.train_step.lower(self.params.tree(), self.opt_state, self._next_batch).compile()
        return time.monotonic() - t0

    def step(self):
        try:
            batch = self._batch()
        except StopIteration:
            return NO_STEP
        params, self.opt_state, loss = self.train_step(self.params.tree(), self.opt_state, batch)
        self.params.set_tree(params)  # checked: a step that changes the tree's structure is refused
        return float(loss)


class SyntheticBackend:
    """No JAX: numpy fragment vectors, a deterministic pseudo-gradient and a sleep per step."""

    slowdown_included = True  # the step sleeps step_time * slowdown itself
    user_step_s: float | None = None  # the core times the step (_TreeBackend.user_step_s)

    def __init__(self, plan: FragmentPlan, cfg: LearnerConfig, seed: int, cancel: threading.Event):
        self.plan = plan
        self.lr = cfg.inner_lr or 1e-3  # the synthetic step's size (no model: no width to derive it from)
        self.step_seconds = cfg.step_time * cfg.slowdown
        self.cancel = cancel
        self.directions = lp.synthetic_directions(plan.sizes, seed)
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(11,))))
        self.frags: list[np.ndarray] = []

    def load(self, vectors: list[np.ndarray]) -> None:
        self.frags = [np.array(v, dtype=np.float32, copy=True).reshape(-1) for v in vectors]

    def step(self) -> float:
        t0 = time.monotonic()
        scales = self.rng.standard_normal(len(self.frags))
        loss = lp.synthetic_step(self.frags, self.directions, self.lr, scales)
        rest = self.step_seconds - (time.monotonic() - t0)
        if rest > 0:
            self.cancel.wait(rest)  # blocks this worker thread, as a long JAX step would
        return loss

    def get_fragment(self, p: int) -> np.ndarray:
        return self.frags[p].copy()

    def set_fragment(self, p: int, vector: np.ndarray) -> None:
        self.frags[p][:] = vector
