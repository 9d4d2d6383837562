"""Typed, frozen configuration objects loaded from a TOML file, the environment and flags.

Promise: one frozen dataclass per component, filled in this order (later wins):
defaults, the ``[section]`` table of the TOML file, ``HEADWATER_<SECTION>_<KEY>``
environment variables, then command-line flags. Every bad value is a ``ConfigError``
naming the file, line and key (or the variable or flag) and what is expected.
Secrets are ``Secret`` values: their ``repr`` and ``str`` never show the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

import psycopg2
import psycopg2.extensions

from tables.errors import ConfigError

DEFAULT_FILE = "headwater.toml"
CONFIG_ENV = "HEADWATER_CONFIG"
# Sections other components own; a table not named here is most likely a typo.
KNOWN_SECTIONS = ("stack", "registry", "capture", "streams", "views", "analytics")

T = TypeVar("T")


class Secret:
    """A string that never prints itself: passwords, SASL secrets, keys."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The secret itself, for the one call that needs it."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    def __str__(self) -> str:
        return "***"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


class Settings(dict[str, str]):
    """Pass-through settings (librdkafka, topic configs); values of secret-looking keys print as ***."""

    SECRET_WORDS = ("password", "secret", "token", "key.pem", "sasl.jaas")

    def __repr__(self) -> str:
        shown = {k: ("***" if any(w in k.lower() for w in self.SECRET_WORDS) else v) for k, v in self.items()}
        return f"Settings({shown!r})"

    __str__ = __repr__

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    @classmethod
    def parse(cls, text: str) -> Settings:
        """``key=value`` pairs separated by commas or semicolons (environment and flags)."""
        pairs = [p.strip() for p in re.split(r"[;,]", text) if p.strip()]
        out = cls()
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"expected key=value pairs, got {pair!r}")
            out[key.strip()] = value.strip()
        return out


def setting(default: Any, help: str) -> Any:
    """A dataclass field with the help text shown by ``--help`` and the README."""
    return dataclasses.field(default=default, metadata={"help": help})


def _toml_line(text: str, section: str, key: str | None) -> int | None:
    """The 1-based line of ``key`` inside ``[section]`` (or of the header when key is None)."""
    current = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        header = re.match(r"^\[\s*([^\]\s]+)\s*\]", line)
        if header:
            current = header.group(1)
            if key is None and current == section:
                return number
            continue
        if current == section and key and re.match(rf"^{re.escape(key)}\s*=", line):
            return number
    return None


def read_file(path: Path) -> tuple[dict[str, Any], str]:
    """Parse a TOML file; a syntax error names the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the config file: {exc.strerror}", path=str(path)) from exc
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"line (\d+)", str(exc))
        raise ConfigError(
            f"not valid TOML: {exc}",
            path=str(path),
            line=int(found.group(1)) if found else None,
            hint="fix the syntax on that line (strings need quotes, tables need [brackets])",
        ) from exc


def config_path(explicit: str | None, environ: Mapping[str, str]) -> Path | None:
    """The file to read: the flag, else $HEADWATER_CONFIG, else ./headwater.toml if present."""
    chosen = explicit or environ.get(CONFIG_ENV)
    if chosen:
        path = Path(chosen)
        if not path.is_file():
            raise ConfigError(
                "the config file does not exist",
                path=str(path),
                hint="pass an existing file with --config or unset HEADWATER_CONFIG",
            )
        return path
    default = Path(DEFAULT_FILE)
    return default if default.is_file() else None


def _coerce(kind: Any, value: Any, *, from_text: bool) -> Any:
    """Turn ``value`` into ``kind`` or raise ValueError saying what was expected."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return str(value).lower() in ("1", "true", "yes", "on")
        raise ValueError("expected true or false")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text and re.fullmatch(r"-?\d+", str(value).strip()):
            return int(value)
        raise ValueError("expected an integer")
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if from_text:
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError("expected a number")
    if kind is Settings:
        if isinstance(value, dict):
            return Settings({str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()})
        if isinstance(value, str):
            return Settings.parse(value)
        raise ValueError("expected a table of settings (or key=value,key=value)")
    if not isinstance(value, str):
        raise ValueError("expected a string")
    if kind is Path:
        return Path(value)
    if kind is Secret:
        return Secret(value)
    return value


