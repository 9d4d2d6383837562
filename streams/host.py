"""The engine's Faust host: ``build(cfg)`` makes the app ``faust -A streams worker`` runs.

Promise: this module, ``streams.profile`` and ``streams.endpoint`` are the only Faust-specific
code (``tests/test_layers.py`` keeps it so). ``build`` does all the start-up I/O — the app,
the catalog (``streams.engine.open_catalog``: tables discovered, views checked, topics made),
the stores, once ``streams.sources`` dropped the local state read from topics made again since —
and nothing happens at import. Every ``discover_every`` seconds it looks for tables capture started
capturing since (``Engine.discover``) and adds their topics to the subscription (Faust's conductor waits
``RESUBSCRIBE_AFTER`` before it resubscribes, not its 45 s). Faust's consumer group assigns the partitions:
the ``raw`` agent subscribes to the raw topic, ``table_rows`` to the table topics and
``view_rows`` to the view topics so that they are assigned, but the app never delivers them
(``App.direct``): the engine reads the raw and table topics itself, and keeps the views of the
view partitions it holds. After each rebalance the engine is told what this worker holds; on a revocation and
at shutdown its readers stop before Faust goes on; a fatal error in the engine crashes the app.
The app's ``Worker`` logs in Headwater's format (``tables.logs``): every line, Faust's too, at
Faust's ``-l`` level when it is given on the command line, else ``HEADWATER_LOG_LEVEL`` (default
info), in ``HEADWATER_LOG_FORMAT`` (text or json), the Kafka clients' connection failures (librdkafka's
and aiokafka's, repeated while a broker is away) at DEBUG; it logs its start and stop at WARNING.
Once the engine is closed at shutdown, Faust's own stop gets ``stop_timeout`` seconds, then the process exits:
aiokafka's fetcher once held a worker's stop past 60 s retrying a broker gone meanwhile (CI, 2026-11-30), and
Kafka Streams' ``close(Duration)`` bounds its own stop the same way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any, cast

import click
import faust

from streams import endpoint, profile, sources
from streams.config import StreamsConfig, load_views
from streams.engine import Catalog, Engine, open_catalog
from streams.memory import Trimmer
from streams.store import TableStore
from streams.viewstore import ViewStore
from streams.writer import TableWriter
from tables import logs
from tables.errors import FatalError, HeadwaterError
from tables.registry import Registry, shown
from tables.views import ViewSpec

log = logging.getLogger("headwater.streams")
RESUBSCRIBE_AFTER = 1.0  # seconds Faust's conductor waits before a changed subscription is sent (its default: 45)


class TableTopics(faust.Topic):
    """The table topics as one subscription, named by all of them (``faust -A streams agents`` lists it)."""

    def get_topic_name(self) -> str:
        return ", ".join(self.topics)


def level_flag_given() -> bool:
    """Whether Faust's ``-l/--loglevel`` was given on the command line (its default is WARN)."""
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        source = ctx.get_parameter_source("loglevel")
        if source is not None and source.name == "COMMANDLINE":
            return True
        ctx = ctx.parent
    return False


class Worker(faust.Worker):
    """Faust's worker, logging in Headwater's format and announcing its start and stop (module promise)."""

    def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
        super().on_setup_root_logger(logger, level)
        options = logs.log_options()
        for handler in logger.handlers:
            logs.restyle(handler, "streams", options)
            handler.addFilter(logs.KAFKA_GATE)  # librdkafka's and aiokafka's connection noise, to DEBUG
        logger.setLevel(level if level_flag_given() else options.number)

    async def on_first_start(self) -> None:
        await super().on_first_start()
        conf = self.app.conf
        log.warning("streams worker starting: app %s, broker %s, endpoint %s", conf.id,
                    ",".join(str(b) for b in conf.broker), conf.canonical_url)  # fmt: skip

    def on_worker_shutdown(self) -> None:
        super().on_worker_shutdown()
        log.warning("streams worker stopping")


