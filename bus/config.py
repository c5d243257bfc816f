"""Typed, frozen, validated configuration from ``DILOCO_*`` environment variables.

Every setting of every role is a field of a frozen dataclass (the common ones below, each role's
in ``<role>/config.py``, declared with :func:`register`); the field's metadata names its parser and
help text, and the environment variable is ``DILOCO_<FIELD NAME IN UPPER CASE>``. This module names
no role: the operations layer imports every role's config (``diloco.config_registry``) to list them
all (docs/configuration.md's table, generated from :func:`markdown_table`; ``diloco config``), and
:data:`bus.variables.VARIABLES`, generated from that registry and checked against it by a test,
lets any process tell a typo from another role's variable without importing that role.

Where a value comes from, highest first: the environment, the file ``DILOCO_ENV_FILE`` names, the
model preset ``DILOCO_MODEL_PRESET`` names (:data:`bus.presets.MODEL_PRESETS`), the default.

A bad value fails at start-up with one line that names the variable, the value and what was
expected, e.g. ``DILOCO_INNER_LR='fast': expected a float > 0``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bus.presets import MODEL_PRESETS
from bus.variables import VARIABLES

PREFIX = "DILOCO_"


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one line naming the variable."""


# -- parsers: str -> value, raising ValueError(expected-description) -------------------------------


def _str(nonempty: bool = True, max_len: int = 256, charset: str | None = None) -> Callable[[str], str]:
    def parse(s: str) -> str:
        if nonempty and not s:
            raise ValueError("expected a non-empty string")
        if len(s) > max_len:
            raise ValueError(f"expected at most {max_len} characters")
        if charset is not None and any(c not in charset for c in s):
            raise ValueError("expected only letters, digits, '-' and '_'")
        return s

    parse.expected = "a string"  # type: ignore[attr-defined]
    return parse


_TOKEN_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"


def token() -> Callable[[str], str]:
    """A NATS-subject-safe token: letters, digits, '-' and '_' (no dots, spaces or wildcards)."""
    return _str(True, 64, _TOKEN_CHARS)


