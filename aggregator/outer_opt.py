"""Outer optimizers for one fragment, in numpy: Nesterov SGD and Delayed Nesterov.

The merged outer gradient g = merge(Delta_1..Delta_M) is treated as a gradient (DiLoCo; DESIGN.md
section 3). With learning rate lr and momentum beta (DiLoCo defaults 0.7 and 0.9):

Nesterov SGD, exactly ``optax.sgd(lr, momentum=beta, nesterov=True)`` followed by
``optax.apply_updates``::

    t <- g + beta * t                 (momentum trace, starts at 0)
    u <- g + beta * t                 (Nesterov look-ahead)
    theta <- theta + (-lr) * u

Delayed Nesterov (Liu et al., arXiv 2401.09135, Algorithm "DN"), for merges that arrive one
learner at a time. Applying Nesterov per arrival applies the momentum once per arrival; DN buffers
the outer gradients and touches the momentum only every N-th merge::

    Delta <- Delta + g;  n <- n + 1
    if n % N == 0:   t <- beta * t + Delta / N;   Delta <- 0
                     theta <- theta - lr * (g / N + beta * t)
    else:            theta <- theta - lr * g / N

Over N merges the parameters move by -lr * (mean(g) + beta * t), one Nesterov step on the mean
outer gradient, while every merge still publishes a new version. N = 1 is ordinary Nesterov.
Operational advice: with K = 1 (every merge holds one learner's gradient) set N near the number
of active learners; with quorum merges of all learners N = 1 is right.

Ownership: ``step(..., inplace=False)`` (default) never modifies its inputs and returns new
arrays. ``inplace=True`` updates ``params`` and the state's arrays in place and returns those same
objects (the old state object must not be used again); ``outer_grad`` is only ever read. In-place
steps use one scratch block, no full-size temporaries. State serialises with ``to_dict`` to a dict
of numpy arrays and ints (arrays are float32; encode them as bytes for msgpack).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from aggregator.merge import DEFAULT_BLOCK, block_slices
from bus.codec import STORAGE_DTYPES, storage_dtype


def momentum_dtype(name: str) -> np.dtype:
    """The numpy dtype of a momentum dtype's name (``bus.codec.STORAGE_DTYPES``)."""
    return storage_dtype(name, "momentum dtype")


def _check_momentum(x: np.ndarray, n: int) -> None:
    if not isinstance(x, np.ndarray) or x.dtype.name not in STORAGE_DTYPES or x.ndim != 1:
        raise ValueError("momentum must be a flat float32 or bfloat16 array")
    if x.size != n:
        raise ValueError(f"momentum has {x.size} elements, expected {n}")


def _check_float32(name: str, x: np.ndarray, n: int | None = None) -> None:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1:
        raise ValueError(f"{name} must be a flat float32 array")
    if n is not None and x.size != n:
        raise ValueError(f"{name} has {x.size} elements, expected {n}")


def _check_hparams(lr: float, momentum: float) -> None:
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")


@dataclass(frozen=True)
class NesterovState:
    """Momentum trace t (float32, like the fragment) and the number of steps taken."""

    momentum: np.ndarray
    count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "nesterov", "momentum": self.momentum, "count": self.count}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NesterovState:
        if data.get("kind") != "nesterov":
            raise ValueError(f"not a Nesterov state: kind={data.get('kind')!r}")
        return cls(np.asarray(data["momentum"], dtype=np.float32).copy(), int(data["count"]))


@dataclass(frozen=True)
class DelayedNesterovState:
    """Momentum trace t, gradient buffer Delta (None when period == 1), merges counted n."""

    momentum: np.ndarray
    buffer: np.ndarray | None
    count: int = 0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": "delayed_nesterov", "momentum": self.momentum,
                             "count": self.count}
        if self.buffer is not None:
            d["buffer"] = self.buffer
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DelayedNesterovState:
        if data.get("kind") != "delayed_nesterov":
            raise ValueError(f"not a Delayed Nesterov state: kind={data.get('kind')!r}")
        buf = data.get("buffer")
        return cls(np.asarray(data["momentum"], dtype=np.float32).copy(),
                   None if buf is None else np.asarray(buf, dtype=np.float32).copy(),
                   int(data["count"]))


