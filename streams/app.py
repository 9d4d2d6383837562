"""The Faust app, bound once: ``faust -A streams worker`` finds it as ``streams.app``.

Promise: the app is built from ``[streams]`` (file and environment) with the broker
profile's settings; agents, topics, tables and web views live in their own modules
that import it, and ``streams`` loads them all when the app is first asked for.
"""

from __future__ import annotations

import logging

from streams import profile
from streams.config import load_streams_config
from tables.registry import shown

cfg = load_streams_config()
app = profile.app_class(cfg)(cfg.app_id, **profile.faust_settings(cfg))
app.direct = frozenset({cfg.changes_topic})  # its owner reads it in batches (streams.feed)
logging.getLogger("headwater.streams").info(
    "streams app %s: broker %s (%s profile), registry %s", cfg.app_id, cfg.bootstrap, cfg.broker_profile,
    shown(cfg.registry_url),
)  # fmt: skip
