"""The endpoint's router against a real HTTP peer: a request goes on to the partition's holder at most once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web as aioweb
from aiohttp.test_utils import TestServer
from yarl import URL

from streams.endpoint import ROUTED, Router

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