class OuterOptimizer(Protocol):
    """init(params) -> state; step(params, outer_grad, state, inplace=...) -> (params, state)."""

    def init(self, params: np.ndarray) -> Any: ...

    def step(self, params: np.ndarray, outer_grad: np.ndarray, state: Any, *,
             inplace: bool = False) -> tuple[np.ndarray, Any]: ...


@dataclass(frozen=True)
class NesterovSGD:
    """SGD with Nesterov momentum on one flat float32 fragment (see module docstring)."""

    lr: float = 0.7
    momentum: float = 0.9
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        _check_hparams(self.lr, self.momentum)

    def init(self, params: np.ndarray) -> NesterovState:
        """Zero momentum shaped like ``params``."""
        _check_float32("params", params)
        return NesterovState(np.zeros_like(params), 0)

    def step(
        self,
        params: np.ndarray,
        outer_grad: np.ndarray,
        state: NesterovState,
        *,
        inplace: bool = False,
    ) -> tuple[np.ndarray, NesterovState]:
        """One outer step: returns (params + (-lr) * (g + beta * t_new), new state)."""
        _check_float32("params", params)
        n = params.size
        _check_float32("outer_grad", outer_grad, n)
        _check_float32("momentum", state.momentum, n)
        p = params if inplace else params.copy()
        t = state.momentum if inplace else state.momentum.copy()
        beta, neg_lr = np.float32(self.momentum), np.float32(-self.lr)
        scratch = np.empty(min(self.block, max(n, 1)), dtype=np.float32)
        for sl in block_slices(n, self.block):
            g, tb, pb = outer_grad[sl], t[sl], p[sl]
            s = scratch[: pb.size]
            np.multiply(tb, beta, out=tb)
            np.add(g, tb, out=tb)          # t = g + beta * t
            np.multiply(tb, beta, out=s)
            np.add(g, s, out=s)            # u = g + beta * t
            np.multiply(s, neg_lr, out=s)  # u = -lr * u
            np.add(pb, s, out=pb)          # theta = theta + u
        return p, NesterovState(t, state.count + 1)


@dataclass(frozen=True)
class DelayedNesterov:
    """Delayed Nesterov: momentum updated every ``period``-th merge (see module docstring)."""

    lr: float = 0.7
    momentum: float = 0.9
    period: int = 1
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        _check_hparams(self.lr, self.momentum)
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"period must be an int >= 1, got {self.period!r}")

    def init(self, params: np.ndarray) -> DelayedNesterovState:
        """Zero momentum; a zero gradient buffer only when period > 1."""
        _check_float32("params", params)
        buf = np.zeros_like(params) if self.period > 1 else None
        return DelayedNesterovState(np.zeros_like(params), buf, 0)

    def step(
        self,
        params: np.ndarray,
        outer_grad: np.ndarray,
        state: DelayedNesterovState,
        *,
        inplace: bool = False,
    ) -> tuple[np.ndarray, DelayedNesterovState]:
        """One merge: buffer g; on every period-th merge also update and apply the momentum."""
        _check_float32("params", params)
        n = params.size
        _check_float32("outer_grad", outer_grad, n)
        _check_float32("momentum", state.momentum, n)
        big_n = self.period
        if big_n > 1:
            if state.buffer is None:
                raise ValueError("state has no gradient buffer: was it made with period 1?")
            _check_float32("buffer", state.buffer, n)
        p = params if inplace else params.copy()
        t = state.momentum if inplace else state.momentum.copy()
        buf = None
        if state.buffer is not None and big_n > 1:
            buf = state.buffer if inplace else state.buffer.copy()
        count = state.count + 1
        milestone = count % big_n == 0
        beta, neg_lr, nf = np.float32(self.momentum), np.float32(-self.lr), np.float32(big_n)
        scratch = np.empty((2, min(self.block, max(n, 1))), dtype=np.float32)
        for sl in block_slices(n, self.block):
            g, tb, pb = outer_grad[sl], t[sl], p[sl]
            s, s2 = scratch[0, : pb.size], scratch[1, : pb.size]
            if buf is not None:
                np.add(buf[sl], g, out=buf[sl])           # Delta = Delta + g
            np.divide(g, nf, out=s)                       # u = g / N
            if milestone:
                delta = g if buf is None else buf[sl]
                np.multiply(tb, beta, out=tb)
                np.divide(delta, nf, out=s2)
                np.add(s2, tb, out=tb)                    # t = beta * t + Delta / N
                if buf is not None:
                    buf[sl] = 0.0                         # Delta = 0
                np.multiply(tb, beta, out=s2)
                np.add(s, s2, out=s)                      # u = g / N + beta * t
            np.multiply(s, neg_lr, out=s)
            np.add(pb, s, out=pb)                         # theta = theta - lr * u
        return p, DelayedNesterovState(t, buf if big_n > 1 else state.buffer, count)


