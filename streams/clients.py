"""The workers' librdkafka clients: every setting the engine's producers, admin and readers use.

Promise: ``producer_settings`` (``view_rows_settings``), ``reader_settings`` and ``kafka_client``
are the whole of what the engine (fan-out, table feed, views, mirror) asks of its Kafka clients; the broker-profile
part is two lines: on the local broker (``tansu``) a long-lived reader at the tail (``follows``:
the feeds, the Redis mirror, the cut-maker's fragments) waits ``TANSU_FOLLOW_WAIT_MS`` (100 ms)
per fetch and a read to an end 10 ms (``TANSU_FETCH_WAIT_MS``), both grown when fetches come
back empty below the end (``tables.kafka.FetchWait``); and the table feed fetches up to 16 MB
at once there, because Tansu lists every batch of a partition for
each fetch (its object-store engine, 0.6.0): the table topics hold many small batches, and at
1 MB a fetch a 5M-row load (1.25M rows a partition) fell to a few hundred rows a second and
stalled. The raw topic's batches are capture's (up to 4 MiB of changes each, lz4), few and large:
its readers keep 1 MB fetches, which is what bounds their memory. The fan-out lingers 20 ms
(Kafka Streams: 100 ms), so a table topic gets fewer, larger batches (the views' rows, whose cuts
wait for them, 5 ms), and never asks the broker to make a topic by writing to it
(``streams.errors.refused`` names a topic the broker lost). The Faust app's own settings are the
host's (``streams.profile``). Nothing here imports Faust.
"""

from __future__ import annotations

import logging
from typing import Any

from streams.config import StreamsConfig
from tables.logs import KAFKA_LOGGER

TABLE_PRODUCER: dict[str, Any] = {
    "enable.idempotence": True,  # librdkafka's idempotence works on Tansu (aiokafka's does not)
    "acks": "all",
    "linger.ms": 20,
    "batch.num.messages": 10000,
    "partitioner": "murmur2_random",  # Java-compatible; the fan-out names partitions itself anyway
    "message.timeout.ms": 0,  # never give a record up: a broker outage stalls, it does not lose
    # a topic the broker lost is not made again by a write (with 1 partition, by the local broker): its records
    # fail with an unknown partition once the broker's metadata shows it missing, and the workers say it is gone
    "allow.auto.create.topics": False,
}

VIEW_ROWS_LINGER_MS = 5
TANSU_FETCH_WAIT_MS = 10  # a read to an end: at the end the broker holds an empty fetch for its whole wait
# A reader that follows a partition at its tail. Tansu 0.6.0 answers a held fetch as soon as a record comes (produce
# -> consume, median: 0.6-1.6 ms at 100-500 ms waits against 3.2-3.6 ms at 10 ms for one partition; ~10 ms for four
# read by one consumer), so a longer wait costs the tail little, and an idle worker's readers at 10 ms kept the broker
# answering ~500 fetches a second: 0.355 of a core against 0.079 at 100 ms, and 26% less of the broker's CPU under
# the views benchmark's load (bench/RESULTS.md, "What an idle pipeline costs on the local stack").
TANSU_FOLLOW_WAIT_MS = 100
TANSU_TABLE_FETCH = 16 << 20  # bytes a table feed's fetch may bring on the local broker (see the promise)

# What each reader may hold fetched ahead of its handler. librdkafka checks its queue's limits only
# before a fetch, and one fetch brings up to fetch.max.bytes of *compressed* batches (Tansu ignores
# max.partition.fetch.bytes): with the defaults (50 MB per fetch, 100,000 messages per partition) a
# worker starting behind a 1M-row raw topic (lz4) held ~190 MB of fetched changes (heaptrack: message
# ops and decompressed batches; 15 MB of Python objects). A 1 MB fetch holds a reader draining
# 1M messages at 164 MB of RSS instead of 403-426 MB, as fast (26 s); a full queue is looked at again
# after 20 ms, not librdkafka's 1 s (``tables.kafka.reader``, which every reader here is made by), so a
# fast handler never waits for a fetch.
READER_MEMORY: dict[str, Any] = {
    "queued.max.messages.kbytes": 8192,
    "queued.min.messages": 20000,
    "max.partition.fetch.bytes": 256 << 10,
    "fetch.max.bytes": 1 << 20,
}


def reader_settings(cfg: StreamsConfig, *, table_feed: bool = False, follows: bool = False) -> dict[str, Any]:
    """librdkafka settings for the workers' own readers (feeds, tails, ends, the Redis mirror); ``follows``: one
    that stays at a partition's tail (see the module promise)."""
    client = kafka_client(cfg)
    largest = int(client.get("message.max.bytes", 1_000_000))  # librdkafka: fetch.max.bytes >= message.max.bytes
    fetch = max(TANSU_TABLE_FETCH if cfg.tansu and table_feed else 1 << 20, largest)
    wait = TANSU_FOLLOW_WAIT_MS if follows else TANSU_FETCH_WAIT_MS
    tansu = {"fetch.wait.max.ms": wait} if cfg.tansu else {}
    return {**READER_MEMORY, "fetch.max.bytes": fetch, **tansu, **client}


def kafka_client(cfg: StreamsConfig) -> dict[str, Any]:
    """librdkafka settings shared by the workers' producer, admin and readers."""
    return {"bootstrap.servers": cfg.bootstrap, **cfg.kafka, "logger": logging.getLogger(KAFKA_LOGGER)}


def producer_settings(cfg: StreamsConfig) -> dict[str, Any]:
    return {**kafka_client(cfg), **TABLE_PRODUCER}


def view_rows_settings(cfg: StreamsConfig) -> dict[str, Any]:
    """The views' rows producer: the table producer's, lingering ``VIEW_ROWS_LINGER_MS``. A publication's rows
    are sent in one go and the next point waits for their acknowledgement, so the table topics' 20 ms only
    delayed every cut: commit -> view topic p50 69-78 ms against 99-108 ms at 2,200 transactions/s, and Redis
    92-107 against 131-149 ms (bench/RESULTS.md, "The views benchmark measured itself")."""
    return {**producer_settings(cfg), "linger.ms": VIEW_ROWS_LINGER_MS}
