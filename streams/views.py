"""The query endpoint (Faust web, 127.0.0.1 unless told otherwise).

Promise: ``GET /tables/`` lists the served tables; ``GET /tables/<table>/<key>`` answers
the latest row for a key as typed JSON (``streams.rows.to_json``) with the commit LSN
that wrote it, from whichever worker owns the key's partition (the request is routed
there). 404 for an unknown table or key, 400 for a key that does not fit the key
columns, 503 with ``Retry-After`` while a rebalance or table recovery is under way.
Composite keys are the key columns in order, comma-separated (``/tables/order_items/7,2``).
``GET /views/`` lists the views with the cut they are published to; ``GET
/views/<view>/<key>`` answers a view row (by its base row's key) the same way, with the
commit LSN it reflects.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import aiohttp

from headwater.topics import UndecodableMessage
from streams.agents import materializer, runtime
from streams.app import app, cfg
from streams.catalog import TableTopic
from streams.errors import KeyError400
from streams.materializer import view_key
from streams.rows import lsn_text, to_json, unpack
from streams.tables import rows, view_state
from streams.topics import TABLES, VIEWS, find, schemas
from tables.partition import partition_for
from tables.views import LSN_FIELD

RETRY = {"Retry-After": "2"}


def owned(t: TableTopic) -> list[int]:
    """Partitions of the table this worker serves (active, not standby)."""
    changelog = rows[t.topic].changelog_topic.get_topic_name()
    return sorted(tp.partition for tp in app.assignor.assigned_actives() if tp.topic == changelog)


def describe(t: TableTopic) -> dict[str, Any]:
    mine = set(owned(t))
    here = sum(1 for key in rows[t.topic] if partition_for(key, cfg.partitions) in mine)
    return {"name": t.short, "table": t.qualified, "topic": t.topic, "key": t.key.columns,
            "partitions": cfg.partitions, "partitions_here": sorted(mine), "rows_here": here}  # fmt: skip


async def routed(table: str, key_bytes: bytes, web: Any, request: Any, owner: str) -> Any:
    """The owner's answer for ``key_bytes`` of Faust table ``table``, a 503, or None when this worker owns it.

    The owner's answer is relayed with its status and ``Retry-After`` (Faust's own router drops headers).
    """
    if app.rebalancing or app.in_recovery:
        return web.json({"error": "rebalancing: partitions are moving between workers"}, status=503, headers=RETRY)
    try:
        dest = app.router.key_store(table, key_bytes)
    except KeyError:
        return web.json({"error": f"the owner of {owner} is not known yet"}, status=503, headers=RETRY)
    if (dest.host, dest.port) == (app.conf.canonical_url.host, app.conf.canonical_url.port):
        return None
    try:
        async with app.http_client.get(request.url.with_host(dest.host).with_port(dest.port)) as answer:
            kept = {"Retry-After": answer.headers["Retry-After"]} if "Retry-After" in answer.headers else None
            return web.text(await answer.text(), content_type=answer.content_type, status=answer.status,
                            headers=kept)  # fmt: skip
    except aiohttp.ClientError as exc:
        return web.json({"error": f"the owner of {owner} ({dest}) does not answer: {exc}"}, status=503, headers=RETRY)


@app.page("/tables/")
async def list_tables(web: Any, request: Any) -> Any:
    return web.json({"tables": [describe(t) for t in TABLES]})


@app.page("/tables/{name}/{key}")
async def get_row(web: Any, request: Any, name: str, key: str) -> Any:
    table = find(unquote(name))
    if table is None:
        return web.json({"error": f"unknown table {name!r}", "tables": [t.short for t in TABLES]}, status=404)
    try:
        key_bytes = table.key.encode_text(unquote(key))
    except KeyError400 as exc:
        return web.json({"error": str(exc), "key": table.key.columns}, status=400)
    elsewhere = await routed(rows[table.topic].name, key_bytes, web, request, "this key")
    if elsewhere is not None:
        return elsewhere
    found = rows[table.topic].get(key_bytes)
    if found is None:
        return web.json({"error": f"no row of {table.qualified} with key {unquote(key)}"}, status=404)
    lsn, position, value = unpack(found)
    try:
        row = schemas.decode(value)
    except UndecodableMessage as exc:
        return web.json({"error": f"stored row cannot be decoded: {exc}"}, status=500)
    return web.json({"table": table.qualified, "key": to_json(schemas.decode(key_bytes)),
                     "commit_lsn": lsn_text(lsn), "position": position, "row": to_json(row)})  # fmt: skip


@app.page("/fanout/")
async def fanout_stats(web: Any, request: Any) -> Any:
    """This worker's fan-out counters (empty on workers not running the fan-out)."""
    fan = runtime.fanout
    counters = vars(fan.counters) if fan else {}
    return web.json({"raw_topic": cfg.changes_topic, "dead_letter_topic": cfg.dlq_topic, **counters})


@app.page("/views/")
async def list_views(web: Any, request: Any) -> Any:
    return web.json(materializer.describe() if materializer else {"views": []})


@app.page("/views/{name}/{key}")
async def get_view_row(web: Any, request: Any, name: str, key: str) -> Any:
    view = VIEWS.get(unquote(name))
    base = find(view.spec.base) if view else None
    if view is None or base is None or materializer is None:
        return web.json({"error": f"unknown view {name!r}", "views": sorted(VIEWS)}, status=404)
    try:
        key_bytes = base.key.encode_text(unquote(key))
    except KeyError400 as exc:
        return web.json({"error": str(exc), "key": view.key_columns}, status=400)
    elsewhere = await routed(view_state.name, key_bytes, web, request, "the views")
    if elsewhere is not None:
        return elsewhere
    found = materializer.row(view.spec.name, view_key(view, key_bytes))
    if found is None:
        return web.json({"error": f"no row of view {view.spec.name} with key {unquote(key)}"}, status=404)
    lsn, doc = found
    doc.pop(LSN_FIELD, None)
    return web.json({"view": view.spec.name, "key": to_json(schemas.decode(key_bytes)), "commit_lsn": lsn_text(lsn),
                     "row": to_json(doc)})  # fmt: skip
