"""The topics the workers read: the raw change topic and the per-table topics.

Promise: at import the captured tables are discovered through the registry, the view
specs are validated against them (their schemas registered), and every topic exists —
compacted, with ``[streams] partitions`` partitions — before any agent subscribes
(Faust would otherwise subscribe to a topic the broker makes up). Values and keys
stay bytes: row images are forwarded as capture encoded them.
"""

from __future__ import annotations

import faust

from streams.app import app, cfg
from streams.catalog import TableTopic, discover
from streams.config import load_views
from streams.materializer import ViewTopic, setup_views
from streams.writer import TableWriter
from tables.registry import Registry

schemas = Registry(cfg.registry_url)
TABLES: list[TableTopic] = discover(cfg, schemas)
writer = TableWriter(cfg)
writer.ensure_topics([t.topic for t in TABLES])
writer.ensure_topics([cfg.dlq_topic], partitions=1, compact=False)
app.direct = app.direct | {t.topic for t in TABLES}  # read by the table feed (streams.tablefeed)
VIEWS: dict[str, ViewTopic]
VIEWS, SHAPES = setup_views(cfg, load_views(), TABLES, schemas, writer)

# Faust assigns the raw topic and the table topics but never delivers them (App.direct)
changes = app.topic(cfg.changes_topic, key_type=bytes, value_type=bytes, key_serializer="raw",
                    value_serializer="raw", acks=False)  # fmt: skip


class TableTopics(faust.Topic):
    """The table topics as one subscription, named by all of them (``faust -A streams agents`` lists it)."""

    def get_topic_name(self) -> str:
        return ", ".join(self.topics)


table_topics = (
    TableTopics(
        app,
        topics=[t.topic for t in TABLES],
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
        partitions=cfg.partitions,
    )
    if TABLES
    else None
)


def find(name: str) -> TableTopic | None:
    """A table by URL name: ``customers`` (public), ``schema.table`` or its topic."""
    for t in TABLES:
        if name in (t.short, t.qualified, t.topic):
            return t
    return None
