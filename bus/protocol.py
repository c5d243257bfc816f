"""What the roles say to each other over the bus: message metadata and record formats (pure).

* **Outer-gradient fragment** (learner -> aggregator), subject ``grad.<frag>.<learner>``: blob =
  ``codec.encode_array(delta)`` (flat float32 vector of the fragment, quantised), chunk metadata =
  :func:`grad_meta`, object id = :func:`grad_obj_id` (unique per learner process and round, so
  a retry is deduplicated and a replay is recognisable).
* **Global version** (aggregator -> learners), versioned object ``global.<frag>``: blob =
  ``codec.encode_array(params_fragment)``, head metadata ``{"model": hash, "plan": plan hash}``.
* **Heartbeat** (learner -> monitor), ``hb.<learner>``: JSON, see ``monitor.membership``.
* **Membership** (monitor -> everyone): KV ``members``, key = learner id, JSON member record.
* **Run manifest**: KV ``run``, key ``manifest``: JSON of :class:`Manifest` (model spec, seed,
  fragment count, hashes), written once by the aggregator that creates version 0.
* **Metrics**: ``metrics.<role>.<id>``: JSON with at least ``role``, ``run``, ``ts``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Annotated

import msgspec

from bus.subjects import check_token

GRAD_FIELDS = ("run", "model", "learner", "inc", "frag", "round", "base", "steps", "tokens", "region")
# absent from a learner before they were added: the aggregator then counts a full round (period) and
# merges each fragment on its own (lockstep), times the learner by its arrivals (step_s) and learns
# that it is done from its membership only (final)
GRAD_OPTIONAL = ("period", "lockstep", "step_s", "final")
MANIFEST_KEY = "manifest"
STEP_S_MAX = 86400.0  # the largest pace (seconds per inner step) a gradient's metadata carries


def grad_obj_id(run: str, learner: str, incarnation: str, fragment: int, round_: int) -> str:
    return f"{run}.{learner}.{incarnation}.{fragment}.{round_}"


def grad_meta(*, run: str, model: str, learner: str, incarnation: str, fragment: int, round_: int,
              base_version: int, inner_steps: int, tokens: int, region: str, period: int | None = None,
              lockstep: bool = False, step_s: float = 0.0, final: bool = False) -> dict:
    """``period``: the learner's sync period H (inner steps) when the fragment was due; the
    contribution holds ``steps / period`` of a round of work (0 or None: not sent). ``lockstep``: a
    synchronous learner (``DILOCO_MODE=sync``), which sends every fragment of a round together and
    waits for all of them to be merged (sent as ``1``; absent otherwise). ``step_s``: the mean seconds
    of the inner steps the contribution holds, the learner's own compute (holds and transfers
    excluded; absent when 0): the aggregator's on-time quorum paces rounds by it. ``final``: sent by
    the learner's final sync (its step budget reached, or an island closing): the learner sends
    nothing more, and a run without a monitor stops waiting for it (sent as ``1``; absent otherwise)."""
    meta = {"run": run, "model": model, "learner": learner, "inc": incarnation, "frag": int(fragment),
            "round": int(round_), "base": int(base_version), "steps": int(inner_steps), "tokens": int(tokens),
            "region": region}
    if period:
        meta["period"] = int(period)
    if lockstep:
        meta["lockstep"] = 1
    if final:
        meta["final"] = 1
    pace = round(float(step_s), 6) if math.isfinite(step_s) else 0.0
    if 0 < pace <= STEP_S_MAX:  # else not sent: a gradient is never malformed for its pace
        meta["step_s"] = pace
    return meta


_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=2**62)]


class GradMeta(msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False):
    """Schema of the metadata of a gradient object (:func:`grad_meta`): exactly these fields."""

    run: _Name
    model: _Name
    learner: _Name
    inc: _Name
    frag: _Count
    round: _Count
    base: _Count
    steps: _Count
    tokens: _Count
    region: _Name
    period: Annotated[int, msgspec.Meta(ge=1, le=2**31)] | msgspec.UnsetType = msgspec.UNSET
    lockstep: Annotated[int, msgspec.Meta(ge=1, le=1)] | msgspec.UnsetType = msgspec.UNSET
    step_s: Annotated[float, msgspec.Meta(gt=0, le=STEP_S_MAX)] | msgspec.UnsetType = msgspec.UNSET
    final: Annotated[int, msgspec.Meta(ge=1, le=1)] | msgspec.UnsetType = msgspec.UNSET


_RULES = {**{k: "must be a non-empty string" for k in ("run", "model", "learner", "inc", "region")},
          **{k: "must be an integer in 0..2**62" for k in ("frag", "round", "base", "steps", "tokens")},
          "period": "must be an integer in 1..2**31", "lockstep": "must be 1 (or absent)",
          "step_s": "must be a number of seconds in (0, 86400]", "final": "must be 1 (or absent)"}


def parse_grad_meta(meta: dict) -> dict:
    """Type-check the metadata of a gradient object (:class:`GradMeta`); ``ValueError('malformed: ...')``
    if wrong; returns ``meta`` itself.

    Semantic checks (right run, active learner, staleness...) belong to the aggregator's validator.
    """
    try:
        msgspec.convert(meta, GradMeta)
    except msgspec.ValidationError as e:
        field = str(e).rpartition("at `$.")[2].rstrip("`")
        if isinstance(meta, dict) and field in _RULES and set(GRAD_FIELDS) <= set(meta):
            raise ValueError(f"malformed: field {field!r} {_RULES[field]}") from None
        raise ValueError(f"malformed: expected fields {', '.join(GRAD_FIELDS)} (and optionally "
                         f"{', '.join(GRAD_OPTIONAL)})") from None
    try:
        check_token("learner", meta["learner"])
    except ValueError as e:
        raise ValueError(f"malformed: {e}") from None
    return meta


@dataclass(frozen=True)
class Manifest:
    """The run's identity: every process checks it before it trains or merges."""

    run: str
    model_hash: str
    spec: dict  # what the model is: ModelSpec fields (the built-in model), or {"kind": "tree"} (a user's)
    seed: int
    num_fragments: int
    plan_hash: str
    created_at: float
    # the run's declared geometry, which bounds what one contribution may claim (None: a run
    # created before these were declared, no bound): the largest peak inner learning rate of any
    # learner, and the most tokens one inner step of any learner may consume
    max_inner_lr: float | None = None
    max_tokens_per_step: int | None = None
    # the parameter tree (``bus.tree.TreeSpec.to_dict``) and how its fragment plan is made: with
    # them any process can merge or read the run without knowing the model (``bus.runs.run_tree``)
    tree: dict | None = None
    max_imbalance: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        try:
            m = cls(str(d["run"]), str(d["model_hash"]), dict(d["spec"]), int(d["seed"]), int(d["num_fragments"]),
                    str(d["plan_hash"]), float(d["created_at"]),
                    None if d.get("max_inner_lr") is None else float(d["max_inner_lr"]),
                    None if d.get("max_tokens_per_step") is None else int(d["max_tokens_per_step"]),
                    None if d.get("tree") is None else dict(d["tree"]),
                    None if d.get("max_imbalance") is None else float(d["max_imbalance"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed manifest: {e}") from None
        if m.num_fragments < 1 or not math.isfinite(m.created_at):
            raise ValueError("malformed manifest: num_fragments < 1 or bad created_at")
        if m.max_inner_lr is not None and not (math.isfinite(m.max_inner_lr) and m.max_inner_lr > 0):
            raise ValueError("malformed manifest: max_inner_lr must be finite and > 0")
        if m.max_tokens_per_step is not None and m.max_tokens_per_step < 1:
            raise ValueError("malformed manifest: max_tokens_per_step must be >= 1")
        if m.max_imbalance is not None and not (math.isfinite(m.max_imbalance) and m.max_imbalance >= 1):
            raise ValueError("malformed manifest: max_imbalance must be finite and >= 1")
        return m
