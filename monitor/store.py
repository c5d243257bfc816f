"""What the monitor reads from JetStream and the rules of what it writes there: the members bucket
(``load_members``; ``needs_write`` coalesces writes; ``adopt_members`` at a takeover), the newest
global version per fragment (``current_heads``) and the transition events' deduplication ids.

``monitor.status`` (``diloco status``) reads the same records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from nats.js.errors import NotFoundError

from bus.codec import CodecError, loads_json
from bus.subjects import GLOBAL, Subjects
from bus.transport import VersionedStore
from monitor.membership import Member, Transition, member_from_dict

_KV_DEL_OPS = ("DEL", "PURGE")


def needs_write(written: Member | None, new: Member, written_at: float | None, now: float, refresh: float) -> bool:
    """Whether ``new`` must be written to KV, given what we last wrote (``written`` at ``written_at``).

    At once when the member is new to KV or its state, reason, incarnation or region changed;
    otherwise (liveness and progress fields only) at most every ``refresh`` seconds.
    """
    if written is None or written_at is None:
        return True
    if new == written:
        return False
    significant = ("state", "since", "reason", "incarnation", "region")
    if any(getattr(new, f) != getattr(written, f) for f in significant):
        return True
    return now - written_at >= refresh


def adopt_members(kv_members: Mapping[str, Member], local: Mapping[str, Member]) -> dict[str, Member]:
    """Membership a monitor takes over when it becomes leader.

    The KV records are authoritative (state, reason, incarnation): they are what everyone has
    seen. Our own observation only contributes liveness: ``last_seen`` is the newer of both.
    Learners we heard but KV does not know are left out: their next heartbeat makes them join
    properly, with their transitions published.
    """
    out: dict[str, Member] = {}
    for name, m in kv_members.items():
        mine = local.get(name)
        if mine is not None and mine.last_seen > m.last_seen:
            m = replace(m, last_seen=mine.last_seen)
        out[name] = m
    return out


def event_msg_id(run: str, t: Transition) -> str:
    """Deduplication id of a transition event (a retried publish is stored once)."""
    old = "none" if t.old is None else t.old.value
    return f"{run}.{t.learner}.{old}.{t.new.value}.{t.at!r}"


# --------------------------------------------------------------------------- KV / stream reads


async def initial_entries(kv, watcher, timeout: float = 10.0) -> list:
    """A new KV watcher's initial values (the newest entry of every key), read to their end.

    nats-py's watcher signals that end with a None, but can signal it first: it checks the
    consumer's pending count right after creating it, and when the server had already pushed every
    entry (pending 0) before the client's callback counted one, the None comes before the entries
    (test_auth saw a key it had just put read as absent, leaf topology, 1 suite in 3). So a None
    ends the read only once an entry came or the bucket holds nothing; else the last entry (the
    server's pending count 0) ends it."""
    out: list = []
    while True:
        entry = await watcher.updates(timeout=timeout)
        if entry is None:
            if out or (await kv.status()).values == 0:
                return out
            continue  # the early end marker: the entries are on their way
        out.append(entry)
        if entry.delta == 0:
            return out


async def load_members(kv, timeout: float = 10.0) -> tuple[dict[str, Member], dict[str, int], dict[str, str]]:
    """All members of a members bucket: (members, KV revision per key, {key: why unreadable}).

    A record that does not parse is reported in the third dict, not raised: the learner is
    treated as unknown and rejoins on its next heartbeat (its revision is kept for the CAS).
    """
    members: dict[str, Member] = {}
    revs: dict[str, int] = {}
    bad: dict[str, str] = {}
    watcher = await kv.watchall()
    try:
        for entry in await initial_entries(kv, watcher, timeout):
            key = entry.key
            if entry.operation in _KV_DEL_OPS:
                members.pop(key, None)
                revs.pop(key, None)
                bad.pop(key, None)
                continue
            revs[key] = entry.revision
            try:
                m = member_from_dict(loads_json(entry.value or b""))  # type: ignore[arg-type]
                if m.learner != key:
                    raise ValueError(f"record of {m.learner!r} stored under key {key!r}")
            except (ValueError, CodecError) as e:
                bad[key] = str(e)[:200]
                members.pop(key, None)
                continue
            bad.pop(key, None)
            members[key] = m
    finally:
        try:
            await watcher.stop()
        except Exception:
            pass
    return members, revs, bad


async def current_heads(js, run: str, fragments: Iterable[int] | None = None) -> dict[int, int]:
    """Newest global version per fragment: of ``fragments``, or of every fragment with a head."""
    store = VersionedStore(js, run, GLOBAL)
    if fragments is None:
        s = Subjects(run)
        try:
            info = await js.stream_info(s.stream(GLOBAL), subjects_filter=s.versioned_heads(GLOBAL))
        except NotFoundError:
            return {}
        frags = set()
        for subj in (info.state.subjects or {}):
            try:
                frags.add(int(subj.split(".")[-2]))
            except (ValueError, IndexError):
                continue
        fragments = sorted(frags)
    out: dict[int, int] = {}
    for f in fragments:
        try:
            h = await store.head(f)
        except ValueError:
            continue
        if h is not None:
            out[int(f)] = h.version
    return out