def build(cfg: StreamsConfig, specs: list[ViewSpec] | None = None) -> profile.App:
    """The worker's app, its engine started by assignment (view specs: the config file's by default)."""
    # a bad HEADWATER_LOG_* is a ConfigError now, said cleanly, not inside Faust's logging set-up; until Faust sets
    # up its own, the build's lines (a wait for the views' tables among them) go out in Headwater's format
    early = logs.setup("streams", logs.log_options())
    try:
        return _build(cfg, specs)
    finally:
        logging.getLogger().removeHandler(early)


def _build(cfg: StreamsConfig, specs: list[ViewSpec] | None) -> profile.App:
    app = profile.app_class(cfg)(cfg.app_id, Worker=Worker, **profile.faust_settings(cfg))
    log.info("streams app %s: broker %s (%s profile), registry %s", cfg.app_id, cfg.bootstrap, cfg.broker_profile,
             shown(cfg.registry_url))  # fmt: skip
    schemas, writer = Registry(cfg.registry_url), TableWriter(cfg)
    catalog = open_catalog(cfg, load_views() if specs is None else specs, schemas, writer)
    app.direct = frozenset({cfg.changes_topic, *catalog.topics, *(v.topic for v in catalog.views.values())})
    loop: list[asyncio.AbstractEventLoop] = []

    def fatal(part: str, exc: FatalError) -> None:
        log.error("%s stopped: %s%s", part, exc, f" ({exc.hint})" if exc.hint else "")
        asyncio.run_coroutine_threadsafe(app.crash(exc), loop[0])

    state = cfg.state_dir
    tables, views = TableStore(state / f"{cfg.app_id}-tables"), state / f"{cfg.app_id}-views"
    ids = sources.read_ids(writer.admin, [cfg.changes_topic, *catalog.topics])
    recorded = sources.Sources(state / f"{cfg.app_id}-sources.json")
    sources.drop_stale(recorded, ids, cfg.changes_topic, tables, views)
    engine = Engine(cfg, schemas, writer, catalog, tables, ViewStore(views), fatal, recorded)
    subscribe(app, cfg, catalog)
    connect(app, engine, loop, cfg.stop_timeout)
    if cfg.discover_every and not cfg.table_names:  # named tables are all found at start
        watch_tables(app, cfg, engine)
    endpoint.install(app, engine)
    return app


def subscribe(app: profile.App, cfg: StreamsConfig, catalog: Catalog) -> None:
    """The agents that hold the raw, table and view partitions' assignments; Faust delivers them nothing. The
    table and view topics have the same number of partitions and the same subscribers: Faust's assignor gives
    partition p of all of them to one worker."""
    changes = app.topic(cfg.changes_topic, key_type=bytes, value_type=bytes, key_serializer="raw",
                        value_serializer="raw", acks=False)  # fmt: skip

    async def raw(stream: Any) -> None:
        async for event in stream.events():
            log.error("Faust delivered raw offset %d: the fan-out reads the raw topic itself", event.message.offset)

    app.agent(changes, name="raw")(raw)
    if not catalog.tables:
        return
    table_topics = channel(app, cfg, sorted(catalog.topics))

    async def table_rows(stream: Any) -> None:
        async for event in stream.events():
            log.error("Faust delivered %s offset %d: the table feed reads the table topics itself",
                      event.message.topic, event.message.offset)  # fmt: skip

    app.agent(table_topics, name="table_rows")(table_rows)
    if not catalog.views:
        return
    view_topics = channel(app, cfg, sorted(v.topic for v in catalog.views.values()))

    async def view_rows(stream: Any) -> None:
        async for event in stream.events():
            log.error("Faust delivered %s offset %d: the views write their topics, they do not read them",
                      event.message.topic, event.message.offset)  # fmt: skip

    app.agent(view_topics, name="view_rows")(view_rows)


