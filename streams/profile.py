"""The Faust app's broker profile: the host's side of every broker-specific setting.

Promise: ``faust_settings(cfg)`` and ``app_class(cfg)`` are the whole of what the host asks of
Faust's Kafka clients (the engine's librdkafka clients are ``streams.clients``). The ``tansu``
profile adds what the local broker needs and nothing else: changelog end offsets found by
fetching (Tansu's ListOffsets answers a multi-record batch's base offset + 1), short group
timeouts (a join takes 30 s with Faust's defaults) and short fetch waits: Tansu holds a fetch
for its whole ``max wait`` even when records arrive meanwhile, and Faust hard-codes 1500 ms —
every hop would add up to 1.5 s (``app_class`` gives the app a consumer that waits 10 ms).
Against real Kafka (``kafka``) none of it applies, but Faust's 60 s group session is cut to
10 s (``KAFKA_FAUST``): a worker killed with ``kill -9`` holds its partitions until its session
times out, and on Kafka 3.6 its restarted self served again only after 60 s. ``[streams]
group_instance_id`` turns on static membership (KIP-345) for workers restarted in place. SASL/TLS
settings in librdkafka names map onto Faust's credentials. On both profiles the app's consumer
never delivers the topics named in ``App.direct`` (the raw topic and the table topics): Faust
assigns them, the engine reads them itself (``streams.feed``, ``streams.tablefeed``), and with
nothing to deliver the consumer still polls (aiokafka would count the worker idle and leave the
group for good after ``broker_max_poll_interval``); and no
worker client asks the broker to auto-create a topic (``app_class``).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

import faust
from aiokafka import client as aiokafka_client
from aiokafka.protocol.metadata import MetadataRequest
from faust.transport.consumer import RecordMap
from faust.transport.drivers import aiokafka as faust_kafka
from faust.types import TP, Message

from streams.clients import TANSU_FETCH_WAIT_MS
from streams.config import StreamsConfig
from tables.errors import FatalError
from tables.kafka import fetched_ends

KAFKA_FAUST: dict[str, Any] = {"broker_session_timeout": 10.0, "broker_heartbeat_interval": 3.0}
TANSU_FAUST: dict[str, Any] = {
    "broker_session_timeout": 6.0,
    "broker_rebalance_timeout": 6.0,
    "broker_heartbeat_interval": 1.0,
}

NOTHING = TP("", -1)  # a partition of no topic: what a worker's poll asks for when Faust has nothing to deliver


class _DirectConsumer(faust_kafka.Consumer):
    """Fetches and delivers everything assigned except the app's ``direct`` topics.

    Leaving them out of the active partitions spares fetching them; the active set is shared
    with the consumer thread and refilled in place on resume, so delivery is filtered too.
    """

    def _get_active_partitions(self) -> set[TP]:
        tps = super()._get_active_partitions()
        tps.difference_update([tp for tp in tps if tp.topic in cast(App, self.app).direct])
        return tps

    async def _wait_next_records(self, timeout: float) -> tuple[RecordMap | None, set[TP] | None]:
        """With every assigned partition direct, Faust would sleep instead of fetching; aiokafka counts that time
        as idle and leaves the group once it passes ``broker_max_poll_interval`` (1000 s) from the worker's start,
        never to join again (seen: each worker of the 720k shop bench left 1000 s after it started). A fetch of
        a partition no topic has (``NOTHING``; an empty set would mean every one, and drain the direct ones),
        answered at once, is a poll: the worker stays in the group as long as its event loop runs."""
        if self.flow_active and not self._get_active_partitions():
            await self._getmany(active_partitions={NOTHING}, timeout=0)
            await self.sleep(1)  # what Faust does without active partitions
            return {}, set()
        return await super()._wait_next_records(timeout)

    async def getmany(self, timeout: float) -> AsyncIterator[tuple[TP, Message]]:
        direct = cast(App, self.app).direct
        async for tp, message in super().getmany(timeout):
            if tp.topic not in direct:
                yield tp, message

    def _new_consumer_thread(self) -> faust_kafka.AIOKafkaConsumerThread:
        return _RoutedThread(self, loop=self.loop, beacon=self.beacon)

    def verify_event_path(self, now: float, tp: TP) -> None:
        """Faust's slow-stream check, except for the direct topics: no stream ever processes them here, so
        it would log "Stream has not started processing" for each of their partitions every few minutes."""
        if tp.topic not in cast(App, self.app).direct:
            super().verify_event_path(now, tp)


class _RoutedThread(faust_kafka.AIOKafkaConsumerThread):
    """Joins the group with Faust's own assignor, always: its metadata says which worker (URL) holds
    each partition, and the endpoint routes keys by it; Faust falls back to aiokafka's round-robin
    assignor when an app has no changelog table (the table rows are not Faust tables)."""

    def _create_worker_consumer(self, transport: faust_kafka.Transport) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._partition_assignment_strategy = [self.app.assignor]  # read when the consumer starts
        return consumer


class _ShortFetchThread(_RoutedThread):
    def _create_worker_consumer(self, transport: faust_kafka.Transport) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._fetch_max_wait_ms = TANSU_FETCH_WAIT_MS  # read when the fetcher starts
        return consumer

    async def _highwaters(self, partitions: list[TP]) -> Mapping[TP, int]:
        """End offsets as fetches find them: Tansu's ListOffsets answers a multi-record batch's base + 1."""
        reported = await super()._highwaters(partitions)
        servers = ",".join(f"{url.host}:{url.port}" for url in self.app.conf.broker)
        return await asyncio.to_thread(true_ends, servers, reported)


def true_ends(servers: str, reported: Mapping[TP, int]) -> dict[TP, int]:
    """Each partition's end found by fetching (``tables.kafka.fetched_ends``)."""
    if not any(end > 0 for end in reported.values()):
        return dict(reported)
    settings = {"bootstrap.servers": servers, "fetch.wait.max.ms": TANSU_FETCH_WAIT_MS}
    found = fetched_ends(settings, cast(Mapping[tuple[str, int], int], reported))
    return {tp: found[tp] for tp in reported}


