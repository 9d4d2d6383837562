"""The snapshot's worker processes, started before the snapshot needs them.

Promise: ``Workers(cfg, count)`` starts ``count`` processes at once — forked when this
process has a single thread (nothing to import again, no threads to copy in a bad
state), spawned otherwise — and each makes its connections and producer
(``snapshot.Copying``) while capture is still registering schemas and creating the
slot. ``run`` hands them the job and the chunks and returns once every worker
reported its rows acknowledged; a worker's error is raised as ``SourceError``.
``close`` kills whatever is still running (unused workers, or all after an error or an
interruption). Workers ignore SIGINT and SIGTERM, which Ctrl-C and service managers send
to the whole group: capture handles them. A worker never outlives capture: it exits when
its parent is gone. Workers log as capture does (``tables.logs``: its format and level).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from capture.config import CaptureConfig
from capture.errors import SourceError
from capture.producer import failed
from capture.snapshot import Chunk, Copying, Job, Report
from tables import logs


class Workers:
    def __init__(self, cfg: CaptureConfig, count: int) -> None:
        ctx: Any = multiprocessing.get_context("fork" if _single_threaded() else "spawn")
        self.todo: Any = ctx.Queue()
        self.events: Any = ctx.Queue()
        self.jobs: list[Any] = [ctx.SimpleQueue() for _ in range(count)]
        self.procs: list[Any] = [
            ctx.Process(
                target=_worker,
                args=(cfg, jobs, self.todo, self.events, logs.current()),
                name=f"snapshot-{i}",
                daemon=True,
            )
            for i, jobs in enumerate(self.jobs)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, job: Job, chunks: list[Chunk], report: Report, check: Callable[[], None]) -> tuple[int, int]:
        """Copy ``chunks`` in the workers; ``check`` is called at least every second (it may raise)."""
        for chunk in chunks:
            self.todo.put(chunk)
        for _ in self.procs:
            self.todo.put(None)
        for i, jobs in enumerate(self.jobs):
            jobs.put(dataclasses.replace(job, index=i, stride=len(self.procs)))
        return self._collect(report, check)

    def _collect(self, report: Report, check: Callable[[], None]) -> tuple[int, int]:
        rows, next_position, done = 0, 0, 0
        while done < len(self.procs):
            check()
            try:
                kind, a, b, c = self.events.get(timeout=1.0)
            except queue.Empty:
                if any(not p.is_alive() and p.exitcode for p in self.procs):
                    raise SourceError("a snapshot worker process died; see the log above") from None
                continue
            if kind == "progress":
                report(a, b, c)
            elif kind == "error":
                raise failed(SourceError(f"snapshot worker {a} failed: {b}"), c)
            else:
                rows, next_position, done = rows + b, max(next_position, c), done + 1
        return rows, next_position

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()  # they ignore SIGTERM; an abandoned snapshot has nothing to save
        for proc in self.procs:
            proc.join(timeout=30)


def _single_threaded() -> bool:
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False  # not Linux: no way to be sure, so spawn


def _exit_with_parent() -> None:
    """A worker must not outlive capture (after a kill -9 it would go on writing an abandoned snapshot)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker(cfg: CaptureConfig, jobs: Any, todo: Any, events: Any, logged: tuple[str, logs.LogOptions] | None) -> None:
    """A worker process: set up, wait for its job (None: not needed), copy chunks until the sentinel."""
    # Ctrl-C and a service manager's stop signal the whole group: capture handles them and then
    # kills its workers (a forked worker would otherwise run capture's handlers, which stop nothing here)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if logged is None:
        logging.basicConfig(level=logging.WARNING)
    else:  # spawned, a worker starts with no logging set up; forked, this changes nothing
        logs.setup(*logged)
    _exit_with_parent()
    index = "?"

    def chunks() -> Iterator[Chunk]:
        while (chunk := todo.get()) is not None:
            yield chunk

    try:
        copying = Copying(cfg)
        try:
            job = jobs.get()
            if job is None:
                return
            index = job.index
            rows, next_position = copying.run(job, chunks(), lambda t, n, done: events.put(("progress", t, n, done)))
        finally:
            copying.close()
        events.put(("done", index, rows, next_position))
    except BaseException as exc:  # reported to the parent, which raises it
        events.put(("error", index, f"{type(exc).__name__}: {exc}", getattr(exc, "failed_deliveries", 0)))
