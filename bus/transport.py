"""Moving fragments of any size over JetStream: chunked publish, assembled pull, versioned objects.

(About 540 lines in one module on purpose: one concern, objects as chunks over JetStream; the
versioned store is chunks plus a head record, and every role, tool and test imports these names
from here.)

Three pieces, thin I/O around :mod:`bus.chunks`:

* :class:`ChunkPublisher` publishes a blob as chunks no larger than ``max_chunk`` through a bounded
  window of in-flight acks. Each chunk has a ``Nats-Msg-Id``, so a retry after a timeout (server
  restart, lost ack) is always safe: JetStream stores it once.
* :class:`ChunkConsumer` pulls chunks from a durable consumer and feeds an :class:`Assembler`;
  the caller gets whole objects and acks their messages only once it has used them (the aggregator
  acks after persisting a merge, so a crash never loses an acknowledged contribution).
* :class:`VersionedStore` keeps the newest versions of a fragment (global parameters, aggregator
  state): the chunks go to ``<kind>.<frag>.c<i>.<slot>``, then a small *head* record with the version and
  the chunks' stream sequences goes to ``<kind>.<frag>.head``. A version exists once its head
  does, so a writer killed mid-publish leaves the previous version readable. Readers fetch chunks
  by sequence (direct get) and verify the crc32; a reader raced by two newer versions retries.
  :meth:`VersionedStore.watch` yields heads as they are published (the newest of every fragment
  first), monotonic per fragment.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import nats.errors
import orjson
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from bus.chunks import Assembled, Assembler, Blob, Chunk, Dropped, blob_size, checksum, chunk_headers, parse_chunk, split
from bus.store_health import StoreWatch
from bus.subjects import Subjects


async def fetch_object(js: JetStreamContext, stream: str, seqs: Iterable[int], parallel: int = 8) -> Assembled:
    """An object published by :class:`ChunkPublisher`, read back by its chunks' stream sequences
    (direct get; the stream needs ``allow_direct``), checked as the :class:`Assembler` checks it:
    one object id, indexes 0..n-1, sizes and crc32. Raises NotFoundError if a chunk is gone (expired,
    evicted at the byte limit, or the sequence now holds another message), TransportError if the
    chunks do not form one whole object. ``tokens`` is empty: nothing is acknowledged."""
    sem = asyncio.Semaphore(parallel)

    async def one(seq: int) -> Chunk:
        async with sem:
            m = await js.get_msg(stream, seq=int(seq), direct=True)
            try:
                return parse_chunk(m.headers, m.data or b"")
            except ValueError as e:
                raise TransportError(f"sequence {seq} of {stream} is not a chunk: {e}") from None

    chunks = await asyncio.gather(*(one(q) for q in seqs))
    if not chunks:
        raise TransportError("no chunk sequences")
    first = chunks[0]
    if (len(chunks) != first.count or any(c.obj_id != first.obj_id or c.index != i or c.crc != first.crc
                                          for i, c in enumerate(chunks))):
        raise NotFoundError  # the sequences no longer hold this object's chunks
    blob = b"".join(c.data for c in chunks)
    if len(blob) != first.size or checksum(blob) != first.crc:
        raise TransportError(f"{first.obj_id}: assembled blob fails its size or crc32 check")
    return Assembled(first.obj_id, first.meta, blob, [])


class VersionLost(RuntimeError):
    """A committed version's chunks are no longer in its stream (dropped at the byte limit)."""


class TransportError(RuntimeError):
    pass


def transient(e: BaseException) -> bool:
    """A read that failed for the link or the server, not for what it read: a timeout, a connection
    down, JetStream not ready after a restart (any nats error). Read it again; anything else (a blob
    that does not decode, fit or check: ``ValueError``, ``TransportError``) is the content's fault."""
    return isinstance(e, (TimeoutError, ConnectionError, nats.errors.Error)) and not isinstance(
        e, (ValueError, TransportError))


class VersionConflict(TransportError):
    """``put`` of a version when this version (with other content) or a newer one is committed."""

    def __init__(self, message: str, committed: "Head"):
        super().__init__(message)
        self.committed = committed


