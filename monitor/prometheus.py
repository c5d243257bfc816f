"""Prometheus exposition of a run's metrics: ``diloco metrics --serve HOST:PORT``.

The CLI folds the run's metrics messages into a :class:`~monitor.metrics_view.MetricsSnapshot`
(as it does for the live table); :func:`families` turns the newest snapshot into Prometheus
metric families, and :class:`SnapshotCollector` hands them to ``prometheus_client``'s HTTP server
at every scrape. The families are a pure function of the snapshot (tested without a server), and
the server is the maintained client library's own (``prometheus_client.start_http_server``):
nothing of the text format is written by hand.

The exporter also reports its own health: ``diloco_exporter_connected`` (1 connected, 0 while it
reconnects: the other values are then the last ones received) and
``diloco_exporter_last_message_age_seconds``; it logs one line when its connection is lost and
one when it is restored (``bus.conn``), not one per reconnect attempt.

Every sample carries the run id as the ``run`` label. Counters are the roles' own cumulative
counts since their process started: a restarted aggregator starts again from zero, which
Prometheus reads as a counter reset (``rate()`` and ``increase()`` handle it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from monitor.membership import State
from monitor.metrics_view import MetricsSnapshot

PREFIX = "diloco"
#: where ``--serve :PORT`` listens: this machine only
DEFAULT_HOST = "127.0.0.1"
LEARNER_STATES: tuple[str, ...] = tuple(s.value for s in State)


def _num(x: float | int | None) -> float | None:
    return None if x is None else float(x)


def families(snap: MetricsSnapshot) -> list[Metric]:
    """The Prometheus metric families of one snapshot (a sample only where a value was reported)."""
    run = snap.run or ""
    out: list[Metric] = []

    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=("run", *labels))
        out.append(g)
        return g

    def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> CounterMetricFamily:
        c = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=("run", *labels))
        out.append(c)
        return c

    # learners
    step = gauge("learner_step", "inner steps done by the learner's process", ("learner", "region"))
    loss = gauge("learner_loss", "the learner's latest training loss (NaN if it diverged)", ("learner", "region"))
    rate = gauge("learner_tokens_per_second", "the learner's training throughput", ("learner", "region"))
    stale = gauge("learner_staleness", "global versions its newest contribution is behind", ("learner", "region"))
    sent = counter("learner_bytes_sent", "bytes the learner published (outer gradients)", ("learner", "region"))
    recv = counter("learner_bytes_received", "bytes the learner downloaded (global versions)", ("learner", "region"))
    state = gauge("learner_state", "1 for the learner's state as it reports it, 0 for the others",
                  ("learner", "region", "state"))
    seen = gauge("learner_last_report_timestamp_seconds", "wall time of the learner's newest metrics message",
                 ("learner", "region"))
    for name in sorted(snap.learners):
        r = snap.learners[name]
        lv = [run, r.learner, r.region]
        for fam, value in ((step, r.step), (loss, r.loss), (rate, r.tokens_per_s), (stale, r.staleness),
                           (sent, r.bytes_sent), (recv, r.bytes_received)):
            v = _num(value)
            if v is not None:
                fam.add_metric(lv, v)
        if r.state is not None:
            states = LEARNER_STATES if r.state in LEARNER_STATES else (*LEARNER_STATES, r.state)
            for s in states:
                state.add_metric([*lv, s], 1.0 if s == r.state else 0.0)
        if r.ts:
            seen.add_metric(lv, float(r.ts))

    # aggregator
    version = gauge("global_version", "newest global version of each fragment", ("fragment",))
    merges = counter("aggregator_merges", "merges the aggregator made")
    accepted = counter("aggregator_accepted", "outer-gradient contributions accepted")
    rejected = counter("aggregator_rejected", "contributions rejected, by reason", ("reason",))
    a = snap.aggregator
    if a is not None:
        for f, v in a.versions:
            version.add_metric([run, str(f)], float(v))
        if a.merges is not None:
            merges.add_metric([run], float(a.merges))
        if a.accepted is not None:
            accepted.add_metric([run], float(a.accepted))
        for reason, n in a.rejected:
            rejected.add_metric([run, reason], float(n))

    # monitor
    members = gauge("members", "learners in each membership state (the monitor's count)", ("state",))
    if snap.monitor is not None:
        counts = dict(snap.monitor.counts)
        for s in sorted(set(LEARNER_STATES) | set(counts)):
            members.add_metric([run, s], float(counts.get(s, 0)))

    # evaluator
    eval_loss = gauge("eval_loss", "held-out loss of the global model (NaN if it diverged)")
    eval_version = gauge("eval_version", "global version the held-out loss was measured on")
    e = snap.evaluator
    if e is not None:
        if e.eval_loss is not None:
            eval_loss.add_metric([run], float(e.eval_loss))
        if e.version is not None:
            eval_version.add_metric([run], float(e.version))

    # the viewer itself
    malformed = counter("metrics_malformed", "metrics messages dropped as malformed, by reason", ("reason",))
    for reason, n in sorted(snap.malformed.items()):
        malformed.add_metric([run, reason], float(n))
    skipped = counter("metrics_skipped", "well-formed metrics messages not applied, by reason", ("reason",))
    for reason, n in sorted(snap.skipped.items()):
        skipped.add_metric([run, reason], float(n))
    applied = counter("metrics_applied", "metrics messages applied to the snapshot")
    applied.add_metric([run], float(snap.applied))
    last = gauge("metrics_last_timestamp_seconds", "wall time of the newest metrics message applied")
    if snap.last_ts is not None and math.isfinite(snap.last_ts):
        last.add_metric([run], float(snap.last_ts))
    return out


def exporter_families(run: str, connected: bool, last_message_age: float | None) -> list[Metric]:
    """The exporter's own health: whether it is connected to the server now, and how long ago it
    received its newest metrics message (alert on either: the other values are then stale)."""
    up = GaugeMetricFamily(f"{PREFIX}_exporter_connected", "1 while the exporter is connected to the NATS server, "
                           "0 while it reconnects (the other values are then the last ones received)", labels=("run",))
    up.add_metric([run], 1.0 if connected else 0.0)
    age = GaugeMetricFamily(f"{PREFIX}_exporter_last_message_age_seconds", "seconds since the exporter received its "
                            "newest metrics message (since it started, before the first)", labels=("run",))
    if last_message_age is not None and math.isfinite(last_message_age):
        age.add_metric([run], max(0.0, float(last_message_age)))
    return [up, age]


#: ``health() -> (connected, seconds since the newest message)``
Health = Callable[[], tuple[bool, float | None]]


class SnapshotCollector(Collector):
    """A ``prometheus_client`` collector that renders ``get()`` (the newest snapshot) at every scrape,
    and the exporter's own health (:func:`exporter_families`) when ``health`` is given."""

    def __init__(self, get: Callable[[], MetricsSnapshot], health: Health | None = None) -> None:
        self.get, self.health = get, health

    def collect(self) -> Iterator[Metric]:
        snap = self.get()
        yield from families(snap)
        if self.health is not None:
            connected, age = self.health()
            yield from exporter_families(snap.run or "", connected, age)


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``:PORT`` -> (host, port); ValueError naming what it expected. ``:PORT``
    listens on ``DEFAULT_HOST`` (127.0.0.1, this machine only): exposing the run's metrics to the
    network takes an explicit host (``0.0.0.0:9464`` for every interface)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--serve expects HOST:PORT or :PORT (e.g. :9464 on 127.0.0.1, 0.0.0.0:9464 on every "
                         f"interface), got {text!r}")
    host = host.strip("[]") or DEFAULT_HOST
    return host, int(port)


def serve(listen: str, get: Callable[[], MetricsSnapshot], health: Health | None = None):
    """Start the exposition server in a daemon thread; returns (server, thread, (host, port))."""
    from prometheus_client import start_http_server

    host, port = parse_listen(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(get, health))
    server, thread = start_http_server(port, addr=host, registry=registry)
    return server, thread, server.server_address[:2]
