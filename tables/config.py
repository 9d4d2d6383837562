"""Typed, frozen configuration objects loaded from a TOML file, the environment and flags.

Promise: one frozen dataclass per component, filled in this order (later wins): defaults,
the ``[section]`` table of the TOML file, ``HEADWATER_<SECTION>_<KEY>`` environment
variables, then command-line flags. The settings every component shares (``PipelineConfig``:
broker, Kafka client settings, registry, Redis, topic prefix) are written once in
``[pipeline]`` (``HEADWATER_PIPELINE_<KEY>``); ``load_component`` puts them under each
component's own: default < local stack < [pipeline] < [section] < HEADWATER_PIPELINE_* <
HEADWATER_<SECTION>_* < flag. Addresses nothing sets are the local stack's (``local_defaults``,
the one place). Pass-through ``Settings`` merge key by key. ``load_traced`` and
``load_component`` say where each value came from (``Source``). Every bad value is a
``ConfigError`` naming the file, line and key (or the variable or flag) and what is expected.
Secrets are ``Secret`` values: their ``repr`` and ``str`` never show the value; ``display``
shows any value with secrets, secret-looking settings and URL passwords masked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import tomllib
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar, cast, get_type_hints
from urllib.parse import urlsplit

import psycopg2
import psycopg2.extensions

from tables.errors import ConfigError
from tables.topics import DEFAULT_PREFIX

DEFAULT_FILE = "headwater.toml"
CONFIG_ENV = "HEADWATER_CONFIG"
# Sections other components own; a table not named here is most likely a typo.
KNOWN_SECTIONS = ("stack", "pipeline", "registry", "capture", "streams", "views", "analytics")

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

    def masked(self) -> dict[str, str]:
        """The settings with the values of secret-looking keys as ``***``."""
        return {k: ("***" if any(w in k.lower() for w in self.SECRET_WORDS) else v) for k, v in self.items()}

    def __repr__(self) -> str:
        return f"Settings({self.masked()!r})"

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
            if current == (section if key is None else f"{section}.{key}"):
                return number  # the section's header, or a sub-table [section.key]
            continue
        if current == section and key and re.match(rf"^{re.escape(key)}\s*[=.]", line):
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
            return Settings(_flat(value))
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


def _flat(table: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """A TOML table as pass-through settings: unquoted dotted keys (``sasl.mechanism = ...``) rejoined."""
    out: dict[str, str] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return out


def _fields(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one value came from, as ``headwater config show`` prints it."""

    kind: str  # default, file, env, flag, stack (the local stack's address) or auto (a rule chose it)
    name: str = ""  # the file, the variable, the flag, the [stack] settings or the rule
    line: int | None = None

    def __str__(self) -> str:
        if self.kind == "file":
            return f"{self.name}:{self.line}" if self.line else self.name
        if self.kind == "stack":
            return f"local stack ([stack] {self.name})"
        if self.kind == "auto":
            return f"auto: {self.name}"
        return self.name or self.kind


DEFAULT = Source("default")
Sources = Mapping[str, tuple[Source, ...]]
Layer = tuple[str, Any, Source]  # a field, its value, where it came from


@dataclasses.dataclass(frozen=True)
class Loaded(Generic[T]):
    """A config object, the sources of its values (last wins) and the local stack it was defaulted from."""

    config: T
    sources: Sources
    local: StackConfig | None = None

    def source(self, name: str) -> str:
        """Where ``name`` came from: ``default``, ``file:line``, a variable, a flag, the local stack."""
        return ", ".join(str(s) for s in self.sources.get(name, (DEFAULT,)))

    def replace(self, name: str, value: Any, why: Source) -> Loaded[T]:
        """The same with ``name`` set to ``value`` by a rule (``why`` is added to its sources)."""
        config = dataclasses.replace(cast(Any, self.config), **{name: value})
        sources = {**self.sources, name: (*self.sources.get(name, ()), why)}
        return dataclasses.replace(self, config=config, sources=sources)


