"""Each global version as the learners download it (:class:`DownlinkEncoder`): whole, a quantised
delta against the newest keyframe (``DILOCO_DOWNLINK_QUANTISER``), or a delta against the previous
version as readers reconstruct it (``DILOCO_DOWNLINK_CHAIN``). The merge stage
(``aggregator.versions``) encodes each version at once, since the next merge updates the
parameters in place, and hands the :class:`~aggregator.publisher.PublishJob` to the publisher.

State of its own: per fragment the newest keyframe (quantised downlink) or the newest
reconstruction (chained downlink), both taken back from the keyframe subjects after a restart.
The encodings themselves are ``bus.downlink``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from aggregator.publisher import PublishJob
from aggregator.step import FragmentState
from bus import codec, sparse
from bus.downlink import Keyframe, View, encode_chain, encode_version


class DownlinkEncoder:
    """The downlink encoding of an aggregator's fragments, and the references it keeps."""

    def __init__(self, cfg: Any, quantiser: str, log: Any):
        self.cfg, self.quantiser, self.log = cfg, quantiser, log
        # newest keyframe per fragment (quantised downlink); after a restart taken back from the
        # keyframe subjects while current (see recover_keyframe)
        self.keys: dict[int, Keyframe] = {}
        # a chained downlink (DILOCO_DOWNLINK_CHAIN): per fragment, the newest version as readers
        # reconstruct it; after a restart taken back from the keyframe subjects (recover_view)
        self.views: dict[int, View] = {}

    def encode(self, st: FragmentState, meta: dict) -> PublishJob:
        """Version ``st`` encoded for the downlink now, with its merge event (``meta``: the head's
        metadata both encodings share)."""
        p = st.fragment
        event = ([list(k) for k in st.last_merge], st.last_scale, st.last_per_round)
        if self.cfg.downlink_chain:
            # every version against the previous reconstruction; the reconstruction itself, whole,
            # on the keyframe subjects for a reader that lost the chain (bus.downlink.encode_chain)
            q = self.quantiser
            blob, extra, view = encode_chain(st.params, st.version, self.views.get(p), q,
                                             **codec.codec_args(q, sparse.DEFAULT_CHUNK, self.cfg.downlink_topk_k))
            self.views[p] = view
            whole = blob if "prev" not in extra else codec.encode_array(view.params)
            return PublishJob(p, st.version, blob, {**meta, **extra}, True, *event, key_blob=whole)
        blob, extra, key = encode_version(st.params, st.version, self.keys.get(p), self.quantiser,
                                          self.cfg.keyframe_every)
        if key is not None:
            self.keys[p] = key
        return PublishJob(p, st.version, blob, {**meta, **extra}, key is not None, *event)

    async def recover_view(self, p: int, size: int, kstore: Any) -> None:
        """A chained downlink after a (re)start: the newest reconstruction on the keyframe subjects
        (the aggregator puts each version's there before its head). The next version published is
        a delta against it if it is the previous version, the view itself whole if it is that
        version, else the exact parameters whole (bus.downlink.encode_chain)."""
        for attempt in range(6):
            try:
                got = await kstore.get(p)
                break
            except Exception as e:
                # going on without the view would publish the exact parameters whole at a version
                # the keyframe subjects may hold already (another content): GLOBAL would skip it
                self.log.warning("view_recovery_failed", fragment=p, error=repr(e), attempt=attempt + 1)
                if attempt == 5:
                    raise RuntimeError(f"fragment {p}: the chained downlink's view cannot be read from the "
                                       f"keyframe subjects ({e!r})") from None
                await asyncio.sleep(0.5 * 2**attempt)
        if got is None:
            return
        head, blob = got
        try:
            vec = np.array(codec.decode_array(blob), dtype=np.float32).reshape(-1)
        except codec.CodecError as e:
            self.log.warning("view_recovery_failed", fragment=p, version=head.version, error=str(e))
            return
        if vec.size == size and np.isfinite(vec).all():
            self.views[p] = View(head.version, vec)

    async def recover_keyframe(self, st: FragmentState, kstore: Any, meta: dict) -> None:
        """Quantised downlink: the keyframe deltas refer to after a (re)start. The newest one on the
        keyframe subjects while it is still current; else, for a fresh fragment, version 0 (every
        reader holds it whole, learners build it from the seed), put on the keyframe subjects for
        readers that join later (``meta``: its model and plan). Otherwise the first version
        published is a keyframe."""
        p = st.fragment
        if p in self.keys:  # (a replay that published versions started from a keyframe)
            return
        if self.cfg.downlink_chain:
            if p not in self.views and st.version == 0:  # every reader holds version 0 whole
                self.views[p] = View(0, np.array(st.params, dtype=np.float32, copy=True))
            return
        if self.quantiser == "fp32":
            return
        got = await kstore.get(p)
        if got is not None:
            head, blob = got
            if head.version <= st.version and st.version - head.version < self.cfg.keyframe_every:
                # its values are the blob's (an fp32 blob decodes to a view on it): no second copy
                self.keys[p] = Keyframe(head.version, np.asarray(codec.decode_array(blob), dtype=np.float32).reshape(-1))
                return
        if st.version == 0:
            blob = codec.encode_array(st.params)
            await kstore.put(p, 0, blob, {**meta, "key": 0})
            self.keys[p] = Keyframe(0, codec.decode_array(blob).reshape(-1))  # the blob's values: a copy
