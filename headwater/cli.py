"""The ``headwater`` command: the local stack, the sample shop, the demo, capture and analytics.

Promise: every subcommand reads its settings from the config file, the environment
and flags (see ``tables.config``), and its ``--help`` lists only the flags it uses;
``config show`` prints each component's effective settings with where each came from,
secrets masked. Any ``HeadwaterError`` ends the command with a one-paragraph message on
stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import psycopg2

from analytics.config import JOB_HELP, AnalyticsConfig, load_analytics, load_analytics_config
from capture.config import CaptureConfig, load_capture, load_capture_config
from headwater import __version__, shop, stack
from tables import extras, logs
from tables.config import (
    Loaded,
    PipelineConfig,
    add_flags,
    config_path,
    display,
    flag_values,
    load,
    load_component,
    load_traced,
)
from tables.errors import ConfigError, FatalError, HeadwaterError
from tables.registry import shown


def stack_config(args: argparse.Namespace) -> stack.StackConfig:
    path = config_path(args.config, os.environ)
    return load(stack.StackConfig, "stack", path=path, flags=flag_values(args, stack.StackConfig))


def _connect(cfg: stack.StackConfig) -> psycopg2.extensions.connection:
    try:
        return psycopg2.connect(cfg.dsn(), connect_timeout=5)
    except psycopg2.OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise FatalError(
            f"cannot connect to {cfg.display_dsn()}: {first}",
            hint="start the local stack with 'headwater stack up'",
        ) from exc


# ---- stack ----------------------------------------------------------------------------
def cmd_stack_up(args: argparse.Namespace) -> int:
    extras.require("local", "the embedded stack (headwater stack up)")
    cfg = stack_config(args)
    started = stack.up(cfg)
    print(f"started: {', '.join(started)}" if started else "already running: nothing to start")
    return cmd_stack_status(args)


def cmd_stack_down(args: argparse.Namespace) -> int:
    stopped = stack.down(stack_config(args))
    print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    return 0


def cmd_stack_status(args: argparse.Namespace) -> int:
    rows = stack.status(stack_config(args))
    for row in rows:
        pid = f"pid {row.pid}" if row.pid else ""
        print(f"{row.name:<9} {row.state:<10} {row.address:<48} {pid}")
    return 0 if all(r.healthy for r in rows) else 3


# ---- demo -----------------------------------------------------------------------------
def cmd_demo_seed(args: argparse.Namespace) -> int:
    cfg = stack_config(args)
    conn = _connect(cfg)
    try:
        scale = shop.Scale(customers=args.customers, products=args.products, orders=args.orders)
        if shop.create(conn, scale):
            print(f"sample shop created and seeded in {cfg.display_dsn()}")
        else:
            print(f"sample shop already present in {cfg.display_dsn()}")
        _print_counts(shop.counts(conn))
    finally:
        conn.close()
    return 0


def cmd_demo_load(args: argparse.Namespace) -> int:
    cfg = stack_config(args)
    conn = _connect(cfg)
    try:
        shop.create(conn)
        work = shop.Workload(conn, rng_seed=args.seed, reconnect=lambda: _connect(cfg))
        started = time.monotonic()
        try:
            work.run(rate=args.rate, duration=args.duration)
        finally:
            conn = work.conn  # a new one after a PostgreSQL restart
        elapsed = time.monotonic() - started
        print(
            f"{work.committed} transactions committed, {work.rolled_back} rolled back in {elapsed:.1f} s"
            f" ({work.committed / elapsed:.0f}/s)"
        )
        if work.interrupted:
            print(f"  {work.interrupted} interrupted by a lost connection (committed or not: unknown)")
        print("  " + ", ".join(f"{k} {v}" for k, v in sorted(work.by_kind.items())))
        _print_counts(shop.counts(conn))
    finally:
        conn.close()
    return 0


def _print_counts(counts: dict[str, int]) -> None:
    print("  rows: " + ", ".join(f"{table} {n}" for table, n in counts.items()))


def cmd_demo(args: argparse.Namespace) -> int:
    """The README's first command: bring everything up, seed, capture, run a little load, show it."""
    extras.require("local", "the demo")
    extras.require("analytics", "the demo (it runs the Spark report)")
    from headwater import demo

    print("== bringing up the local stack")
    cmd_stack_up(args)
    print("\n== the sample shop")
    cmd_demo_seed(args)
    local, capture = stack_config(args), capture_config(args)
    print(f"\n== capture: snapshot, then every committed change into {capture.changes_topic}")
    stack_env = {f"HEADWATER_STACK_{k.upper()}": str(v) for k, v in flag_values(args, stack.StackConfig).items()}
    passthrough = (["--config", args.config] if args.config else []) + _as_flags(flag_values(args, CaptureConfig))
    pid = demo.start_capture(local, capture, passthrough, stack_env)
    demo.wait_caught_up(capture, pid)  # the load must come after the slot's start, or the snapshot holds all of it
    print(f"\n== running the shop workload for {args.duration:g} s at {args.rate:g} tx/s")
    cmd_demo_load(args)
    demo.wait_caught_up(capture, pid)
    print(f"\n== what capture wrote to {capture.changes_topic} (Avro, schemas in {shown(capture.registry_url)})")
    demo.show_changes(capture)
    capture_url = f"http://{capture.metrics_host}:{capture.metrics_port}"
    if capture.metrics_port:
        print("\n== capture's metrics (Prometheus), health and readiness")
        demo.wait_reported(capture, capture_url)
        demo.show_metrics(capture_url, demo.CAPTURE_SHOWN, focus={"table": "public.orders"})
    print(f"\n== streams: faust -A streams worker fans {capture.changes_topic} out into per-table topics")
    env = {"HEADWATER_CONFIG": demo.worker_config(args.config, local), **stack_env}
    from streams.config import load_streams_config

    streams_cfg = load_streams_config({**os.environ, **env})
    url = f"http://{streams_cfg.web_host}:{streams_cfg.web_port}"
    worker = demo.start_worker(local, env, streams_cfg.web_port)
    demo.show_streams(capture, worker, url)
    print("\n== views: orders joined with their customer, items and products, kept in Redis")
    demo.show_views(streams_cfg, env, capture, url)
    print("\n== analytics: PySpark reads the view at its newest cut (headwater analytics shop-report)")
    analytics_cfg = load_analytics_config(args.config, os.environ, local=local)
    demo.show_analytics(analytics_cfg, local.dsn())
    print("\n== the worker's metrics (Prometheus), health and readiness")
    demo.show_metrics(url, demo.STREAMS_SHOWN)
    print("\n== headwater status")
    cmd_status(args)
    capture_at = f"pid {pid}, " + (f"metrics {capture_url}/metrics" if capture.metrics_port else "no metrics port")
    _print_running(local, capture_at, f"pid {worker}", url, analytics_cfg)
    return 0


