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

    def __init__(self, params: TreeParams):
        self.params = params

    def load(self, vectors: list[np.ndarray]) -> None:
        for p, v in enumerate(vectors):
            self.params.set_fragment(p, v)

    def get_fragment(self, p: int) -> np.ndarray:
        return self.params.get_fragment(p)

    def set_fragment(self, p: int, vector: np.ndarray) -> None:
        self.params.set_fragment(p, vector)

    def fold_progress(self, p: int, base: np.ndarray, acc: np.ndarray) -> None:
        """``acc += base - theta_p``, ``base <- theta_p``, in chunks (``TreeParams.fold_progress``)."""
        self.params.fold_progress(p, base, acc)


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

    def serve(self) -> None:
        with self._cv:
            self._served += 1
            self._cv.notify_all()
        # the previous step's parameters are freed here, in the worker thread, while the user's
        # next step runs (freeing 200 MB of buffers took 35 ms inside island.step, bench.island);
        # then their pages go back to the system (learner.malloc.trim): without, the heap kept
        # them, 2.8-2.9x the parameter bytes over the user's loop alone against 2.1-2.9x with
        # (what remains depends on whether the user's next step allocates before they are freed)
        if self._previous is not None:
            self._previous = None
            trim()

    def step(self):
        with self._cv:
            if self._served == 0:  # joined: the run's current parameters are the user's first
                self._served = 1
                self._cv.notify_all()
            # the user's thread may also be gone (an exception ended the script without close():
            # the interpreter's exit then waits for this worker thread)
            while (self._deposit is None and not self.closing and not self.cancel.is_set()
                   and threading.main_thread().is_alive()):
                self._cv.wait(0.1)
            if self._deposit is None:
                return NO_STEP
            tree, loss = self._deposit
            self._deposit = None
        self._previous = self.params.set_tree(tree, checked=True)  # checked in the user's thread (exchange)
        return loss

    def exchange(self, tree: Any, loss: float, alive: Callable[[], bool], why: Callable[[], str | None] = lambda: None
                 ) -> Any:
        """User thread: deposit this step's parameters, wait until the learner took them and mixed
        in any arrived global version, return the parameters."""
        self.params.check(tree)  # a wrong tree is the user's error, not the learner's
        with self._cv:
            target = self._served + 1
            self._deposit = (tree, loss)
            self._cv.notify_all()
            while self._served < target:
                if not alive():
                    raise IslandClosed(f"the island's learner stopped: {why() or 'see its log'}")
                self._cv.wait(0.1)
            return self.params.tree()

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
