"""Streams: the Faust app (``faust -A streams worker``): fan-out, tables, query endpoint.

Promise: importing ``streams`` does nothing; asking for ``streams.app`` builds the app
from ``[streams]`` and loads its topics, tables, agents and web views (which discover
the captured tables through the registry). The pure parts (``streams.fanout``,
``streams.rows``, ``streams.config``) import without any service.
"""

from __future__ import annotations

import sys
from typing import Any

from tables.errors import HeadwaterError


def __getattr__(name: str) -> Any:
    if name == "app":
        try:
            from streams import agents, views  # noqa: F401 - registers agents, tables and pages
        except HeadwaterError as exc:  # a bad setting or spec, a service away: say so, not a traceback
            print(f"headwater streams: {exc}", file=sys.stderr)
            raise SystemExit(getattr(exc, "exit_code", 1)) from None
        from streams.app import app

        globals()["app"] = app  # the App, not the submodule of the same name the import just bound
        return app
    raise AttributeError(name)