class ChunkPublisher:
    """Publish blobs as chunk messages with at most ``inflight`` unacknowledged chunks."""

    def __init__(self, js: JetStreamContext, max_chunk: int = 1024 * 1024, inflight: int = 16,
                 ack_timeout: float = 10.0, deadline: float = 300.0, watch: StoreWatch | None = None,
                 fail_fast: bool = False):
        """``watch``: told of every chunk stored and every failure (a full store is said once, by
        the role that owns it: ``bus.store_health``). ``fail_fast``: once the watch knows the store
        is faulted, a failed chunk raises at once instead of being retried until ``deadline`` (the
        aggregator's loop must not wait minutes on a full disk; the learner's publishes retry)."""
        self.js = js
        self.max_chunk = max_chunk
        self.inflight = inflight
        self.ack_timeout = ack_timeout
        self.deadline = deadline
        self.watch = watch
        self.fail_fast = fail_fast
        self.bytes_sent = 0
        self.retries = 0

    async def _publish_one(self, subject: str, payload: memoryview, headers: dict, t_end: float):
        """Awaited publish with retries until ``t_end`` (same Msg-Id: duplicates are dropped by the server)."""
        delay = 0.1
        while True:
            # (waiting the whole ack timeout while the store was faulted kept a learner's work off
            # the run for up to 10 s after the server's restart)
            timeout = self.ack_timeout if self.watch is None else self.watch.attempt_timeout(self.ack_timeout)
            try:
                ack = await self.js.publish(subject, payload, timeout=timeout, headers=dict(headers))
            except Exception as e:
                full = self.watch is not None and await self.watch.failed(e)
                if time.monotonic() + delay > t_end or (full and self.fail_fast):
                    raise TransportError(f"publish to {subject} failed after retries: {e!r} {e}") from e
                self.retries += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            else:
                if self.watch is not None:
                    self.watch.stored()
                return ack

    async def publish(self, subjects: str | list[str], obj_id: str, blob: Blob, meta: dict) -> list:
        """Publish ``blob`` under ``obj_id``; returns the PubAcks in chunk order.

        ``subjects`` is one subject for every chunk, or one per chunk (versioned objects).
        """
        parts = split(blob, self.max_chunk)
        n = len(parts)
        subj = [subjects] * n if isinstance(subjects, str) else list(subjects)
        if len(subj) != n:
            raise ValueError(f"{len(subj)} subjects for {n} chunks")
        crc = checksum(blob)
        size = blob_size(blob)
        t_end = time.monotonic() + self.deadline
        acks: list = [None] * n
        window: list[tuple[int, asyncio.Future, dict]] = []

        async def settle(i: int, fut: asyncio.Future, hdrs: dict) -> None:
            try:
                acks[i] = await asyncio.wait_for(fut, self.ack_timeout)
            except Exception as e:
                # a timeout here is not judged: nats-py 2.16 loses the error a server answers to an
                # async publish (its reply handler raises instead of failing the future), so a
                # refused chunk ("insufficient resources") times out; the awaited retry hears it
                if (self.watch is not None and not isinstance(e, TimeoutError) and await self.watch.failed(e)
                        and self.fail_fast):
                    raise TransportError(f"chunk {i} of {obj_id} not stored: {e!r} {e}") from e
                self.retries += 1
                acks[i] = await self._publish_one(subj[i], parts[i], hdrs, t_end)
            else:
                if self.watch is not None:
                    self.watch.stored()

        for i, part in enumerate(parts):
            hdrs = chunk_headers(obj_id, i, n, size, crc, meta)
            try:
                fut = await self.js.publish_async(subj[i], part, headers=dict(hdrs), wait_stall=self.ack_timeout)
            except Exception:
                fut = asyncio.get_running_loop().create_future()
                fut.set_exception(TransportError("publish_async failed"))
            window.append((i, fut, hdrs))
            if len(window) >= self.inflight:
                await self._settle_or_drop(settle, window)
        while window:
            await self._settle_or_drop(settle, window)
        for a in acks:
            if getattr(a, "stream", None) is None:
                raise TransportError(f"no ack for a chunk of {obj_id}")
        self.bytes_sent += size
        return acks

    @staticmethod
    async def _settle_or_drop(settle, window: list) -> None:
        """Settle the oldest chunk of ``window``; if that raises, the acks still awaited are
        cancelled (an unanswered future stays in nats-py's table of pending acks otherwise)."""
        try:
            await settle(*window.pop(0))
        except BaseException:
            for _, fut, _ in window:
                fut.cancel()
            window.clear()
            raise


@dataclass
class ConsumerStats:
    chunks: int = 0
    objects: int = 0
    bytes: int = 0
    dropped: dict | None = None

    def drop(self, reason: str) -> None:
        self.dropped = self.dropped or {}
        self.dropped[reason] = self.dropped.get(reason, 0) + 1


