"""`diloco aggregator`'s companions: the membership monitor embedded in the aggregator's process.

A run of an aggregator and islands (the README's island section) used to need a third process,
the monitor; without it every contribution was held, then rejected as ``unknown_learner``, and the
islands said nothing. So ``diloco aggregator`` runs a :class:`monitor.service.MonitorService` in its
own event loop by default (``DILOCO_EMBEDDED_MONITOR``, on). It is an ordinary monitor: it competes
for the run's leader lease, so next to ``diloco monitor`` processes one of them leads and the others
stand by (a crash of the aggregator's process then hands membership to a standby within the lease
TTL). ``python -m aggregator`` is the aggregator alone. It lives here, in the operations layer,
because no role imports another (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from bus.config import CommonConfig, from_env


def monitor_companions(agg_cfg) -> list[Callable[..., Awaitable[None]]]:
    """The companions of ``diloco aggregator`` for ``agg_cfg`` (AggregatorConfig): the embedded
    monitor unless DILOCO_EMBEDDED_MONITOR=false. The monitor's configuration is read now, so a bad
    ``DILOCO_*`` monitor variable fails the start in one line (ConfigError), not later."""
    if not agg_cfg.embedded_monitor:
        return []
    from monitor.config import MonitorConfig

    cfg = from_env(MonitorConfig)
    if not cfg.monitor_id:
        cfg = dataclasses.replace(cfg, monitor_id=f"{agg_cfg.aggregator_id}-monitor")

    async def embedded_monitor(common: CommonConfig, _agg_cfg, stop: asyncio.Event) -> None:
        from monitor.service import MonitorService

        await MonitorService(common, cfg).run(stop)

    return [embedded_monitor]