def channel(app: profile.App, cfg: StreamsConfig, topics: list[str]) -> TableTopics:
    """One subscription to table or view topics: assigned like the others (same partitions), never delivered."""
    return TableTopics(app, topics=topics, key_type=bytes, value_type=bytes, key_serializer="raw",
                       value_serializer="raw", partitions=cfg.partitions)  # fmt: skip


def watch_tables(app: profile.App, cfg: StreamsConfig, engine: Engine) -> None:
    """Every ``discover_every`` seconds, the tables capture started capturing since (a table added to its
    publication, one newly matched by its ``include``) are served from then on: their topics join the app's
    subscription, Faust's group rebalances and gives their partitions out like the other table topics' (the
    same partition count and subscribers: partition p of every table topic to one worker)."""
    conductor = cast(Any, app.topics)  # Faust's conductor: the subscription (the private parts used are named)
    conductor._resubscribe_sleep_lock_seconds = RESUBSCRIBE_AFTER
    waiting: set[str] = set()  # topics added to the subscription, not in Faust's index yet
    failing: list[str] = []  # the last look's error, said once until a look succeeds

    async def look() -> None:
        try:
            found = await asyncio.to_thread(engine.discover)
        except HeadwaterError as exc:
            said = f"{exc}{f' ({exc.hint})' if exc.hint else ''}"
            level = logging.DEBUG if failing else logging.WARNING
            log.log(level, "looking for tables capture started capturing: %s (looking again every %g s)", said,
                    cfg.discover_every)  # fmt: skip
            failing[:] = [said]
            return
        if failing:
            log.info("looking for tables capture started capturing works again")
            failing.clear()
        topics = engine.adopt(found)
        if topics:
            app.direct = app.direct | set(topics)
            conductor.add(channel(app, cfg, topics))
            waiting.update(topics)
        waiting.difference_update(conductor._topic_name_index)
        if waiting:  # Faust drops a subscription change flagged while it rebalances: flag it again
            conductor._flag_changes()

    app.timer(cfg.discover_every, name="headwater-discover-tables")(look)


def connect(app: profile.App, engine: Engine, loop: list[asyncio.AbstractEventLoop], stop_timeout: float) -> None:
    """Rebalances, revocations and shutdown drive the engine; from the first assignment on, the worker
    hands the memory it freed back to the system (``streams.memory``); once the engine closed, Faust's own
    stop has ``stop_timeout`` seconds (``exit_after``)."""
    trimmer = Trimmer()

    async def rebalanced(sender: Any, *args: Any, **kwargs: Any) -> None:
        loop[:] = [asyncio.get_running_loop()]
        engine.assigned({(tp.topic, tp.partition) for tp in app.consumer.assignment()})
        trimmer.start()

    async def revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
        await asyncio.to_thread(engine.revoked)

    async def shutdown(sender: Any, *args: Any, **kwargs: Any) -> None:
        trimmer.stopping.set()
        await asyncio.to_thread(engine.close)
        log.warning("streams worker stopped: its readers and stores are closed")
        exit_after(stop_timeout, app)

    app.on_rebalance_complete.connect(rebalanced)  # type: ignore[arg-type]  # mode types the handler too narrowly
    app.on_partitions_revoked.connect(revoked)  # type: ignore[arg-type]
    app.on_before_shutdown.connect(shutdown)  # type: ignore[arg-type]


def exit_after(seconds: float, app: profile.App) -> threading.Timer:
    """Ends the process ``seconds`` from now unless it ended before: with 1 after a crash, else 0. A daemon
    timer, so it keeps nothing alive; called once nothing of Headwater's is pending (its engine closed)."""

    def expire() -> None:
        code = 1 if app.crash_reason else 0
        log.warning("Faust's own stop did not end within %g s of the worker's readers and stores closing (its Kafka "
                    "client may be waiting for a broker that is away): exiting with %d; nothing of Headwater's was "
                    "pending, and the group gives this worker's partitions to others once its session times out "
                    "([streams] stop_timeout)", seconds, code)  # fmt: skip
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(code)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer
