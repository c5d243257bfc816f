"""Every role's configuration in one registry, assembled where the roles meet (the operations
layer: ``bus.config`` names no role).

Importing this module imports each role's config module (declarations only: dataclasses of settings,
no role code), whose ``@register`` adds its classes to :data:`bus.config.ROLE_CONFIGS`. ``diloco
config``, ``diloco up`` and docs/configuration.md's table read them all from here.

A role process does not import the other roles, yet must know their variables (a learner's env file
may well hold DILOCO_QUORUM) to warn about typos only: :data:`bus.variables.VARIABLES` lists every
name. It is generated from this registry (``python -m diloco.config_registry --write``) and a test
checks that the two agree.
"""

from __future__ import annotations

import pathlib
import sys

import aggregator.config  # noqa: F401  (registers "aggregator")
import learner.config  # noqa: F401  (registers "model", "learner", "eval")
import monitor.config  # noqa: F401  (registers "monitor")
from bus.config import ROLE_CONFIGS, config_variables

#: The file :func:`variables_module` is written to.
VARIABLES_FILE = pathlib.Path(__file__).resolve().parent.parent / "bus" / "variables.py"


def load_role_configs() -> dict[str, type]:
    """Every role's config class by role (``common``, ``model``, ``learner``, ``eval``,
    ``aggregator``, ``monitor``)."""
    return ROLE_CONFIGS


def variables_module(names: set[str]) -> str:
    """The text of ``bus/variables.py`` listing ``names`` (sorted, one a line)."""
    lines = [
        '"""Every ``DILOCO_*`` variable the roles\' configs declare, so that any process tells another',
        "role's variable from a typo without importing that role. Generated from the registry of",
        "``diloco.config_registry`` (``python -m diloco.config_registry --write``); a test checks that",
        'the two agree: do not edit by hand."""',
        "",
        "VARIABLES: frozenset[str] = frozenset({",
        *(f'    "{n}",' for n in sorted(names)),
        "})",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``--write``: regenerate ``bus/variables.py``; ``--check``: exit 1 if it is stale."""
    args = sys.argv[1:] if argv is None else argv
    text = variables_module(config_variables(load_role_configs()))
    if args == ["--write"]:
        VARIABLES_FILE.write_text(text)
        return 0
    if args == ["--check"]:
        stale = VARIABLES_FILE.read_text() != text
        if stale:
            print(f"{VARIABLES_FILE} is stale: regenerate it with `python -m diloco.config_registry --write`",
                  file=sys.stderr)
        return int(stale)
    print("usage: python -m diloco.config_registry --write | --check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
