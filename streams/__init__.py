"""Streams: the Faust app (``faust -A streams worker``): fan-out, tables, query endpoint.

Promise: importing ``streams`` does nothing; asking for ``streams.app`` builds the app
from ``[streams]`` and loads its topics, tables, agents and web views (which discover
the captured tables through the registry). The pure parts (``streams.fanout``,
``streams.rows``, ``streams.config``) import without any service.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "app":
        from streams import agents, views  # noqa: F401 - registers agents, tables and pages
        from streams.app import app

        globals()["app"] = app  # the App, not the submodule of the same name the import just bound
        return app
    raise AttributeError(name)