def _print_running(local: stack.StackConfig, capture_at: str, worker_at: str, url: str,
                   analytics_cfg: AnalyticsConfig) -> None:  # fmt: skip
    """The demo's last words: what runs where, and how to stop it."""
    print(
        "\n== what is running\n"
        f"  PostgreSQL  {local.display_dsn()}  (wal_level=logical)\n"
        f"  Kafka       {local.bootstrap}\n"
        f"  registry    {local.registry_url}\n"
        f"  Redis       {local.redis_url}\n"
        f"  capture     {capture_at}\n"
        f"  streams     {worker_at}, query endpoint {url}/tables/ and {url}/views/, metrics {url}/metrics\n"
        f"  analytics   headwater analytics shop-report | tables  (PySpark {analytics_cfg.master},"
        f" Parquet in {analytics_cfg.output}/)\n"
        "Stop everything with: headwater stack down"
    )


def _as_flags(values: Mapping[str, Any]) -> list[str]:
    """Flags given to this command, as the command line of another (bool flags take no value)."""
    out: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        out += [flag] if value == "true" else [flag, str(value)]
    return out


# ---- capture --------------------------------------------------------------------------
def capture_config(args: argparse.Namespace) -> CaptureConfig:
    """[capture] over [pipeline]; what neither sets is the local stack's (``capture.config.load_capture``)."""
    return load_capture_config(args.config, os.environ, flag_values(args, CaptureConfig), local=stack_config(args))


