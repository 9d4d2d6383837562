"""The Confluent Schema Registry REST API over aiohttp, backed by ``Store`` and ``SchemaLog``.

Promise: the routes, bodies, status codes and error codes that Confluent-compatible
clients (confluent-kafka, python-schema-registry-client) use for Avro; every error
is a JSON body ``{"error_code", "message"}``. Only AVRO schemas without references.
A write is planned and appended under the log's lock (two registrations never get
one id), and a registration answers an id only once this registry serves it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from registry import errors
from registry.log import SchemaLog
from registry.store import Store

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger("headwater.registry")

STORE: web.AppKey[Store] = web.AppKey("store", Store)
LOG: web.AppKey[SchemaLog] = web.AppKey("log", SchemaLog)


def reply(data: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(data), status=status, content_type=CONTENT_TYPE.split(";")[0])


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except errors.HttpError as exc:
        return reply(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return reply({"error_code": exc.status, "message": exc.reason}, exc.status)
    except Exception as exc:
        log.exception("internal error on %s %s", request.method, request.path)
        return reply({"error_code": 50001, "message": f"Internal error: {exc!r}"}, 500)


def _flag(request: web.Request, name: str) -> bool:
    return request.query.get(name, "false").lower() == "true"


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise errors.RegistryError(400, 400, "The request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise errors.RegistryError(422, 422, "The request body must be a JSON object")
    return body


async def _schema_text(request: web.Request) -> str:
    body = await _body(request)
    kind = body.get("schemaType", "AVRO") or "AVRO"
    if kind != "AVRO":
        raise errors.invalid_schema(f"schema type {kind!r} is not supported by the embedded registry (AVRO only)")
    if body.get("references"):
        raise errors.invalid_schema("schema references are not supported by the embedded registry")
    text = body.get("schema")
    if not isinstance(text, str):
        raise errors.invalid_schema("the request needs a 'schema' string holding the Avro schema JSON")
    return text


def _schema_id(request: web.Request) -> int:
    try:
        return int(request.match_info["id"])
    except ValueError:
        raise errors.schema_not_found(f"Schema {request.match_info['id']} not found") from None


routes = web.RouteTableDef()


@routes.get("/")
async def root(request: web.Request) -> web.Response:
    return reply({})


@routes.get("/schemas/types")
async def schema_types(request: web.Request) -> web.Response:
    return reply(["AVRO"])


@routes.get("/schemas/ids/{id}")
async def schema_by_id(request: web.Request) -> web.Response:
    return reply({"schema": request.app[STORE].schema_by_id(_schema_id(request)).canonical})


@routes.get("/schemas/ids/{id}/schema")
async def raw_schema_by_id(request: web.Request) -> web.Response:
    text = request.app[STORE].schema_by_id(_schema_id(request)).canonical
    return web.Response(text=text, content_type=CONTENT_TYPE)


@routes.get("/schemas/ids/{id}/versions")
async def versions_of_id(request: web.Request) -> web.Response:
    return reply(request.app[STORE].subject_versions_of(_schema_id(request)))


@routes.get("/schemas/ids/{id}/subjects")
async def subjects_of_id(request: web.Request) -> web.Response:
    pairs = request.app[STORE].subject_versions_of(_schema_id(request))
    return reply(sorted({p["subject"] for p in pairs}))


@routes.get("/subjects")
async def subjects(request: web.Request) -> web.Response:
    return reply(request.app[STORE].subject_names(deleted=_flag(request, "deleted")))


@routes.get("/subjects/{subject}/versions")
async def versions(request: web.Request) -> web.Response:
    return reply(request.app[STORE].versions(request.match_info["subject"], deleted=_flag(request, "deleted")))


@routes.post("/subjects/{subject}/versions")
async def register(request: web.Request) -> web.Response:
    text, store, subject = await _schema_text(request), request.app[STORE], request.match_info["subject"]
    answer = await request.app[LOG].write(lambda: store.plan_register(subject, text))
    if answer["id"] not in store.schemas:  # never acknowledge an id that a GET would not find
        raise errors.store_error(f"schema id {answer['id']} was written but not read back")
    return reply(answer)


@routes.get("/subjects/{subject}/versions/{version}")
async def version(request: web.Request) -> web.Response:
    m = request.match_info
    return reply(request.app[STORE].version(m["subject"], m["version"], deleted=_flag(request, "deleted")))


@routes.get("/subjects/{subject}/versions/{version}/schema")
async def version_schema(request: web.Request) -> web.Response:
    m = request.match_info
    found = request.app[STORE].version(m["subject"], m["version"], deleted=_flag(request, "deleted"))
    return web.Response(text=found["schema"], content_type=CONTENT_TYPE)


@routes.delete("/subjects/{subject}/versions/{version}")
async def delete_version(request: web.Request) -> web.Response:
    m, store, permanent = request.match_info, request.app[STORE], _flag(request, "permanent")
    return reply(await request.app[LOG].write(lambda: store.plan_delete_version(m["subject"], m["version"], permanent)))


@routes.post("/subjects/{subject}")
async def lookup(request: web.Request) -> web.Response:
    text = await _schema_text(request)
    return reply(request.app[STORE].lookup(request.match_info["subject"], text, deleted=_flag(request, "deleted")))


@routes.delete("/subjects/{subject}")
async def delete_subject(request: web.Request) -> web.Response:
    store, subject, permanent = request.app[STORE], request.match_info["subject"], _flag(request, "permanent")
    return reply(await request.app[LOG].write(lambda: store.plan_delete_subject(subject, permanent)))


def _subject(request: web.Request) -> str | None:
    return request.match_info.get("subject") or None


async def get_config(request: web.Request) -> web.Response:
    subject, store = _subject(request), request.app[STORE]
    if subject is not None and subject not in store.subject_levels and not _flag(request, "defaultToGlobal"):
        raise errors.subject_config_not_found(subject)
    return reply({"compatibilityLevel": store.level(subject)})


async def put_config(request: web.Request) -> web.Response:
    body = await _body(request)
    level, store, subject = (
        body.get("compatibility", body.get("compatibilityLevel")),
        request.app[STORE],
        _subject(request),
    )
    await request.app[LOG].write(lambda: (None, store.plan_config(subject, level)))
    return reply({"compatibility": str(level).upper()})


async def delete_config(request: web.Request) -> web.Response:
    store, subject = request.app[STORE], _subject(request)
    previous = await request.app[LOG].write(lambda: store.plan_delete_config(subject))
    return reply({"compatibilityLevel": previous})


async def compatibility(request: web.Request) -> web.Response:
    text = await _schema_text(request)
    m = request.match_info
    problems = request.app[STORE].test_compatibility(m["subject"], m.get("version"), text)
    answer: dict[str, Any] = {"is_compatible": not problems}
    if _flag(request, "verbose"):
        answer["messages"] = problems
    return reply(answer)


@routes.get("/mode")
async def mode(request: web.Request) -> web.Response:
    return reply({"mode": "READWRITE"})


@routes.get("/mode/{subject}")
async def subject_mode(request: web.Request) -> web.Response:
    return reply({"mode": "READWRITE"})


def make_app(store: Store, schema_log: SchemaLog) -> web.Application:
    app = web.Application(middlewares=[error_middleware])
    app[STORE] = store
    app[LOG] = schema_log
    app.add_routes(routes)
    for path in ("/config", "/config/", "/config/{subject}"):
        app.router.add_get(path, get_config)
        app.router.add_put(path, put_config)
    app.router.add_delete("/config/{subject}", delete_config)
    app.router.add_post("/compatibility/subjects/{subject}/versions/{version}", compatibility)
    app.router.add_post("/compatibility/subjects/{subject}/versions", compatibility)

    async def lifecycle(app: web.Application) -> Any:
        await schema_log.start()
        yield
        await schema_log.stop()

    app.cleanup_ctx.append(lifecycle)
    return app
