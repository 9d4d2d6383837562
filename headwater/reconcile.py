"""Reconciling the raw change topic with PostgreSQL: apply the changes in order, compare rows.

Promise: ``apply_changes`` rebuilds each table's rows from the raw topic as a consumer
applying it in order by the key's values would (an update that changed the key removes the old
one; a key written under an older key schema names the row whose key has the same values, whatever
the bytes: ``numeric(10,2)`` made ``numeric(10,3)`` gives 1.50 and 0.150 the same body; a consumer keyed
by the bytes, as compaction and the Faust tables are, differs there); ``compare`` lists every difference between
those rows and the table in PostgreSQL (missing, extra, or differing values), with
values compared by meaning (instants in UTC, JSON parsed, decimals exact). For the
stream workers, ``latest_rows`` is a table topic's latest value per key (tombstones
drop the key) and ``compare_endpoint`` asks the query endpoint for every row of a
table and compares the JSON it answers. For the views, ``view_docs_sql`` runs a view's
own SQL (``ViewSpec.sql``) in PostgreSQL, and ``latest_view_docs`` / ``redis_view_docs``
/ ``endpoint_view_docs`` read the view back from its topic, Redis and the endpoint, all
rendered as JSON; ``compare_docs`` lists the differences. ``keyed_rows`` is a report's rows
from PostgreSQL, to hold against the same report from Spark. Tests and the demo both use it.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterable
from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import httpx
import psycopg2.extensions
import psycopg2.extras
import redis

from capture.backfill import hashable
from streams.rows import to_json
from tables.kafka import read_topic
from tables.registry import Registry
from tables.topics import view_key
from tables.views import LSN_FIELD
from tables.wire import body, schema_id

Docs = dict[tuple[str, ...], Any]  # key column values as text -> the view row as JSON
Key = tuple[Any, ...]  # a row's key column values, as decoded


def apply_changes(changes: list[dict[str, Any]], decode: Registry) -> dict[str, dict[Key, dict[str, Any]]]:
    """Table name to {the key's values: decoded row} after every change in topic order."""
    state: dict[str, dict[Key, dict[str, Any]]] = {}
    for change in changes:
        op = change["op"]
        if op == "SNAPSHOT_END":
            continue
        rows = state.setdefault(change["table"], {})
        if op != "TRUNCATE" and change["key"] is None:
            continue  # a table without key (allow_unkeyed): rows cannot be matched one by one
        if op == "TRUNCATE":
            rows.clear()
        elif op == "DELETE":
            rows.pop(_values(decode(change["key"]).values()), None)
        else:
            if op == "UPDATE" and change.get("before") is not None:
                rows.pop(_old_key(change["key"], change["before"], decode), None)
            rows[_values(decode(change["key"]).values())] = decode(change["after"])
    return state


def _values(values: Iterable[Any]) -> Key:
    """A key's values, hashable (an array's list made a tuple, an interval's record its items)."""
    return tuple(hashable(v) for v in values)


def _old_key(key: bytes, before: bytes, decode: Registry) -> Key:
    """The key an update had before it (the old key image, or the key columns of the full old row)."""
    old = decode(before)
    if before[:5] == key[:5]:
        return _values(old.values())
    return _values(old[f["name"]] for f in decode.parsed(schema_id(key))["fields"])


def same(pg: Any, avro: Any) -> bool:
    if pg is None or avro is None:
        return pg is avro
    if isinstance(pg, dict | list) and isinstance(avro, str):
        return bool(pg == json.loads(avro))
    if isinstance(pg, datetime) and isinstance(avro, datetime):
        pg_utc = pg.astimezone(UTC) if pg.tzinfo else pg.replace(tzinfo=UTC)
        avro_utc = avro.astimezone(UTC) if avro.tzinfo else avro.replace(tzinfo=UTC)
        return pg_utc == avro_utc
    if isinstance(pg, Decimal) and isinstance(avro, Decimal):
        return pg == avro
    if isinstance(pg, uuid.UUID | str) and isinstance(avro, uuid.UUID | str):
        return str(pg) == str(avro)
    return bool(pg == avro)


def pg_rows(conn: psycopg2.extensions.connection, table: str, key: list[str]) -> dict[tuple[Any, ...], dict[str, Any]]:
    with conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {table}")  # noqa: S608 - test tables
        names = [d.name for d in cur.description or ()]
        rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    conn.commit()
    return {tuple(r[k] for k in key): r for r in rows}


def compare(
    conn: psycopg2.extensions.connection, table: str, key: list[str], captured: dict[Any, dict[str, Any]]
) -> tuple[int, list[str]]:
    """The table's row count and every difference between it and the rows rebuilt from the topic."""
    expected = pg_rows(conn, table, key)
    got = {tuple(r[k] for k in key): r for r in captured.values()}
    problems = [f"{table} {k}: in PostgreSQL, not on the topic" for k in sorted(set(expected) - set(got))]
    problems += [f"{table} {k}: on the topic, not in PostgreSQL" for k in sorted(set(got) - set(expected))]
    for k in sorted(set(expected) & set(got)):
        for column, value in expected[k].items():
            if not same(value, got[k].get(column)):
                problems.append(f"{table} {k} {column}: postgres {value!r} != topic {got[k].get(column)!r}")
    return len(expected), problems


def assert_table_matches(
    conn: psycopg2.extensions.connection, table: str, key: list[str], captured: dict[Any, dict[str, Any]]
) -> int:
    """For tests: ``compare`` finds nothing; returns the row count."""
    count, problems = compare(conn, table, key, captured)
    assert not problems, "\n".join(problems[:20])
    return count


def _latest(bootstrap: str, topic: str, timeout: float = 30.0) -> dict[bytes, bytes]:
    """A compacted topic's latest value per key; a tombstone removes the key."""
    latest: dict[bytes, bytes | None] = {}
    for record in read_topic(bootstrap, topic, timeout=timeout):  # a key lives in one partition: in offset order
        if record.key is not None:
            latest[record.key] = record.value
    return {key: value for key, value in latest.items() if value is not None}


def latest_rows(bootstrap: str, topic: str, decode: Registry, timeout: float = 30.0) -> dict[bytes, dict[str, Any]]:
    """A table topic's latest row per key (key bytes without frame); a tombstone removes the key."""
    return {body(key): decode(value) for key, value in _latest(bootstrap, topic, timeout).items()}


def same_json(pg: Any, shown: Any) -> bool:
    """A PostgreSQL value against the endpoint's JSON rendering of it (``streams.rows.to_json``)."""
    if pg is None or shown is None:
        return pg is shown
    if isinstance(pg, dict | list) and isinstance(shown, str):
        return bool(pg == json.loads(shown))
    if isinstance(pg, datetime):
        return same(pg, datetime.fromisoformat(shown))
    if isinstance(pg, date | time):
        return bool(pg == type(pg).fromisoformat(shown))
    if isinstance(pg, Decimal):
        return pg == Decimal(shown)
    if isinstance(pg, memoryview | bytes):
        return bytes(pg) == base64.b64decode(shown)
    return same(pg, shown)


def compare_endpoint(
    conn: psycopg2.extensions.connection, table: str, key: list[str], url: str, name: str
) -> tuple[int, list[str]]:
    """Every row of ``table`` asked from the query endpoint at ``url`` (as ``/tables/<name>/<key>``)."""
    expected = pg_rows(conn, table, key)
    problems = []
    with httpx.Client(base_url=url, timeout=10) as client:
        for k, row in sorted(expected.items()):
            response = client.get(f"/tables/{name}/" + quote(",".join(str(v) for v in k)))
            if response.status_code != 200:
                problems.append(f"{table} {k}: endpoint answered {response.status_code} {response.text[:100]}")
                continue
            shown = response.json()["row"]
            problems += [
                f"{table} {k} {column}: postgres {value!r} != endpoint {shown.get(column)!r}"
                for column, value in row.items()
                if not same_json(value, shown.get(column))
            ]
    return len(expected), problems


def view_docs_sql(conn: psycopg2.extensions.connection, sql: str) -> Docs:
    """A view computed by PostgreSQL (``ViewSpec.sql``): key values -> document (numbers exact)."""
    with conn.cursor() as cur:
        psycopg2.extras.register_default_jsonb(cur, loads=lambda text: json.loads(text, parse_float=Decimal))
        cur.execute("SET LOCAL TIME ZONE 'UTC'")
        cur.execute(sql)
        rows = cur.fetchall()
    conn.commit()
    return {tuple(str(v) for v in row[:-1]): row[-1] for row in rows}


def keyed_rows(conn: psycopg2.extensions.connection, sql: str, width: int) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """A query's rows keyed by their first ``width`` columns (reports: the group, then the figures)."""
    with conn.cursor() as cur:
        cur.execute(sql)
        rows = cur.fetchall()
    conn.commit()
    return {tuple(r[:width]): tuple(r[width:]) for r in rows}


def same_doc(pg: Any, shown: Any) -> bool:
    """PostgreSQL's jsonb of a view row against the JSON rendering of ours (json columns are text in ours)."""
    if isinstance(pg, dict | list) and isinstance(shown, str):
        return bool(pg == json.loads(shown, parse_float=Decimal))
    if isinstance(pg, dict):
        return isinstance(shown, dict) and pg.keys() == shown.keys() and all(same_doc(pg[k], shown[k]) for k in pg)
    if isinstance(pg, list):
        return isinstance(shown, list) and len(pg) == len(shown) and all(map(same_doc, pg, shown))
    if pg is None or shown is None:
        return pg is shown
    if isinstance(pg, Decimal):
        return pg == Decimal(str(shown))
    if isinstance(pg, str) and isinstance(shown, str) and pg != shown:
        try:
            return datetime.fromisoformat(pg) == datetime.fromisoformat(shown)
        except ValueError:
            return False
    return bool(pg == shown)


def compare_docs(expected: Docs, got: Docs, where: str) -> list[str]:
    """Every view row missing, extra or different in ``got`` (read from ``where``)."""
    problems = [f"{where} {k}: in PostgreSQL's join, missing" for k in sorted(set(expected) - set(got))]
    problems += [f"{where} {k}: not in PostgreSQL's join" for k in sorted(set(got) - set(expected))]
    for k in sorted(set(expected) & set(got)):
        if not same_doc(expected[k], got[k]):
            problems.append(f"{where} {k}: postgres {json.dumps(expected[k], default=str)[:300]} != "
                            f"{json.dumps(got[k], default=str)[:300]}")  # fmt: skip
    return problems


def _doc(decoded: dict[str, Any]) -> Any:
    decoded.pop(LSN_FIELD, None)
    return to_json(decoded)


def latest_view_docs(bootstrap: str, topic: str, decode: Registry, timeout: float = 30.0) -> Docs:
    """A view topic's latest row per key (tombstones drop it), as JSON."""
    latest = _latest(bootstrap, topic, timeout)
    return {tuple(str(to_json(v)) for v in decode(key).values()): _doc(decode(value)) for key, value in latest.items()}


def redis_view_docs(url: str, prefix: str, view: str) -> tuple[Docs, int | None]:
    """The rows Redis holds for a view, and the cut (commit LSN) it shows."""
    client = redis.Redis.from_url(url)
    try:
        out: Docs = {}
        head = f"{view_key(prefix, view)}:"
        names = list(client.scan_iter(match=head + "*", count=1000))
        for first in range(0, len(names), 1000):  # a round trip per 1,000 rows, not per row
            part, pipe = names[first : first + 1000], client.pipeline(transaction=False)
            for name in part:
                pipe.hget(name, "doc")
            for name, doc in zip(part, pipe.execute(), strict=True):
                if doc is not None:
                    out[tuple(name.decode()[len(head) :].split(","))] = json.loads(doc)
        cut = client.hget(view_key(prefix, view), "cut_lsn")
        return out, None if cut is None else int(cut)
    finally:
        client.close()


def endpoint_view_docs(url: str, view: str, keys: list[tuple[str, ...]]) -> Docs:
    """The rows the query endpoint answers for ``keys`` (absent ones left out)."""
    out: Docs = {}
    with httpx.Client(base_url=url, timeout=10) as client:
        for key in keys:
            response = client.get(f"/views/{view}/" + quote(",".join(key)))
            if response.status_code == 200:
                out[key] = response.json()["row"]
            elif response.status_code != 404:
                raise AssertionError(f"/views/{view}/{key}: {response.status_code} {response.text[:200]}")
    return out