def cmd_capture(args: argparse.Namespace) -> int:
    from capture import agent
    from capture.metrics import CaptureMetrics

    cfg = capture_config(args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    agent.run(cfg, stop, CaptureMetrics(cfg, __version__))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from capture import catalog, slot
    from capture.decoder import pg_time
    from capture.state import State
    from tables.wire import lsn_text

    cfg = capture_config(args)
    conn = catalog.connect(cfg.dsn.reveal())
    try:
        info = slot.find(conn, cfg.slot)
    finally:
        conn.close()
    if info is None:
        print(f"slot {cfg.slot}: does not exist (capture has not run yet)")
        return 3
    active = f"active (pid {info.active_pid})" if info.active_pid else "inactive"
    print(f"slot {cfg.slot}: {active}, wal_status {info.wal_status}")
    print(f"  confirmed LSN {lsn_text(info.confirmed_lsn or 0)}, server at {lsn_text(info.current_lsn)}")
    print(f"  WAL retained behind the slot: {info.retained_bytes} bytes; lag: {info.lag_bytes} bytes")
    if not (cfg.state_dir / f"{cfg.slot}.sqlite").exists():
        print(f"  no checkpoint in {cfg.state_dir}")
        return 0
    state = State(cfg.state_dir, cfg.slot)
    try:
        checkpoint, tables = state.load(), state.snapshot_progress()
    finally:
        state.close()
    if checkpoint is None:
        print(f"  no checkpoint in {cfg.state_dir}")
        return 0
    if checkpoint.last_commit_lsn:
        committed = pg_time(checkpoint.last_commit_time)
        behind = time.time() - committed.timestamp()
        print(
            f"  last commit captured: {lsn_text(checkpoint.last_commit_lsn)} at {committed.isoformat()}"
            f" ({behind:.1f} s ago)"
        )
    print(f"  events: {checkpoint.events} since start, {checkpoint.rate:.0f}/s at the last checkpoint")
    print(f"  snapshot: {'done' if checkpoint.snapshot_done else 'in progress or interrupted'}")
    if not checkpoint.snapshot_done:
        for table, done, estimate, finished in tables:
            print(f"    {table}: {done}/{estimate} rows{' (done)' if finished else ''}")
    _print_backfills(cfg, unfinished=True)
    return 0


def _print_backfills(cfg: CaptureConfig, *, unfinished: bool) -> None:
    """Backfills from capture's state: those not finished (``headwater status``), or the latest 50."""
    from capture.state import State

    state = State(cfg.state_dir, cfg.slot)
    try:
        backfills = state.backfills(unfinished=unfinished, limit=50)
        rates = state.backfill_rates()
        finished = len(state.backfills(limit=10**9)) - len(state.backfills(unfinished=True))
    finally:
        state.close()
    if unfinished and (backfills or finished):
        print(f"  backfills: {len(backfills)} not finished, {finished} finished (headwater snapshot --status)")
    else:
        print("backfills:" if backfills else "no backfills yet")
    for backfill in backfills:
        print(f"    {backfill.describe(rates.get(backfill.id, 0.0))}")
    if not unfinished:
        _print_requests(cfg)


def _print_requests(cfg: CaptureConfig) -> None:
    """The latest requests (headwater snapshot, the signal table) and what capture made of them."""
    from capture.state import Mailbox

    mailbox = Mailbox(cfg.state_dir, cfg.slot)
    try:
        requests = mailbox.requests(10)
    finally:
        mailbox.close()
    if requests:
        print("latest requests:")
    for rid, action, tables, predicate, origin, outcome in requests:
        what = " ".join([action, *tables] + ([f"where {predicate}"] if predicate else []))
        print(f"    {rid} ({origin}) {what}: {outcome or 'waiting for capture'}")


def _capture_state(cfg: CaptureConfig) -> Path:
    path = cfg.state_dir / f"{cfg.slot}.sqlite"
    if not path.exists():
        raise FatalError(f"no capture state for slot {cfg.slot} in {cfg.state_dir}",
                         hint="run headwater capture first, or point --state-dir and --slot at its state")  # fmt: skip
    return path


def cmd_snapshot(args: argparse.Namespace) -> int:
    """Ask the running capture to backfill tables (or pause, resume, cancel backfills); --status lists them."""
    from capture.backfill import Request, SignalError
    from capture.state import Mailbox

    cfg = capture_config(args)
    _capture_state(cfg)
    if args.status:
        _print_backfills(cfg, unfinished=False)
        return 0
    action = "pause" if args.pause else "resume" if args.resume else "cancel" if args.cancel else "snapshot"
    try:
        request = Request(action, tuple(args.tables), args.where)
    except SignalError as exc:
        raise ConfigError(str(exc), hint="headwater snapshot TABLE... [--where SQL], or --pause/--resume/--cancel"
                          " [TABLE...], or --status") from exc  # fmt: skip
    mailbox = Mailbox(cfg.state_dir, cfg.slot)
    try:
        rid = mailbox.request(request.action, request.tables, request.predicate)
        outcome = _wait_outcome(mailbox, rid, args.wait)
    finally:
        mailbox.close()
    if outcome is None:
        print(f"request {rid} is waiting for capture (slot {cfg.slot}) to pick it up: it does within a second of"
              " running; see headwater snapshot --status")  # fmt: skip
    elif outcome.startswith("refused"):
        raise ConfigError(f"capture {outcome}")
    else:
        print(outcome)
    return 0


def _wait_outcome(mailbox: Any, request_id: int, seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while True:
        outcome = mailbox.outcome(request_id)
        if outcome is not None or time.monotonic() >= deadline:
            return str(outcome) if outcome is not None else None
        time.sleep(0.1)


# ---- analytics ------------------------------------------------------------------------
def cmd_analytics(args: argparse.Namespace) -> int:
    extras.require("analytics", f"headwater analytics {args.job}")
    from pyspark.sql import SparkSession

    from analytics.jobs import JOBS, explain, show
    from analytics.session import spark_session
    from analytics.streamjobs import STREAM_JOBS

    cfg = load_analytics_config(args.config, os.environ, flag_values(args, AnalyticsConfig), local=stack_config(args))
    run = {**JOBS, **STREAM_JOBS}[args.job]
    started = SparkSession.getActiveSession() is None  # a session this process already runs is used, left running
    spark = spark_session(cfg, f"headwater {args.job}")
    try:
        for result in run(spark, cfg):
            print(show(result, args.rows) + "\n")
    except Exception as exc:
        relayed = None if isinstance(exc, HeadwaterError) else explain(exc)
        if relayed is None:
            raise
        raise relayed from exc
    finally:
        if started:
            spark.stop()
    return 0


# ---- config ---------------------------------------------------------------------------
def _effective(component: str, explicit: str | None) -> Loaded[Any]:
    """One component's settings as it would run with them, with their sources."""
    from streams.config import load_streams

    env, path = os.environ, config_path(explicit, os.environ)
    loaders: dict[str, Callable[[], Loaded[Any]]] = {
        "stack": lambda: load_traced(stack.StackConfig, "stack", path=path, environ=env),
        "pipeline": lambda: load_component(PipelineConfig, "pipeline", path=path, environ=env),
        "capture": lambda: load_capture(explicit, env),
        "streams": lambda: load_streams(env, explicit),
        "analytics": lambda: load_analytics(explicit, env),
    }
    return loaders[component]()


def render(section: str, loaded: Loaded[Any]) -> list[str]:
    """``[section]`` and one ``key = value  # source`` line per setting, secrets masked."""
    rows = [
        (f"{f.name} = {display(getattr(loaded.config, f.name))}", loaded.source(f.name))
        for f in dataclasses.fields(loaded.config)
    ]
    width = min(max(len(text) for text, _ in rows), 56)
    return [f"[{section}]", *(f"{text:<{width}}  # {source}" for text, source in rows)]


def cmd_config_show(args: argparse.Namespace) -> int:
    path = config_path(args.config, os.environ)
    print(f"# config file: {path}" if path else "# no config file: defaults, the environment and the local stack")
    for component in [args.component] if args.component else CONFIG_COMPONENTS:
        print("\n" + "\n".join(render(component, _effective(component, args.config))))
    return 0


CONFIG_COMPONENTS = ("stack", "pipeline", "capture", "streams", "analytics")


# ---- parser ---------------------------------------------------------------------------
class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line plus a hint, with exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n  hint: see '{self.prog} --help'\n")


def _number(kind: type[int] | type[float], *, least: float, what: str) -> Callable[[str], float]:
    """An argparse type: ``kind`` of the text, refused below ``least`` with ``what`` it must be."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not least <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


POSITIVE_INT = _number(int, least=1, what="a whole number of at least 1")
COUNT = _number(int, least=0, what="a whole number of at least 0")
POSITIVE = _number(float, least=sys.float_info.min, what="a number greater than 0")


def _with_config_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", help="TOML config file (default: $HEADWATER_CONFIG or ./headwater.toml)")
    parser.add_argument(
        "--log-level",
        choices=logs.LEVELS,
        type=str.lower,
        help=f"log level (default: ${logs.LEVEL_ENV}, else info for capture, warning otherwise)",
    )
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        type=str.lower,
        help=f"text, or json: one object per line (default: ${logs.FORMAT_ENV}, else text)",
    )
    return parser


def setup_logging(args: argparse.Namespace) -> None:
    """One format for every command (``tables.logs``); only capture logs at INFO unless told otherwise."""
    default = "info" if args.command == "capture" else "warning"
    options = logs.log_options(args.log_level, args.log_format, default=default)
    logs.setup("capture" if args.command == "capture" else "headwater", options)


def _with_stack_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _with_config_flag(parser)
    add_flags(parser.add_argument_group("local stack settings ([stack] in the config file)"), stack.StackConfig)
    return parser


def _capture_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    add_flags(parser.add_argument_group("capture settings ([capture] in the config file)"), CaptureConfig, only)


def _workload_flags(parser: argparse.ArgumentParser, rate: float, duration: float) -> None:
    parser.add_argument("--rate", type=POSITIVE, default=rate, help=f"transactions per second (default: {rate})")
    parser.add_argument("--duration", type=POSITIVE, default=duration, help=f"seconds to run (default: {duration})")
    parser.add_argument("--seed", type=int, default=7, help="random seed of the workload")


Commands = argparse._SubParsersAction  # what add_subparsers returns


def _stack_commands(commands: Commands) -> None:
    stack_cmd = commands.add_parser("stack", help="start, stop and check the embedded local stack")
    stack_sub = stack_cmd.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, fn, text in (
        ("up", cmd_stack_up, "start PostgreSQL, Kafka (Tansu), the registry and Redis"),
        ("down", cmd_stack_down, "stop them all"),
        ("status", cmd_stack_status, "show each service's address and health (exit 3 if any is down)"),
    ):
        _with_stack_flags(stack_sub.add_parser(name, help=text)).set_defaults(func=fn)


def _capture_commands(commands: Commands) -> None:
    text = "snapshot, then stream every committed change into <prefix>.changes"
    capture_cmd = _with_config_flag(commands.add_parser("capture", help=text))
    _capture_flags(capture_cmd)
    capture_cmd.set_defaults(func=cmd_capture)
    text = "the slot (confirmed LSN, WAL retained, lag) and capture's progress"
    status_cmd = _with_config_flag(commands.add_parser("status", help=text))
    _capture_flags(status_cmd, only=("dsn", "slot", "state_dir"))
    status_cmd.set_defaults(func=cmd_status)
    text = "backfill tables while capture streams (incremental snapshot), or pause, resume, cancel, list backfills"
    snap = _with_config_flag(commands.add_parser("snapshot", help=text))
    snap.add_argument("tables", nargs="*", metavar="TABLE", help="schema.table (or table, in public) to snapshot")
    snap.add_argument("--where", help="SQL predicate: only the rows it matches (e.g. \"created > '2024-01-01'\")")
    actions = snap.add_mutually_exclusive_group()
    actions.add_argument("--status", action="store_true", help="list the backfills and their progress")
    actions.add_argument("--pause", action="store_true", help="pause the backfills of TABLE... (all if none)")
    actions.add_argument("--resume", action="store_true", help="resume paused backfills of TABLE... (all if none)")
    actions.add_argument("--cancel", action="store_true", help="cancel the backfills of TABLE... (all if none)")
    snap.add_argument("--wait", type=POSITIVE, default=10.0, help="seconds to wait for capture's answer (10)")
    _capture_flags(snap, only=("dsn", "slot", "state_dir"))
    snap.set_defaults(func=cmd_snapshot)


def _analytics_command(commands: Commands) -> None:
    text = "run a batch or streaming job on the topics with PySpark (local[*] by default)"
    analytics_cmd = _with_config_flag(commands.add_parser("analytics", help=text))
    jobs = "; ".join(f"{k}: {v}" for k, v in JOB_HELP.items())
    analytics_cmd.add_argument("job", choices=sorted(JOB_HELP), help=jobs)
    analytics_cmd.add_argument("--rows", type=POSITIVE_INT, default=50, help="rows of each result to print")
    add_flags(analytics_cmd.add_argument_group("analytics settings ([analytics] in the config file)"), AnalyticsConfig)
    analytics_cmd.set_defaults(func=cmd_analytics)


def _demo_commands(commands: Commands) -> None:
    demo_cmd = commands.add_parser("demo", help="the sample shop: seed it, load it, or run the whole demo")
    demo_sub = demo_cmd.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = _with_stack_flags(demo_sub.add_parser("run", help="stack up, seed the shop, run a short load, show it"))
    _workload_flags(run, rate=50, duration=5)
    _capture_flags(run)
    run.set_defaults(func=cmd_demo, customers=200, products=50, orders=400)
    seed = _with_stack_flags(demo_sub.add_parser("seed", help="create and seed the sample shop (once)"))
    seed.add_argument("--customers", type=POSITIVE_INT, default=200, help="customers (default: 200)")
    seed.add_argument("--products", type=POSITIVE_INT, default=50, help="products (default: 50)")
    seed.add_argument("--orders", type=COUNT, default=400, help="orders, each with 1 to 4 items (default: 400)")
    seed.set_defaults(func=cmd_demo_seed)
    load_cmd = _with_stack_flags(demo_sub.add_parser("load", help="run the shop's transaction mix"))
    _workload_flags(load_cmd, rate=100, duration=10)
    load_cmd.set_defaults(func=cmd_demo_load)


def _config_commands(commands: Commands) -> None:
    config_cmd = commands.add_parser("config", help="the settings every component runs with")
    config_sub = config_cmd.add_subparsers(dest="action", required=True, metavar="ACTION")
    text = "each component's effective settings and where each came from (secrets masked)"
    show = _with_config_flag(config_sub.add_parser("show", help=text))
    show.add_argument("--component", choices=CONFIG_COMPONENTS, help="only this component (default: all)")
    show.set_defaults(func=cmd_config_show)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="headwater",
        description="PostgreSQL change data capture into Kafka.",
        epilog="exit codes: 0 done, 1 a service failed, 2 bad config or command line,"
        " 3 a service is down ('stack status') or there is no slot yet ('status'), 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"headwater {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_stack_commands, _capture_commands, _analytics_command, _demo_commands, _config_commands):
        add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        setup_logging(args)
        return int(args.func(args))
    except HeadwaterError as exc:
        print(f"headwater: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
