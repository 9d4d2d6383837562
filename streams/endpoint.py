"""The query endpoint (Faust web, 127.0.0.1 unless told otherwise): ``install(app, engine)`` adds its pages.

Promise: ``GET /tables/`` lists the served tables with, per table, the partitions this
worker holds and how far each was read (rows, offset, end, ETA); ``GET /tables/<table>/<key>``
answers the latest row for a key as typed JSON (``streams.rows.to_json``) with the commit LSN
that wrote it, from whichever worker holds the key's partition (the request is routed
there, once: ``Router``). 404 for an unknown table, and for a key only once its partition has read everything
its topic had at the last fetch; until then — loading after a start, catching up behind the
fan-out — 503 with ``Retry-After`` and the progress, never 404. 400 for a key that does not
fit the key columns, 503 with ``Retry-After`` while a rebalance is under way.
Composite keys are the key columns in order, comma-separated (``/tables/order_items/7,2``).
``GET /views/`` lists the views, the view partitions this worker holds, the last point it
published them at and (on the raw partition's owner, which makes the cuts) the last cut; ``GET
/views/<view>/<key>`` answers a view row (by its base row's key) from the worker holding its view
partition (routed there like a table's key), with the commit LSN it reflects: the row as that
worker last published it, which may be newer than the last cut (read Redis or the view topic
up to a cut for rows of one cut); 503 while that partition replays or moves. The pages read the
engine; routing is the Faust app's.
``GET /metrics`` is the engine's metrics in the Prometheus text format (``streams.metrics``);
``GET /health`` answers 200 while the worker runs; ``GET /ready`` 200 once it serves everything it
holds, else 503 with the reason (rebalancing, recovering, loading: ``Engine.unready``). Every
request is counted by page and status.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import aiohttp
from yarl import URL

from streams.catalog import TableTopic
from streams.engine import Engine
from streams.errors import KeyError400
from streams.rows import to_json, unpack
from streams.tablefeed import Progress
from streams.viewtopic import view_key
from tables.partition import partition_for
from tables.views import LSN_FIELD
from tables.wire import UndecodableMessage, lsn_text

RETRY = {"Retry-After": "2"}


def shown(p: Progress) -> dict[str, Any]:
    eta = p.eta()
    return {"rows": p.rows, "offset": p.offset, "end": p.end, "loaded": p.loaded, "resumed_at": p.loaded_from[1],
            "eta_seconds": None if p.current or eta is None else round(eta, 1)}  # fmt: skip


def describe(engine: Engine, t: TableTopic) -> dict[str, Any]:
    partitions = engine.cfg.partitions
    held = {p: engine.tables.progress((t.topic, p)) for p in range(partitions)}
    here = {p: shown(progress) for p, progress in held.items() if progress is not None}
    return {"name": t.short, "table": t.qualified, "topic": t.topic, "key": t.key.columns,
            "partitions": partitions, "partitions_here": sorted(here),
            "loaded": engine.backlog.done.is_set() and all(h["loaded"] for h in here.values()),
            "rows_here": sum(h["rows"] for h in here.values()),
            "progress": here}  # fmt: skip


ROUTED = "X-Headwater-Routed-By"  # on a request one worker sent another: the sender's URL


class Router:
    """Sends a request to the worker that holds a partition (Faust's assignor metadata says which), once: a
    request another worker sent is answered where it lands (503 when the partition is not held there), never sent
    on, so two workers that disagree on the holder (stale metadata; a re-keyed table's key read with two key schemas,
    ``streams.engine.Engine.rekeyed``) do not send it back and forth."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def owner(self, topic: str, partition: int) -> Any:
        """The URL of the worker assigned ``(topic, partition)`` (KeyError: none known yet)."""
        for url, topics in self.app.router.external_topics_metadata().items():
            if partition in topics.get(topic, ()):
                return URL(url)
        raise KeyError((topic, partition))

    async def routed(self, owner_of: Callable[[], Any], web: Any, request: Any, owner: str) -> Any:
        """The owner's answer (``owner_of()`` gives its URL), a 503, or None when this worker is the owner.

        The owner's answer is relayed with its status and ``Retry-After`` (Faust's own router drops headers).
        """
        app = self.app
        if app.rebalancing or app.in_recovery:
            return web.json({"error": "rebalancing: partitions are moving between workers"}, status=503, headers=RETRY)
        if ROUTED in request.headers:
            return None
        try:
            dest = owner_of()
        except KeyError:
            return web.json({"error": f"the owner of {owner} is not known yet"}, status=503, headers=RETRY)
        if (dest.host, dest.port) == (app.conf.canonical_url.host, app.conf.canonical_url.port):
            return None
        try:
            url, sender = request.url.with_host(dest.host).with_port(dest.port), str(app.conf.canonical_url)
            async with app.http_client.get(url, headers={ROUTED: sender}) as answer:
                kept = {"Retry-After": answer.headers["Retry-After"]} if "Retry-After" in answer.headers else None
                return web.text(await answer.text(), content_type=answer.content_type, status=answer.status,
                                headers=kept)  # fmt: skip
        except aiohttp.ClientError as exc:
            return web.json({"error": f"the owner of {owner} ({dest}) does not answer: {exc}"}, status=503,
                            headers=RETRY)  # fmt: skip


def table_row(engine: Engine, web: Any, table: TableTopic, key_bytes: bytes, key: str) -> Any:
    """This worker's answer for a key of a partition it holds: the row, 404, or 503 while loading."""
    partition = partition_for(key_bytes, engine.cfg.partitions)
    progress = engine.tables.progress((table.topic, partition))
    if progress is None:
        return web.json({"error": f"partition {partition} of {table.topic} is not read here yet"}, status=503,
                        headers=RETRY)  # fmt: skip
    found = engine.store.get(table.topic, partition, key_bytes)
    if found is None and not progress.current:
        return web.json({"error": f"{table.qualified} is still loading: partition {partition} is not read to its end",
                         **shown(progress)}, status=503, headers=RETRY)  # fmt: skip
    backlog = engine.backlog
    if found is None and not backlog.done.is_set():
        return web.json({"error": f"{table.qualified} is still loading: the fan-out is at raw offset {backlog.at} of"
                         f" {backlog.target}", **shown(progress)}, status=503, headers=RETRY)  # fmt: skip
    moved = moving_row(engine, web, table, key) if found is None else None
    if moved is not None:
        return moved
    if found is None:
        return web.json({"error": f"no row of {table.qualified} with key {key}"}, status=404)
    return stored_row(engine, web, table, key_bytes, found)


def stored_row(engine: Engine, web: Any, table: TableTopic, key_bytes: bytes, found: bytes) -> Any:
    """The answer for a row read from the table store: the row, or 500 when it cannot be decoded."""
    lsn, position, value = unpack(found)
    try:
        row = engine.schemas.decode(value)
    except UndecodableMessage as exc:
        return web.json({"error": f"stored row cannot be decoded: {exc}"}, status=500)
    return web.json({"table": table.qualified, "key": to_json(engine.schemas.decode(key_bytes)),
                     "commit_lsn": lsn_text(lsn), "position": position, "row": to_json(row)})  # fmt: skip


def moving_row(engine: Engine, web: Any, table: TableTopic, key: str) -> Any:
    """A row already moved to the key schema this worker's fan-out is moving ``table`` to (``Engine.moving_key``),
    503 when that key's partition is held elsewhere or not read to its end, or None (no move under way, or no such
    row under it either)."""
    codec = engine.moving_key(table)
    if codec is None:
        return None
    try:
        key_bytes = codec.encode_text(key)
    except KeyError400:
        return None
    partition = partition_for(key_bytes, engine.cfg.partitions)
    progress = engine.tables.progress((table.topic, partition))
    if progress is None or not progress.current:
        return web.json({"error": f"{table.qualified} is moving to key schema {codec.schema_id}: this key's partition "
                         f"{partition} under it is held by another worker or not read to its end"}, status=503,
                        headers=RETRY)  # fmt: skip
    found = engine.store.get(table.topic, partition, key_bytes)
    return None if found is None else stored_row(engine, web, table, key_bytes, found)


def view_row(engine: Engine, web: Any, name: str, key_bytes: bytes, key: str, partition: int) -> Any:
    """This worker's answer for a view row of a partition it holds: the row, 404, or 503 while it replays."""
    views = engine.views
    assert views is not None
    view = engine.catalog.views[name]
    if not views.holds(partition):
        return web.json({"error": f"partition {partition} of {view.topic} is not held here yet"}, status=503,
                        headers=RETRY)  # fmt: skip
    found = views.row(name, view_key(view, key_bytes), partition)
    replay = views.replaying()
    if found is None and replay is not None:
        return web.json({"error": f"view {name} is replaying the raw topic up to offset {replay}"}, status=503,
                        headers=RETRY)  # fmt: skip
    if found is None:
        return web.json({"error": f"no row of view {name} with key {key}"}, status=404)
    lsn, doc = found
    doc.pop(LSN_FIELD, None)
    return web.json({"view": name, "key": to_json(engine.schemas.decode(key_bytes)), "commit_lsn": lsn_text(lsn),
                     "row": to_json(doc)})  # fmt: skip


def views_listing(engine: Engine) -> dict[str, Any]:
    """``GET /views/``: the views, the partitions held here, and the last cut when this worker makes them."""
    if engine.views is None:
        return {"views": []}
    assembler = engine.owner.assembler
    cut = assembler.last() if assembler is not None else None
    return {**engine.views.describe(), "cut_lsn": None if cut is None else lsn_text(cut)}


def unready(app: Any, engine: Engine) -> str | None:
    """Why this worker is not ready (``GET /ready``), or None."""
    if app.rebalancing:
        return "rebalancing: partitions are moving between workers"
    if app.in_recovery:
        return "recovering: Faust is restoring its state"
    return engine.unready()


def counted(engine: Engine, page: str) -> Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]]:
    """Count a page's answers by status (``headwater_streams_http_requests_total``)."""
    requests = engine.metrics.requests

    def wrap(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(handler)
        async def page_handler(*args: Any, **kwargs: Any) -> Any:
            response = await handler(*args, **kwargs)
            requests.labels(page, str(response.status)).inc()
            return response

        return page_handler

    return wrap


def install(app: Any, engine: Engine) -> None:
    """Add the endpoint's pages to the app."""
    install_probes(app, engine)
    router = Router(app)
    install_tables(app, engine, router)
    install_views(app, engine, router)


def install_tables(app: Any, engine: Engine, router: Router) -> None:
    """``/tables/``, ``/tables/<table>/<key>`` and ``/fanout/`` (the tables as the engine's catalog has them now:
    it grows when capture starts capturing a table, ``streams.engine.Engine.adopt``)."""

    @app.page("/tables/")
    @counted(engine, "/tables/")
    async def list_tables(web: Any, request: Any) -> Any:
        return web.json({"tables": [describe(engine, t) for t in engine.catalog.tables]})

    @app.page("/tables/{name}/{key}")
    @counted(engine, "/tables/{name}/{key}")
    async def get_row(web: Any, request: Any, name: str, key: str) -> Any:
        catalog = engine.catalog
        table = catalog.find(unquote(name))
        if table is None:
            return web.json({"error": f"unknown table {name!r}", "tables": [t.short for t in catalog.tables]},
                            status=404)  # fmt: skip
        try:
            key_bytes = table.key.encode_text(unquote(key))
        except KeyError400 as exc:
            return web.json({"error": str(exc), "key": table.key.columns}, status=400)
        partition = partition_for(key_bytes, engine.cfg.partitions)
        elsewhere = await router.routed(lambda: router.owner(table.topic, partition), web, request, "this key")
        return elsewhere if elsewhere is not None else table_row(engine, web, table, key_bytes, unquote(key))

    @app.page("/fanout/")
    @counted(engine, "/fanout/")
    async def fanout_stats(web: Any, request: Any) -> Any:
        """This worker's fan-out counters (empty on workers not running the fan-out)."""
        fan = engine.fanout.fanout
        counters = vars(fan.counters) if fan else {}
        return web.json({"raw_topic": engine.cfg.changes_topic, "dead_letter_topic": engine.cfg.dlq_topic, **counters})


def install_views(app: Any, engine: Engine, router: Router) -> None:
    """``/views/`` and ``/views/<view>/<key>``."""
    catalog = engine.catalog

    @app.page("/views/")
    @counted(engine, "/views/")
    async def list_views(web: Any, request: Any) -> Any:
        return web.json(views_listing(engine))

    @app.page("/views/{name}/{key}")
    @counted(engine, "/views/{name}/{key}")
    async def get_view_row(web: Any, request: Any, name: str, key: str) -> Any:
        view = catalog.views.get(unquote(name))
        base = catalog.find(view.spec.base) if view else None
        if view is None or base is None or engine.views is None:
            return web.json({"error": f"unknown view {name!r}", "views": sorted(catalog.views)}, status=404)
        try:
            key_bytes = base.key.encode_text(unquote(key))
        except KeyError400 as exc:
            return web.json({"error": str(exc), "key": view.key_columns}, status=400)
        partition = partition_for(view.key_of_base_key(key_bytes), engine.cfg.partitions)
        elsewhere = await router.routed(lambda: router.owner(view.topic, partition), web, request, "this view row")
        if elsewhere is not None:
            return elsewhere
        return view_row(engine, web, view.spec.name, key_bytes, unquote(key), partition)


def install_probes(app: Any, engine: Engine) -> None:
    """``/metrics``, ``/health`` and ``/ready`` (see the module promise)."""

    @app.page("/metrics")
    async def metrics(web: Any, request: Any) -> Any:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest  # reads /proc when imported

        body = generate_latest(engine.metrics.registry)
        return web.bytes(body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    @app.page("/health")
    @counted(engine, "/health")
    async def health(web: Any, request: Any) -> Any:
        return web.json({"status": "alive"})

    @app.page("/ready")
    @counted(engine, "/ready")
    async def ready(web: Any, request: Any) -> Any:
        reason = unready(app, engine)
        if reason is None:
            return web.json({"ready": True, "reason": None})
        return web.json({"ready": False, "reason": reason}, status=503, headers=RETRY)