#: The most :func:`prompt_fetch` waits for the server's answer to its request for the messages the
#: first said were already there. The server answers such a request (``no_wait``) with the messages
#: or a status (404 none left; 408 none deliverable within ``DRAIN_EXPIRES_S``), which ends the wait;
#: this bounds only a server that does not answer at all. It was a fixed 50 ms round trip once: on a
#: loaded CI machine the answer came later and a poll returned 1 message of 32 (the rest waited for
#: the next poll).
DRAIN_WAIT_S = 2.0
#: How long the server holds that request when none of the pending messages is deliverable now
#: (``max_ack_pending`` reached): it then answers 408. A timer on the server, so a loaded client or
#: link does not shorten what it returns.
DRAIN_EXPIRES_S = 0.1


async def prompt_fetch(sub, batch: int, timeout: float) -> list:
    """Up to ``batch`` messages of a pull subscription: wait at most ``timeout`` for the first, then
    take the ones it says are already pending (its ``num_pending``), and return.

    Not ``sub.fetch(batch, timeout)``: when the messages land while its first pull request is in
    flight, nats-py 2.16 waits for the batch to fill until the request expires, so what arrived is
    held for up to ``timeout`` (in a loop of fetch(32, 0.2) about 1% of messages were held
    70-190 ms: a lock-step round whose last chunk is held waits that long).
    ``fetch(1)`` returns at its first message; then :func:`take_pending` asks for exactly what is
    pending and returns at the server's answer (when the first message was in the subscription's
    queue before the poll, its ``num_pending`` is from when an earlier request was given it: the
    consumer's count now is asked for instead; asking for more than is there would end in a 408
    that :func:`stale_status` takes for an earlier request's, and a wait of ``DRAIN_WAIT_S``).
    ``python -m bench.transport`` measures both (``poll_delay_ms``)."""
    inner = getattr(sub, "_sub", None)
    # a message in the queue before this poll was given to an earlier request (a fetch's, timed out
    # on the client, still open on the server): its num_pending is from then (0 if it was the
    # first published), so the server is asked what is pending now (one request, in that case only)
    queued = inner is not None and any(not JetStreamContext.is_status_msg(m) for m in inner._pending_queue._queue)
    msgs = await sub.fetch(1, timeout=timeout)
    try:
        pending = int(msgs[-1].metadata.num_pending)
    except Exception:  # noqa: BLE001 - no metadata (not a JetStream message): take the first only
        pending = 0
    if queued and batch > len(msgs):
        try:
            pending = int((await sub.consumer_info()).num_pending or 0)
        except Exception:  # noqa: BLE001 - connection trouble the next poll meets
            pass
    if batch > len(msgs) and pending > 0:
        try:
            msgs += await take_pending(sub, min(batch - len(msgs), pending), DRAIN_WAIT_S)
        except Exception:  # noqa: BLE001 - connection trouble the next poll meets
            pass
    return msgs


def _none_pending(msg) -> bool:
    """The server had nothing more for the consumer when it delivered ``msg`` (its JetStream
    metadata); False when that is not known."""
    try:
        return int(msg.metadata.num_pending) == 0
    except Exception:  # noqa: BLE001 - no metadata (not a JetStream message)
        return False


async def take_pending(sub, n: int, wait: float) -> list:
    """Up to ``n`` messages the server holds for ``sub`` now: one pull request with ``no_wait``,
    read until ``n`` came or the server's status says there are no more (404: none left, e.g.
    another puller took them; 408 after ``DRAIN_EXPIRES_S`` on the server's clock when none is
    deliverable, e.g. ``max_ack_pending`` reached); ``wait`` seconds at most if it never answers.
    nats-py's ``fetch`` cannot end there: after a 404 it sends a lingering request and waits out its
    timeout. What comes after we stop reading stays in the subscription's queue, where the next
    fetch takes it first: nothing is lost."""
    inner, nms, deliver = (getattr(sub, a, None) for a in ("_sub", "_nms", "_deliver"))
    if inner is None or nms is None or deliver is None:  # another nats-py: its own fetch, briefly
        return await sub.fetch(n, timeout=min(wait, 0.05))
    out: list = []
    queue = inner._pending_queue
    while len(out) < n and not queue.empty():  # a previous request's late answer
        m = queue.get_nowait()
        inner._pending_size -= len(m.data)
        if not JetStreamContext.is_status_msg(m):
            out.append(m)
    if len(out) >= n:
        return out
    req = {"batch": n - len(out), "no_wait": True, "expires": int(DRAIN_EXPIRES_S * 1e9)}
    before = len(out)
    sent = time.monotonic()
    await sub._nc.publish(nms, orjson.dumps(req), deliver)
    t_end = sent + wait
    while len(out) < n:
        left = t_end - time.monotonic()
        if left <= 0:
            break
        try:
            m = await inner.next_msg(timeout=left)
        except (asyncio.TimeoutError, TimeoutError):
            break
        status = JetStreamContext.is_status_msg(m)
        if status:
            if stale_status(status, time.monotonic() - sent, _pending_of(m), req["batch"] - (len(out) - before)):
                continue
            break
        out.append(m)
    return out


