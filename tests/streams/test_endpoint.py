"""The endpoint's router against a real HTTP peer: a request goes on to the partition's holder at most once; and a
table's row answered while the fan-out moves it to another key schema."""

from __future__ import annotations

import asyncio
import io
from types import SimpleNamespace
from typing import Any

import aiohttp
import fastavro
import pytest
from aiohttp import web as aioweb
from aiohttp.test_utils import TestServer
from yarl import URL

from streams.catalog import KeyCodec, TableTopic
from streams.endpoint import ROUTED, Router, table_row
from streams.rows import pack
from streams.tablefeed import Progress
from tables.partition import partition_for
from tables.wire import avro_body, frame, schema_id

HERE = URL("http://127.0.0.1:1")  # this worker's canonical URL (never listened on: nothing is sent to it)


class Web:
    """Faust's ``web`` answers, as (status, body)."""

    def json(self, value: Any, status: int = 200, headers: Any = None) -> tuple[int, Any]:
        return status, value

    def text(self, value: str, content_type: str = "", status: int = 200, headers: Any = None) -> tuple[int, Any]:
        return status, value


async def route(headers: dict[str, str]) -> tuple[Any, list[dict[str, str]]]:
    """``Router.routed`` for a request with ``headers`` whose partition the peer holds: its answer, and the
    headers of every request the peer received."""
    seen: list[dict[str, str]] = []

    async def handle(request: aioweb.Request) -> aioweb.Response:
        seen.append(dict(request.headers))
        return aioweb.json_response({"row": "at the peer"})

    server = aioweb.Application()
    server.router.add_get("/tables/t/1", handle)
    peer = TestServer(server, host="127.0.0.1")
    await peer.start_server()
    async with aiohttp.ClientSession() as client:
        app = SimpleNamespace(rebalancing=False, in_recovery=False, conf=SimpleNamespace(canonical_url=HERE),
                              http_client=client)  # fmt: skip
        request = SimpleNamespace(url=HERE.with_path("/tables/t/1"), headers=headers)
        try:
            answer = await Router(app).routed(lambda: peer.make_url("/"), Web(), request, "this key")
        finally:
            await peer.close()
    return answer, seen


@pytest.mark.unit
def test_a_request_for_another_workers_partition_is_sent_there_saying_who_sent_it() -> None:
    answer, seen = asyncio.run(route({}))
    assert answer == (200, '{"row": "at the peer"}')
    assert [h.get(ROUTED) for h in seen] == [str(HERE)]


@pytest.mark.unit
def test_a_request_another_worker_sent_is_answered_here_never_sent_on() -> None:
    answer, seen = asyncio.run(route({ROUTED: "http://127.0.0.1:2"}))
    assert answer is None  # the caller answers from this worker's state (503 when it does not hold the partition)
    assert seen == []


INT_KEY = {"type": "record", "name": "k", "fields": [{"name": "aid", "type": "int"}]}
LONG_KEY = {"type": "record", "name": "k", "fields": [{"name": "aid", "type": "long"}]}
VALUE = {"type": "record", "name": "v", "fields": [{"name": "aid", "type": "long"}, {"name": "note", "type": "string"}]}


def moving_engine(rows: dict[int, str], moved_current: bool = True) -> tuple[Any, TableTopic]:
    """A worker whose fan-out moves ``t`` from key schema 11 (int) to 4 (long): ``rows`` (aid -> note) are
    already written under 4; the old key's partitions are read to their end, the new one's as ``moved_current``."""
    old, new = KeyCodec(11, INT_KEY), KeyCodec(4, LONG_KEY)
    table, schemas = TableTopic("public.t", "p.t", old), {11: INT_KEY, 4: LONG_KEY, 9: VALUE}
    store: dict[tuple[str, int, bytes], bytes] = {}
    for aid, note in rows.items():
        key = new.encode_text(str(aid))
        store[(table.topic, partition_for(key, 4), key)] = pack(7, 0, frame(9) + avro_body(VALUE, {"aid": aid,
                                                                                                   "note": note}))

    def progress(tp: tuple[str, int]) -> Progress:
        done = moved_current or all(partition_for(new.encode_text(str(a)), 4) != tp[1] for a in rows)
        return Progress(offset=5, end=5 if done else 6)

    def decode(data: bytes) -> Any:
        return fastavro.schemaless_reader(io.BytesIO(data[5:]), schemas[int.from_bytes(data[1:5], "big")], None)

    reads: list[bytes] = []

    def get(*at: Any) -> bytes | None:
        reads.append(at[2])
        return store.get(at)

    engine = SimpleNamespace(cfg=SimpleNamespace(partitions=4), tables=SimpleNamespace(progress=progress), reads=reads,
                             store=SimpleNamespace(get=get), backlog=SimpleNamespace(
                                 done=SimpleNamespace(is_set=lambda: True)), moving_key=lambda t: new,
                             schemas=SimpleNamespace(decode=decode))  # fmt: skip
    return engine, table


def ask(engine: Any, table: TableTopic, aid: int) -> tuple[int, Any]:
    key = str(aid)
    return table_row(engine, Web(), table, table.key.encode_text(key), key)  # type: ignore[no-any-return]


@pytest.mark.unit
def test_a_row_already_moved_to_the_new_key_schema_is_served_under_it() -> None:
    engine, table = moving_engine({42: "moved"})
    status, body = ask(engine, table, 42)
    assert status == 200
    assert body["row"] == {"aid": 42, "note": "moved"} and body["key"] == {"aid": 42}
    assert [schema_id(key) for key in engine.reads] == [11, 4]  # once under each key schema, the row not read again


@pytest.mark.unit
def test_a_key_under_neither_key_schema_is_not_found() -> None:
    engine, table = moving_engine({42: "moved"})
    assert ask(engine, table, 43)[0] == 404


@pytest.mark.unit
def test_a_key_whose_moved_to_partition_is_not_read_to_its_end_asks_to_retry() -> None:
    engine, table = moving_engine({42: "moved"}, moved_current=False)
    status, body = ask(engine, table, 42)
    assert status == 503 and "moving to key schema 4" in body["error"]
