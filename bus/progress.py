"""A learner's progress in the run: the record that outlives the learner's process (issue 38).

Part of the run contract. Each learner id has one record in the run's ``progress`` KV bucket (key:
the learner id), written by the learner itself while it trains and read back by the next process
started with the same id, on this machine or another one, and by ``diloco status``::

    {"schema": 1, "learner": "us-0", "incarnation": "3f2a...", "step": 310, "trained": 312,
     "budget": 600, "restarts": 1, "lost": 2, "done": false, "at": 1796000000.0}

``step``: inner steps of this learner id whose work the run holds (the learner's step at its newest
outer gradient stored in the GRAD stream: the aggregator merges it even if the learner dies right
after). A restarted learner resumes there: its step counter, learning-rate schedule, budget and
data position. ``trained``: the step the learner had reached when it wrote the record (it trains on
between writes: ``trained - step`` steps are lost if it dies then). ``restarts``: processes started
with this id after the first; ``lost``: inner steps trained and never sent, summed over restarts.
``done``: it trained its whole ``budget`` (``None``: no budget, an island's loop decides).

Pure: parsing and the resume decision; the KV I/O is ``learner.progress``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SCHEMA = 1
#: the progress bucket: one small record per learner id, history 1
KIND = "progress"


@dataclass(frozen=True)
class Progress:
    """One learner id's progress (see the module docstring)."""

    learner: str
    incarnation: str
    step: int = 0
    trained: int = 0
    budget: int | None = None
    restarts: int = 0
    lost: int = 0
    done: bool = False
    at: float = 0.0

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, **asdict(self)}


class BadProgress(ValueError):
    """A progress record that cannot be read (wrong types, negative counters, another schema)."""


def _int(d: dict, key: str) -> int:
    v = d.get(key, 0)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadProgress(f"progress record: {key} must be an int >= 0, got {v!r}")
    return v


def _int_or_none(d: dict, key: str) -> int | None:
    return None if d.get(key) is None else _int(d, key)


def progress_from_dict(d: object) -> Progress:
    """The record of a decoded JSON value; BadProgress saying what is wrong."""
    if not isinstance(d, dict):
        raise BadProgress(f"progress record: expected an object, got {type(d).__name__}")
    if d.get("schema") != SCHEMA:
        raise BadProgress(f"progress record: schema {d.get('schema')!r}, this version reads {SCHEMA}")
    learner, inc = d.get("learner"), d.get("incarnation")
    if not isinstance(learner, str) or not learner or not isinstance(inc, str):
        raise BadProgress("progress record: learner and incarnation must be strings")
    at = d.get("at", 0.0)
    if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
        raise BadProgress(f"progress record: at must be a finite number, got {at!r}")
    done = d.get("done", False)
    if not isinstance(done, bool):
        raise BadProgress(f"progress record: done must be true or false, got {done!r}")
    p = Progress(learner=learner, incarnation=inc, step=_int(d, "step"), trained=_int(d, "trained"),
                 budget=_int_or_none(d, "budget"), restarts=_int(d, "restarts"), lost=_int(d, "lost"), done=done,
                 at=float(at))
    if p.trained < p.step:
        raise BadProgress(f"progress record: trained {p.trained} < step {p.step}")
    return p


@dataclass(frozen=True)
class Resume:
    """Where a starting learner begins, from the record its id left (``resume_from``)."""

    start_step: int  # steps of this id the run holds: the new process continues after them
    restarts: int  # processes after the first, this one included
    lost: int  # steps the previous process trained and never sent (at least: it may have trained on)
    lost_total: int  # over every restart
    previous: str | None  # the previous process's incarnation (None: a first start)
    remaining: int | None  # steps left of the budget (None: no budget)

    @property
    def resumed(self) -> bool:
        return self.previous is not None


def resume_from(record: Progress | None, budget: int | None, enabled: bool = True) -> Resume:
    """Where a learner with step budget ``budget`` (None: none) starts, given its id's record.

    No record, or resuming disabled (``DILOCO_RESUME=false``): step 0 (the restart is still counted
    when there is a record). Otherwise the record's ``step``, capped at the budget: a learner whose id
    trained its whole budget already has nothing left (``remaining`` 0)."""
    if record is None:
        return Resume(0, 0, 0, 0, None, budget)
    restarts = record.restarts + 1
    lost = max(0, record.trained - record.step)
    if not enabled:
        return Resume(0, restarts, lost, record.lost + lost, record.incarnation, budget)
    start = record.step if budget is None else min(record.step, budget)
    return Resume(start, restarts, lost, record.lost + lost, record.incarnation,
                  None if budget is None else budget - start)
