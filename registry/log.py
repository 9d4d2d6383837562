"""The registry's durable log: a one-partition compacted Kafka topic (``_schemas``).

Promise: ``start`` creates the topic if missing and replays it completely before
returning (it writes a NOOP marker and reads until it sees it, so it needs no end
offset from the broker); afterwards a background task keeps applying records that
any instance writes. ``append`` returns only once Kafka acknowledged the records
(acks=all) and this instance has applied them, so a write is readable at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from headwater.errors import FatalError
from registry import errors
from registry.store import Record, Store

log = logging.getLogger("headwater.registry")


class SchemaLog:
    """Keeps ``store`` equal to the replayed topic and appends new records to it."""

    def __init__(self, bootstrap: str, topic: str, store: Store, *, timeout: float = 30.0) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.store = store
        self.timeout = timeout
        self.tp = TopicPartition(topic, 0)
        self._applied = -1
        self._changed = asyncio.Condition()
        self._write_lock = asyncio.Lock()
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._tail: asyncio.Task[None] | None = None

    async def start(self) -> None:
        try:
            await asyncio.wait_for(self._connect(), self.timeout)
        except (KafkaError, OSError, TimeoutError) as exc:
            await self.stop()
            raise FatalError(
                f"the registry cannot reach Kafka at {self.bootstrap} for its '{self.topic}' topic: {exc!r}",
                hint="start the broker first ('headwater stack up') or pass the right --bootstrap",
            ) from exc
        self._tail = asyncio.create_task(self._follow())
        marker = await self._send([self._noop()])
        await self._wait_applied(marker)
        log.info("registry replayed %s up to offset %d", self.topic, marker)

    async def _connect(self) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            if self.topic not in await admin.list_topics():
                await admin.create_topics([NewTopic(self.topic, 1, 1, topic_configs={"cleanup.policy": "compact"})])
        finally:
            await admin.close()
        # acks=all; no idempotence: Tansu answers aiokafka's InitProducerId with an error,
        # and the registry writes one record at a time under a lock anyway.
        self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=0)
        await self._producer.start()
        # a short fetch wait: a write is answered once this consumer has read it back
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=20,
        )
        await self._consumer.start()
        self._consumer.assign([self.tp])
        await self._consumer.seek_to_beginning(self.tp)

    @staticmethod
    def _noop() -> Record:
        return json.dumps({"keytype": "NOOP", "magic": 0}).encode(), json.dumps({"nonce": uuid.uuid4().hex}).encode()

    async def _follow(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(self.tp, timeout_ms=500)
            for message in batches.get(self.tp, []):
                try:
                    self.store.apply(message.key, message.value)
                except (ValueError, KeyError, TypeError) as exc:
                    log.error("skipping unreadable %s record at offset %d: %r", self.topic, message.offset, exc)
                async with self._changed:
                    self._applied = message.offset
                    self._changed.notify_all()

    async def _send(self, records: list[Record]) -> int:
        assert self._producer is not None
        last = -1
        for key, value in records:
            metadata = await self._producer.send_and_wait(self.topic, key=key, value=value, partition=0)
            last = metadata.offset
        return last

    async def _wait_applied(self, offset: int) -> None:
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self._applied >= offset), self.timeout)

    async def append(self, records: list[Record]) -> None:
        """Write ``records`` and return once they are applied here."""
        if not records:
            return
        async with self._write_lock:
            try:
                offset = await asyncio.wait_for(self._send(records), self.timeout)
                await self._wait_applied(offset)
            except (KafkaError, TimeoutError) as exc:
                raise errors.store_error(f"writing to '{self.topic}' failed: {exc!r}") from exc

    async def stop(self) -> None:
        if self._tail is not None:
            self._tail.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tail
        for client in (self._consumer, self._producer):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.stop()

    def __repr__(self) -> str:
        return f"SchemaLog(bootstrap={self.bootstrap!r}, topic={self.topic!r}, applied={self._applied})"
