"""Reconciling the raw change topic with PostgreSQL: apply the changes in order, compare rows."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import psycopg2.extensions

from tests.plugins.kafka import AvroDecoder


def apply_changes(changes: list[dict[str, Any]], decode: AvroDecoder) -> dict[str, dict[bytes, dict[str, Any]]]:
    """Table name to {key bytes (without frame): decoded row} after every change in topic order."""
    state: dict[str, dict[bytes, dict[str, Any]]] = {}
    for change in changes:
        op = change["op"]
        if op == "SNAPSHOT_END":
            continue
        rows = state.setdefault(change["table"], {})
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
        names = [d.name for d in cur.description]
        rows = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    conn.commit()
    return {tuple(r[k] for k in key): r for r in rows}


def assert_table_matches(
    conn: psycopg2.extensions.connection, table: str, key: list[str], captured: dict[bytes, dict[str, Any]]
) -> int:
    """The rows rebuilt from the topic equal the table's rows; returns the row count."""
    expected = pg_rows(conn, table, key)
    got = {tuple(r[k] for k in key): r for r in captured.values()}
    assert set(got) == set(expected), (
        f"{table}: keys missing {sorted(set(expected) - set(got))[:5]}, extra {sorted(set(got) - set(expected))[:5]}"
    )
    for k, row in expected.items():
        for column, value in row.items():
            assert same(value, got[k][column]), f"{table} {k} {column}: postgres {value!r} != topic {got[k][column]!r}"
    return len(expected)
