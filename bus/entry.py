"""How every command's function is called, by ``diloco <command>`` (:mod:`diloco.cli`) and by each
role's own entry point (``python -m learner``, ``python -m learner.evaluator``...): the same exit
codes either way, without the role importing the operations layer.

A function takes the remaining argv and returns an exit code; a :class:`~bus.config.ConfigError`
(a bad ``DILOCO_*`` variable) becomes one line on stderr and exit code 2, Ctrl-C exit code 130.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from bus.config import ConfigError
from bus.conn import ConnectFailed


def run_command(name: str, fn: Callable[[list[str]], int | None], argv: list[str]) -> int:
    """``fn(argv)`` as ``diloco <name>``: its exit code, 2 after one line for a configuration error,
    130 on Ctrl-C."""
    from bus.blas import single_threaded_blas

    single_threaded_blas()
    try:
        return int(fn(argv) or 0)
    except ConfigError as e:
        print(f"diloco {name}: {e}", file=sys.stderr)
        return 2
    except ConnectFailed as e:  # the server not reachable at start: its one line
        print(f"diloco {name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