def text(nonempty: bool = False) -> Callable[[str], str]:
    return _str(nonempty, 4096)


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    desc = "an integer" + (f" >= {lo}" if lo is not None else "") + (f" <= {hi}" if hi is not None else "")

    def parse(s: str) -> int:
        try:
            v = int(s.strip(), 10)
        except ValueError:
            raise ValueError(f"expected {desc}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ValueError(f"expected {desc}")
        return v

    return parse


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Callable[[str], float]:
    op = ">" if lo_open else ">="
    desc = "a float" + (f" {op} {lo:g}" if lo is not None else "") + (f" <= {hi:g}" if hi is not None else "")

    def parse(s: str) -> float:
        try:
            v = float(s.strip())
        except ValueError:
            raise ValueError(f"expected {desc}") from None
        if not math.isfinite(v):
            raise ValueError(f"expected {desc}")
        if lo is not None and (v < lo or (lo_open and v == lo)):
            raise ValueError(f"expected {desc}")
        if hi is not None and v > hi:
            raise ValueError(f"expected {desc}")
        return v

    return parse


def boolean() -> Callable[[str], bool]:
    def parse(s: str) -> bool:
        v = s.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected one of 1/0, true/false, yes/no, on/off")

    return parse


def choice(*options: str) -> Callable[[str], str]:
    def parse(s: str) -> str:
        if s not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return s

    return parse


def nats_urls() -> Callable[[str], str]:
    def parse(s: str) -> str:
        parts = [p.strip() for p in s.split(",") if p.strip()]
        if not parts or any("://" not in p for p in parts):
            raise ValueError("expected comma-separated URLs like nats://host:4222 or tls://host:4222")
        for p in parts:
            scheme = p.split("://", 1)[0]
            if scheme not in ("nats", "tls", "ws", "wss"):
                raise ValueError("expected URL schemes nats://, tls://, ws:// or wss://")
        return ",".join(parts)

    return parse


def var(default: Any, parse: Callable[[str], Any], help: str, secret: bool = False,
        show: Callable[[Any], Any] | None = None) -> Any:
    """A config field: its default (already typed), its parser, one line of help; ``show``: how
    ``diloco config`` prints a value (e.g. 0 as ``all``), if not as it is."""
    return field(default=default, metadata={"parse": parse, "help": help, "secret": secret, "show": show})


# -- the settings ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommonConfig:
    """Settings every role reads."""

    env_file: str = var("", text(), "a file of DILOCO_*=value lines (as `diloco auth init` writes) for the variables "
                        "the environment does not set (compose reads each service's credentials this way)")
    nats_url: str = var("nats://127.0.0.1:4222", nats_urls(), "NATS server URL(s), comma-separated")
    connect_timeout: float = var(10.0, number(0.1, 86400),
                                 "seconds a process (or an island) tries to reach the server at start before it "
                                 "exits with one line saying what to check; once connected, long-running roles "
                                 "reconnect through outages forever")
    run: str = var("default", token(), "run id: every subject, stream and bucket of a run carries it")
    model_preset: str = var("default", choice(*MODEL_PRESETS),
                            "the built-in model's shape, batch and fragment count for every role by one name: "
                            "tiny, small or default (the DILOCO_* values of bus/presets.py; a DILOCO_* you set wins)")
    region: str = var("local", token(), "region / island name of this process")
    nats_user: str = var("", text(), "NATS user name (empty: no user/password auth)")
    nats_password: str = var("", text(), "NATS password", secret=True)
    nats_creds: str = var("", text(), "path of a NATS .creds file (JWT + nkey)")
    nats_nkey_seed: str = var("", text(), "path of an nkey seed file")
    tls_ca: str = var("", text(), "CA certificate (PEM) to verify the server's TLS certificate")
    tls_cert: str = var("", text(), "client certificate (PEM) for mutual TLS")
    tls_key: str = var("", text(), "client key (PEM) for mutual TLS", secret=True)
    log_level: str = var("info", choice("debug", "info", "warning", "error"),
                         "lowest level logged (every process, islands and `diloco export` too)")
    strict_env: bool = var(False, boolean(), "an unknown DILOCO_* variable (a typo: DILOCO_QUROUM) is an error "
                           "at start, not a warning")
    metrics_interval: float = var(2.0, number(0.05, 3600), "seconds between metrics messages")
    max_chunk_bytes: int = var(
        1024 * 1024, integer(4096, 64 * 1024 * 1024), "largest message the transport sends (<= server max_payload)"
    )
    inflight_chunks: int = var(16, integer(1, 1024), "chunks published without waiting for their acks")
    stream_max_age: float = var(3600.0, number(1, 365 * 86400), "seconds a gradient chunk is kept in its stream")
    stream_max_bytes: int = var(
        0, integer(0), "bytes each stream of a run may hold; 0: sized from the run's parameter bytes "
        "(an explicit value too small for the run is refused at start)"
    )
    global_history: int = var(2, integer(2, 64), "global versions kept per fragment, rounded up to even (>= 2 so readers never race)")
    partial_timeout: float = var(60.0, number(0.1, 86400), "seconds before an incomplete fragment is dropped")


ROLE_CONFIGS: dict[str, type] = {"common": CommonConfig}


def register(role: str) -> Callable[[type], type]:
    """Class decorator: declare ``cls`` as the config of ``role`` (its fields join the variable list)."""

    def deco(cls: type) -> type:
        ROLE_CONFIGS[role] = cls
        return cls

    return deco


#: Variables read outside the config dataclasses (name -> who reads it).
OTHER_VARIABLES = {
    "DILOCO_NATS_SERVER_BIN": "bus.server: the nats-server binary to run",
    "DILOCO_UP_OUT": "diloco up: set on its children, the output folder of the launch",
}


def config_variables(configs: Mapping[str, type]) -> set[str]:
    """The ``DILOCO_*`` name of every field of ``configs`` (role -> config class)."""
    return {env_name(f.name) for cls in configs.values() for f in _fields(cls)}


def known_variables() -> set[str]:
    """Every ``DILOCO_*`` name some process reads: :data:`bus.variables.VARIABLES` (every role's,
    without importing the roles: a learner's env file may well hold DILOCO_QUORUM), the configs
    registered in this process, and :data:`OTHER_VARIABLES`."""
    return set(VARIABLES) | config_variables(ROLE_CONFIGS) | set(OTHER_VARIABLES)


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """(name, the closest known name or None) of every ``DILOCO_*`` variable of ``environ`` (and
    of DILOCO_ENV_FILE's file) that no process reads: a typo, or a setting of another version."""
    env = with_env_file(os.environ if environ is None else environ)
    known = known_variables()
    suffixes = {k[len(PREFIX):]: k for k in known}
    out = []
    for name in sorted(k for k in env if k.startswith(PREFIX) and k not in known):
        close = difflib.get_close_matches(name[len(PREFIX):], list(suffixes), n=1, cutoff=0.75)
        out.append((name, suffixes[close[0]] if close else None))
    return out


def describe_unknown(name: str, closest: str | None) -> str:
    return f"{name} is not a variable of any role" + (f" (did you mean {closest}?)" if closest else "")


_reported: set[str] = set()


def check_environment(environ: Mapping[str, str] | None = None) -> list[str]:
    """The one-line warnings for the unknown ``DILOCO_*`` variables of ``environ`` (the process's
    by default) not reported yet in this process, so that a process warns once per name however
    often it sets up. :class:`ConfigError` naming them all instead when DILOCO_STRICT_ENV is true."""
    env = os.environ if environ is None else environ
    unknown = unknown_variables(env)
    if not unknown:
        return []
    if from_env(CommonConfig, env).strict_env:
        raise ConfigError("; ".join(describe_unknown(n, c) for n, c in unknown)
                          + f" ({env_name('strict_env')} is true: remove or correct it)")
    fresh = [(n, c) for n, c in unknown if n not in _reported]
    _reported.update(n for n, _ in fresh)
    return [describe_unknown(n, c) + f": ignored ({env_name('strict_env')}=true makes it an error)"
            for n, c in fresh]


def env_name(field_name: str) -> str:
    return PREFIX + field_name.upper()


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "parse" in f.metadata]


