"""structlog JSON logging with run, role and island ids bound on every line.

Every logger of this code (:func:`get_logger`) filters at the level in force, ``DILOCO_LOG_LEVEL``,
checked at each call, whatever structlog's global configuration says:

* a process of ours (each role's ``main``, the ``diloco`` commands) calls :func:`setup`, which
  owns structlog's configuration: JSON lines on stderr, ``bound`` ids on every line;
* code of ours in someone else's process (an :class:`~learner.island.Island`) calls
  :func:`setup_library` instead, which configures nothing global: our lines render with the
  process's structlog configuration if it has one (the user's format and destination), else as
  our JSON lines on stderr; the user's own loggers, level and context are left as they are.

Both check the ``DILOCO_*`` variables once per process (:func:`bus.config.check_environment`):
one ``unknown_variable`` warning per unknown name, ConfigError when DILOCO_STRICT_ENV is true.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_state = {"level": logging.INFO}


class DilocoLogger(structlog.BoundLoggerBase):
    """A bound logger that drops events below the level in force at the call (not at creation:
    loggers made before :func:`setup` or :func:`setup_library` follow it too)."""

    def _emit(self, level: int, method: str, event: Any, args: tuple, kw: dict) -> Any:
        if level < _state["level"]:
            return None
        if args:
            event = event % args
        return self._proxy_to_logger(method, event, **kw)

    def debug(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit(logging.DEBUG, "debug", event, args, kw)

    def info(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit(logging.INFO, "info", event, args, kw)

    def warning(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit(logging.WARNING, "warning", event, args, kw)

    warn = warning

    def error(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit(logging.ERROR, "error", event, args, kw)

    def critical(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        return self._emit(logging.CRITICAL, "critical", event, args, kw)

    def exception(self, event: Any = None, *args: Any, **kw: Any) -> Any:
        kw.setdefault("exc_info", True)
        return self._emit(logging.ERROR, "error", event, args, kw)


def _processors() -> list:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(),
    ]


def set_level(level: str) -> None:
    """The level of every logger of this code from now on (``debug``, ``info``, ``warning``, ``error``)."""
    _state["level"] = _LEVELS.get(level, logging.INFO)


def setup(level: str = "info", *, check_env: bool = True, **bound: object) -> Any:
    """A process of ours: configure JSON logs to stderr at ``level``; ``bound`` (run=, role=,
    island=...) appears on every line. Then (``check_env``) warn once about each unknown
    ``DILOCO_*`` variable, or raise ConfigError when DILOCO_STRICT_ENV is true."""
    set_level(level)
    structlog.configure(
        processors=_processors(),
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**bound)
    if check_env:
        warn_unknown_variables(None)
    return structlog.get_logger()


def setup_library(level: str, environ: Mapping[str, str] | None = None) -> None:
    """Our code in a user's process (an island): our loggers filter at ``level`` and nothing global
    is configured (see the module docstring); the unknown variables of ``environ`` are warned
    about once (ConfigError under DILOCO_STRICT_ENV)."""
    set_level(level)
    warn_unknown_variables(environ)


def warn_unknown_variables(environ: Mapping[str, str] | None) -> None:
    from bus.config import check_environment

    for line in check_environment(environ):
        get_logger(component="config").warning("unknown_variable", problem=line)


def get_logger(**bound: object) -> Any:
    """A logger of this code with ``bound`` on its lines, filtered at the level in force."""
    if structlog.is_configured():  # ours (setup) or the user's: its processors and destination
        return structlog.wrap_logger(None, wrapper_class=DilocoLogger).bind(**bound)
    return structlog.wrap_logger(structlog.PrintLogger(sys.stderr), processors=_processors(),
                                 wrapper_class=DilocoLogger).bind(**bound)