class _ShortFetchConsumer(_DirectConsumer):
    def _new_consumer_thread(self) -> faust_kafka.AIOKafkaConsumerThread:
        return _ShortFetchThread(self, loop=self.loop, beacon=self.beacon)


class _DirectTransport(faust_kafka.Transport):
    Consumer = _DirectConsumer


class _ShortFetchTransport(faust_kafka.Transport):
    Consumer = _ShortFetchConsumer


class App(faust.App):
    """The workers' Faust app: ``direct`` topics are assigned by Faust but read by their owner."""

    direct: frozenset[str] = frozenset()
    transport_class: type[faust_kafka.Transport] = _DirectTransport

    def _new_transport(self) -> Any:
        return self.transport_class(self.conf.broker_consumer, self)


class TansuApp(App):
    """An app whose consumer fetches with a short wait (see the module promise)."""

    transport_class = _ShortFetchTransport


class _NoAutoCreate(MetadataRequest):
    """A metadata request that does not ask the broker to make the topics it names."""

    def __init__(self, topics: list[str] | None = None, allow_auto_topic_creation: bool | None = False) -> None:
        super().__init__(topics, allow_auto_topic_creation)


def app_class(cfg: StreamsConfig) -> type[App]:
    """The app for the broker profile. The workers' aiokafka clients stop asking for topic
    auto-creation (aiokafka asks for it in every metadata request): every topic they use is made
    on purpose, and a broker that lost its topics must not get the raw topic back empty with its
    default partition count from a worker's subscription."""
    aiokafka_client.MetadataRequest = _NoAutoCreate
    return TansuApp if cfg.tansu else App


def faust_credentials(settings: dict[str, str]) -> faust.types.auth.CredentialsT | None:
    """Faust's credentials from librdkafka-style settings (security.protocol, sasl.*, ssl.*)."""
    protocol = settings.get("security.protocol", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return None
    context = None
    if protocol in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=settings.get("ssl.ca.location"))
        if "ssl.certificate.location" in settings:
            context.load_cert_chain(settings["ssl.certificate.location"], settings.get("ssl.key.location"))
    if protocol == "SSL":
        return faust.SSLCredentials(context)
    if protocol not in ("SASL_PLAINTEXT", "SASL_SSL"):
        raise FatalError(f"[streams] kafka: unknown security.protocol {protocol!r}",
                         hint="use PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL")  # fmt: skip
    mechanism = settings.get("sasl.mechanism", "PLAIN").upper()
    user, password = settings.get("sasl.username"), settings.get("sasl.password")
    if mechanism == "PLAIN":
        return faust.SASLCredentials(username=user, password=password, ssl_context=context)
    if mechanism.startswith("SCRAM-"):
        return faust.SASLCredentials(username=user, password=password, ssl_context=context, mechanism=mechanism)
    raise FatalError(f"[streams] kafka: sasl.mechanism {mechanism!r} is not supported by the workers",
                     hint="use PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512")  # fmt: skip


def faust_settings(cfg: StreamsConfig) -> dict[str, Any]:
    """Keyword arguments for ``faust.App``."""
    settings: dict[str, Any] = {
        "broker": [f"kafka://{host.strip()}" for host in cfg.bootstrap.split(",") if host.strip()],
        "broker_credentials": faust_credentials(dict(cfg.kafka)),
        "store": "memory://",
        # every key and value the workers handle stays bytes (row images are forwarded as encoded)
        "key_serializer": "raw",
        "value_serializer": "raw",
        "topic_partitions": cfg.partitions,
        "topic_replication_factor": cfg.replication_factor,
        "topic_disable_leader": True,
        "table_standby_replicas": cfg.table_standby_replicas,
        "consumer_auto_offset_reset": "earliest",
        # Faust waits for every delivered event to be acked before a rebalance or a stop, but events
        # sitting in a take_events buffer when the agents stop are never acked: the worker would hang
        # (seen at SIGTERM). The agents keep their own checkpoints, and unacked events are not
        # committed, so they come again to whoever owns the partition next.
        "stream_wait_empty": False,
        "producer_acks": -1,
        "web_enabled": True,
        "web_bind": cfg.web_host,
        "web_host": cfg.web_host,
        "web_port": cfg.web_port,
        "datadir": str(cfg.state_dir),
    }
    if cfg.canonical_url:
        settings["canonical_url"] = cfg.canonical_url
    if cfg.group_instance_id:
        settings["consumer_group_instance_id"] = cfg.group_instance_id
    settings.update(TANSU_FAUST if cfg.tansu else KAFKA_FAUST)
    return settings
