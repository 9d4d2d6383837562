"""Stream workers for tests: the real ``faust -A streams worker`` as a process, per test.

``worker_factory(prefix)`` starts a worker reading ``<prefix>.changes`` on the session's
stack with a free web port, its own app id (consumer group and changelogs) unless one
is given, its own data directory, and the view specs given as config-file text;
``Worker`` waits for it, asks its endpoint, and kills it (``kill -9`` too). Every worker is stopped after the test.
``run_until`` runs one of a worker's reader threads in the test's process until it did what the test waits for.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from streams.feed import Follower
from tables.config import StackConfig
from tests.plugins.stack import free_port

REPO = Path(__file__).resolve().parents[2]


def run_until(follower: Follower, done: threading.Event, caplog: pytest.LogCaptureFixture,
              got: Callable[[], str], timeout: float = 90.0) -> list[str]:  # fmt: skip
    """Run ``follower`` until ``done`` is set (failing after ``timeout`` s with ``got()``: what it got so far), then
    stop it; the WARNING lines the workers' logger had meanwhile."""
    with caplog.at_level(logging.WARNING, logger="headwater.streams"):
        follower.start()
        try:
            assert done.wait(timeout), got()
        finally:
            follower.stop()
    return [r.getMessage() for r in caplog.records]


@dataclasses.dataclass
class Worker:
    env: dict[str, str]
    port: int
    log: Path
    process: subprocess.Popen[bytes] | None = None
    loglevel: str | None = "info"  # Faust's -l; None: the worker's own default (HEADWATER_LOG_LEVEL, else info)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> Worker:
        self.launch().wait_ready(timeout)
        return self

    def launch(self) -> Worker:
        """Start the process without waiting for it to be ready."""
        level = ["-l", self.loglevel] if self.loglevel else []
        argv = [sys.executable, "-m", "faust", "-A", "streams", "worker", *level, "--web-port", str(self.port)]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.log.parent
            )
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited with {self.process.returncode}:\n{self.tail()}")
            if "Worker]: Ready" in self.log.read_text(errors="replace") or self.loglevel is None:
                try:
                    if httpx.get(self.url + "/tables/", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise AssertionError(f"worker not ready within {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10)

    def counters(self) -> dict[str, Any]:
        return dict(self.get("/fanout/").json())

    def synced(self) -> bool:
        """Whether the last group join its log shows was followed by a sync: a member paused while it joins waits
        in the join (the rebalance's timeout), not past its session."""
        text = self.log.read_text(errors="replace")
        return text.rfind("Successfully synced group") > text.rfind("(Re-)joining group")

    def pause(self, seconds: float) -> None:
        """Stop the process (SIGSTOP) for ``seconds``, then let it go on (SIGCONT): paused past its group session,
        the worker comes back not knowing that the group gave its partitions to others meanwhile."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            self.process.send_signal(signal.SIGCONT)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` and wait; a worker that does not stop within 60 s is killed (never left running)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=60)
                raise AssertionError(f"the worker did not stop within 60 s of signal {sig}:\n{self.tail()}") from None


def streams_env(local_stack: StackConfig, prefix: str, app_id: str, state_dir: Path) -> dict[str, str]:
    """The environment that points a worker (or an engine's settings) at the session's stack."""
    return {
        "HEADWATER_STACK_DATA_DIR": str(local_stack.data_dir),
        "HEADWATER_STACK_KAFKA_PORT": str(local_stack.kafka_port),
        "HEADWATER_STACK_REGISTRY_PORT": str(local_stack.registry_port),
        "HEADWATER_STACK_POSTGRES_PORT": str(local_stack.postgres_port),
        "HEADWATER_STACK_REDIS_PORT": str(local_stack.redis_port),
        "HEADWATER_STREAMS_TOPIC_PREFIX": prefix,
        "HEADWATER_STREAMS_APP_ID": app_id,
        "HEADWATER_STREAMS_STATE_DIR": str(state_dir),
    }


@pytest.fixture
def worker_factory(local_stack: StackConfig, unique_name: str, tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(prefix: str, *, app_id: str | None = None, views: str = "", environ: dict[str, str] | None = None,
             **settings: Any) -> Worker:  # fmt: skip
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("HEADWATER_")},
            "PYTHONPATH": str(REPO),
            **streams_env(local_stack, prefix, app_id or f"{unique_name}-app", tmp_path / f"streams{len(made)}"),
            **(environ or {}),
        }
        env.update({f"HEADWATER_STREAMS_{k.upper()}": str(v) for k, v in settings.items()})
        if views:  # view specs live in the config file
            config = tmp_path / f"worker{len(made)}.toml"
            config.write_text(views)
            env["HEADWATER_CONFIG"] = str(config)
        worker = Worker(env, free_port(), tmp_path / f"worker{len(made)}.log")
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.kill(signal.SIGTERM)
