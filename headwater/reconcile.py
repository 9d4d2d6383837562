"""Reconciling the raw change topic with PostgreSQL: apply the changes in order, compare rows.

Promise: ``apply_changes`` rebuilds each table's rows from the raw topic exactly as a
consumer applying it in order would; ``compare`` lists every difference between
those rows and the table in PostgreSQL (missing, extra, or differing values), with
values compared by meaning (instants in UTC, JSON parsed, decimals exact). For the
stream workers, ``latest_rows`` is a table topic's latest value per key (tombstones
drop the key) and ``compare_endpoint`` asks the query endpoint for every row of a
table and compares the JSON it answers. Tests and the demo both use it.
"""

from __future__ import annotations

import base64
import json
import uuid
from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import httpx
import psycopg2.extensions

from headwater.topics import AvroDecoder, read_topic


def apply_changes(changes: list[dict[str, Any]], decode: AvroDecoder) -> dict[str, dict[bytes, dict[str, Any]]]:
    """Table name to {key bytes (without frame): decoded row} after every change in topic order."""
    state: dict[str, dict[bytes, dict[str, Any]]] = {}
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
            rows.pop(change["key"][5:], None)
        else:
            rows[change["key"][5:]] = decode(change["after"])
    return state


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
    conn: psycopg2.extensions.connection, table: str, key: list[str], captured: dict[bytes, dict[str, Any]]
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
    conn: psycopg2.extensions.connection, table: str, key: list[str], captured: dict[bytes, dict[str, Any]]
) -> int:
    """For tests: ``compare`` finds nothing; returns the row count."""
    count, problems = compare(conn, table, key, captured)
    assert not problems, "\n".join(problems[:20])
    return count


def latest_rows(bootstrap: str, topic: str, decode: AvroDecoder) -> dict[bytes, dict[str, Any]]:
    """A table topic's latest row per key (key bytes without frame); a tombstone removes the key."""
    latest: dict[bytes, bytes | None] = {}
    for record in read_topic(bootstrap, topic):  # a key lives in one partition: offset order is its order
        if record.key is not None:
            latest[record.key] = record.value
    return {key[5:]: decode(value) for key, value in latest.items() if value is not None}


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
