"""The workers' state: the latest row of each captured table per key, and the views' join state.

Promise: ``store`` holds the rows of the table-topic partitions this worker is assigned, on
disk (``streams.store``, in ``<state_dir>/<app_id>-tables``), read in by ``streams.tablefeed``
with the table topic as its changelog; it is opened when the worker starts, not at import.
``view_store`` holds the views' join state on disk (``streams.viewstore``, in
``<state_dir>/<app_id>-views``), opened by the views when they start.
"""

from __future__ import annotations

from streams.app import cfg
from streams.store import TableStore
from streams.viewstore import ViewStore

store = TableStore(cfg.state_dir / f"{cfg.app_id}-tables")
view_store = ViewStore(cfg.state_dir / f"{cfg.app_id}-views")
