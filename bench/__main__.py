"""``python -m bench [capture|backfill|fanout|debezium|tables|schema|views|shopview|analytics|lookups|brokerfetch]
[--changes N] [--rows N] [--scale N] [--seconds S] [--rate R] [--workers N] [--connections C] [--burst N] [--drain N]
[--messages N] [--customers N] [--orders N] [--fault pause|kill] [--bootstrap HOST:PORT]`` (or ``./dev bench``);
``capture`` runs the backfill benchmark after its own."""

from __future__ import annotations

import argparse
import sys

from bench import analytics, backfill, brokerfetch, capture, debezium, fanout, lookups, schema, shopview, tables, views
from tables.config import InvalidSetting, check_bootstrap


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("which", nargs="?", default="all",
                        choices=["all", "capture", "backfill", "fanout", "debezium", "tables", "schema", "views",
                                 "shopview", "analytics", "lookups", "brokerfetch"])  # fmt: skip
    parser.add_argument("--changes", type=int, default=1_000_000, help="changes in the slot backlog")
    parser.add_argument("--rows", type=int, default=1_000_000,
                        help="rows to snapshot, orders to backfill, keys of the lookups benchmark")  # fmt: skip
    parser.add_argument("--scale", type=int, default=10,
                        help="pgbench scale of the tables, schema and backfill benchmarks (x 100,000 rows)",
                        )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="steady load of the views benchmark (shopview: at least 120)")  # fmt: skip
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="steady load of the views latency benchmark, transactions/s (default: half the sustained)",
    )
    parser.add_argument("--workers", type=int, default=1,
                        help="stream workers of the views and shopview benchmarks (one group)")  # fmt: skip
    parser.add_argument("--connections", type=int, default=4, help="connections the views benchmark commits from")
    parser.add_argument("--burst", type=int, default=6000, help="transactions of the views benchmark's burst")
    parser.add_argument("--drain", type=int, default=20_000,
                        help="transactions the views benchmark commits while capture is stopped, then drains: each "
                             "stage's capacity (0: none; keep its commits under a minute: PostgreSQL's "
                             "wal_sender_timeout drops a stopped capture)")  # fmt: skip
    parser.add_argument("--bootstrap", default="",
                        help="views: a Kafka of your own (host:port) instead of the bench stack's broker; the run's "
                             "topics get a prefix of their own and are deleted after it")  # fmt: skip
    parser.add_argument("--messages", type=int, default=1_000_000, help="messages of the analytics benchmark's topic")
    parser.add_argument("--customers", type=int, default=20_000, help="customers of the shopview benchmark's shop")
    parser.add_argument("--orders", type=int, default=200_000, help="orders of the shopview benchmark's shop")
    parser.add_argument("--fault", choices=shopview.FAULTS, default=None,
                        help="shopview: 20 s into the load, stop the raw partition's owner for 20 s (pause) or "
                             "kill -9 it and start it again (kill)")  # fmt: skip
    return parser


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; a ``--bootstrap`` that is not host:port, or given to another benchmark, is refused."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.drain < 0:
        parser.error(f"--drain {args.drain}: a number of transactions, 0 or more (0: no drain phase)")
    if args.bootstrap:
        if args.which != "views":
            parser.error("--bootstrap is taken by the views benchmark only: run 'views' with it")
        try:
            check_bootstrap("--bootstrap", args.bootstrap)
        except InvalidSetting as exc:
            parser.error(f"--bootstrap {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.which in ("all", "capture"):
        capture.main(changes=args.changes, rows=args.rows)
    if args.which in ("all", "capture", "backfill"):
        backfill.main(rows=args.rows, scale=args.scale, rate=None)
    if args.which in ("all", "fanout"):
        fanout.main(changes=args.changes)
    if args.which in ("all", "debezium"):
        debezium.main(changes=min(args.changes, 200_000))
    if args.which in ("all", "tables"):
        tables.main(scale=args.scale)
    if args.which in ("all", "schema"):
        schema.main(scale=args.scale)
    if args.which in ("all", "views"):
        views.main(
            seconds=args.seconds,
            burst=args.burst,
            drain=args.drain,
            rate_steady=args.rate,
            workers=args.workers,
            connections=args.connections,
            bootstrap=args.bootstrap,
        )
    if args.which in ("all", "shopview"):
        shopview.main(customers=args.customers, orders=args.orders, seconds=max(args.seconds, 120.0),
                      rate=args.rate or 150.0, workers=args.workers, fault=args.fault)  # fmt: skip
    if args.which in ("all", "analytics"):
        analytics.main(messages=args.messages)
    if args.which in ("all", "lookups"):
        lookups.main(rows=args.rows)
    if args.which in ("all", "brokerfetch"):
        brokerfetch.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