def parse_env_file(text: str) -> dict[str, str]:
    """The variables of an env file (``KEY=value`` lines, values shell-quoted as ``diloco auth init``
    writes them; comments and blank lines skipped)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        k, v = line.split("=", 1)
        vals = shlex.split(v) if v else [""]
        out[k.strip()] = vals[0] if vals else ""
    return out


def with_env_file(environ: Mapping[str, str]) -> Mapping[str, str]:
    """``environ`` over the ``DILOCO_*`` variables of the file ``DILOCO_ENV_FILE`` names (if it does):
    the environment wins, as with compose's ``env_file``. ConfigError (one line) if it cannot be read."""
    name = env_name("env_file")
    path = environ.get(name)
    if not path:
        return environ
    shown = path if len(path) <= 200 else path[:200] + "..."
    if len(path) > 4096:
        raise ConfigError(f"{name}={shown!r}: expected a path of at most 4096 characters")
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"{name}={shown!r}: cannot read it ({e.strerror}): expected a readable file of "
                          "DILOCO_*=value lines") from None
    try:
        found = parse_env_file(text)
    except ValueError as e:
        raise ConfigError(f"{name}={shown!r}: expected KEY=value lines ({e})") from None
    return {**{k: v for k, v in found.items() if k.startswith(PREFIX)}, **environ}


def preset_values(environ: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """(name, its ``DILOCO_*`` values) of the model preset ``DILOCO_MODEL_PRESET`` of ``environ``
    (``default`` and {} if unset). ConfigError (one line naming the valid names) for an unknown one."""
    f = CommonConfig.__dataclass_fields__["model_preset"]
    name = env_name(f.name)
    raw = environ.get(name)
    if raw is None:
        return str(f.default), {}
    try:
        preset = f.metadata["parse"](raw)
    except ValueError as e:
        raise ConfigError(f"{name}={raw!r}: {e}") from None
    return preset, dict(MODEL_PRESETS[preset])


def layered(environ: Mapping[str, str]) -> Mapping[str, str]:
    """Every value a process sees: ``environ`` over ``DILOCO_ENV_FILE``'s file over the model
    preset's values (:func:`preset_values`, the preset named in either)."""
    filed = with_env_file(environ)
    _, values = preset_values(filed)
    return {**values, **filed} if values else filed


def from_env(cls: type, environ: Mapping[str, str] | None = None, **overrides: Any) -> Any:
    """Build ``cls`` from ``DILOCO_*`` variables (and those of ``DILOCO_ENV_FILE``'s file and of the
    model preset ``DILOCO_MODEL_PRESET``, which the environment overrides: :func:`layered`); unset
    ones take the default. Raises :class:`ConfigError`."""
    env = layered(os.environ if environ is None else environ)
    values: dict[str, Any] = {}
    for f in _fields(cls):
        name = env_name(f.name)
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        raw = env.get(name)
        if raw is None:
            continue
        try:
            values[f.name] = f.metadata["parse"](raw)
        except ValueError as e:
            shown = "***" if f.metadata.get("secret") else raw
            raise ConfigError(f"{name}={shown!r}: {e}") from None
    try:
        return cls(**values)
    except ValueError as e:  # cross-field checks in __post_init__ name their variables themselves
        raise ConfigError(str(e)) from None


def sources(cls: type, environ: Mapping[str, str] | None = None) -> list[tuple[str, Any, str]]:
    """(variable, effective value, 'env' | 'file' | 'preset NAME' | 'default') for ``diloco config ROLE``."""
    env = os.environ if environ is None else environ
    cfg = from_env(cls, env)
    filed = with_env_file(env)
    preset, preset_vars = preset_values(filed)
    out = []
    for f in _fields(cls):
        name = env_name(f.name)
        value = getattr(cfg, f.name)
        if f.metadata.get("show") is not None:
            value = f.metadata["show"](value)
        if f.metadata.get("secret") and value:
            value = "***"
        src = ("env" if name in env else "file" if name in filed else f"preset {preset}" if name in preset_vars
               else "default")
        out.append((name, value, src))
    return out


def all_variables() -> list[tuple[str, str, Any, str]]:
    """(variable, role, default, help) for every variable, each listed once under its first role."""
    seen: set[str] = set()
    rows = []
    order = ("common", "model", "learner", "eval", "aggregator", "monitor")
    roles = sorted(ROLE_CONFIGS.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0]))
    for role, cls in roles:
        for f in _fields(cls):
            name = env_name(f.name)
            if name in seen:
                continue
            seen.add(name)
            show = f.metadata.get("show")
            rows.append((name, role, f.default if show is None else show(f.default), f.metadata["help"]))
    return rows


def markdown_table() -> str:
    lines = ["| variable | role | default | meaning |", "| --- | --- | --- | --- |"]
    for name, role, default, help_ in all_variables():
        d = "(empty)" if default == "" else f"`{default}`"
        lines.append(f"| `{name}` | {role} | {d} | {help_} |")
    return "\n".join(lines)
