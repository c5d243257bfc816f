"""``diloco trust``: what the aggregators hold against each learner, and an operator's clear.

    diloco trust [--dir OUT | --url URL --run RUN]          each learner's trust, reason and evidence
    diloco trust clear LEARNER [--dir OUT | ...]            forget what the aggregators hold against it

A clear needs a user that may write the run's ``run`` bucket's ``trust_clear.*`` keys: the admin user
(``diloco auth init``'s ``admin.env``; ``--dir`` of a ``diloco up`` with auth uses its ``auth/admin.env``).
"""

from __future__ import annotations

import argparse
import os

from bus.config import CommonConfig, parse_env_file
from monitor.cli import _add_common_args, _run_cli, open_connection


def _admin_env(a: argparse.Namespace) -> None:
    """``--dir`` of a ``diloco up`` with auth: its admin user's credentials (a clear writes the run bucket)."""
    if getattr(a, "dir", None):
        path = os.path.join(a.dir, "auth", "admin.env")
        if os.path.exists(path):
            with open(path) as f:
                env = parse_env_file(f.read())
            a.env_over = {k: env[k] for k in ("DILOCO_NATS_USER", "DILOCO_NATS_PASSWORD") if k in env}


async def _clear(cfg: CommonConfig, a: argparse.Namespace) -> int:
    from bus.trust_clears import request_clear
    from monitor.cli import CliError

    nc = await open_connection(cfg, name="cli-trust")
    try:
        try:
            n = await request_clear(nc.jetstream(timeout=5), cfg.run, a.learner, by=cfg.nats_user or "")
        except Exception as e:  # noqa: BLE001 - no bucket, no permission: one line
            raise CliError(f"could not store the clear of {a.learner} in run {cfg.run!r}: {e!r} (is the run created, "
                           "and is this the admin user?)") from None
    finally:
        await nc.close()
    print(f"diloco trust clear: {a.learner}'s trust records cleared (clear {n}): each aggregator forgets them at "
          "each fragment's next merge, and the learner is measured afresh")
    return 0


async def _show(cfg: CommonConfig, a: argparse.Namespace) -> int:
    from bus.codec import dumps_json
    from monitor.status import gather_trust, suspicion, trust_cell

    nc = await open_connection(cfg, name="cli-trust")
    try:
        trust = await gather_trust(nc, cfg.run, a.wait) or {}
    finally:
        await nc.close()
    if a.json:
        print(dumps_json(trust).decode())
        return 0
    if not trust:
        print(f"run {cfg.run!r}: no aggregator metrics with trust records (trust off, or no merge of four "
              "learners or more yet)")
        return 0
    for x in sorted(trust):
        rec = trust[x]
        print(f"{x:<20} {trust_cell(rec):<28} {suspicion(x, rec) if rec.get('reason') else ''}")
    return 0


def cmd_trust(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="diloco trust", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what")
    show = sub.add_parser("show", help="each learner's trust, reason and evidence (the default)")
    clr = sub.add_parser("clear", help="forget what the aggregators hold against a learner")
    clr.add_argument("learner")
    for q in (p, show, clr):
        _add_common_args(q)
    for q in (p, show):
        q.add_argument("--wait", type=float, default=2.5, help="seconds to wait for the aggregators' metrics")
    a = p.parse_args(argv)
    if a.what == "clear":
        _admin_env(a)
        return _run_cli("diloco trust clear", _clear, a)
    return _run_cli("diloco trust", _show, a)
