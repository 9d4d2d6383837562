"""Streams: the engine (fan-out, tables, views) and its Faust host (``faust -A streams worker``).

Promise: importing ``streams`` or any of its modules does nothing; asking for ``streams.app``
builds the app from ``[streams]`` and the config file's views (``streams.host.build``: tables
discovered through the registry, topics made, agents and endpoint pages added). The engine's
parts (``streams.engine`` and what it wires) import and run without Faust.
"""

from __future__ import annotations

import sys
from typing import Any

from tables.errors import HeadwaterError


def __getattr__(name: str) -> Any:
    if name == "app":
        from streams.config import load_streams_config
        from streams.host import build

        try:
            app = build(load_streams_config())
        except HeadwaterError as exc:  # a bad setting or spec, a service away: say so, not a traceback
            print(f"headwater streams: {exc}", file=sys.stderr)
            raise SystemExit(getattr(exc, "exit_code", 1)) from None
        globals()["app"] = app
        return app
    raise AttributeError(name)
