"""How every command's function is called, by ``diloco <command>`` (:mod:`diloco.cli`) and by each
role's own entry point (``python -m learner``, ``python -m learner.evaluator``...): the same exit
codes either way, without the role importing the operations layer.

A function takes the remaining argv and returns an exit code; a :class:`~bus.config.ConfigError`
(a bad ``DILOCO_*`` variable) becomes one line on stderr and exit code 2, a server that cannot be
reached at start (:class:`~bus.conn.ConnectFailed`) one line and exit code 4, Ctrl-C exit code 130.

The exit codes are the ``EXIT_*`` constants below, the same for every command and role (the table is in
docs/monitor.md, "Exit codes").
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from bus.config import ConfigError
from bus.conn import ConnectFailed

#: done
EXIT_OK = 0
#: failed; the one line on stderr says why (also what has no code of its own below)
EXIT_ERROR = 1
#: a bad argument or ``DILOCO_*`` setting, an unknown command: nothing was tried
EXIT_USAGE = 2
#: the run is not this one: its model, plan or streams differ from what the process expects
EXIT_MISMATCH = 3
#: what the command needs did not come: the server could not be reached or refused the login at
#: start (``bus.conn.connect``), or a learner's run (manifest, global version) did not come in time
EXIT_UNAVAILABLE = 4
#: ``diloco export --require-merged``: every fragment still at version 0, nothing written
EXIT_NOT_MERGED = 5
#: stopped by Ctrl-C (SIGINT) before the end
EXIT_INTERRUPTED = 130

#: (code, meaning) rows, for help texts and the docs' table
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "done"),
    (EXIT_ERROR, "failed (the one line on stderr says why)"),
    (EXIT_USAGE, "bad argument or DILOCO_* setting, unknown command"),
    (EXIT_MISMATCH, "the run is not this one (model, plan or streams differ)"),
    (EXIT_UNAVAILABLE, "server unreachable or login refused at start; a learner's run not there in time"),
    (EXIT_NOT_MERGED, "export --require-merged: nothing merged yet"),
    (EXIT_INTERRUPTED, "Ctrl-C"),
)


def run_command(name: str, fn: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """``fn(argv)`` as ``diloco <name>``: its exit code, EXIT_USAGE after one line for a configuration
    error, EXIT_UNAVAILABLE after one line for a server out of reach, EXIT_INTERRUPTED on Ctrl-C."""
    from bus.blas import single_threaded_blas

    single_threaded_blas()
    try:
        return int(fn(argv) or 0)
    except ConfigError as e:
        print(f"diloco {name}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ConnectFailed as e:  # the server not reachable at start: its one line
        print(f"diloco {name}: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
