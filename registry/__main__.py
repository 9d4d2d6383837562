"""``python -m registry``: serve the embedded schema registry (the local stack runs this).

Promise: binds to 127.0.0.1 unless told otherwise, replays ``_schemas`` before it
answers, and exits non-zero with a clear message when Kafka cannot be reached.
"""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from registry.log import SchemaLog
from registry.server import make_app
from registry.store import Store
from tables import logs
from tables.errors import HeadwaterError

log = logging.getLogger("headwater.registry")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registry", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092", help="Kafka bootstrap servers")
    parser.add_argument("--topic", default="_schemas", help="compacted topic holding the registry's state")
    parser.add_argument("--log-level", choices=logs.LEVELS, type=str.lower,
                        help=f"default: ${logs.LEVEL_ENV}, else info")
    parser.add_argument("--log-format", choices=logs.FORMATS, type=str.lower,
                        help=f"text, or json: one object per line (default: ${logs.FORMAT_ENV}, else text)")
    args = parser.parse_args(argv)
    try:
        logs.setup("registry", logs.log_options(args.log_level, args.log_format))
    except HeadwaterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    store = Store()
    app = make_app(store, SchemaLog(args.bootstrap, args.topic, store))
    log.warning("registry starting on %s:%d, state in %s at %s", args.host, args.port, args.topic, args.bootstrap,
                extra=logs.facts(topic=args.topic))  # fmt: skip
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    except HeadwaterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    finally:
        log.warning("registry stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