def _fields(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def load(
    cls: type[T],
    section: str,
    *,
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` from defaults, ``[section]`` of ``path``, the environment and ``flags``."""
    environ = os.environ if environ is None else environ
    kinds = _fields(cls)
    values: dict[str, Any] = {}
    text = ""
    if path is not None:
        from_file, text = _from_file(kinds, section, path)
        values.update(from_file)
    prefix = f"HEADWATER_{section.upper()}_"
    for name, kind in kinds.items():
        var = prefix + name.upper()
        if var in environ:
            try:
                values[name] = _coerce(kind, environ[var], from_text=True)
            except ValueError as exc:
                raise ConfigError(f"{exc}, got {environ[var]!r}", key=var) from exc
    for name, value in (flags or {}).items():
        if name in kinds and value is not None:
            flag = "--" + name.replace("_", "-")
            try:
                values[name] = _coerce(kinds[name], value, from_text=True)
            except ValueError as exc:
                raise ConfigError(f"{exc}, got {value!r}", key=flag) from exc
    try:
        return cls(**values)
    except InvalidSetting as exc:
        line = _toml_line(text, section, exc.key) if text else None
        raise ConfigError(str(exc), path=str(path) if line else None, line=line, key=exc.key) from exc


def _from_file(kinds: Mapping[str, Any], section: str, path: Path) -> tuple[dict[str, Any], str]:
    data, text = read_file(path)
    for name, table in data.items():
        if name not in KNOWN_SECTIONS or not isinstance(table, dict):
            raise ConfigError(
                f"unknown section [{name}]" if name not in KNOWN_SECTIONS else f"'{name}' must be a table",
                path=str(path),
                line=_toml_line(text, name, None),
                hint=f"known sections: {', '.join(KNOWN_SECTIONS)}",
            )
    values: dict[str, Any] = {}
    for key, value in data.get(section, {}).items():
        line = _toml_line(text, section, key)
        if key not in kinds:
            raise ConfigError(
                f"unknown setting in [{section}]",
                path=str(path),
                line=line,
                key=key,
                hint=f"known settings: {', '.join(sorted(kinds))}",
            )
        try:
            values[key] = _coerce(kinds[key], value, from_text=False)
        except ValueError as exc:
            raise ConfigError(f"{exc}, got {value!r}", path=str(path), line=line, key=key) from exc
    return values, text


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """Add one ``--kebab-name`` flag per field of ``cls`` (all default to 'not given')."""
    kinds = _fields(cls)
    for field in dataclasses.fields(cls):
        if kinds[field.name] is bool:
            parser.add_argument(
                "--" + field.name.replace("_", "-"),
                dest=field.name,
                action="store_const",
                const="true",
                default=None,
                help=field.metadata.get("help", ""),
            )
            continue
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            default=None,
            metavar=field.name.upper(),
            help=f"{field.metadata.get('help', '')} (default: {field.default})",
        )


def flag_values(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flags of ``cls`` the user actually gave."""
    return {
        f.name: getattr(namespace, f.name)
        for f in dataclasses.fields(cls)
        if getattr(namespace, f.name, None) is not None
    }


class InvalidSetting(ValueError):
    """Raised by a config object's ``__post_init__`` for one bad setting."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def check_port(name: str, port: int) -> None:
    """Raise InvalidSetting unless ``port`` is a usable TCP port."""
    if not 1 <= port <= 65535:
        raise InvalidSetting(name, f"must be a TCP port between 1 and 65535, got {port}")


# libpq options whose values libpq refuses only when connecting; checked up front instead.
DSN_INTEGERS = ("port", "connect_timeout", "keepalives", "keepalives_idle", "keepalives_interval",
                "keepalives_count", "tcp_user_timeout")  # fmt: skip
DSN_CHOICES = {"sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")}
DSN_EXAMPLE = "host=HOST port=5432 dbname=DB user=USER or postgresql://USER@HOST:5432/DB"


def _masked(message: str, dsn: str) -> str:
    """libpq's message without any quoted piece of the DSN that could be (part of) a password."""

    def keep(found: re.Match[str]) -> str:
        piece = found.group(1)
        punctuation = len(piece) == 1 and not piece.isalnum()
        keyword = re.fullmatch(r"[a-z_]+", piece) is not None and re.search(rf"\b{piece}\s*=", dsn) is not None
        return found.group(0) if punctuation or keyword else '"***"'

    return re.sub(r'"([^"]*)"', keep, message.strip().removeprefix("invalid dsn: "))


def _dsn_value_problem(key: str, value: str) -> str | None:
    if key == "port":
        for port in value.split(","):
            if port and not (port.isdigit() and 1 <= int(port) <= 65535):
                return f"port must be a number between 1 and 65535, got {port!r}"
    elif key in DSN_INTEGERS and value and not re.fullmatch(r"-?\d+", value):
        return f"{key} must be an integer, got {value!r}"
    elif key in DSN_CHOICES and value not in DSN_CHOICES[key]:
        return f"{key} must be one of {', '.join(DSN_CHOICES[key])}, got {value!r}"
    return None


def dsn_problem(dsn: str) -> str | None:
    """What is wrong with a libpq connection string or URL (None if nothing); never echoes the password."""
    try:
        options = psycopg2.extensions.parse_dsn(dsn)
    except psycopg2.ProgrammingError as exc:
        return _masked(str(exc), dsn)
    for key, value in options.items():
        problem = _dsn_value_problem(key, value)
        if problem:
            return problem
    return None


def check_dsn(name: str, dsn: str) -> None:
    """Raise InvalidSetting unless ``dsn`` is empty or a well-formed libpq connection string or URL."""
    problem = dsn_problem(dsn) if dsn else None
    if problem:
        raise InvalidSetting(name, f"not a valid PostgreSQL connection string: {problem} (expected {DSN_EXAMPLE})")


@dataclasses.dataclass(frozen=True)
class StackConfig:
    """Where and how the local stack runs ([stack] in headwater.toml, HEADWATER_STACK_*)."""

    data_dir: Path = setting(Path(".headwater"), "directory for the cluster, logs and pid files")
    host: str = setting("127.0.0.1", "address every service listens on")
    postgres_port: int = setting(54329, "PostgreSQL port")
    kafka_port: int = setting(19092, "Kafka (Tansu) port")
    registry_port: int = setting(18081, "schema registry HTTP port")
    redis_port: int = setting(16379, "Redis port")
    postgres_user: str = setting("headwater", "PostgreSQL superuser of the local cluster")
    postgres_password: Secret = setting(Secret("headwater"), "its password (never printed)")
    database: str = setting("shop", "database holding the sample shop")
    start_timeout: float = setting(60.0, "seconds each service may take to become healthy")

    def __post_init__(self) -> None:
        ports = {
            "postgres_port": self.postgres_port,
            "kafka_port": self.kafka_port,
            "registry_port": self.registry_port,
            "redis_port": self.redis_port,
        }
        for name, port in ports.items():
            check_port(name, port)
        if len(set(ports.values())) < len(ports):
            raise InvalidSetting("postgres_port", f"the four service ports must differ, got {ports}")
        if not self.start_timeout > 0:
            raise InvalidSetting("start_timeout", f"must be seconds greater than 0, got {self.start_timeout}")

    def dsn(self, database: str | None = None) -> str:
        """libpq connection string, password included (quoted as libpq needs): pass it to a driver, never print it."""
        return psycopg2.extensions.make_dsn(
            host=self.host,
            port=self.postgres_port,
            user=self.postgres_user,
            password=self.postgres_password.reveal(),
            dbname=database or self.database,
        )

    def display_dsn(self, database: str | None = None) -> str:
        return f"postgresql://{self.postgres_user}:***@{self.host}:{self.postgres_port}/{database or self.database}"

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.kafka_port}"

    @property
    def registry_url(self) -> str:
        return f"http://{self.host}:{self.registry_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.host}:{self.redis_port}/0"
