"""Session-scoped real services and per-test factories on top of them.

``local_stack`` starts PostgreSQL, the Tansu broker, the embedded registry and
Redis once per session on free ports in a temporary directory, through the same
``headwater.stack`` code users run, and stops them at the end. Factories give each
test its own database (``pg_database``, ``shop_db``) and topics (``topic_factory``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import psycopg2
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from headwater import shop, stack
from tables.kafka import create_topics

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_record_batches(bootstrap: str, topic: str, count: int) -> None:
    """``topic`` made with one partition and ``count`` records written to it, each in a batch of its own: on
    the local broker a fetch lists a partition's batches within its wait (``tables.kafka.FetchWait``)."""
    create_topics(AdminClient({"bootstrap.servers": bootstrap}), [NewTopic(topic, 1, 1)])
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "batch.num.messages": 1})
    for i in range(count):
        producer.produce(topic, b"%d" % i, partition=0)
        producer.poll(0)
    assert producer.flush(60) == 0


def free_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


def make_stack_config(data_dir: Path) -> stack.StackConfig:
    pg, kafka, registry, redis = free_ports(4)
    return stack.StackConfig(
        data_dir=data_dir, postgres_port=pg, kafka_port=kafka, registry_port=registry, redis_port=redis
    )


@contextlib.contextmanager
def stack_dir() -> Iterator[Path]:
    """A data directory the 'postgres' user can reach (pytest's tmp dirs are private to root)."""
    path = Path(tempfile.mkdtemp(prefix="headwater-test-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def local_stack() -> Iterator[stack.StackConfig]:
    with stack_dir() as path, stack.running(make_stack_config(path)) as cfg:
        yield cfg


@pytest.fixture
def pg_database(local_stack: stack.StackConfig, unique_name: str) -> Iterator[str]:
    """A fresh, empty database for this test; yields its libpq DSN."""
    admin = psycopg2.connect(local_stack.dsn("postgres"))
    admin.autocommit = True
    with admin.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{unique_name}"')
    try:
        yield local_stack.dsn(unique_name)
    finally:
        with admin.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{unique_name}" WITH (FORCE)')
        admin.close()


@pytest.fixture
def shop_db(pg_database: str) -> Iterator[psycopg2.extensions.connection]:
    """A connection to a fresh database holding a small seeded sample shop."""
    conn = psycopg2.connect(pg_database)
    shop.install(conn)
    shop.seed(conn, shop.Scale(customers=30, products=10, orders=40, description_size=3000))
    try:
        yield conn
    finally:
        conn.close()


@pytest.fixture
def topic_factory(local_stack: stack.StackConfig, unique_name: str) -> Iterator[Callable[..., str]]:
    """Creates topics named after this test; deletes them afterwards."""
    admin = AdminClient({"bootstrap.servers": local_stack.bootstrap})
    created: list[str] = []

    def create(suffix: str = "", *, partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = f"{unique_name}{'.' + suffix if suffix else ''}"
        futures = admin.create_topics([NewTopic(name, partitions, 1, config=config or {})])
        futures[name].result(timeout=10)
        created.append(name)
        return name

    yield create
    if created:
        for future in admin.delete_topics(created).values():
            future.exception(timeout=10)


class RegistryProcess:
    """An extra registry instance (own port, chosen ``_schemas`` topic) a test controls."""

    def __init__(self, cfg: stack.StackConfig, topic: str, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable, "-m", "registry", "--port", str(self.port),
            "--bootstrap", cfg.bootstrap, "--topic", topic,
        ]  # fmt: skip
        self._log = log.open("ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"registry exited: {log.read_text()[-2000:]}"
            try:
                if httpx.get(self.url + "/subjects", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise AssertionError(f"registry not healthy: {log.read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=15)
        self._log.close()


@pytest.fixture
def registry_factory(
    local_stack: stack.StackConfig, unique_name: str, tmp_path: Path
) -> Iterator[Callable[[], RegistryProcess]]:
    """Starts registry instances sharing one ``_schemas`` topic unique to this test."""
    started: list[RegistryProcess] = []

    def start() -> RegistryProcess:
        instance = RegistryProcess(local_stack, f"_schemas_{unique_name}", tmp_path / f"registry{len(started)}.log")
        started.append(instance)
        return instance

    yield start
    for instance in started:
        instance.stop()


class BrokerProcess:
    """A Tansu broker of a test's own, started like the stack's; it can stop and start again on
    the same port (memory storage: a restart empties it, as a user's ``stack down``/``up`` would)."""

    def __init__(self, data_dir: Path) -> None:
        self.cfg = make_stack_config(data_dir)
        self.service = stack.Broker(self.cfg)
        self.start()

    @property
    def bootstrap(self) -> str:
        return self.cfg.bootstrap

    def start(self) -> None:
        self.service.start()

    def stop(self) -> None:
        self.service.stop()

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[[], BrokerProcess]]:
    """Starts brokers of this test's own (not the session's); stops them afterwards."""
    started: list[BrokerProcess] = []

    def start() -> BrokerProcess:
        broker = BrokerProcess(tmp_path / f"broker{len(started)}")
        started.append(broker)
        return broker

    yield start
    for broker in started:
        broker.stop()


@pytest.fixture
def own_postgres() -> Iterator[stack.Postgres]:
    """A PostgreSQL of this test's own, to restart without disturbing the session's stack."""
    with stack_dir() as path:
        pg = stack.Postgres(make_stack_config(path))
        pg.start()
        try:
            yield pg
        finally:
            pg.stop()


def restart_postgres(pg: stack.Postgres, mode: str) -> None:
    """``pg_ctl restart -m mode`` (fast or immediate shutdown) as the server's user; waits until it is back."""
    argv = [str(stack.Postgres.bindir() / "pg_ctl"), "-D", str(pg.dir), "-w", "-t", "60", "restart", "-m", mode,
            "-l", str(pg.dir / "restarted.log")]  # fmt: skip
    with (pg.dir.parent / "pg_ctl.log").open("ab") as out:
        subprocess.run(argv, check=True, user=pg.user(), stdout=out, stderr=subprocess.STDOUT, timeout=120)


class _AdvertisedBehind(stack.Broker):
    """A broker that advertises another port: its clients reach it only through a ``Proxy``."""

    def __init__(self, cfg: stack.StackConfig, advertised: int) -> None:
        super().__init__(cfg)
        self.advertised = advertised

    def argv(self) -> list[str]:
        argv = super().argv()
        argv[argv.index("--advertised-listener-url") + 1] = f"tcp://{self.cfg.host}:{self.advertised}"
        return argv


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            end.close()


class Proxy:
    """TCP from ``port`` to ``target`` on 127.0.0.1. ``outage(seconds)`` (or ``cut()`` then ``restore()``)
    drops every connection and refuses new ones for a while: what a broker restart that keeps its data
    looks like to clients. A connection stays open however long either side is silent. While cut, the port
    stays bound without listening (connections are refused), so no other test's free port can take it."""

    def __init__(self, port: int, target: int) -> None:
        self.port, self.target = port, target
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.down = threading.Event()
        self.closed = threading.Event()
        self.listener = self._listen(self._bind())
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _bind(self) -> socket.socket:
        sock = socket.socket()
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
        except OSError:
            sock.close()
            raise
        return sock

    @staticmethod
    def _listen(listener: socket.socket) -> socket.socket:
        listener.listen(64)
        listener.settimeout(0.2)
        return listener

    def _accept(self) -> None:
        while not self.closed.is_set():
            if self.down.is_set():
                time.sleep(0.05)
                continue
            try:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                continue
            client.settimeout(None)  # blocking both ways: a connect timeout must not close a quiet connection
            upstream.settimeout(None)
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def _drop_all(self) -> None:
        with contextlib.suppress(OSError):  # out of LISTEN now: the accept thread's poll() holds the socket on
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            self.conns.clear()

    def outage(self, seconds: float) -> None:
        self.cut()
        time.sleep(seconds)
        self.restore()

    def cut(self) -> None:
        self.down.set()
        self._drop_all()
        self.listener = self._bind()

    def restore(self) -> None:
        self._listen(self.listener)
        self.down.clear()

    def close(self) -> None:
        self.closed.set()
        self._drop_all()
        self.thread.join(timeout=5)


class ProxiedBroker:
    """A broker of a test's own that clients reach through a ``Proxy`` (``bootstrap``)."""

    def __init__(self, data_dir: Path) -> None:
        self.cfg = make_stack_config(data_dir)
        self.proxy = Proxy(free_port(), self.cfg.kafka_port)
        self.service = _AdvertisedBehind(self.cfg, self.proxy.port)
        self.service.start()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.proxy.port}"

    @contextlib.contextmanager
    def cut_off(self, seconds: float) -> Iterator[None]:
        """Connections dropped and refused for ``seconds`` from entering the block; it ends when they are over."""
        outage = threading.Thread(target=self.proxy.outage, args=(seconds,))
        outage.start()
        try:
            yield
        finally:
            outage.join()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The broker stopped (SIGSTOP: connections stay open, nothing answers) for the block."""
        pid = self.service.pid()
        assert pid is not None, "the broker is not running"
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def outages(self, look: Callable[[str], T], between: Callable[[], object], seconds: float = 12) -> dict[str, T]:
        """Two outages of ``seconds``: connections cut off, then (after ``between()``) the broker paused.
        ``look("cut")`` and ``look("paused")`` run from 7 s into each; what they return, by name."""
        seen: dict[str, T] = {}
        with self.cut_off(seconds):
            time.sleep(7)
            seen["cut"] = look("cut")
        between()
        with self.paused():
            paused_at = time.monotonic()
            time.sleep(7)
            seen["paused"] = look("paused")
            time.sleep(max(seconds - (time.monotonic() - paused_at), 0))
        return seen

    def stop(self) -> None:
        self.proxy.close()
        self.service.stop()


@pytest.fixture
def proxied_broker(tmp_path: Path) -> Iterator[ProxiedBroker]:
    """A broker of this test's own behind a proxy that can cut it off (``proxy.outage``)."""
    broker = ProxiedBroker(tmp_path / "proxied-broker")
    try:
        yield broker
    finally:
        broker.stop()
