"""One learner's outer gradient for one fragment, as the aggregator sees it.

A contribution carries Delta_{m,p} = Theta_p(base_version) - theta_{m,p} (DESIGN.md section 3)
for learner m and fragment p, already assembled from its chunks and decoded to a flat float32
vector, together with the counters the weighting needs (inner steps and tokens since that
learner's last sync of this fragment).

Identity for de-duplication is ``key = (learner, incarnation, fragment, round)``: ``incarnation``
is a random id drawn each time a learner process starts, ``round`` counts that incarnation's
contributions to that fragment and only ever increases. A redelivered or replayed message has the
same key; a restarted learner has a new incarnation and starts its rounds again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aggregator.int8vec import Vector

ContributionKey = tuple[str, str, int, int]
"""(learner, incarnation, fragment, round)."""


@dataclass(frozen=True, eq=False)
class Contribution:
    """An outer-gradient fragment from one learner (immutable metadata, flat float32 vector).

    Nothing is checked here: :func:`aggregator.validate.validate` decides whether a contribution
    is usable and names the reason when it is not. ``eq=False`` because comparing the vectors
    element-wise is never what the caller wants; compare :attr:`key` instead.

    The vector is not copied. The aggregator treats it as read-only; whoever decoded it owns the
    buffer and must not reuse it while the contribution is buffered.
    """

    run: str
    model_hash: str
    learner: str
    incarnation: str
    fragment: int
    round: int
    base_version: int
    inner_steps: int
    tokens: int
    vector: Vector  # an int8 uplink is an Int8Vector, decoded block by block where it is read
    period: int = 0  # the learner's sync period when it sent this (0: not declared)
    lockstep: bool = False  # from a synchronous learner: its round's fragments merge together
    step_s: float = 0.0  # the learner's mean seconds per inner step of this contribution (0: not reported)
    final: bool = False  # from the learner's final sync: it sends nothing more (bus.protocol.grad_meta)

    @property
    def round_share(self) -> float:
        """The share of one round of the learner's work this contribution holds: inner steps over
        its sync period, at most 1 (1 when the period is not declared). A final sync at the step
        budget, or a staggered fragment's first sync, holds less than a round."""
        if self.period <= 0:
            return 1.0
        return min(1.0, max(0, self.inner_steps) / self.period)

    @property
    def key(self) -> ContributionKey:
        """(learner, incarnation, fragment, round): the identity used for de-duplication."""
        return (self.learner, self.incarnation, self.fragment, self.round)

    def staleness(self, current_version: int) -> int:
        """d = current_version - base_version (negative means the base is from the future)."""
        return current_version - self.base_version


def from_grad_message(meta: dict, blob, out=None) -> Contribution:
    """The contribution of a gradient object (its chunk metadata and assembled blob), as intake and
    a replay of the merge log both build it. Raises ValueError (malformed metadata) or
    ``bus.codec.CodecError`` (a blob that does not decode). ``out``: as in ``bus.codec.decode_array``.

    A flat int8 blob of whole blocks (the default uplink) is not decoded: its vector is an
    :class:`aggregator.int8vec.Int8Vector` on the blob, decoded block by block where it is read."""
    import math

    from aggregator.int8vec import from_parts
    from bus import codec
    from bus.protocol import parse_grad_meta

    meta = parse_grad_meta(meta)
    h, shape, parts = codec.decode_parts(blob)
    lazy = from_parts(parts, math.prod(shape), h["b"]) if h["q"] == "int8" and len(shape) == 1 else None
    vec: Vector
    if lazy is not None:
        vec = lazy
    else:  # its shape is checked, never mended; a forged inf/nan scale is caught by validation (non_finite)
        with np.errstate(over="ignore", invalid="ignore"):
            vec = np.asarray(codec.decode_array(blob, out))
    return Contribution(run=meta["run"], model_hash=meta["model"], learner=meta["learner"],
                        incarnation=meta["inc"], fragment=meta["frag"], round=meta["round"],
                        base_version=meta["base"], inner_steps=meta["steps"], tokens=meta["tokens"], vector=vec,
                        period=meta.get("period", 0), lockstep=bool(meta.get("lockstep", 0)),
                        step_s=float(meta.get("step_s", 0.0)), final=bool(meta.get("final", 0)))
