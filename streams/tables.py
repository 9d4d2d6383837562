"""The workers' state: the latest row of each captured table per key, and the views' join state.

Promise: ``store`` holds the rows of the table-topic partitions this worker is assigned, on
disk (``streams.store``, in ``<state_dir>/<app_id>-tables``), read in by ``streams.tablefeed``
with the table topic as its changelog; it is opened when the worker starts, not at import.
``view_state`` is the views' Faust table (changelog-backed, one partition).
"""

from __future__ import annotations

from typing import Any

from streams.app import app, cfg
from streams.store import TableStore
from streams.topics import VIEWS

store = TableStore(cfg.state_dir / f"{cfg.app_id}-tables")

# The views' join state (rows of the joined tables, published rows, progress markers):
# one partition, like the raw topic it is built from, so its changelog keeps the order of writes.
view_state: Any = None
if VIEWS:
    view_state = app.Table("views.state", key_type=bytes, value_type=bytes, partitions=1, use_partitioner=True,
                           help="join state and published rows of the views")  # fmt: skip