def load(
    cls: type[T],
    section: str,
    *,
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` from defaults, ``[section]`` of ``path``, the environment and ``flags``."""
    return load_traced(cls, section, path=path, environ=environ, flags=flags).config


def load_traced(
    cls: type[T],
    section: str,
    *,
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Loaded[T]:
    """``load``, with where each value came from."""
    environ = os.environ if environ is None else environ
    kinds = _fields(cls)
    data, text = _sections(path)
    layers = [
        *_file_layer(kinds, section, data, text, path),
        *_env_layer(kinds, section, environ),
        *_flag_layer(kinds, flags),
    ]
    return _build(cls, *_fold(layers))


def load_component(
    cls: type[T],
    section: str,
    *,
    path: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    local: StackConfig | None = None,
    renames: Mapping[str, str] | None = None,
) -> Loaded[T]:
    """A component's settings: ``[pipeline]`` under its own section, the local stack's addresses where
    neither sets them. Later wins: default, local stack (only where empty), [pipeline], [section],
    HEADWATER_PIPELINE_*, HEADWATER_<SECTION>_*, flags. ``renames`` maps a field of ``cls`` to the
    [pipeline] setting it takes (capture's ``producer`` takes ``kafka``); same-named fields take theirs.
    ``local`` is the stack to default from (else ``[stack]`` of the same file and environment)."""
    environ = os.environ if environ is None else environ
    kinds = _fields(cls)
    data, text = _sections(path)
    shared = {} if section == "pipeline" else _shared(kinds, renames or {})
    general: tuple[list[Layer], list[Layer]] = ([], [])
    if shared:
        pipeline = _fields(PipelineConfig)
        general = _file_layer(pipeline, "pipeline", data, text, path), _env_layer(pipeline, "pipeline", environ)
        _build(PipelineConfig, *_fold([*general[0], *general[1]]))  # a bad [pipeline] is named as such
    layers = [
        *_renamed(general[0], shared),
        *_file_layer(kinds, section, data, text, path),
        *_renamed(general[1], shared),
        *_env_layer(kinds, section, environ),
        *_flag_layer(kinds, flags),
    ]
    values, sources = _fold(layers)
    local = local if local is not None else load(StackConfig, "stack", path=path, environ=environ)
    _default_to_local(values, sources, kinds, local_defaults(local, section))
    return dataclasses.replace(_build(cls, values, sources), local=local)


def local_defaults(local: StackConfig, section: str) -> dict[str, tuple[Any, str]]:
    """The one place components take the local stack's addresses from: each setting's value and the
    [stack] settings it is made of. State directories follow ``data_dir``: ``<data_dir>/<section>``."""
    return {
        "dsn": (Secret(local.dsn()), "host, postgres_port, postgres_user, postgres_password, database"),
        "bootstrap": (local.bootstrap, "kafka_bootstrap" if local.kafka_bootstrap else "host, kafka_port"),
        "registry_url": (local.registry_url, "host, registry_port"),
        "redis_url": (local.redis_url, "host, redis_port"),
        "state_dir": (local.data_dir / section, "data_dir"),
    }


def _default_to_local(
    values: dict[str, Any], sources: dict[str, tuple[Source, ...]], kinds: Collection[str],
    defaults: Mapping[str, tuple[Any, str]],
) -> None:  # fmt: skip
    """Fill the settings of ``kinds`` nothing set (or set empty) from the local stack's ``defaults``."""
    for name, (value, made_of) in defaults.items():
        if name in kinds and _empty(values.get(name, "")):
            values[name], sources[name] = value, (Source("stack", made_of),)


def _empty(value: Any) -> bool:
    return (value.reveal() if isinstance(value, Secret) else value) == ""


def _shared(kinds: Collection[str], renames: Mapping[str, str]) -> dict[str, str]:
    """Each field of a component that takes a [pipeline] setting, and that setting's name."""
    same = {name: name for name in _fields(PipelineConfig) if name in kinds}
    return {**same, **{mine: theirs for mine, theirs in renames.items() if mine in kinds}}


def _renamed(layers: Iterable[Layer], shared: Mapping[str, str]) -> list[Layer]:
    """[pipeline] values under the names the component gives them."""
    return [
        (mine, value, source) for mine, theirs in shared.items() for name, value, source in layers if name == theirs
    ]


def _fold(layers: Iterable[Layer]) -> tuple[dict[str, Any], dict[str, tuple[Source, ...]]]:
    """The values the layers give, later winning; pass-through ``Settings`` merge key by key."""
    values: dict[str, Any] = {}
    sources: dict[str, tuple[Source, ...]] = {}
    for name, value, source in layers:
        if isinstance(value, Settings) and name in values:
            values[name] = Settings({**values[name], **value})
            sources[name] = (*sources[name], source)
        else:
            values[name], sources[name] = value, (source,)
    return values, sources


def _build(cls: type[T], values: dict[str, Any], sources: Mapping[str, tuple[Source, ...]]) -> Loaded[T]:
    """``cls(**values)``; a setting it refuses is a ConfigError naming where that value came from."""
    try:
        config = cls(**values)
    except InvalidSetting as exc:
        where = sources.get(exc.key, (DEFAULT,))[-1]
        if where.kind == "file":
            raise ConfigError(str(exc), path=where.name, line=where.line, key=exc.key) from exc
        suffix = "" if where.kind == "default" else f" (set by {where})"
        raise ConfigError(f"{exc}{suffix}", key=exc.key) from exc
    return Loaded(config, {name: sources.get(name, (DEFAULT,)) for name in _fields(cls)})


def _sections(path: Path | None) -> tuple[dict[str, Any], str]:
    """The parsed file (empty without one); a section no component owns is refused with its line."""
    if path is None:
        return {}, ""
    data, text = read_file(path)
    for name, table in data.items():
        if name not in KNOWN_SECTIONS or not isinstance(table, dict):
            raise ConfigError(
                f"unknown section [{name}]" if name not in KNOWN_SECTIONS else f"'{name}' must be a table",
                path=str(path),
                line=_toml_line(text, name, None),
                hint=f"known sections: {', '.join(KNOWN_SECTIONS)}",
            )
    return data, text


def _got(kind: Any, value: Any) -> str:
    """The bad value for an error message, unless it may hold a secret."""
    return "" if kind in (Secret, Settings) else f", got {value!r}"


def _file_layer(kinds: Mapping[str, Any], section: str, data: Mapping[str, Any], text: str,
                path: Path | None) -> list[Layer]:  # fmt: skip
    out: list[Layer] = []
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
            out.append((key, _coerce(kinds[key], value, from_text=False), Source("file", str(path), line)))
        except ValueError as exc:
            raise ConfigError(f"{exc}{_got(kinds[key], value)}", path=str(path), line=line, key=key) from exc
    return out


def _env_layer(kinds: Mapping[str, Any], section: str, environ: Mapping[str, str]) -> list[Layer]:
    out: list[Layer] = []
    for name, kind in kinds.items():
        var = f"HEADWATER_{section.upper()}_{name.upper()}"
        if var in environ:
            try:
                out.append((name, _coerce(kind, environ[var], from_text=True), Source("env", var)))
            except ValueError as exc:
                raise ConfigError(f"{exc}{_got(kind, environ[var])}", key=var) from exc
    return out


def _flag_layer(kinds: Mapping[str, Any], flags: Mapping[str, Any] | None) -> list[Layer]:
    out: list[Layer] = []
    for name, value in (flags or {}).items():
        if name in kinds and value is not None:
            flag = "--" + name.replace("_", "-")
            try:
                out.append((name, _coerce(kinds[name], value, from_text=True), Source("flag", flag)))
            except ValueError as exc:
                raise ConfigError(f"{exc}{_got(kinds[name], value)}", key=flag) from exc
    return out


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, only: Collection[str] | None = None
) -> None:
    """Add one ``--kebab-name`` flag per field of ``cls`` (or of those named in ``only``); none has a
    default of its own, so a flag not given leaves the file and the environment in charge."""
    kinds = _fields(cls)
    for field in dataclasses.fields(cls):
        if only is not None and field.name not in only:
            continue
        text = field.metadata.get("help", "")
        if kinds[field.name] is bool:
            parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name, action="store_const",
                                const="true", default=None, help=text)  # fmt: skip
            continue
        if "default" not in text and field.default not in ("", Settings()):  # else the help says it better
            text = f"{text} (default: {field.default})"
        parser.add_argument(
            "--" + field.name.replace("_", "-"), dest=field.name, default=None, metavar=field.name.upper(), help=text
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


def check_bootstrap(name: str, value: str) -> None:
    """Raise InvalidSetting unless ``value`` is a comma-separated list of ``host:port``."""
    for server in value.split(","):
        host, _, port = server.strip().rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise InvalidSetting(name, f"must be host:port[,host:port...] (e.g. 127.0.0.1:9092), got {value!r}")


TOPIC_PREFIX = re.compile(r"^[A-Za-z0-9._-]*$")


def check_prefix(name: str, prefix: str) -> None:
    """Raise InvalidSetting unless ``prefix`` can start Kafka topic names (it may be empty)."""
    if not TOPIC_PREFIX.match(prefix):
        raise InvalidSetting(name, f"must be letters, digits, '.', '_' or '-' (it starts topic names), got {prefix!r}")


def check_topic(name: str, topic: str) -> None:
    """Raise InvalidSetting unless ``topic`` is a name Kafka accepts for a topic."""
    if not TOPIC_PREFIX.match(topic) or topic in (".", "..") or len(topic) > 249:
        raise InvalidSetting(name, f"must be a Kafka topic name: 1-249 letters, digits, '.', '_' or '-', and not '.' "
                                   f"or '..', got {topic!r}")  # fmt: skip


def check_url(name: str, url: str, schemes: Collection[str], example: str) -> None:
    """Raise InvalidSetting unless ``url`` is empty or a URL of one of ``schemes`` with a host."""
    try:
        parts = urlsplit(url)
        ok = not url or (parts.scheme in schemes and bool(parts.hostname or parts.scheme == "unix"))
    except ValueError:
        ok = False
    if not ok:
        raise InvalidSetting(name, f"must be a {'/'.join(schemes)} URL such as {example}, got {_unpassworded(url)!r}")


def _unpassworded(text: str) -> str:
    """``text`` with the password of a URL in it masked (tables.registry.shown); unparsable: all masked."""
    from tables.registry import shown  # not at the top: the config model imports no Avro

    if "://" not in text:
        return text
    try:
        return shown(text)
    except ValueError:
        return "***"


def display(value: Any) -> str:
    """A setting's value as TOML, with secrets, secret-looking settings and URL passwords as ``***``."""
    if isinstance(value, Secret):
        return '"***"'
    if isinstance(value, Settings):
        pairs = (f"{json.dumps(k)} = {json.dumps(_unpassworded(v))}" for k, v in value.masked().items())
        return "{ " + ", ".join(pairs) + " }" if value else "{}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(_unpassworded(str(value)))


def masked_repr(self: Any) -> str:
    """``repr`` of a config object with every value as ``display`` shows it."""
    shown = ", ".join(f"{f.name}={display(getattr(self, f.name))}" for f in dataclasses.fields(self))
    return f"{type(self).__name__}({shown})"


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


BROKER_PROFILES = ("auto", "tansu", "kafka")
BROKER_PROFILE_HELP = "tansu (what the local broker needs), kafka, or auto (tansu exactly for the local stack's broker)"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """What every component shares, written once ([pipeline] in headwater.toml, HEADWATER_PIPELINE_*):
    capture, the stream workers and analytics use it unless their own section sets the same setting."""

    bootstrap: str = setting("", "Kafka bootstrap servers of every component (default: the local stack's broker)")
    kafka: Settings = setting(Settings(), "librdkafka client settings of every component (SASL, TLS, ...)")
    registry_url: str = setting("", "schema registry URL, basic auth as user:password@ (default: the local stack's)")
    redis_url: str = setting("", "Redis the workers mirror views into (default: the local stack's; 'none': off)")
    topic_prefix: str = setting(DEFAULT_PREFIX, "prefix of every topic: <prefix>.changes, <prefix>.<table>, ...")
    broker_profile: str = setting("auto", BROKER_PROFILE_HELP)

    __repr__ = masked_repr

    def __post_init__(self) -> None:
        check_shared(self.topic_prefix, self.registry_url, self.redis_url)
        check_profile(self.broker_profile)


class OnBroker:
    """A component's configuration read for its broker profile (``broker_profile``, resolved)."""

    broker_profile: str

    @property
    def tansu(self) -> bool:
        """Whether the local broker's profile is in force."""
        return self.broker_profile == "tansu"


def check_profile(value: str) -> None:
    """Raise InvalidSetting unless ``value`` names a broker profile."""
    if value not in BROKER_PROFILES:
        raise InvalidSetting("broker_profile", f"must be one of {', '.join(BROKER_PROFILES)}, got {value!r}")


def on_local_stack(loaded: Loaded[Any]) -> bool:
    """Whether the component's broker is the local stack's — its Tansu, or the Kafka of your own it runs on
    (``kafka_bootstrap``) — however it was named."""
    return loaded.local is not None and cast(Any, loaded.config).bootstrap == loaded.local.bootstrap


def resolve_profile(loaded: Loaded[T]) -> Loaded[T]:
    """``broker_profile = auto`` made ``tansu`` exactly when the component's broker is the local stack's Tansu
    (``on_local_stack``, without ``kafka_bootstrap``), else ``kafka``; an explicit profile is kept."""
    if cast(Any, loaded.config).broker_profile != "auto" or loaded.local is None:
        return loaded
    on_local = on_local_stack(loaded)
    if on_local and loaded.local.kafka_bootstrap:
        return loaded.replace("broker_profile", "kafka", Source("auto", "the local stack runs on a Kafka of your own"))
    why = "the broker is the local stack's" if on_local else "the broker is not the local stack's"
    return loaded.replace("broker_profile", "tansu" if on_local else "kafka", Source("auto", why))


def check_shared(topic_prefix: str, registry_url: str, redis_url: str = "") -> None:
    """Raise InvalidSetting for a malformed topic prefix, registry URL or Redis URL (wherever they are set)."""
    check_prefix("topic_prefix", topic_prefix)
    check_url("registry_url", registry_url, ("http", "https"), "http://127.0.0.1:8081")
    if redis_url != "none":
        check_url("redis_url", redis_url, ("redis", "rediss", "unix"), "redis://127.0.0.1:6379/0")


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
    kafka_bootstrap: str = setting("", "a Kafka of your own (host:port[,host:port...]): the stack starts no broker "
                                       "and every component uses this one")  # fmt: skip
    registry_topic: str = setting("", "the registry's topic (default: _schemas on the stack's broker, "
                                      "_headwater_schemas on a Kafka of your own)")  # fmt: skip

    def __post_init__(self) -> None:
        if self.kafka_bootstrap:
            check_bootstrap("kafka_bootstrap", self.kafka_bootstrap)
        if self.registry_topic:
            check_topic("registry_topic", self.registry_topic)
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
        return self.kafka_bootstrap or f"{self.host}:{self.kafka_port}"

    @property
    def registry_url(self) -> str:
        return f"http://{self.host}:{self.registry_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://{self.host}:{self.redis_port}/0"
