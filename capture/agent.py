"""The capture agent: checks, slot, snapshot, then the stream — and what to do when things fail.

Promise: ``run`` starts from whatever the slot and the checkpoint say. A new slot
gets a consistent snapshot (unless skipped) before streaming from its consistent
point; on an existing slot, tables that joined the captured set are backfilled while
the stream runs (``capture.backfiller``); an interrupted snapshot is started over on a new slot, never left looking
complete; a slot that was dropped or invalidated, or disagrees with the checkpoint,
stops the agent with the way out. Transient failures (connection lost, broker down,
registry unreachable) are retried with backoff from the last confirmed commit, or
end the run with ``on_error = "exit"``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass

import psycopg2

from capture import catalog, retract, slot, snapshot
from capture.backfiller import Backfiller
from capture.catalog import Connection, TableRef, TypeCache, connection_lost
from capture.changes import ChangeSink
from capture.config import CaptureConfig
from capture.encoder import change_writer
from capture.errors import BrokerError, CheckpointMismatchError, SlotLostError, SourceError, SourceUnreachableError
from capture.kafkawatch import KafkaWatch
from capture.metrics import CaptureMetrics, Probe
from capture.producer import ChangeProducer, ensure_changes_topic, sized
from capture.schemas import Ids, register_changes, register_table
from capture.slotwatch import SlotWatch
from capture.state import Checkpoint, State, snapshot_done
from capture.stream import Loop, Streamer
from capture.workers import Workers
from tables.catalog import TableSchema
from tables.errors import HeadwaterError, RetryableError, first_line
from tables.logs import facts
from tables.registry import NoRegistry, Registry
from tables.wire import lsn_text

log = logging.getLogger("headwater.capture")


def run(cfg: CaptureConfig, stop: threading.Event | None = None, metrics: CaptureMetrics | None = None) -> None:
    """Capture until ``stop`` is set (or a fatal error), serving metrics, health and readiness meanwhile."""
    stop = stop or threading.Event()
    metrics = metrics or CaptureMetrics(cfg)
    probe = Probe(cfg, metrics, beside=[SlotWatch(cfg, metrics), KafkaWatch(cfg, metrics)])
    log.warning("capture starting: slot %s, publication %s, into %s at %s", cfg.slot, cfg.publication,
                cfg.changes_topic, cfg.bootstrap, extra=facts(slot=cfg.slot, topic=cfg.changes_topic))  # fmt: skip
    outcome = "asked to stop"
    try:
        retry(cfg, stop, metrics, probe)
    except BaseException as exc:
        outcome = f"{type(exc).__name__}: {first_line(exc)}"
        raise
    finally:
        metrics.stopped()
        probe.close()
        log.warning("capture stopped (%s)", outcome, extra=facts(slot=cfg.slot))


def retry(cfg: CaptureConfig, stop: threading.Event, metrics: CaptureMetrics, probe: Probe) -> None:
    """Sessions until one ends normally; a transient failure after streaming started is retried with backoff
    (``on_error = log``), logged once when the outage begins and once when capture streams again."""
    delay = 1.0
    streamed_before = False
    while not stop.is_set():
        session = Session(cfg, metrics, probe)
        try:
            session.run(stop)
            return
        except RetryableError as exc:
            streamed_before = streamed_before or session.streamed
            if cfg.on_error == "exit" or not streamed_before:
                raise  # a failure before the first stream is a set-up problem: say so at once
            metrics.session_failed(exc, delay)
            stop.wait(delay)
            delay = min(delay * 2, 30.0)


def follow(state: State, checkpoint: Checkpoint, slot_lsn: int | None) -> None:
    """A slot ahead of the checkpoint: taken if capture was settled then (``capture.stream`` says why), else
    refused (``CheckpointMismatchError``)."""
    if slot_lsn is None or slot_lsn <= checkpoint.confirmed_lsn:
        return
    ahead = f"slot '{state.slot}' was confirmed up to {lsn_text(slot_lsn)}, past this checkpoint "
    if not checkpoint.settled:
        raise CheckpointMismatchError(
            ahead + f"({lsn_text(checkpoint.confirmed_lsn)}) while changes were in flight: something else "
            "advanced it; changes may be missing",
            hint="drop the slot and start over with a snapshot, or restore the matching state_dir",
        )
    log.info("%s(%s) by the server's keepalives while nothing was in flight: resuming from the slot",
             ahead, lsn_text(checkpoint.confirmed_lsn))  # fmt: skip
    state.advance(slot_lsn)


@dataclass(frozen=True)
class Parts:
    """What one session connected and built, handed to its steps."""

    conn: Connection
    state: State
    tables: list[TableRef]
    types: TypeCache
    registrar: Registry | NoRegistry
    sink: ChangeSink
    producer: ChangeProducer
    workers: Workers | None


class Session:
    """One connected run: set-up, optional snapshot, then streaming until stopped or failed."""

    def __init__(self, cfg: CaptureConfig, metrics: CaptureMetrics, probe: Probe) -> None:
        self.cfg, self.metrics, self.probe = cfg, metrics, probe
        self.dsn = cfg.dsn.reveal()
        self.streamed = False
        self.made: list[str] = []  # what this session created and must remove if a first start fails

    def _state(self, conn: Connection) -> State:
        """Capture's state file (``conn`` is closed when it cannot be opened)."""
        try:
            return State(self.cfg.state_dir, self.cfg.slot)
        except BaseException:
            conn.close()
            raise

    def run(self, stop: threading.Event) -> None:
        cfg = self.cfg
        conn = catalog.connect(self.dsn)
        state = self._state(conn)
        registrar: Registry | NoRegistry = Registry(cfg.registry_url) if cfg.format == "avro" else NoRegistry()
        producer: ChangeProducer | None = None
        sink: ChangeSink | None = None
        repl: Connection | None = None
        workers: Workers | None = None
        try:
            catalog.check_source(conn)
            if not catalog.publication_exists(conn, cfg.publication):
                self.made.append("publication")
            tables = catalog.ensure_publication(conn, cfg, catalog.select_tables(conn, cfg))
            workers = self._workers()  # before any Kafka client: forked while this process has one thread
            self.probe.start()  # its threads after the fork, too
            writer = change_writer(cfg.format, *register_changes(registrar, cfg), cfg.raw_images)
            limit = ensure_changes_topic(cfg, written=self._written(state))
            producer = ChangeProducer(sized(cfg, limit))  # batch settings for it alone: capture's readers share cfg
            producer.on_wait = functools.partial(self.metrics.watch_producer, producer)  # Kafka watched while it waits
            sink = ChangeSink(writer, producer)
            sink.prepare_chunks()  # made now: a new idempotent producer sends nothing for ~0.5 s (its producer id)
            types = TypeCache(conn)
            parts = Parts(conn, state, tables, types, registrar, sink, producer, workers)
            try:
                repl, start_lsn = self._position(parts, stop)
            except snapshot.Interrupted as exc:
                log.warning("%s", exc)
                return
            self._stream(parts, repl, start_lsn, stop)
        except psycopg2.Error as exc:
            if not connection_lost(exc):
                raise
            raise SourceUnreachableError(f"lost the PostgreSQL connection: {first_line(exc)}") from exc
        finally:
            if workers is not None:
                workers.close()
            for closable in (repl, conn):
                if closable is not None and not closable.closed:
                    closable.close()
            if producer is not None:
                self.metrics.session_ended(sink, producer)
                producer.abandon()
            registrar.close()
            try:
                self._leave_nothing(state)
            finally:
                state.close()

    def _stream(self, parts: Parts, repl: Connection, start_lsn: int, stop: threading.Event) -> None:
        """Stream from the slot until stopped (``capture.stream``)."""
        keyed = {(t.schema, t.name): t.keyed for t in parts.tables}
        streamer = Streamer(self.cfg, parts.conn, parts.types, parts.registrar, parts.sink, parts.state, keyed)
        checkpoint = parts.state.load()
        confirmed = checkpoint.confirmed_lsn if checkpoint else start_lsn
        heartbeat_conn = catalog.connect(self.dsn)
        try:
            backfiller = Backfiller(self.cfg, self.dsn, parts.state, parts.sink, parts.registrar, streamer)
            self.streamed = True
            try:
                backfiller.start(parts.tables, fresh=start_lsn != 0)
                Loop(self.cfg, repl, heartbeat_conn, streamer, parts.producer, parts.state, confirmed,
                     self.metrics).run(start_lsn, stop)  # fmt: skip
            finally:
                backfiller.close()
        finally:
            heartbeat_conn.close()

    def _leave_nothing(self, state: State) -> None:
        """A first start that did not finish its snapshot removes the slot (it would hold WAL) and the
        publication it created; the next start makes them again. Says what it could not remove."""
        checkpoint = state.load()
        if not self.made or (checkpoint is not None and checkpoint.snapshot_done):
            return
        cfg, removed = self.cfg, []
        try:
            conn = catalog.connect(self.dsn)
            try:
                if "slot" in self.made and slot.drop_when_released(conn, cfg.slot):
                    removed.append(f"slot {cfg.slot}")
                if "publication" in self.made and catalog.drop_publication(conn, cfg.publication):
                    removed.append(f"publication {cfg.publication}")
            finally:
                conn.close()
        except (psycopg2.Error, HeadwaterError) as exc:
            log.error("the snapshot did not finish and slot %s / publication %s could not be removed (%s): drop them"
                      " with SELECT pg_drop_replication_slot('%s'); DROP PUBLICATION %s", cfg.slot, cfg.publication,
                      exc, cfg.slot, cfg.publication)  # fmt: skip
            return
        if removed:
            log.warning("the snapshot did not finish: removed %s (made by this start; the next start makes them"
                        " again)", " and ".join(removed))  # fmt: skip

    def _written(self, state: State) -> bool:
        """True when capture already wrote the raw topic for this slot (a finished snapshot, or streaming)."""
        checkpoint = state.load()
        return checkpoint is not None and checkpoint.snapshot_done

    def _workers(self) -> Workers | None:
        """Snapshot workers, started now when this run will take a snapshot (no finished one in the
        state), so that they connect while the schemas and the slot are done."""
        cfg = self.cfg
        if cfg.skip_snapshot or cfg.snapshot_workers < 2 or snapshot_done(cfg.state_dir, cfg.slot):
            return None
        return Workers(cfg, cfg.snapshot_workers)

    def _position(self, parts: Parts, stop: threading.Event) -> tuple[Connection, int]:
        """Where to stream from: an existing slot's position, or a new slot after its snapshot."""
        cfg, conn, state = self.cfg, parts.conn, parts.state
        info = slot.inspect(conn, cfg.slot)
        checkpoint = state.load()
        if info is not None:
            if checkpoint is None:
                raise CheckpointMismatchError(
                    f"slot '{cfg.slot}' exists but {state.path} holds no checkpoint for it",
                    hint=f"point state_dir at the capture state of that slot, or drop the slot "
                    f"(SELECT pg_drop_replication_slot('{cfg.slot}')) to start over with a snapshot",
                )
            if not checkpoint.snapshot_done:
                log.warning("the snapshot of slot %s was interrupted: starting it over on a new slot", cfg.slot)
                slot.drop(conn, cfg.slot)
                info = None
            else:
                follow(state, checkpoint, info.confirmed_lsn)
                return catalog.connect(self.dsn, replication=True), 0
        elif checkpoint is not None and checkpoint.snapshot_done:
            raise SlotLostError(
                cfg.slot, f"no longer exists (the checkpoint is at {lsn_text(checkpoint.confirmed_lsn)})"
            )
        repl = catalog.connect(self.dsn, replication=True)
        consistent_point, snapshot_name = slot.create(repl, cfg.slot)
        self.made.append("slot")
        log.info("created slot %s at %s", cfg.slot, lsn_text(consistent_point))
        state.start_snapshot(consistent_point, done=cfg.skip_snapshot, tables=tuple(t.qualified for t in parts.tables))
        if not cfg.skip_snapshot:
            try:
                self._snapshot(parts, consistent_point, snapshot_name, stop)
            except BaseException:
                repl.close()
                raise
        return repl, consistent_point

    def _snapshot(self, parts: Parts, lsn: int, name: str, stop: threading.Event) -> None:
        cfg, tables, registrar, sink = self.cfg, parts.tables, parts.registrar, parts.sink
        ids: dict[str, Ids] = {}
        shapes: list[TableSchema] = []
        for table in tables:
            shape = catalog.table_schema(parts.conn, parts.types, cfg.topic_prefix, table)
            ids[table.qualified] = register_table(registrar, shape, cfg)
            sink.writer.learn(shape, ids[table.qualified])
            shapes.append(shape)
        registry = registrar if isinstance(registrar, Registry) else None
        earlier = retract.earlier_keys(cfg, [(t.schema, t.name) for t in tables], registry)
        chunks, estimates = snapshot.plan(parts.conn, tables, cfg.snapshot_chunk_pages)
        report = self.metrics.snapshot_rows
        progress = snapshot.Progress(estimates, chunks, parts.state, lambda t, n, of: report("snapshot", t, n, of))
        self.metrics.snapshot(started=True)
        time_us = int(time.time() * 1_000_000)
        job = snapshot.Job(cfg, name, lsn, time_us, ids, (sink.writer.key_id, sink.writer.value_id))
        sink.start_snapshot(lsn, time_us)
        started = time.monotonic()
        try:
            rows, next_position = snapshot.run(job, chunks, progress, parts.workers, stop)
        except (BrokerError, SourceError) as exc:
            self.metrics.delivery_errors.inc(exc.failed_deliveries)  # a snapshot sender's
            raise
        finally:
            if parts.workers is not None:
                parts.workers.close()
        if earlier is not None:
            next_position = self._retract(parts, name, shapes, earlier, next_position)
        sink.end_snapshot(rows, next_position)
        sink.events += rows  # the workers' rows count as this run's events too
        for qualified, read in progress.done.items():
            schema, _, name = qualified.partition(".")
            sink.tally[(schema, name, "READ")] += read
        parts.producer.flush(timeout=600)
        parts.state.finish_snapshot()
        self.metrics.snapshot(started=False)
        elapsed = time.monotonic() - started
        log.info(
            "snapshot done: %d rows from %d tables in %.2f s (%.0f rows/s)",
            rows,
            len(tables),
            elapsed,
            rows / max(elapsed, 1e-6),
        )

    def _retract(self, parts: Parts, name: str, shapes: list[TableSchema], earlier: retract.LiveKeys,
                 position: int) -> int:  # fmt: skip
        """DELETEs for the keys the raw topic held before this snapshot that its tables do not hold."""
        conn = snapshot.import_snapshot(self.dsn, name)
        try:
            for shape in shapes:
                keys = list(earlier.keys.get((shape.schema, shape.name), ()))
                if not keys or not shape.key_indexes:
                    continue
                gone = retract.missing(conn, shape, keys, self._key_decoder(parts, shape))
                position = parts.sink.retract(shape, gone, position)
                if gone:
                    log.info("%s: %d of %d keys from before this snapshot are gone from the table: DELETE sent",
                             shape.qualified, len(gone), len(keys))  # fmt: skip
        finally:
            conn.close()
        return position

    def _key_decoder(self, parts: Parts, shape: TableSchema) -> retract.KeyDecoder:
        if self.cfg.format == "json" or not isinstance(parts.registrar, Registry):
            return retract.json_keys(shape)
        return retract.avro_keys(shape, parts.registrar.schema)
