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
    ``{"key": version}``; the returned Keyframe holds a copy), else ``Q(params - key.params)`` with
    ``{"ref": key.version}``.
    """
    if key_every < 1:
        raise ValueError(f"key_every must be >= 1, got {key_every}")
    p = np.asarray(params, dtype=np.float32).reshape(-1)
    if quantiser == "fp32":
        return codec.encode_array(p), {}, None
    if is_keyframe_due(version, key, key_every):
        return codec.encode_array(p), {"key": int(version)}, Keyframe(int(version), p.copy())
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
    if not isinstance(ref, int) or isinstance(ref, bool) or ref < 0:
        raise ValueError(f"bad keyframe reference {ref!r}")
    if key is None or key.version != ref:
        raise MissingKeyframe(ref)
    if vec.size != key.params.size:
        raise ValueError(f"delta has {vec.size} values, keyframe v{ref} {key.params.size}")
    return (key.params + vec).astype(np.float32, copy=False)
