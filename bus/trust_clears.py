"""An operator's clears of trust records (``diloco trust clear LEARNER``), kept in the run's KV bucket.

A clear is the key ``trust_clear.<learner>`` of the ``run`` bucket; its KV revision is the clear's id
(it only grows). Each aggregator reads the keys of the learners it holds records for and applies a
clear it has not applied yet to each of its fragments at that fragment's next merge, logged with the
merge (``aggregator.mlog.MergeRecord.cleared``) so a replay applies it at the same point. The record
of the learner is then forgotten: it is measured afresh (``aggregator.trust.clear``).
"""

from __future__ import annotations

import time

import orjson

from bus.subjects import Subjects, check_token

PREFIX = "trust_clear."


def clear_key(learner: str) -> str:
    return PREFIX + check_token("learner", learner)


async def request_clear(js, run: str, learner: str, by: str = "") -> int:
    """Store a clear of ``learner``'s trust records; return its id (the KV revision)."""
    kv = await js.key_value(Subjects(run).bucket("run"))
    return int(await kv.put(clear_key(learner), orjson.dumps({"learner": learner, "ts": time.time(), "by": by})))


async def read_clears(js, run: str, learners) -> dict[str, int]:
    """{learner: the id of its newest clear} for those of ``learners`` that were ever cleared."""
    from nats.js.errors import KeyNotFoundError

    kv = await js.key_value(Subjects(run).bucket("run"))
    out: dict[str, int] = {}
    for x in sorted(learners):
        try:
            e = await kv.get(clear_key(x))
        except KeyNotFoundError:
            continue
        if e.value is not None and e.revision is not None:
            out[x] = int(e.revision)
    return out
