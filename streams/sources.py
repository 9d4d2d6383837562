"""Which incarnation of each topic a worker's local state was read from, so state of a topic that is gone is dropped.

Promise: the table store and the views' state are read from topics by offset. A topic deleted and made again
— by hand, or by a broker that lost its data, such as the local stack's in-memory broker after a restart —
starts its offsets over with other records: state kept from the old one would skip the new one's first records
and keep rows the new one no longer has. ``Sources`` records, in ``<state_dir>/<app_id>-sources.json``
(owner-only), the Kafka topic id (``tables.kafka.topic_ids``) of the raw topic and of every table topic as the
worker starts; ``stale`` names the recorded topics whose id changed since, or that are gone. ``drop_stale``
drops their state before the stores open: the views' whole state when the raw topic changed (the views are
rebuilt by replaying the new one), a table topic's partitions in the table store (read again from its start),
each with a WARNING saying why; then the new ids are recorded. ``adopt`` does the same for the table topics a
running worker starts to serve (``streams.engine.Engine.adopt``). A topic without an id (a broker before Kafka
2.8) is not checked, and state from before the file existed is taken as it is.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Collection, Mapping
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from streams.store import TableStore
from tables.errors import RetryableError
from tables.kafka import topic_ids

log = logging.getLogger("headwater.streams")


def stale(recorded: Mapping[str, str], current: Mapping[str, str]) -> dict[str, str]:
    """The recorded topics whose id is not the current one: topic -> what happened, in words."""
    found = {}
    for topic, was in recorded.items():
        now = current.get(topic)
        if now != was:
            found[topic] = f"topic id {was}, now {now}" if now else f"topic id {was}, and the topic is gone"
    return found


def read_ids(admin: AdminClient, topics: Collection[str]) -> dict[str, str]:
    """The current ids of ``topics`` (those that exist and have one)."""
    try:
        return topic_ids(admin, topics)
    except KafkaException as exc:
        raise RetryableError(f"asking Kafka for the ids of the topics the worker reads: {exc}",
                             hint="is the broker up? the worker starts once it answers") from exc  # fmt: skip


class Sources:
    """The topic ids a worker's local state was read from, in one small file next to that state."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def recorded(self) -> dict[str, str]:
        """The ids written last ({} before the first)."""
        try:
            found = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("could not read %s (%s): the worker's state is taken as it is", self.path, exc)
            return {}
        return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}

    def record(self, ids: Mapping[str, str]) -> None:
        """Replace the file at once (a crash leaves the old one or the new one), readable by its owner only."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        spare = self.path.with_name(self.path.name + ".new")
        fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(dict(sorted(ids.items())), out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(spare, self.path)


def drop_stale(sources: Sources, ids: Mapping[str, str], raw_topic: str, tables: TableStore, views: Path) -> None:
    """Drop the state read from topics that are not the ones it was read from, then record ``ids``."""
    gone = stale(sources.recorded(), ids)
    if raw_topic in gone and views.exists():
        log.warning("%s is not the raw topic the views' state in %s was read from (%s: deleted and made again, or "
                    "a broker that lost its data): the views are rebuilt from the new topic's start",
                    raw_topic, views, gone[raw_topic])  # fmt: skip
        shutil.rmtree(views)
    forget(tables, {t: why for t, why in gone.items() if t != raw_topic})
    sources.record(ids)


def forget(tables: TableStore, gone: Mapping[str, str]) -> None:
    """Drop the table store's partitions of the table topics in ``gone`` (topic -> what happened), each with a
    WARNING; the store is left open or closed as it was (a store not made yet holds nothing to drop)."""
    if not gone or not tables.path.exists():
        return
    closed = tables.db is None
    if closed:
        tables.open()
    try:
        for topic in sorted(gone):
            log.warning("%s is not the table topic the table store read (%s): its partitions are read again "
                        "from the start", topic, gone[topic])  # fmt: skip
            tables.forget_topic(topic)
    finally:
        if closed:
            tables.close()


def adopt(sources: Sources, ids: Mapping[str, str], tables: TableStore) -> None:
    """Table topics a running worker starts to serve: what its store read from an earlier topic of the same name
    is dropped (as at start), and their ids join the record. Call it where nothing opens or closes the store."""
    recorded = sources.recorded()
    forget(tables, stale({t: recorded[t] for t in ids if t in recorded}, ids))
    sources.record({**recorded, **ids})
