"""Every subject, stream and bucket name of a run, in one place (pure: no I/O).

Subjects of run ``R`` (``diloco.R.…``):

===================================  ===============  ==================================================
subject                              carried by       what
===================================  ===============  ==================================================
``diloco.R.grad.<frag>.<learner>``   stream GRAD      outer-gradient chunks, learner -> aggregator
``diloco.R.grad.probe.<learner>``    stream GRAD      a waiting learner's probe: does the store take writes?
``diloco.R.global.<frag>.c<i>.<slot>`` stream GLOBAL  chunk i of the newest global versions of a fragment
``diloco.R.global.<frag>.head``      stream GLOBAL    commit record of a global version (version, seqs)
``diloco.R.global.<frag>.kc<i>.<slot>/khead``        keyframes of a quantised downlink (``bus.downlink``)
``diloco.R.state.<frag>.c<i>.<slot>/head`` STATE     aggregator's checkpoints (params, momentum, set)
``diloco.R.state.<frag>.log.<slot>`` stream STATE     merge log: how each version was made (``aggregator.mlog``)
``diloco.R.state.probe``            stream STATE     the aggregator's probe: does its store take writes?
``diloco.R.hb.<learner>``            core NATS        heartbeats, learner -> monitor (1 s)
``diloco.R.metrics.<role>.<id>``     core NATS        metrics of every process -> ``diloco metrics``
``diloco.R.feedback.<learner>``      core NATS        aggregator -> a learner: its work rejected or held
``diloco.R.events.<kind>``           stream EVENTS    membership transitions and other run events
===================================  ===============  ==================================================

KV buckets: ``diloco_R_members`` (membership, written only by the monitor), ``diloco_R_lease``
(monitor leader lease), ``diloco_R_run`` (run manifest: model spec, fragment plan),
``diloco_R_progress`` (each learner id's progress record, written by that learner: ``bus.progress``).
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "diloco"
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_")


def check_token(kind: str, value: str) -> str:
    """A subject token: non-empty, at most 64 chars of letters, digits, '-' and '_'."""
    if not value or len(value) > 64 or not set(value) <= _SAFE:
        raise ValueError(f"{kind} {value!r}: expected 1-64 letters, digits, '-' or '_'")
    return value


@dataclass(frozen=True)
class Subjects:
    """Names for one run. ``Subjects("exp1").grad(3, "eu-0")`` -> ``diloco.exp1.grad.3.eu-0``."""

    run: str

    def __post_init__(self) -> None:
        check_token("run", self.run)

    @property
    def prefix(self) -> str:
        return f"{ROOT}.{self.run}"

    # outer gradients (uplink)
    def grad(self, fragment: int, learner: str) -> str:
        return f"{self.prefix}.grad.{int(fragment)}.{check_token('learner', learner)}"

    def grad_probe(self, learner: str) -> str:
        """A learner's probe write to the GRAD stream (``bus.store_health.probe_store``): on its own
        subject (allowed as ``grad.*.<id>``), which no fragment's consumer reads."""
        return f"{self.prefix}.grad.probe.{check_token('learner', learner)}"

    def grad_fragment_filter(self, fragment: int) -> str:
        return f"{self.prefix}.grad.{int(fragment)}.*"

    @property
    def grad_all(self) -> str:
        return f"{self.prefix}.grad.>"

    # global versions (downlink) and aggregator state: versioned objects
    def versioned_chunk(self, kind: str, fragment: int, index: int, tag: str = "", slot: int = 0) -> str:
        """Chunk ``index`` of a version in ``slot`` (0 or 1): a writer uses the slot the committed
        head does not, so however many writes die before their head, none evicts the committed
        version (``bus.transport.VersionedStore.put``)."""
        return f"{self.prefix}.{kind}.{int(fragment)}.{tag}c{int(index)}.{int(slot) % 2}"

    def versioned_head(self, kind: str, fragment: int, tag: str = "") -> str:
        return f"{self.prefix}.{kind}.{int(fragment)}.{tag}head"

    def versioned_heads(self, kind: str) -> str:
        return f"{self.prefix}.{kind}.*.head"

    def versioned_all(self, kind: str) -> str:
        return f"{self.prefix}.{kind}.>"

    @property
    def state_probe(self) -> str:
        """A probe write to the STATE stream (one message kept) that tells an aggregator whether its
        store takes writes (``bus.store_health``, ``aggregator.durability``)."""
        return f"{self.prefix}.{STATE}.probe"

    # the aggregator's merge log (aggregator.mlog): in the STATE stream, one subject per slot
    def merge_log(self, fragment: int, slot: int) -> str:
        return f"{self.prefix}.{STATE}.{int(fragment)}.log.{int(slot)}"

    def merge_log_filter(self, fragment: int) -> str:
        return f"{self.prefix}.{STATE}.{int(fragment)}.log.*"

    # liveness, metrics, events
    def heartbeat(self, learner: str) -> str:
        return f"{self.prefix}.hb.{check_token('learner', learner)}"

    @property
    def heartbeat_all(self) -> str:
        return f"{self.prefix}.hb.*"

    def metrics(self, role: str, ident: str) -> str:
        return f"{self.prefix}.metrics.{check_token('role', role)}.{check_token('id', ident)}"

    @property
    def metrics_all(self) -> str:
        return f"{self.prefix}.metrics.>"

    def feedback(self, learner: str) -> str:
        """Aggregator -> one learner: its contributions rejected (and why) or held (aggregator.feedback)."""
        return f"{self.prefix}.feedback.{check_token('learner', learner)}"

    @property
    def feedback_all(self) -> str:
        return f"{self.prefix}.feedback.*"

    def event(self, kind: str) -> str:
        return f"{self.prefix}.events.{check_token('event', kind)}"

    @property
    def events_all(self) -> str:
        return f"{self.prefix}.events.>"

    # streams and buckets
    def stream(self, kind: str) -> str:
        """Stream name: ``DILOCO_<run>_<KIND>`` (stream names allow no dots)."""
        return f"DILOCO_{self.run}_{kind.upper()}"

    def bucket(self, kind: str) -> str:
        return f"diloco_{self.run}_{kind}"


GLOBAL = "global"
STATE = "state"
