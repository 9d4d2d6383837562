"""Capture agents for tests: unique slot, publication, topic prefix and state per test.

``capture_factory`` builds a ``CaptureConfig`` for a test database and runs the agent
in a thread (``start``) or as the real ``headwater capture`` process (``spawn``);
``changes`` reads the raw topic back decoded; ``shop_writer`` starts the shop workload in a
thread and stops every one it started before the test's database is dropped, also when the
test fails (a writer left running fails the next test once its database is gone).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from capture import agent, slot
from capture.backfill import UNFINISHED, Backfill
from capture.config import CaptureConfig
from capture.state import State
from headwater import shop
from tables.change import ChangeReader
from tables.config import Secret, StackConfig
from tables.kafka import read_topic
from tables.registry import Registry
from tests.plugins.stack import free_port


@dataclasses.dataclass
class Capture:
    cfg: CaptureConfig
    stack: StackConfig
    thread: threading.Thread | None = None
    stop_event: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: list[BaseException] = dataclasses.field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def start(self) -> Capture:
        def target() -> None:
            try:
                agent.run(self.cfg, self.stop_event)
            except BaseException as exc:
                self.error.append(exc)

        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=target, name="capture", daemon=True)
        self.thread.start()
        return self

    def failure(self, timeout: float = 30.0) -> BaseException:
        """Start the agent (if not running) and return the one error it stops with."""
        if self.thread is None:
            self.start()
        assert self.thread is not None
        self.thread.join(timeout=timeout)
        assert not self.thread.is_alive(), "capture kept running; an error was expected"
        self.thread = None
        assert len(self.error) == 1, f"expected one error, got {self.error}"
        return self.error[0]

    def stop(self) -> None:
        if self.thread is not None:
            self.stop_event.set()
            self.thread.join(timeout=60)
            assert not self.thread.is_alive(), "capture did not stop"
            self.thread = None
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)

    def argv(self) -> list[str]:
        c = self.cfg
        return [
            sys.executable, "-m", "headwater.cli", "capture",
            "--slot", c.slot, "--publication", c.publication, "--topic-prefix", c.topic_prefix,
            "--include", c.include, "--state-dir", str(c.state_dir), "--bootstrap", c.bootstrap,
            "--registry-url", c.registry_url, "--status-interval", str(c.status_interval),
            "--heartbeat-interval", str(c.heartbeat_interval), "--on-error", c.on_error, "--format", c.format,
            "--raw-images", c.raw_images,
            "--metrics-port", str(c.metrics_port), "--slot-warn-bytes", str(c.slot_warn_bytes),
            *(["--producer", ",".join(f"{k}={v}" for k, v in c.producer.items())] if c.producer else []),
            "--backfill-chunk-rows", str(c.backfill_chunk_rows), *(["--signal-table", c.signal_table] if c.signal_table
                                                                     else []),
            *(["--allow-unkeyed"] if c.allow_unkeyed else []),
        ]  # fmt: skip

    def spawn(self, *extra: str) -> subprocess.Popen[bytes]:
        """The real command in its own process (for kill -9 and exit codes)."""
        assert self.log is not None
        env = {**os.environ, "HEADWATER_CAPTURE_DSN": self.cfg.dsn.reveal()}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen([*self.argv(), *extra], stdout=out, stderr=subprocess.STDOUT, env=env)
        return self.process

    def changes(self) -> list[dict[str, Any]]:
        """The raw topic's changes in order, their images framed (whichever ``raw_images`` capture wrote)."""
        read = ChangeReader(Registry(self.cfg.registry_url))
        out = []
        for record in read_topic(self.cfg.bootstrap, self.cfg.changes_topic):
            assert record.value is not None, f"a raw message without value at offset {record.offset}"
            change = read(record.value)
            change["_offset"] = record.offset
            out.append(change)
        return out

    def wait_caught_up(self, dsn: str, timeout: float = 60.0) -> None:
        """Until the slot confirmed everything written so far (so Kafka holds every commit)."""

        def alive() -> bool:
            self.raise_error()
            return self.process is None or self.process.poll() is None

        slot.wait_caught_up(dsn, self.cfg.slot, timeout=timeout, alive=alive, state_dir=self.cfg.state_dir)

    @property
    def metrics_url(self) -> str:
        return f"http://{self.cfg.metrics_host}:{self.cfg.metrics_port}"

    def backfills(self) -> list[Backfill]:
        """Every backfill capture's state holds (as saved: a chunk once Kafka acknowledged it)."""
        state = State(self.cfg.state_dir, self.cfg.slot)
        try:
            return state.backfills()
        finally:
            state.close()

    def wait_backfilled(self, dsn: str, count: int = 1, timeout: float = 120.0) -> list[Backfill]:
        """Until ``count`` backfills exist and none is unfinished, then until the slot caught up."""
        deadline = time.monotonic() + timeout
        while True:
            self.raise_error()
            found = self.backfills()
            if len(found) >= count and not any(b.status in UNFINISHED for b in found):
                break
            assert time.monotonic() < deadline, f"backfills not done: {[b.describe() for b in found]}"
            assert self.process is None or self.process.poll() is None, "capture exited"
            time.sleep(0.2)
        self.wait_caught_up(dsn)
        return found

    def snapshot(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The real ``headwater snapshot`` command against this capture's state."""
        argv = [sys.executable, "-m", "headwater.cli", "snapshot", *args, "--slot", self.cfg.slot,
                "--state-dir", str(self.cfg.state_dir)]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        assert not check or done.returncode == 0, f"exit {done.returncode}: {done.stdout}{done.stderr}"
        return done

    def raise_error(self) -> None:
        if self.error:
            raise self.error[0]


class ShopWriter:
    """The shop workload in a thread, at a steady rate, counting committed transactions."""

    def __init__(self, dsn: str, rate: float = 150) -> None:
        self.conn = psycopg2.connect(dsn)
        self.work = shop.Workload(self.conn, rng_seed=int.from_bytes(os.urandom(2), "big"), rollback_share=0.05)
        self.rate = rate
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        start = time.monotonic()
        done = 0
        while not self.stop_event.is_set():
            self.work.step()
            done += 1
            delay = start + done / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def start(self) -> ShopWriter:
        self.thread.start()
        return self

    def stop(self) -> int:
        """Stop writing (again: no-op) and return the committed transactions."""
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join()
        self.conn.close()
        return self.work.committed


@pytest.fixture
def shop_writer(pg_database: str) -> Iterator[Callable[..., ShopWriter]]:
    """Start a ``ShopWriter`` on the test's database; teardown (before the database's) stops them all."""
    started: list[ShopWriter] = []

    def start(rate: float = 150) -> ShopWriter:
        started.append(ShopWriter(pg_database, rate=rate).start())
        return started[-1]

    yield start
    for writer in started:
        writer.stop()


@pytest.fixture
def capture_factory(local_stack: StackConfig, unique_name: str, tmp_path: Path) -> Iterator[Callable[..., Capture]]:
    made: list[Capture] = []

    def make(dsn: str, **overrides: Any) -> Capture:
        settings: dict[str, Any] = {
            "dsn": Secret(dsn),
            "slot": unique_name,
            "publication": unique_name,
            "topic_prefix": unique_name,
            "bootstrap": local_stack.bootstrap,
            "registry_url": local_stack.registry_url,
            "state_dir": tmp_path / "capture-state",
            "status_interval": 0.2,
            "heartbeat_interval": 0.0,
            "on_error": "exit",
            "metrics_port": free_port(),  # each capture its own (/metrics, /health, /ready)
            **overrides,
        }
        capture = Capture(CaptureConfig(**settings), local_stack, log=tmp_path / f"capture{len(made)}.log")
        made.append(capture)
        return capture

    yield make
    for capture in made:
        capture.stop()
    admin = psycopg2.connect(local_stack.dsn("postgres"))
    admin.autocommit = True
    with admin.cursor() as cur:
        slots = sorted({c.cfg.slot for c in made} | {unique_name})  # a test may run captures on slots of its own
        cur.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
            " WHERE slot_name = ANY(%s) AND active_pid IS NOT NULL",
            (slots,),
        )
        time.sleep(0.2)
        cur.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ANY(%s)", (slots,)
        )
    admin.close()