async def ask_if_drained(sub, seen: int, wait: float = DRAIN_WAIT_S) -> tuple[list, float | None]:
    """After a poll's wait ran out on this side: (messages that reached the subscription meanwhile,
    the moment as of which every message the server held for ``sub`` has been read here, or None).

    A wait that ended on the client is not the server's word: a reply slower than the wait (a
    10 ms poll after a busy pass, on a loaded machine) leaves a message on its way or on the server.
    Taken for "nothing pending", it made the aggregator judge a round's deadline as if it had read
    that message: the round closed without it
    (``test_a_busy_aggregator_judges_a_round_s_deadline_by_what_it_had_read``, 1 of 4 suite runs).
    So the consumer's state is asked for: drained if the server has given this subscription nothing
    beyond ``seen`` (the highest consumer sequence read here; a message given to the timed-out
    request may still be on its way: its sequence says so, whatever order the two replies take)
    and holds nothing it could give (pending messages it cannot deliver while ``max_ack_pending`` are
    unacknowledged cannot be read either: they do not hold deadlines, as before). As of when the
    question was sent; no answer within ``wait`` raises. Not a pull request: one without
    ``expires`` is not answered at all while ``max_ack_pending`` are out, and one with it is held
    for the next message to come."""
    nc = getattr(sub, "_nc", None)
    if nc is not None and not nc.is_connected:
        return [], None  # (reconnecting: nothing to ask, and not drained)
    asked = time.monotonic()
    jsm = getattr(getattr(sub, "_js", None), "_jsm", None)
    # (at most ``wait``: a poll of a server that does not answer ends as it did, not after the
    # context's whole timeout)
    info = (await jsm.consumer_info(sub._stream, sub._consumer, timeout=wait) if jsm is not None
            else await sub.consumer_info())
    out = []
    inner = getattr(sub, "_sub", None)
    queue = inner._pending_queue if inner is not None else None
    while queue is not None and not queue.empty():  # what the timed-out request was given: here now
        m = queue.get_nowait()
        inner._pending_size -= len(m.data)
        if not JetStreamContext.is_status_msg(m):
            out.append(m)
    if out:
        return out, None
    if (info.delivered.consumer_seq or 0) > seen:
        return [], None  # given to this subscription, not read yet
    limit = info.config.max_ack_pending if info.config else None
    if (info.num_pending or 0) > 0 and (limit is None or limit < 0 or (info.num_ack_pending or 0) < limit):
        return [], None  # deliverable, not given yet
    return [], asked


def _pending_of(status_msg) -> int | None:
    """The ``Nats-Pending-Messages`` of a pull request's status: what of that request's batch was
    still undelivered when it ended (None if the server did not say)."""
    try:
        return int((status_msg.headers or {})["Nats-Pending-Messages"])
    except (KeyError, TypeError, ValueError):
        return None


def stale_status(status: str, since_request: float, pending: int | None = None, remaining: int | None = None) -> bool:
    """A status that cannot be the answer to :func:`take_pending`'s request sent ``since_request``
    seconds ago, of which ``remaining`` messages have not come yet: a 408 (a pull request expired)
    that says fewer messages were pending than we still wait for (``Nats-Pending-Messages``: the
    server tells each expired request what of its own batch it did not deliver; ours says at least
    ``remaining``, more when a message an older open request was given reached us and was counted
    as ours), or, where that does not decide, one that came before half of ``DRAIN_EXPIRES_S`` had
    passed, since ours is held that long by the server's timer. Such a 408
    is an earlier request's: ``fetch``'s, whose client-side timeout fired before the server's 408
    came (the subscription shares one inbox). Taken as our answer, it ended the read with none of
    the pending messages: a poll returned 1 message of 32
    (``test_prompt_fetch_takes_what_is_pending_and_no_more_than_the_batch``, in loaded suites: first
    with the time rule alone, which a 408 delivered more than 50 ms late passes)."""
    if status != "408":
        return False
    if pending is not None and remaining is not None:
        if pending < remaining:  # fewer undelivered than we still wait for: another request's
            return True
        if pending > remaining:  # ours: an older open request's message was counted among ours
            return False
    return since_request < DRAIN_EXPIRES_S / 2


