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
from tables.errors import HeadwaterError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registry", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8081)
    parser.add_argument("--bootstrap", default="127.0.0.1:9092", help="Kafka bootstrap servers")
    parser.add_argument("--topic", default="_schemas", help="compacted topic holding the registry's state")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = Store()
    app = make_app(store, SchemaLog(args.bootstrap, args.topic, store))
    try:
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    except HeadwaterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
