"""Reading global versions (learners, the evaluator): whole ones, or deltas against a keyframe.

:class:`GlobalReader` wraps the run's GLOBAL :class:`~bus.transport.VersionedStore` and its
keyframe store (tag ``k``), and caches the newest keyframe of every fragment it has seen, so a
delta version costs one quantised blob (see :mod:`bus.downlink`). Every vector goes through the
caller's ``check`` before it is returned or cached as a keyframe, so a blob that does not fit the
run never becomes a reference for later deltas.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from nats.js.errors import NotFoundError

from bus.chunks import checksum
from bus.downlink import Keyframe, MissingKeyframe, View, decode_chain, decode_version
from bus.subjects import GLOBAL
from bus.transport import Head, VersionedStore

#: ``check(head, vector) -> vector``: raises ValueError if the vector does not fit the run.
Check = Callable[[Head, np.ndarray], np.ndarray]


class GlobalReader:
    def __init__(self, js, run: str, check: Check):
        self.store = VersionedStore(js, run, GLOBAL)
        self.keystore = VersionedStore(js, run, GLOBAL, tag="k")
        self.check = check
        self.keys: dict[int, Keyframe] = {}
        self.keyframes_fetched = 0
        # a chained downlink: the newest version of each fragment as reconstructed here (a copy: the
        # caller may write into what read() returns)
        self.views: dict[int, View] = {}
        self.views_fetched = 0  # whole reconstructions taken from the keyframe subjects (chain lost)
        #: optional ``head -> blob or None`` of version 0, kept after start-up (the built-in model
        #: rebuilds it from the seed): the first chained delta is against version 0, which the
        #: reader then needs as a view; built here it costs no download (checked by the crc32 of the
        #: version-0 head seen at start-up)
        self.v0_source: Callable[[Head], bytes | bytearray | None] | None = None
        self._v0_heads: dict[int, Head] = {}
        self.views_built = 0
        #: optional ``head -> blob or None``: a blob the reader can build itself (version 0 from the
        #: run's seed), taken instead of a download when its size and crc32 match the head
        self.local: Callable[[Head], bytes | bytearray | None] | None = None
        self.local_hits = 0

    @property
    def bytes_received(self) -> int:
        return self.store.bytes_received + self.keystore.bytes_received

    @property
    def bad_heads(self) -> int:
        return self.store.bad_heads

    async def read(self, head: Head) -> np.ndarray:
        """The checked parameters of version ``head``.

        Raises NotFoundError when the blob (or the keyframe a delta refers to) is gone or not there
        yet: a newer version replaced it, and its head follows. ValueError/TransportError for a
        version that does not decode or fit.
        """
        return await self._decode(head, await self.store.fetch(head))

    async def head(self, fragment: int) -> Head | None:
        """The newest head of ``fragment``, without its blob (None: no version yet)."""
        return await self.store.head(fragment)

    async def newest(self, fragment: int) -> tuple[Head, np.ndarray] | None:
        """The newest version of ``fragment``, checked, or None if it has none yet."""
        if self.local is not None:
            head = await self.store.head(fragment)
            blob = self.local(head) if head is not None else None
            if blob is not None and len(blob) == head.size and checksum(blob) == head.crc:
                self._v0_heads[fragment] = head
                self.local_hits += 1
                return head, await self._decode(head, blob)
        for _ in range(self.store.attempts):
            got = await self.store.get(fragment)
            if got is None:
                return None
            if got[0].version == 0:
                self._v0_heads[fragment] = got[0]
            try:
                return got[0], await self._decode(*got)
            except NotFoundError:
                continue  # its keyframe was replaced meanwhile: read the newer head
        raise NotFoundError

    async def _decode(self, head: Head, blob) -> np.ndarray:
        p = head.fragment
        if head.meta.get("chain"):
            return await self._decode_chain(head, blob)
        try:
            vec = decode_version(blob, head.meta, self.keys.get(p))
        except MissingKeyframe as e:
            key = await self._fetch_key(p, e.ref)
            vec = decode_version(blob, head.meta, key)
        vec = self.check(head, vec)
        # a keyframe of a quantised downlink. Version 0 is whole but not kept: with the default fp32
        # downlink no delta ever refers to it, and a copy of every parameter held for nothing was a
        # third of an island's memory over its own (bench.island); with a quantised downlink the
        # aggregator puts version 0 on the keyframe subjects, fetched once by the first delta
        if head.meta.get("key") == head.version:
            self._remember(p, Keyframe(head.version, np.array(vec, dtype=np.float32, copy=True)))
        return vec

    async def _decode_chain(self, head: Head, blob) -> np.ndarray:
        """A chained version: our view plus its delta; without the previous version's view, the
        whole reconstruction of this version from the keyframe subjects."""
        p = head.fragment
        if p not in self.views and head.meta.get("prev") == 0:
            self._view_of_version0(p)
        try:
            vec = decode_chain(blob, head.meta, self.views.get(p))
        except MissingKeyframe:
            got = await self.keystore.get(p)
            if got is None or got[0].version != head.version:
                raise NotFoundError from None  # not there yet, or replaced: a newer head follows
            vec = decode_chain(got[1], {}, None)
            self.views_fetched += 1
        vec = self.check(head, vec)
        old = self.views.get(p)
        if old is None or head.version > old.version:
            self.views[p] = View(head.version, np.array(vec, dtype=np.float32, copy=True))
        return vec

    def _view_of_version0(self, p: int) -> None:
        h0 = self._v0_heads.get(p)
        if self.v0_source is None or h0 is None:
            return
        blob = self.v0_source(h0)
        if blob is None or len(blob) != h0.size or checksum(blob) != h0.crc:
            return
        vec = self.check(h0, decode_chain(blob, {}, None))
        self.views[p] = View(0, np.array(vec, dtype=np.float32, copy=True))
        self.views_built += 1

    async def _fetch_key(self, p: int, ref: int) -> Keyframe:
        got = await self.keystore.get(p)
        if got is None or got[0].version != ref:
            raise NotFoundError  # not published yet, or already replaced by a newer keyframe
        head, blob = got
        vec = self.check(head, decode_version(blob, {}, None))
        key = Keyframe(ref, np.array(vec, dtype=np.float32, copy=True))
        self.keyframes_fetched += 1
        self._remember(p, key)
        return key

    def _remember(self, p: int, key: Keyframe) -> None:
        old = self.keys.get(p)
        if old is None or key.version >= old.version:
            self.keys[p] = key
