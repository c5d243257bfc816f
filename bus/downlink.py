"""Global versions on the wire: whole (fp32), or a quantised delta against a keyframe (pure).

Quantising the *parameters* of every global version would round the global model itself: outer
updates smaller than the quantisation step would vanish. Instead, with a downlink quantiser Q other
than fp32, the aggregator keeps its parameters exact and publishes

* a **keyframe** every ``key_every`` versions of a fragment (and as the first version after it
  starts): the whole fp32 parameters, meta ``{"key": v}``, also kept on the keyframe subjects
  (``diloco.<run>.global.<frag>.kc<i>.<slot>`` / ``.khead``);
* every other version v as ``Q(Theta_v - Theta_k)`` against the newest keyframe k, meta
  ``{"ref": k}``.

A reader holding keyframe k reconstructs ``Theta_k + deQ(blob)``: one delta per download, never a
chain, so a learner that skips versions (``DILOCO_FETCH=round``) still needs one blob. The error of
a reconstruction is one quantisation step of the delta since the keyframe, and does not accumulate:
the next keyframe is exact, the aggregator never applies it to its own parameters, and a
learner's outer gradient is taken against the reconstruction it started from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bus import codec


@dataclass(frozen=True)
class Keyframe:
    """Version ``version`` of a fragment, exact float32 parameters."""

    version: int
    params: np.ndarray


class MissingKeyframe(LookupError):
    """A delta version refers to keyframe ``ref``, which the reader does not hold."""

    def __init__(self, ref: int):
        super().__init__(f"keyframe v{ref} is not held")
        self.ref = ref


def is_keyframe_due(version: int, key: Keyframe | None, key_every: int) -> bool:
    """Publish ``version`` whole? Yes without a keyframe, or ``key_every`` versions after the last."""
    return key is None or version - key.version >= key_every or version <= key.version


def encode_version(params: np.ndarray, version: int, key: Keyframe | None, quantiser: str,
                   key_every: int) -> tuple[bytearray, dict, Keyframe | None]:
    """(blob, meta, new keyframe or None) of global version ``version`` with ``params``.

    fp32: the whole parameters, no meta, no keyframes. Otherwise a keyframe when due (whole fp32,
    ``{"key": version}``; the returned Keyframe's values are the blob's: a copy of ``params``), else ``Q(params - key.params)`` with
    ``{"ref": key.version}``.
    """
    if key_every < 1:
        raise ValueError(f"key_every must be >= 1, got {key_every}")
    p = np.asarray(params, dtype=np.float32).reshape(-1)
    if quantiser == "fp32":
        return codec.encode_array(p), {}, None
    if is_keyframe_due(version, key, key_every):
        blob = codec.encode_array(p)
        # the keyframe is the blob's own values (an fp32 blob decodes to a view on it): one copy of
        # the parameters, not two, while it is published (the blob must not be written to after)
        return blob, {"key": int(version)}, Keyframe(int(version), codec.decode_array(blob).reshape(-1))
    if key.params.shape != p.shape:
        raise ValueError(f"keyframe has {key.params.size} values, the parameters {p.size}")
    return codec.encode_delta(p, key.params, quantiser), {"ref": key.version}, None


def decode_version(blob, meta: dict, key: Keyframe | None) -> np.ndarray:
    """The float32 parameters of a global version (a new array when it is a delta).

    Raises MissingKeyframe when ``meta`` names a keyframe ``key`` is not; ValueError for a
    malformed reference or a delta whose size differs from the keyframe's.
    """
    ref = meta.get("ref")
    vec = codec.decode_array(blob).reshape(-1)
    if ref is None:
        return vec
    return _plus(vec, ref, key, "keyframe")


def _plus(vec: np.ndarray, ref, base, what: str) -> np.ndarray:
    """``base.params + vec`` once ``ref`` is a version number and ``base`` (a Keyframe or View) is
    that version of the same size; else MissingKeyframe or ValueError."""
    if not isinstance(ref, int) or isinstance(ref, bool) or ref < 0:
        raise ValueError(f"bad {what} reference {ref!r}")
    if base is None or base.version != ref:
        raise MissingKeyframe(ref)
    if vec.size != base.params.size:
        raise ValueError(f"delta has {vec.size} values, {what} v{ref} {base.params.size}")
    return (base.params + vec).astype(np.float32, copy=False)


# -- the chained downlink (error feedback on the way down) ------------------------------------------
#
# Against a keyframe, the error of a reconstruction is one quantisation step of everything since
# the keyframe: at 2 bits that is most of the model's movement, and training broke down (a 400-step
# simulation.reference run: held-out 3.99 against 2.71 chained; docs/BENCHMARKS.md, "What each lever bought").
# A chain sends each version against the *previous reconstruction* instead:
#
#     D_v = Q(Theta_v - V_{v-1}),  V_v = V_{v-1} + deQ(D_v)
#
# where V is what every follower holds. What Q leaves out stays in Theta - V and goes out with a later
# version (error feedback, with the aggregator's exact parameters as the reference), so the error of a
# reconstruction is bounded by one quantisation step of one version's change, and a sparse codec works
# on the way down too. The cost: a follower must apply every version in order (a joiner starts from a
# whole copy of V, which the aggregator keeps on the keyframe subjects for every version).
# ``DILOCO_DOWNLINK_CHAIN`` (aggregator) and simulation.reference's ``downlink_chain``.


@dataclass(frozen=True)
class View:
    """Version ``version`` of a fragment as every follower of the chain reconstructs it."""

    version: int
    params: np.ndarray


def encode_chain(params: np.ndarray, version: int, view: View | None, q: str,
                 **codec_args) -> tuple[bytearray, dict, View]:
    """(blob, meta, the new view) of global version ``version`` on a chained downlink; meta always
    holds ``"chain": 1`` (readers keep their view and follow every version).

    * ``view`` at ``version - 1``: ``Q(params - view)``, ``{"prev": version - 1}``; the new view is
      ``view + deQ(blob)``, computed as a follower computes it (:func:`decode_chain`), bit for bit.
    * ``view`` at ``version`` already (a version published again after a restart): that view whole.
    * otherwise (no view: a fresh start, or a restart that lost it): the exact parameters whole,
      ``{"key": version}``, and the view becomes exact.
    """
    p = np.asarray(params, dtype=np.float32).reshape(-1)
    if view is not None and view.params.shape != p.shape:
        raise ValueError(f"view has {view.params.size} values, the parameters {p.size}")
    if view is not None and view.version == version:
        return codec.encode_array(view.params), {"key": int(version), "chain": 1}, view
    if view is None or view.version != version - 1:
        return codec.encode_array(p), {"key": int(version), "chain": 1}, View(int(version), p.copy())
    blob = codec.encode_array((p - view.params).astype(np.float32, copy=False), q, **codec_args)
    meta = {"prev": view.version, "chain": 1}
    return blob, meta, View(int(version), decode_chain(blob, meta, view))


def decode_chain(blob, meta: dict, view: View | None) -> np.ndarray:
    """A follower's reconstruction of a chained version: whole, or its view plus the delta.
    Raises MissingKeyframe (``ref`` = the version it needs first) when the view is not the one the
    delta was taken against."""
    vec = np.asarray(codec.decode_array(blob), dtype=np.float32).reshape(-1)
    if "prev" not in meta:
        return vec
    return _plus(vec, meta.get("prev"), view, "view")
