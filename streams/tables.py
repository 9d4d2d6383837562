"""Changelog-backed Faust tables: the latest row of each captured table, per key.

Promise: one table per table topic, named ``rows.<topic>``, keyed by the key bytes as
on the topic and co-partitioned with it (same partition count, same murmur2 placement;
changelog records are placed by that partitioner, ``use_partitioner``, since a batch
of events has no single source partition), so a worker holds exactly the rows of the
partitions it owns, recovered from the changelog after a restart. Values are
``streams.rows.pack``-ed rows. Keys and values are declared ``bytes``: Faust picks a
table's changelog serializer from ``key_type`` and ``value_type`` (a ``schema``
argument is not enough: recovery would decode JSON).
"""

from __future__ import annotations

from typing import Any

from streams.app import app, cfg
from streams.topics import TABLES, VIEWS

rows: dict[str, Any] = {
    t.topic: app.Table(
        f"rows.{t.topic}",
        key_type=bytes,
        value_type=bytes,
        partitions=cfg.partitions,
        use_partitioner=True,
        help=f"latest row per key of {t.qualified}",
    )
    for t in TABLES
}

# The views' join state (rows of the joined tables, published rows, progress markers):
# one partition, like the raw topic it is built from, so its changelog keeps the order of writes.
view_state: Any = None
if VIEWS:
    view_state = app.Table("views.state", key_type=bytes, value_type=bytes, partitions=1, use_partitioner=True,
                           help="join state and published rows of the views")  # fmt: skip
