"""The registry's durable log: a one-partition compacted Kafka topic (``_schemas``).

Promise: ``start`` creates the topic if missing (explicitly, never by a client's
auto-create) and replays it completely before returning (it writes a NOOP marker and
reads until it sees it, so it needs no end offset from the broker). Afterwards a
background task applies the records any instance writes and watches the topic.
``write`` plans and appends under one lock and returns only once Kafka acknowledged
the records (acks=all) and this instance applied them, so what it acknowledges is
served at once. When the broker stops answering (refuses connections, or leaves three
probes in a row unanswered: one slow answer is a busy machine, not a lost log), or the
topic is gone, emptied or recreated (the local broker keeps topics in memory only, so a
restart empties it), writes answer 503 until the registry has reconnected, replayed the
topic and, if it misses records this registry holds, rewritten all of them from memory in
id order (ids and versions unchanged); reads are answered from memory throughout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, KafkaTimeoutError, RequestTimedOutError
from aiokafka.structs import ConsumerRecord

from registry import errors
from registry.store import Record, Store
from tables.errors import FatalError, HeadwaterError, RetryableError

log = logging.getLogger("headwater.registry")
T = TypeVar("T")
TOPIC_ALREADY_EXISTS = 36
TROUBLE = (KafkaError, OSError, TimeoutError)
SLOW = (TimeoutError, KafkaTimeoutError, RequestTimedOutError)  # the admin request's own 5 s may end first


class LogTrouble(RetryableError):
    """The topic is not (yet) what the registry needs; the next attempt may fix it."""


class SchemaLog:
    """Keeps ``store`` equal to the replayed topic and appends new records to it."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        store: Store,
        *,
        timeout: float = 30.0,
        write_timeout: float = 10.0,
        probe_interval: float = 1.0,
        probe_misses: int = 3,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.store = store
        self.timeout = timeout
        self.write_timeout = write_timeout
        self.probe_interval = probe_interval
        self.probe_misses = probe_misses
        self._missed = 0  # probes in a row the broker did not answer in time
        self.tp = TopicPartition(topic, 0)
        self._applied = -1
        self._problem: str | None = "it is not open yet"
        self._changed = asyncio.Condition()
        self._write_lock = asyncio.Lock()
        self._admin: AIOKafkaAdminClient | None = None
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._watch: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self, attempts: int = 3) -> None:
        """Open the log (a few tries: a broker that just started may refuse the first write)."""
        for attempt in range(1, attempts + 1):
            try:
                await asyncio.wait_for(self._open(startup=True), self.timeout)
                break
            except (*TROUBLE, RetryableError) as exc:
                await self._close()
                if attempt == attempts:
                    raise FatalError(
                        f"the registry cannot reach Kafka at {self.bootstrap} for its '{self.topic}' topic: {exc!r}",
                        hint="start the broker first ('headwater stack up') or pass the right --bootstrap",
                    ) from exc
                await asyncio.sleep(self.probe_interval)
            except BaseException:
                await self._close()
                raise
        self._watch = asyncio.create_task(self._supervise())
        log.info("registry replayed %s up to offset %d", self.topic, self._applied)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self._close()

    async def _open(self, *, startup: bool = False) -> None:
        """Connect, make sure the topic is right, replay it, and make it hold all of memory."""
        await self._connect(startup)
        missing = await self._replay_all()
        if missing:
            await self._rebuild(missing)
        self._problem = None
        self._missed = 0

    async def _connect(self, startup: bool) -> None:
        self._admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=5000)
        await self._admin.start()
        await self._ensure_topic(startup)
        # acks=all; no idempotence: Tansu answers aiokafka's InitProducerId with an error,
        # and the registry writes under a lock anyway.
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap, acks="all", linger_ms=0, request_timeout_ms=5000
        )
        await self._producer.start()
        # a short fetch wait: a write is answered once this consumer has read it back;
        # no offset reset: a position past the end means the log was lost, never "start over"
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, enable_auto_commit=False, auto_offset_reset="none", fetch_max_wait_ms=20
        )
        await self._consumer.start()
        self._consumer.assign([self.tp])

    async def _close(self) -> None:
        for client in (self._consumer, self._producer):
            if client is not None:
                await _stop(client)
        if self._admin is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._admin.close(), 10)
        self._admin = self._producer = self._consumer = None

    # ---- the topic itself --------------------------------------------------------------------
    async def _partitions(self) -> int | None:
        """How many partitions the topic has, None if it does not exist (never auto-creates it)."""
        assert self._admin is not None
        for topic in await self._admin.describe_topics():  # all topics: no auto-create
            if topic["topic"] == self.topic:
                return len(topic["partitions"])
        return None

    async def _ensure_topic(self, startup: bool) -> None:
        partitions = await self._partitions()
        if partitions not in (None, 1):
            if startup:
                raise FatalError(
                    f"topic '{self.topic}' on {self.bootstrap} has {partitions} partitions; the registry's log needs 1",
                    hint="it was probably auto-created by a client: delete it, or pass another --topic",
                )
            log.warning("%s has %s partitions (auto-created after it was lost): recreating it", self.topic, partitions)
            await self._admin_call("delete_topics", [self.topic])
            partitions = None
        if partitions is None:
            await self._admin_call("create_topics", [NewTopic(self.topic, 1, 1, topic_configs=_TOPIC_CONFIG)])

    async def _admin_call(self, name: str, argument: list[Any]) -> None:
        """Run an admin request; raise LogTrouble when the broker answers an error code."""
        assert self._admin is not None
        answer = await getattr(self._admin, name)(argument)
        codes = getattr(answer, "topic_errors", None) or getattr(answer, "topic_error_codes", [])
        for entry in codes:
            if entry[1] not in (0, TOPIC_ALREADY_EXISTS):
                raise LogTrouble(f"{name} for '{self.topic}' answered error code {entry[1]}")

    # ---- reading -------------------------------------------------------------------------------
    def _apply(self, message: ConsumerRecord[bytes, bytes], replica: Store | None = None) -> None:
        for store in (self.store, replica):
            if store is None:
                continue
            try:
                store.apply(message.key, message.value)
            except (ValueError, KeyError, TypeError) as exc:
                log.error("skipping unreadable %s record at offset %d: %r", self.topic, message.offset, exc)
        self._applied = message.offset

    async def _replay_all(self) -> list[Record]:
        """Read the topic from its start into memory; the records of memory it lacks."""
        assert self._consumer is not None
        await self._consumer.seek_to_beginning(self.tp)
        self._applied = -1
        replica = Store()
        _, marker = await self._send([_noop()])
        while self._applied < marker:
            batches = await self._consumer.getmany(self.tp, timeout_ms=500)
            for message in batches.get(self.tp, []):
                self._apply(message, replica)
        present = set(replica.snapshot())
        return [record for record in self.store.snapshot() if record not in present]

    async def _follow(self) -> str:
        """Apply records as they come; return why the log can no longer be trusted."""
        assert self._consumer is not None
        next_probe = time.monotonic() + self.probe_interval
        while self._problem is None:
            batches = await self._consumer.getmany(self.tp, timeout_ms=200)
            if messages := batches.get(self.tp, []):
                for message in messages:
                    self._apply(message)
                async with self._changed:
                    self._changed.notify_all()
            end = self._consumer.highwater(self.tp)
            if end is not None and end <= self._applied:
                return f"its end offset fell to {end}, not after offset {self._applied} read (emptied or recreated)"
            if time.monotonic() >= next_probe:
                if problem := await self._probe():
                    return problem
                next_probe = time.monotonic() + self.probe_interval
        return self._problem

    async def _probe(self) -> str | None:
        try:
            partitions = await asyncio.wait_for(self._partitions(), 5)
        except SLOW as exc:
            return self._missed_probe(exc)
        except TROUBLE as exc:
            return f"the broker does not answer ({exc!r})"
        self._missed = 0
        if partitions is None:
            return "the topic is gone (deleted, or lost by a broker restart)"
        if partitions != 1:
            return f"the topic was recreated with {partitions} partitions"
        return None

    def _missed_probe(self, exc: BaseException) -> str | None:
        """A slow answer is no lost log: only ``probe_misses`` in a row make it trouble (a busy
        machine once kept one probe past 5 s; a write in that time still times out by itself)."""
        self._missed += 1
        if self._missed < self.probe_misses:
            log.info("the broker did not answer a probe of '%s' within 5 s (%d in a row); asking again",
                     self.topic, self._missed)  # fmt: skip
            return None
        self._missed = 0
        return f"the broker does not answer ({self.probe_misses} probes in a row: {exc!r})"

    # ---- noticing trouble and recovering -------------------------------------------------------
    async def _supervise(self) -> None:
        while True:
            try:
                problem = await self._follow()
            except TROUBLE as exc:
                problem = f"reading it failed: {exc!r}"
            except Exception as exc:  # a bug must not leave the registry acknowledging nothing forever
                log.exception("the %s follower failed", self.topic)
                problem = f"its follower failed: {exc!r}"
            await self._notice(problem)
            await self._recover()

    async def _notice(self, problem: str) -> None:
        """Refuse writes from now on, say why once, and wake writers waiting for a read-back."""
        if self._problem is None:
            self._problem = problem
            log.warning(
                "schema log '%s' on %s cannot be trusted: %s; refusing writes (reads still answered from memory) "
                "until it is reconnected and checked",
                self.topic,
                self.bootstrap,
                problem,
            )
        async with self._changed:
            self._changed.notify_all()

    async def _recover(self) -> None:
        """Reconnect until the topic holds everything in memory again."""
        while not await self._reopen():
            await asyncio.sleep(self.probe_interval)
        log.info("schema log '%s' reconnected at offset %d; accepting writes again", self.topic, self._applied)

    async def _reopen(self) -> bool:
        async with self._write_lock:
            await self._close()
            try:
                await asyncio.wait_for(self._open(), self.timeout)
                return True
            except (*TROUBLE, HeadwaterError) as exc:
                log.debug("schema log '%s' not back yet: %r", self.topic, exc)
            except Exception:
                log.exception("reopening schema log '%s' failed", self.topic)
        return False

    async def _rebuild(self, missing: list[Record]) -> None:
        records = self.store.snapshot()
        self._problem = f"it is being rebuilt from memory ({len(records)} records)"
        log.warning(
            "schema log '%s' on %s lacks %d of the %d records this registry holds (deleted, emptied or "
            "recreated, e.g. by a broker restart): rewriting all of them from memory, ids unchanged",
            self.topic,
            self.bootstrap,
            len(missing),
            len(records),
        )
        started = time.monotonic()
        await self._send(records)
        if still := await self._replay_all():
            raise LogTrouble(f"the rebuilt '{self.topic}' still lacks {len(still)} records")
        ids = sorted(self.store.schemas)
        log.info(
            "schema log '%s' rebuilt from memory: %d records, %d schema ids (highest %s) unchanged, in %.1f s",
            self.topic,
            len(records),
            len(ids),
            ids[-1] if ids else "none",
            time.monotonic() - started,
        )

    # ---- writing ---------------------------------------------------------------------------------
    async def write(self, plan: Callable[[], tuple[T, list[Record]]]) -> T:
        """Run ``plan`` (the answer and the records to append) and append its records.

        Returns the answer once the records are acknowledged and applied here. An answer
        needing no records (e.g. a schema registered before) is given from memory even
        while the log is unavailable; new records are then refused with 503.
        """
        if self._problem is not None:
            answer, records = plan()
            if records:
                raise self._unavailable()
            return answer
        try:
            async with asyncio.timeout(self.write_timeout):
                return await self._locked_write(plan)
        except TimeoutError:
            await self._notice(f"a write was not acknowledged and read back within {self.write_timeout:.0f} s")
            raise self._unavailable() from None

    async def _locked_write(self, plan: Callable[[], tuple[T, list[Record]]]) -> T:
        async with self._write_lock:
            answer, records = plan()
            if records:
                await self._append(records)
            return answer

    async def _append(self, records: list[Record]) -> None:
        if self._problem is not None:
            raise self._unavailable()
        before = self._applied
        try:
            first, last = await self._send(records)
        except KafkaError as exc:
            await self._notice(f"writing to it failed: {exc!r}")
            raise self._unavailable() from exc
        if first <= before:
            await self._notice(f"the broker stored a write at offset {first}, not after offset {before} already read")
            raise self._unavailable()
        async with self._changed:
            await self._changed.wait_for(lambda: self._applied >= last or self._problem is not None)
        if self._applied < last:
            raise self._unavailable()

    async def _send(self, records: list[Record]) -> tuple[int, int]:
        """Send in order; the offsets of the first and last record once all are acknowledged."""
        assert self._producer is not None
        pending = [await self._producer.send(self.topic, key=key, value=value, partition=0) for key, value in records]
        offsets = [metadata.offset for metadata in await asyncio.gather(*pending)]
        return offsets[0], offsets[-1]

    def _unavailable(self) -> errors.RegistryUnavailable:
        return errors.log_unavailable(self.topic, self.bootstrap, self._problem or "it was lost")

    def __repr__(self) -> str:
        return f"SchemaLog(bootstrap={self.bootstrap!r}, topic={self.topic!r}, applied={self._applied})"


_TOPIC_CONFIG = {"cleanup.policy": "compact"}


async def _stop(client: AIOKafkaConsumer | AIOKafkaProducer) -> None:
    """Stop an aiokafka client and close its connections, whatever state the broker left it in."""
    try:
        await asyncio.wait_for(client.stop(), 10)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        # aiokafka's consumer re-raises the cancellation of a fetch task of its own (the broker
        # being away) before it closes its connections; close them, or they keep retrying
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client._client.close(), 10)
    except Exception as exc:
        log.debug("stopping %s failed: %r", type(client).__name__, exc)


def _noop() -> Record:
    return json.dumps({"keytype": "NOOP", "magic": 0}).encode(), json.dumps({"nonce": uuid.uuid4().hex}).encode()