@dataclass
class RoundNesterovState:
    """The momentum trace and the share of a round the merges since the last completed round hold.

    ``momentum`` is the trace t after the last completed round while ``folded`` is False; once a
    round has begun (``folded``) it holds ``beta * t + B``, the trace with the round's outer
    gradients so far (B) already added: what t becomes when the round completes. One array of the
    fragment's size, where t and B took two (issue 41: the aggregator's memory per value).
    ``buffer``: B held apart, as checkpoints written before that change have it (None otherwise);
    the next step folds it in."""

    momentum: np.ndarray
    buffer: np.ndarray | None
    progress: float = 0.0
    count: int = 0
    folded: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": "round_nesterov", "momentum": self.momentum,
                             "progress": float(self.progress), "count": self.count}
        if self.buffer is not None:
            d["buffer"] = self.buffer
        if self.folded:
            d["folded"] = True
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RoundNesterovState:
        if data.get("kind") != "round_nesterov":
            raise ValueError(f"not a round Nesterov state: kind={data.get('kind')!r}")
        buf = data.get("buffer")
        mom = np.asarray(data["momentum"])  # (bfloat16 kept as it is: a replay must see what was stored)
        return cls(mom.copy() if mom.dtype.name == "bfloat16" else np.asarray(mom, dtype=np.float32).copy(),
                   None if buf is None else np.asarray(buf, dtype=np.float32).copy(), float(data["progress"]),
                   int(data["count"]), bool(data.get("folded", False)))


ROUND_TOL = 1e-9