class ChunkConsumer:
    """Pull chunks from a durable consumer and assemble them into objects.

    Operational advice: ``ack_wait`` must exceed the longest time a caller holds an object before
    acking (the aggregator holds contributions until their merge is persisted); ``max_ack_pending``
    bounds how many chunks can be held unacked at once: raise it with many learners and big
    fragments, or delivery silently stalls.
    """

    def __init__(self, js: JetStreamContext, stream: str, durable: str, filter_subjects: list[str],
                 assembler: Assembler | None = None, batch: int = 16, ack_wait: float = 300.0,
                 max_ack_pending: int = 100_000, deliver_new: bool = False):
        self.js = js
        self.stream = stream
        self.durable = durable
        self.filter_subjects = filter_subjects
        self.assembler = assembler or Assembler()
        self.batch = batch
        self.ack_wait = ack_wait
        self.max_ack_pending = max_ack_pending
        self.deliver_new = deliver_new
        self.stats = ConsumerStats()
        self._sub = None
        #: monotonic time of the newest poll that left nothing pending on the server: every message
        #: stored before then has been read (what a deadline is judged against: aggregator.service)
        self.drained_at = 0.0
        #: the highest consumer sequence read here (what :func:`ask_if_drained` compares with)
        self._seen = 0

    async def start(self) -> None:
        cfg = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait,
            max_ack_pending=self.max_ack_pending,
            deliver_policy=DeliverPolicy.NEW if self.deliver_new else DeliverPolicy.ALL,
            max_deliver=-1,
        )
        if len(self.filter_subjects) == 1:
            cfg.filter_subject = self.filter_subjects[0]
        else:
            cfg.filter_subjects = self.filter_subjects
        try:
            await self.js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            await self.js.add_consumer(self.stream, cfg)
        self._sub = await self.js.pull_subscribe_bind(
            self.durable, self.stream, pending_bytes_limit=512 * 1024 * 1024
        )
        try:  # what earlier subscriptions were given: redelivered to this one under new sequences
            self._seen = int((await self._sub.consumer_info()).delivered.consumer_seq or 0)
        except Exception:  # noqa: BLE001 - until the first message read, a timeout says not drained
            pass

    async def poll(self, timeout: float = 1.0) -> list[Assembled | Dropped]:
        """Fetch what has arrived (waiting at most ``timeout`` for the first message), feed the
        assembler, expire old partials."""
        assert self._sub is not None, "call start() first"
        out: list[Assembled | Dropped] = []
        drained = False
        try:
            msgs = await prompt_fetch(self._sub, self.batch, timeout)
            drained = not msgs or _none_pending(msgs[-1])
        except Exception as e:  # noqa: BLE001 - a timeout, or connection trouble (the client reconnects by itself)
            msgs = []
            if isinstance(e, (asyncio.TimeoutError, TimeoutError)) or "timeout" in repr(e).lower():
                try:  # nothing came within the wait: the server says whether nothing was there
                    msgs, as_of = await ask_if_drained(self._sub, self._seen)
                    if as_of is not None:
                        self.drained_at = max(self.drained_at, as_of)
                except Exception:  # noqa: BLE001 - connection trouble the next poll meets
                    pass
            else:
                await asyncio.sleep(min(timeout, 0.5))
        now = time.monotonic()
        if drained:
            self.drained_at = now
        for m in msgs:
            try:
                self._seen = max(self._seen, int(m.metadata.sequence.consumer))
            except Exception:  # noqa: BLE001 - no metadata (not a JetStream message)
                pass
            self.stats.chunks += 1
            try:
                c = parse_chunk(m.headers, m.data, token=m)
            except ValueError as e:
                out.append(Dropped("?", "bad_header", str(e), [m]))
                continue
            # the handle is kept until the object is acknowledged (after its merge), its bytes only
            # until the object is assembled: the chunk holds them, the blob after (issue 41: a held
            # contribution kept its bytes twice)
            m.data = b""
            r = self.assembler.add(c, now)
            if r is not None:
                out.append(r)
        out.extend(self.assembler.expire(now))
        for r in out:
            if isinstance(r, Assembled):
                self.stats.objects += 1
                self.stats.bytes += len(r.blob)
            else:
                self.stats.drop(r.reason)
        return out

    async def unsubscribe(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
            self._sub = None


async def ack_all(tokens: Iterable) -> None:
    """Ack message handles (ignoring ones whose connection is gone: they will be redelivered)."""
    for m in tokens:
        if m is None:
            continue
        try:
            await m.ack()
        except Exception:
            pass


async def term_all(tokens: Iterable) -> None:
    """Terminate handles of dropped chunks: never redeliver them."""
    for m in tokens:
        if m is None:
            continue
        try:
            await m.term()
        except Exception:
            pass


@dataclass(frozen=True)
class Head:
    fragment: int
    version: int
    count: int
    size: int
    crc: int
    seqs: tuple[int, ...]
    meta: dict
    obj: str = ""  # object id of the chunks when not the default one of (fragment, version)
    slot: int = -1  # chunk subjects used (0 or 1, see VersionedStore.put); -1: written before slots

    def to_bytes(self) -> bytes:
        d = {"f": self.fragment, "v": self.version, "n": self.count, "s": self.size,
             "c": self.crc, "q": list(self.seqs), "m": self.meta}
        if self.obj:
            d["o"] = self.obj
        if self.slot >= 0:
            d["p"] = self.slot
        return orjson.dumps(d)

    @classmethod
    def from_bytes(cls, data: bytes) -> "Head":
        try:
            d = orjson.loads(data)
            h = cls(int(d["f"]), int(d["v"]), int(d["n"]), int(d["s"]), int(d["c"]),
                    tuple(int(x) for x in d["q"]), dict(d["m"]), str(d.get("o", "")), int(d.get("p", -1)))
        except Exception:
            raise ValueError("bad_head: not a head record") from None
        if h.count != len(h.seqs) or h.version < 0 or h.fragment < 0:
            raise ValueError("bad_head: inconsistent head record")
        return h


class VersionedStore:
    """Newest versions of each fragment of ``kind`` (``global`` or ``state``) of a run."""

    def __init__(self, js: JetStreamContext, run: str, kind: str, publisher: ChunkPublisher | None = None,
                 fetch_parallel: int = 8, attempts: int = 5, tag: str = ""):
        self.js = js
        self.s = Subjects(run)
        self.kind = kind
        self.tag = tag  # "k": the keyframes of a quantised downlink, beside the versions of ``kind``
        self.stream = self.s.stream(kind)
        self.publisher = publisher or ChunkPublisher(js)
        self.fetch_parallel = fetch_parallel
        self.attempts = attempts
        self.bytes_received = 0
        self.bad_heads = 0  # head messages that did not parse (garbage on a head subject)
        self.rewrites = 0  # versions republished under a fresh object id (see put)
        self._oldest: dict[int, int] = {}  # fragment -> first chunk seq of the version we committed
        self.check_every, self._checked_at = 1.0, float("-inf")

    def obj_id(self, fragment: int, version: int) -> str:
        return f"{self.s.run}.{self.kind}{'.' + self.tag if self.tag else ''}.{fragment}.v{version}"

    async def put(self, fragment: int, version: int, blob: Blob, meta: dict | None = None) -> Head:
        """Publish version ``version`` of ``fragment``: chunks first, then the head that commits it.

        The chunks go to the slot (one of two sets of chunk subjects, each keeping
        ceil(global_history / 2) messages) that the committed head does not use, so no write, even
        one that dies before its head, evicts the committed version's chunks.

        If this version is committed already with the same content, its head is returned and
        nothing is written; if it is committed with other content, or a newer one is,
        :class:`VersionConflict` is raised (a second writer, or an earlier head that was stored
        although its publish reported a failure: the caller should adopt what is committed). A
        head that does not parse, or whose chunks cannot be read (forged, purged), commits
        nothing and is written over. The head is read on every call (one direct get), not
        remembered from this store's last put: only that detects another writer.

        Chunk ids are deterministic, so a retried chunk is stored once. But a writer killed
        between its chunks and its head leaves chunks under the same ids: if the next writer's
        content differs (a merge redone after a crash), JetStream drops its chunks as duplicates
        and acks the old ones. Duplicate acks are therefore checked against the stored chunk, and
        on a mismatch the version is written again under a fresh object id that the head names."""
        meta = dict(meta or {})
        crc = checksum(blob)
        size = blob_size(blob)
        try:
            committed = await self.head(fragment)
        except ValueError:
            committed = None  # garbage on the head subject: nothing readable is committed
        if committed is not None and committed.version >= version:
            if committed.version == version and committed.crc == crc and committed.size == size:
                return committed
            if not await self._readable(committed):
                committed = None  # a head without its chunks (forged, or purged): it commits nothing
        if committed is not None and committed.version >= version:
            raise VersionConflict(f"{self.kind} fragment {fragment}: version {committed.version} is committed, "
                                  f"cannot write version {version} ({'other content' if committed.version == version else 'older'})",
                                  committed)
        slot = 1 - committed.slot if committed is not None and committed.slot in (0, 1) else 0
        n = len(split(blob, self.publisher.max_chunk))
        subjects = [self.s.versioned_chunk(self.kind, fragment, i, self.tag, slot) for i in range(n)]
        base = oid = self.obj_id(fragment, version)
        acks = await self.publisher.publish(subjects, oid, blob, {**meta, "f": fragment, "v": version})
        if not await self._stored_as_sent(acks, oid, crc):
            oid = f"{base}.{secrets.token_hex(4)}"
            self.rewrites += 1
            acks = await self.publisher.publish(subjects, oid, blob, {**meta, "f": fragment, "v": version})
        head = Head(fragment, version, n, size, crc, tuple(a.seq for a in acks), meta,
                    "" if oid == base else oid, slot)
        await self.publisher._publish_one(
            self.s.versioned_head(self.kind, fragment, self.tag), memoryview(head.to_bytes()),
            {"Nats-Msg-Id": f"{oid}.head"}, time.monotonic() + self.publisher.deadline,
        )
        if head.seqs:
            self._oldest[fragment] = min(head.seqs)
        await self._check_kept()
        return head

    async def _check_kept(self) -> None:
        """Raise :class:`VersionLost` if the stream dropped chunks of a version this store committed
        (a stream at its byte limit drops its oldest messages: ``bus.streams`` sizes runs so it
        cannot, this says so loudly if it does anyway). At most every ``check_every`` seconds:
        it costs a request, and the aggregator's merge loop writes several versions a second."""
        now = time.monotonic()
        if now - self._checked_at < self.check_every:
            return
        self._checked_at = now
        try:
            first = (await self.js.stream_info(self.stream)).state.first_seq
        except Exception:  # the version is committed; the check waits for the next put
            return
        lost = sorted(p for p, seq in self._oldest.items() if seq < first)
        if lost:
            raise VersionLost(f"stream {self.stream} dropped committed chunks of fragments {lost} at its byte "
                              "limit: its max_bytes cannot hold the run (see DILOCO_STREAM_MAX_BYTES)")

    async def _readable(self, head: Head) -> bool:
        try:
            await self.fetch(head)
        except (NotFoundError, TransportError, ValueError):
            return False
        return True

    async def _stored_as_sent(self, acks: list, oid: str, crc: int) -> bool:
        """False if a chunk the server called a duplicate is not ours (another write's content, or gone)."""
        for i, a in enumerate(acks):
            if not getattr(a, "duplicate", False):
                continue
            try:
                m = await self.js.get_msg(self.stream, seq=a.seq, direct=True)
                c = parse_chunk(m.headers, m.data or b"")
            except (NotFoundError, ValueError):
                return False
            if c.obj_id != oid or c.index != i or c.crc != crc:
                return False
        return True

    async def head(self, fragment: int) -> Head | None:
        """The newest committed head of ``fragment``, or None if it has none yet."""
        try:
            m = await self.js.get_msg(self.stream, subject=self.s.versioned_head(self.kind, fragment, self.tag),
                                      direct=True)
        except NotFoundError:
            return None
        return Head.from_bytes(m.data)

    async def fetch(self, head: Head) -> bytes:
        """The blob of ``head`` (chunks by sequence, crc32 checked). Raises NotFoundError if purged."""
        sem = asyncio.Semaphore(self.fetch_parallel)

        async def one(seq: int) -> Chunk:
            async with sem:
                m = await self.js.get_msg(self.stream, seq=seq, direct=True)
                return parse_chunk(m.headers, m.data or b"")

        chunks = await asyncio.gather(*(one(q) for q in head.seqs))
        want = head.obj or self.obj_id(head.fragment, head.version)
        if any(c.obj_id != want or c.index != i for i, c in enumerate(chunks)):
            raise NotFoundError  # the sequence now holds something else: a newer version replaced it
        blob = b"".join(c.data for c in chunks)
        if len(blob) != head.size or checksum(blob) != head.crc:
            raise TransportError(f"{want}: assembled blob fails its size or crc32 check")
        self.bytes_received += len(blob)
        return blob

    async def get(self, fragment: int) -> tuple[Head, bytes] | None:
        """Newest complete version of ``fragment`` as (head, blob), or None if there is none."""
        for attempt in range(self.attempts):
            h = await self.head(fragment)
            if h is None:
                return None
            try:
                return h, await self.fetch(h)
            except NotFoundError:
                await asyncio.sleep(0.05 * (attempt + 1))  # raced by newer versions: read the head again
        raise TransportError(f"{self.kind} fragment {fragment}: could not read a stable version")

    async def watch(self, stop: asyncio.Event | None = None,
                    verified: dict[int, int] | None = None) -> AsyncIterator[Head]:
        """Heads as they are committed: first the newest of every fragment, then live ones.

        Versions are monotonic per fragment: a head not newer than one already yielded is skipped.
        With ``verified`` (fragment -> version), the caller keeps that record itself, updating it
        only for heads whose blob it fetched and checked: then a forged head with a huge version
        cannot hide the genuine ones that follow. Uses an ordered consumer, which re-creates itself
        after reconnects and gaps.
        """
        own = verified is None
        newest: dict[int, int] = {} if verified is None else verified
        sub = None
        errors = 0
        try:
            while stop is None or not stop.is_set():
                if sub is None:
                    try:
                        sub = await self.js.subscribe(self.s.versioned_heads(self.kind), ordered_consumer=True,
                                                      deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
                    except Exception:  # server unreachable right now: try again shortly
                        await asyncio.sleep(0.5)
                        continue
                try:
                    m = await sub.next_msg(timeout=0.5)
                    errors = 0
                except (asyncio.TimeoutError, TimeoutError):
                    continue
                except Exception:
                    # a dead subscription raises at once: re-create it after a few errors (the
                    # monotonic filter below drops the heads we already yielded)
                    errors += 1
                    if errors >= 3:
                        await _unsubscribe(sub)
                        sub, errors = None, 0
                    await asyncio.sleep(0.1)
                    continue
                try:
                    h = Head.from_bytes(m.data)
                except ValueError:
                    self.bad_heads += 1
                    continue
                if h.version <= newest.get(h.fragment, -1):
                    continue
                if own:
                    newest[h.fragment] = h.version
                yield h
        finally:
            if sub is not None:
                await _unsubscribe(sub)


async def follow_heads(store: VersionedStore, halt: asyncio.Event, on_head, known, num_fragments: int, log,
                       verified: dict[int, int] | None = None, poll_interval: float = 5.0) -> None:
    """Call ``await on_head(head)`` for every newer head of ``store`` until ``halt``.

    Two loops: :meth:`VersionedStore.watch` (re-entered after errors), and, as a safety net after
    reconnects or a dead subscription, a poll of every fragment's head every ``poll_interval``
    seconds; ``known(p)`` is the newest version of p the caller already has.
    """

    # the newest head record handed to on_head per fragment: neither the poll nor a re-created
    # watch (which starts again from the newest head of each subject) hands the same record again
    # (a forged head that stays the newest on its subject was counted twice, ~1 test run in 10)
    delivered: dict[int, Head] = {}

    async def deliver(head: Head) -> None:
        if delivered.get(head.fragment) == head:
            return
        delivered[head.fragment] = head
        await on_head(head)

    async def sleep(seconds: float) -> None:
        try:
            await asyncio.wait_for(halt.wait(), max(0.0, seconds))
        except asyncio.TimeoutError:
            pass

    async def watching() -> None:
        while not halt.is_set():
            try:
                async for head in store.watch(halt, verified):
                    await deliver(head)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("global_watch_error", error=repr(e))
                await sleep(1.0)

    async def polling() -> None:
        while not halt.is_set():
            await sleep(poll_interval)
            for p in range(num_fragments):
                if halt.is_set():
                    return
                try:
                    head = await store.head(p)
                except Exception:
                    break
                if head is not None and head.version > known(p):
                    await deliver(head)

    await asyncio.gather(watching(), polling())


async def _unsubscribe(sub) -> None:
    try:
        await sub.unsubscribe()
    except Exception:
        pass
