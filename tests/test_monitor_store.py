"""monitor.store.initial_entries: a KV watcher's initial values read to their end, also when
nats-py's end marker (None) comes before the entries (its consumer-info check raced the pushed
messages: test_auth read a key it had just put as absent)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from monitor.store import initial_entries


@dataclass
class Entry:
    key: str
    delta: int


class Scripted:
    """What a watcher hands out, in order (the sequences nats-py produces)."""

    def __init__(self, *updates, values: int):
        self.updates_left, self.values = list(updates), values

    async def updates(self, timeout: float):
        return self.updates_left.pop(0)

    async def status(self):
        return type("Status", (), {"values": self.values})()


def _read(w: Scripted) -> list:
    return asyncio.run(initial_entries(w, w, timeout=1))


def test_the_end_marker_after_the_entries_ends_the_read_at_the_last_entry():
    w = Scripted(Entry("a", 1), Entry("b", 0), None, values=2)
    assert [e.key for e in _read(w)] == ["a", "b"]
    assert w.updates_left == [None]  # the marker after the last entry is not waited for


def test_an_early_end_marker_of_a_bucket_that_holds_values_is_not_the_end():
    w = Scripted(None, Entry("a", 1), Entry("b", 0), values=2)
    assert [e.key for e in _read(w)] == ["a", "b"]


def test_the_end_marker_of_an_empty_bucket_is_the_end():
    assert _read(Scripted(None, values=0)) == []


async def test_a_real_bucket_is_read_whole_and_an_empty_one_at_once(js):
    kv = await js.create_key_value(bucket="store_t")
    empty = await kv.watchall()
    assert await initial_entries(kv, empty, timeout=5) == []
    await empty.stop()
    for i in range(5):
        await kv.put(f"k{i}", b"v")
    await kv.delete("k2")
    w = await kv.watchall()
    got = await initial_entries(kv, w, timeout=5)
    await w.stop()
    assert sorted(e.key for e in got) == ["k0", "k1", "k2", "k3", "k4"]
    assert [e.operation for e in got if e.key == "k2"] == ["DEL"]