@dataclass(frozen=True)
class RoundNesterov:
    """Nesterov whose momentum advances once per *round of work*, however the work is grouped, and
    only with closed-loop work.

    Each merge passes its outer gradient g (already scaled by its share of the run: contributions
    / participants, see :func:`aggregator.step.participation_scale`), the part ``m`` of g that may
    feed the momentum (default all of it) and ``work``, the share of a round that part holds::

        theta <- theta - lr * g;   B <- B + m;   w <- w + work
        when w reaches 1:          t <- beta * t + B / floor(w);   theta <- theta - lr * beta * t;
                                   B <- 0;   w <- w - floor(w)

    Over one round in which each of M learners contributes once, in any number of merges, theta
    moves by -lr * (mean(g) + beta * t) with t = beta * t + mean(g): exactly one Nesterov step of
    synchronous DiLoCo on the mean outer gradient (``NesterovSGD`` with M contributions in one
    merge). Nesterov per merge instead advances the momentum once per arrival, so its step per
    round depends on how arrivals are grouped.

    **Backlog work does not drive the momentum** (issue 24). After an outage (aggregator or server
    down, learners training on alone) the aggregator merges seconds of *open-loop* work: rounds that
    were computed without seeing each other's results. Its sum is sound as a plain step, but a
    momentum fed with it extrapolates it by beta / (1 - beta) more (the chaos run's divergence, at
    0.9). Two rules keep the momentum to what synchronous rounds would have fed it:

    - the caller passes as ``m`` only the *closed-loop* part of a merge (contributions whose base had
      seen all but at most one of their learner's own earlier rounds, :func:`aggregator.step.momentum_part`);
      the others are applied as plain SGD steps and count no work;
    - when a merge completes several rounds at once (``w`` >= 2: a backlog of several rounds per
      learner merged together), the momentum takes their mean ``B / floor(w)``, not the sum: one
      round's worth per milestone, however much work arrived at once. (A fraction of a round carried
      from a partial sync, ``w`` = 1.25 say, still completes one round: B / 1.)

    With both, a backlog moves theta by lr x (its contributions' sum / M), as plain SGD does, plus
    at most one ordinary round's momentum.
    """

    lr: float = 0.7
    momentum: float = 0.9
    block: int = DEFAULT_BLOCK
    #: the trace's storage at ``init`` (``DILOCO_OUTER_MOMENTUM_DTYPE``). bfloat16: half its memory,
    #: each block computed in float32 and rounded where it is stored once per merge. A state keeps
    #: the dtype it was made (or checkpointed) with: a step follows the state, not this field.
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_hparams(self.lr, self.momentum)
        momentum_dtype(self.dtype)

    def init(self, params: np.ndarray) -> RoundNesterovState:
        _check_float32("params", params)
        return RoundNesterovState(np.zeros(params.shape, dtype=momentum_dtype(self.dtype)), None, 0.0, 0)

    def step(self, params: np.ndarray, outer_grad: np.ndarray, state: RoundNesterovState, *,
             inplace: bool = False, work: float = 1.0,
             momentum_grad: np.ndarray | float | None = None) -> tuple[np.ndarray, RoundNesterovState]:
        """One merge. ``momentum_grad``: what of ``outer_grad`` feeds the momentum buffer: None (all
        of it), a factor f (f x outer_grad; 0: none) or an array; ``work``: the share of a round it
        holds (see the class docstring).

        The buffer B is not held apart: the first merge of a round folds it into the trace
        (``momentum`` becomes beta * t, :class:`RoundNesterovState`) and each merge adds its part to
        it, so the milestone's ``t <- beta * t + B`` is already done when the round completes. The
        one case this cannot give exactly: a merge that completes several rounds at once (w >= 2)
        after part of a round was merged. The mean is then taken of that merge's part only (the
        earlier part counts whole): the momentum takes at most the partial round more than one
        round's worth, where a fresh round's backlog merge takes exactly one."""
        _check_float32("params", params)
        _check_float32("outer_grad", outer_grad, params.size)
        return self.step_blocks(params, ((sl, outer_grad[sl]) for sl in block_slices(params.size, self.block)),
                                state, inplace=inplace, work=work, momentum_grad=momentum_grad)

    def step_blocks(self, params: np.ndarray, grad_blocks: Iterable[tuple[slice, np.ndarray]],
                    state: RoundNesterovState, *, inplace: bool = False, work: float = 1.0,
                    momentum_grad: np.ndarray | float | None = None) -> tuple[np.ndarray, RoundNesterovState]:
        """:meth:`step` with the outer gradient given block by block: (slice, its float32 values) in
        order, covering the parameters once (the merged gradient is made one block at a time and
        applied while in cache: no buffer of the fragment's size, ``aggregator.step.merge_step``).
        The same values, bit for bit, as :meth:`step` on the whole gradient."""
        _check_float32("params", params)
        n = params.size
        _check_momentum(state.momentum, n)
        if state.buffer is not None:
            _check_float32("buffer", state.buffer, n)
        if not (math.isfinite(work) and work >= 0):
            raise ValueError(f"work must be finite and >= 0, got {work}")
        mfac = np.float32(1.0)
        marr: np.ndarray | None = None
        if momentum_grad is None:
            pass
        elif isinstance(momentum_grad, np.ndarray):
            _check_float32("momentum_grad", momentum_grad, n)
            marr = momentum_grad
        else:
            if not (math.isfinite(float(momentum_grad)) and float(momentum_grad) >= 0):
                raise ValueError(f"momentum_grad factor must be finite and >= 0, got {momentum_grad}")
            mfac = np.float32(momentum_grad)
        p = params if inplace else params.copy()
        t = state.momentum if inplace else state.momentum.copy()
        progress = state.progress + float(work)
        milestone = progress >= 1.0 - ROUND_TOL
        # a milestone that completes several rounds at once takes their mean (class docstring)
        per_round = np.float32(1.0 / max(1.0, math.floor(progress + ROUND_TOL)))
        fold = not state.folded  # the round begins: t <- beta * t (+ a checkpoint's buffer B)
        beta, neg_lr = np.float32(self.momentum), np.float32(-self.lr)
        rounded = t.dtype != np.float32  # a bfloat16 trace: each block in float32, rounded where stored
        scratch = np.empty((3, 0), dtype=np.float32)
        covered = 0
        for sl, g in grad_blocks:
            if sl.start != covered or g.dtype != np.float32 or g.shape != (sl.stop - sl.start,):
                raise ValueError(f"gradient block {sl} of shape {g.shape}: expected float32 blocks in order from {covered}")
            covered = sl.stop
            tb, pb = t[sl], p[sl]
            if scratch.shape[1] < pb.size:
                scratch = np.empty((3, pb.size), dtype=np.float32)
            if rounded:
                stored, tb = tb, scratch[2, : pb.size]
                tb[...] = stored
            s = scratch[0, : pb.size]
            np.multiply(g, neg_lr, out=s)
            np.add(pb, s, out=pb)                 # theta = theta - lr * g
            if fold:
                np.multiply(tb, beta, out=tb)     # T = beta * t
                if state.buffer is not None:
                    np.add(tb, state.buffer[sl], out=tb)  # + B of a checkpoint that held it apart
            if marr is not None:
                mb = marr[sl]
            elif mfac == 1.0:
                mb = g
            elif mfac != 0.0:
                mb = scratch[1, : pb.size]
                np.multiply(g, mfac, out=mb)
            else:
                mb = None
            if mb is not None:
                if per_round != 1.0:
                    np.multiply(mb, per_round, out=s)
                    mb = s
                np.add(tb, mb, out=tb)            # T = T + m (/ w)
            if milestone:
                np.multiply(tb, beta * neg_lr, out=s)
                np.add(pb, s, out=pb)             # theta = theta - lr * beta * t, t = T
            if rounded:
                stored[...] = tb
        if covered != n:
            raise ValueError(f"the gradient blocks cover {covered} of {n} values")
        if milestone:
            progress = max(0.0, progress - math.floor(progress + ROUND_TOL))
        return p, RoundNesterovState(t, None, progress, state.count + 1, folded=not milestone)


def make_outer_optimizer(
    kind: str = "nesterov", *, lr: float = 0.7, momentum: float = 0.9, period: int = 1, dtype: str = "float32"
) -> NesterovSGD | DelayedNesterov | RoundNesterov:
    """"nesterov" -> NesterovSGD(lr, momentum); "delayed_nesterov" (or "delayed") ->
    DelayedNesterov(lr, momentum, period); "rounds" -> RoundNesterov(lr, momentum), its trace kept in
    ``dtype`` (the other two keep float32)."""
    if kind == "nesterov":
        return NesterovSGD(lr, momentum)
    if kind in ("delayed_nesterov", "delayed"):
        return DelayedNesterov(lr, momentum, period)
    if kind in ("round_nesterov", "rounds"):
        return RoundNesterov(lr, momentum, dtype=dtype)
    raise ValueError(f"unknown outer optimizer {kind!r}, expected nesterov, delayed_nesterov or rounds")
