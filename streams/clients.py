"""The workers' librdkafka clients: every setting the engine's producers, admin and readers use.

Promise: ``producer_settings``, ``reader_settings`` and ``kafka_client`` are the whole of what
the engine (fan-out, table feed, views, mirror) asks of its Kafka clients; the broker-profile
part is one line: on the local broker (``tansu``) readers wait 10 ms per fetch, because Tansu
holds a fetch for its whole ``fetch.wait.max.ms`` even when records arrive meanwhile. The Faust
app's own settings are the host's (``streams.profile``). Nothing here imports Faust.
"""

from __future__ import annotations

import logging
from typing import Any

from streams.config import StreamsConfig

TABLE_PRODUCER: dict[str, Any] = {
    "enable.idempotence": True,  # librdkafka's idempotence works on Tansu (aiokafka's does not)
    "acks": "all",
    "linger.ms": 5,
    "batch.num.messages": 10000,
    "partitioner": "murmur2_random",  # Java-compatible; the fan-out names partitions itself anyway
    "message.timeout.ms": 0,  # never give a record up: a broker outage stalls, it does not lose
}

TANSU_FETCH_WAIT_MS = 10

# each reader's prefetch queue (librdkafka's default is 64 MB per consumer, and a worker runs several):
# a batch of 10,000 table rows is 1-3 MB, so 16 MB keeps the readers busy and the worker's memory small
READER_QUEUE_KB = 16384


def reader_settings(cfg: StreamsConfig) -> dict[str, Any]:
    """librdkafka settings for the workers' own readers (feeds, tails, ends, the Redis mirror)."""
    tansu = {"fetch.wait.max.ms": TANSU_FETCH_WAIT_MS} if cfg.tansu else {}
    return {"queued.max.messages.kbytes": READER_QUEUE_KB, **kafka_client(cfg), **tansu}


def kafka_client(cfg: StreamsConfig) -> dict[str, Any]:
    """librdkafka settings shared by the workers' producer, admin and readers."""
    return {"bootstrap.servers": cfg.bootstrap, **cfg.kafka, "logger": logging.getLogger("headwater.kafka")}


def producer_settings(cfg: StreamsConfig) -> dict[str, Any]:
    return {**kafka_client(cfg), **TABLE_PRODUCER}
