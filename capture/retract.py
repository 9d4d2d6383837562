"""Retractions: rows that an earlier, abandoned snapshot (or an earlier slot's stream) left on the raw topic.

Promise: a snapshot replaces everything the raw topic said about its tables before it.
When the raw topic already holds changes as a new snapshot starts — a snapshot that was
interrupted and is being started over, or the stream of an earlier slot — ``LiveKeys``
applies them in order, keys only (``earlier_keys`` reads them, up to the end the topic had
before the new snapshot wrote anything), and ``missing`` asks PostgreSQL, inside the new
snapshot's exported snapshot, which of those keys its tables do not hold. Capture writes a
DELETE for each of them as part of the snapshot (the snapshot's commit LSN, one below
the consistent point, after its READ rows and before SNAPSHOT_END), so every consumer that applies the raw
topic in order — the fan-out, the views, reconciliation, Spark — ends equal to the tables,
and a cut at SNAPSHOT_END holds no phantom row. Keys are compared by value (decoded with
the schema their bytes name), so a key written under an older key schema is still matched.
The key set is held in memory while it is checked: about 100 bytes per key on the topic.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import threading
import time as clock
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from datetime import date, datetime, time
from typing import Any

import fastavro
from confluent_kafka import Consumer, KafkaError, Message
from psycopg2 import sql

from capture._copier import change_head
from capture.catalog import Connection
from capture.config import CaptureConfig
from capture.errors import BrokerError
from tables.catalog import TableSchema
from tables.change import CHANGE_VALUE_SCHEMA, OPS, ChangeReader
from tables.kafka import bounds, read_on_batches, reader
from tables.logs import KAFKA_GATE, KAFKA_LOGGER
from tables.registry import Registry
from tables.wire import FRAME_SIZE, body, schema_id

log = logging.getLogger("headwater.capture")
READER_LOGGER = KAFKA_LOGGER + ".reader"  # librdkafka's lines of the raw topic readers (``SharedSettings``)
Table = tuple[str, str]  # (schema, name)
KeyDecoder = Callable[[bytes], list[Any]]  # key image -> the key columns' values, in key order
Earlier = tuple[str, Table, bytes | None, bytes | None]  # (op, table, key, before) of a raw change
BATCH = 5000
UNKNOWN_TOPIC = KafkaError.UNKNOWN_TOPIC_OR_PART
METADATA_WAIT = 5.0  # seconds raw_end asks again while the raw topic's metadata has an error


class LiveKeys:
    """Keys the raw topic leaves alive per table, applying its changes in order (pure)."""

    def __init__(self, tables: Iterable[Table]) -> None:
        self.keys: dict[Table, dict[bytes, None]] = {t: {} for t in tables}
        self.taken: dict[Table, int] = {t: 0 for t in tables}  # keys held that a READ past the end took out (``read``)

    def apply(self, op: str, table: Table, key: bytes | None, before: bytes | None) -> None:
        keys = self.keys.get(table)
        if keys is None:
            return
        if op == "TRUNCATE":
            keys.clear()
        elif key is None:
            return
        elif op == "DELETE":
            keys.pop(key, None)
        elif op in ("READ", "INSERT", "UPDATE"):
            keys[key] = None
        if op == "UPDATE" and _moved(key, before):
            keys.pop(before, None)  # type: ignore[arg-type]

    def remove(self, op: str, table: Table, key: bytes | None, before: bytes | None) -> None:
        """Only what a change takes away: a deleted key, every key (a truncate), an update's old key."""
        if op in ("DELETE", "TRUNCATE"):
            self.apply(op, table, key, before)
        elif op == "UPDATE" and _moved(key, before):
            self.keys.get(table, {}).pop(before, None)  # type: ignore[arg-type]

    def read(self, op: str, table: Table, key: bytes | None) -> None:
        """A READ row's key past the end, for a caller whose READ rows there need no check (``earlier_keys``'
        ``reads``): a key held as it is framed is taken out (counted in ``taken``). Any other is a row added since,
        or a held key framed by another schema id, whose bytes may mean another value: the held one stays."""
        keys = self.keys.get(table)
        if op == "READ" and key is not None and keys is not None and key in keys:
            del keys[key]
            self.taken[table] += 1

    def __len__(self) -> int:
        return sum(len(k) for k in self.keys.values())


def _moved(key: bytes | None, before: bytes | None) -> bool:
    """An update changed the key: ``before`` is the old key image (same key schema), not the key itself."""
    return key is not None and before is not None and before[:5] == key[:5] and before != key


class SharedSettings(logging.Filter):
    """Capture's Kafka settings are its producer's and its readers': a reader's warning that one of them is a
    producer's and does not apply to it is expected, and goes to DEBUG; its other lines pass the gate every
    librdkafka client's lines pass (``KAFKA_GATE``: connection failures counted)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "is a producer property" in record.getMessage():
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return KAFKA_GATE.filter(record)


def _settings(cfg: CaptureConfig) -> dict[str, Any]:
    """A raw topic reader's settings: capture's Kafka settings, librdkafka's lines through logging (never
    straight to stderr: a JSON log stays JSON)."""
    logger = logging.getLogger(READER_LOGGER)
    if not any(isinstance(f, SharedSettings) for f in logger.filters):
        logger.addFilter(SharedSettings())
    return {"bootstrap.servers": cfg.bootstrap, **cfg.producer, "logger": logger}


def raw_end(cfg: CaptureConfig, *, missing_ok: bool = True) -> int:
    """The raw topic's true end offset (0 when it is empty, or does not exist yet if ``missing_ok``), asked by one
    reader; ``BrokerError`` when the broker cannot say (a backfill saves the end: a wrong 0 would check no key)."""
    consumer = reader(_settings(cfg))
    try:
        if not _listed(consumer, cfg.changes_topic, missing_ok):
            return 0
    finally:
        consumer.close()
    return bounds(_settings(cfg), cfg.changes_topic, 0)[1]


def _listed(consumer: Consumer, topic: str, missing_ok: bool) -> bool:
    """Whether the broker lists the topic with its partitions (False: no such topic, if ``missing_ok``), asked
    again for up to ``METADATA_WAIT`` s while the topic's metadata has an error (a leader being elected, a topic
    just made)."""
    deadline = clock.monotonic() + METADATA_WAIT
    while True:
        listed = consumer.list_topics(topic, timeout=10).topics.get(topic)
        error = listed.error if listed is not None else None
        if missing_ok and (listed is None or (error is not None and error.code() == UNKNOWN_TOPIC)):
            return False
        if listed is not None and error is None and listed.partitions:
            return True
        if clock.monotonic() >= deadline:
            raise BrokerError(f"the raw topic {topic}'s end is unknown: {error or 'no such topic, or no partition'}")
        clock.sleep(0.5)


def earlier_changes(cfg: CaptureConfig, end: int, registry: Registry | None, tables: Collection[Table],
                    removals_from: int | None = None, *,
                    reads: bool = False) -> Iterator[list[tuple[int, Earlier]]]:  # fmt: skip
    """Batches of (offset, (op, table, key, before)) of the raw changes below offset ``end`` that may touch
    ``tables``, in order; Avro records are read with their writer's schema from ``registry``, so records of every
    version of the change schema, with framed or nested images, are read (images framed:
    ``tables.change.ChangeReader``). A change whose Kafka key names another table is skipped unread
    (``KeyFilter``); from offset ``removals_from`` on, so is one whose op takes no key away
    (``HeadReader.may_remove``; with ``reads``, a READ is read). By batch (``read_on_batches``), not a change
    at a time through three generators: 1M changes read in 4.8-5.1 s against 6.3-7.2 s, in a script with
    capture's GC settings (inside capture the read waits longer on its fetches, and took 4.0-5.1 us a change
    either way; bench/RESULTS.md, 2026-11-29)."""
    json_format = cfg.format == "json" or registry is None
    skipped = NO_READ if reads else NO_REMOVAL
    decode = JsonHeads() if json_format else HeadReader(registry, skipped)  # type: ignore[arg-type]
    wanted = KeyFilter(tables, json.loads if json_format else registry.decode)  # type: ignore[union-attr]
    removals_from = end if removals_from is None else removals_from
    for batch in read_on_batches(_settings(cfg), {(cfg.changes_topic, 0): 0}, timeout=600):
        yield _earlier(batch, end, removals_from, wanted, decode)
        if (batch[-1].offset() or 0) + 1 >= end:
            return


def _earlier(batch: list[Message], end: int, removals_from: int, wanted: KeyFilter,
             decode: HeadReader | JsonHeads) -> list[tuple[int, Earlier]]:  # fmt: skip
    """``earlier_changes`` of one batch of the raw topic's messages."""
    found = []
    for msg in batch:
        offset = msg.offset() or 0
        if offset >= end:
            break
        if wanted(msg.key()):
            value = msg.value()
            if value and (offset < removals_from or decode.may_remove(value)):
                found.append((offset, decode(value)))
    return found


class KeyFilter:
    """Whether a raw change's Kafka key (``tables.change.CHANGE_KEY_SCHEMA``: its schema and table) may name
    one of ``tables``: each distinct key is decoded once (a topic has a few: one per table and key schema
    id), so changes of other tables cost a dict lookup instead of decoding their value. Measured (``./dev bench
    backfill``, a 100-row table after a 1M-row one): its backfill took 10.7 s before, 3.7 s after.
    A key that is missing or does not decode to a table passes (its value decides)."""

    def __init__(self, tables: Collection[Table], decode: Callable[[bytes], Any]) -> None:
        self.tables, self.decode = set(tables), decode
        self.seen: dict[bytes, bool] = {}

    def __call__(self, key: bytes | None) -> bool:
        if key is None:
            return True
        found = self.seen.get(key)
        if found is None:
            found = self.seen[key] = self._names_one(key)
        return found

    def _names_one(self, key: bytes) -> bool:
        try:
            named = self.decode(key)
            return (named["schema"], named["table"]) in self.tables
        except Exception:  # not a change key of this contract: the value decides
            return True


def _first_bytes(*ops: str) -> frozenset[int]:
    """The first byte of the head of a change of each of ``ops`` (the op enum's index, zigzag-encoded)."""
    return frozenset(2 * OPS.index(op) for op in ops)


NO_REMOVAL = _first_bytes("READ", "INSERT")
NO_READ = _first_bytes("INSERT")  # for a read past the end that wants the READ rows too


class HeadReader:
    """(op, table, key, before) of raw changes: a record whose writer schema begins as ``CHANGE_VALUE_SCHEMA``
    does (framed images, any later fields) has only its head read, in C (``capture._copier.change_head``);
    any other (nested images, another layout), or one the head read refuses, is read whole by ``ChangeReader``.
    Measured: a whole framed change reads in ~6 µs (fastavro), which made a re-snapshot of a 1M-row table
    wait 16.6 s for its own keys under load."""

    def __init__(self, registry: Registry, skipped: frozenset[int] = NO_REMOVAL) -> None:
        self.registry, self.whole = registry, ChangeReader(registry)
        self.skipped = skipped  # first bytes ``may_remove`` says False to
        self.heads: dict[bytes, bool] = {}  # frame (writer schema id) -> its head is CHANGE_VALUE_SCHEMA's

    def __call__(self, value: bytes) -> Earlier:
        known = self.heads.get(value[:FRAME_SIZE])
        if known is None:
            known = self.heads[value[:FRAME_SIZE]] = self._known(value)
        if known:
            try:
                op, schema, table, key, before = change_head(value)
                return OPS[op], (schema, table), key, before
            except (ValueError, IndexError):  # bytes the head read refuses: the whole read says what is wrong
                pass
        c = self.whole(value)
        return c["op"], (c["schema"], c["table"]), c["key"], c["before"]

    def _known(self, value: bytes) -> bool:
        return _head_of(self.registry.schema(schema_id(value))) == _head_of(CHANGE_VALUE_SCHEMA)

    def may_remove(self, value: bytes) -> bool:
        """False when the change surely takes no key away: a READ or an INSERT (an INSERT only, with ``skipped``
        ``NO_READ``: the READs are wanted too), told by its first byte (``op``, the head's first field: the enum's
        index, zigzag), with no decoding. Measured on a restarted backfill's read
        past its end (1M changes, nearly all its own READ rows), alternating: 2.31-2.66 s with every head read,
        1.61-2.35 s with this (bench/RESULTS.md, 2026-11-28)."""
        if len(value) <= FRAME_SIZE or not self.heads.get(value[:FRAME_SIZE]):
            return True  # a writer schema not seen yet, or another layout: read it
        return value[FRAME_SIZE] not in self.skipped


class JsonHeads:
    """(op, table, key, before) of the json format's raw changes; each is read to know its op."""

    def __call__(self, value: bytes) -> Earlier:
        return _json_change(value)

    def may_remove(self, value: bytes) -> bool:
        return True


def _head_of(schema: dict[str, Any]) -> list[tuple[str, Any]]:
    """The names and types of a change schema's fields up to ``before`` (types without docs or names)."""
    fields = list(schema.get("fields", ()))
    ends = [i for i, f in enumerate(fields) if f.get("name") == "before"]
    return [(f.get("name"), _shape(f.get("type"))) for f in fields[: ends[0] + 1]] if ends else []


def _shape(t: Any) -> Any:
    if isinstance(t, list):
        return tuple(_shape(b) for b in t)
    if isinstance(t, dict):
        return t.get("type"), tuple(t.get("symbols", ())), t.get("logicalType")
    return t


def _json_change(value: bytes) -> Earlier:
    c = json.loads(value)
    return c["op"], (c["schema"], c["table"]), _json_image(c.get("key")), _json_image(c.get("before"))


def _json_image(image: Any) -> bytes | None:
    """A row image as the json format embeds it (``JsonRowWriter``'s separators, key order kept)."""
    return None if image is None else json.dumps(image, separators=(",", ":"), ensure_ascii=False).encode()


def earlier_keys(cfg: CaptureConfig, tables: Iterable[Table], registry: Registry | None, what: str = "this snapshot",
                 stop: threading.Event | None = None, end: int | None = None,
                 removed_to: int | None = None, reads: bool = False) -> LiveKeys | None:  # fmt: skip
    """The keys the raw topic holds alive for ``tables`` before a new snapshot (or backfill: ``what``): below
    ``end`` (the topic's end when it started; its end now when not given), less those its changes from ``end``
    up to ``removed_to`` took away (a backfill restarted: the DELETEs it wrote before); with ``reads``, less the keys
    of the READ rows there too (``LiveKeys.read``: a restarted backfill's own rows, its chunks vouched for); None
    when there is nothing below ``end``. ``stop`` set: it stops reading (and says nothing)."""
    end = raw_end(cfg) if end is None else end
    removed_to = end if removed_to is None else max(removed_to, end)
    if end == 0:
        return None
    started = clock.monotonic()
    live = LiveKeys(tables)
    for batch in earlier_changes(cfg, removed_to, registry, live.keys, end, reads=reads):
        if stop is not None and stop.is_set():
            return None
        for at, (op, table, key, before) in batch:
            (live.apply if at < end else live.remove)(op, table, key, before)
            if reads and at >= end:
                live.read(op, table, key)
    log.info("the raw topic holds %d changes from before %s (%d keys of its tables, read in %.1f s%s): keys %s does"
             " not find get a DELETE", end, what, len(live) + sum(live.taken.values()), clock.monotonic() - started,
             f"; deletes up to offset {removed_to} taken away" if removed_to > end else "", what)  # fmt: skip
    return live


def missing(conn: Connection, table: TableSchema, keys: Sequence[bytes], decode: KeyDecoder) -> list[bytes]:
    """The ``keys`` (images) whose row ``table`` does not hold, asked in batches on ``conn``.

    A date or timestamp at an end of Avro's range is infinity, or a real value there (capture writes
    both the same): a key is missing only if neither is in the table — never a DELETE for a row that exists.
    """
    query = _missing_query(conn, table)
    out: list[bytes] = []
    for start in range(0, len(keys), BATCH):
        batch = keys[start : start + BATCH]
        values = [decode(k) for k in batch]
        gone = _absent(conn, query, values, literal=False)
        ends = [i for i in gone if any(at_an_end(v) for v in values[i])]
        if ends:
            again = _absent(conn, query, [values[i] for i in ends], literal=True)
            gone = [i for i in gone if i not in ends] + [ends[j] for j in again]
        out.extend(batch[i] for i in sorted(gone))
    return out


def _absent(conn: Connection, query: sql.Composed, values: list[list[Any]], *, literal: bool) -> list[int]:
    """Indexes of the keys (``values``, one list per key) that no row of the table has."""
    columns = list(zip(*values, strict=True))
    with conn.cursor() as cur:
        cur.execute(query, [list(range(len(values))), *([pg_text(v, literal) for v in col] for col in columns)])
        return [i for (i,) in cur.fetchall()]


def _missing_query(conn: Connection, table: TableSchema) -> sql.Composed:
    """``SELECT i FROM unnest(indexes, key columns as text) ... WHERE NOT EXISTS (the row)``."""
    names = [table.columns[i].name for i in table.key_indexes]
    with conn.cursor() as cur:
        cur.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attname = ANY(%s)",
            (sql.Identifier(table.schema, table.name).as_string(conn), names),
        )
        types = dict(cur.fetchall())
    aliases = [sql.Identifier(f"k{i}") for i in range(len(names))]
    match = sql.SQL(" AND ").join(
        sql.SQL("t.{} = k.{}::{}").format(sql.Identifier(n), a, sql.SQL(types[n]))
        for n, a in zip(names, aliases, strict=True)
    )
    return sql.SQL("SELECT k.i FROM unnest(%s::int[], {arrays}) AS k(i, {aliases})"
                   " WHERE NOT EXISTS (SELECT 1 FROM ONLY {table} t WHERE {match})").format(
        arrays=sql.SQL(", ").join(sql.SQL("%s::text[]") for _ in names), aliases=sql.SQL(", ").join(aliases),
        table=sql.Identifier(table.schema, table.name), match=match)  # fmt: skip


def at_an_end(value: Any) -> bool:
    """A date or timestamp where capture writes PostgreSQL's infinity (``tables.types``)."""
    if isinstance(value, datetime):
        return value.replace(tzinfo=None) in (datetime.max, datetime.min)
    return isinstance(value, date) and value in (date.max, date.min)


def pg_text(value: Any, literal: bool = False) -> str | None:
    """A decoded key value as PostgreSQL's text input for its column's type (an end of the date range
    as infinity, unless ``literal``)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    if isinstance(value, datetime | date | time):
        if not literal and isinstance(value, date) and at_an_end(value):
            return "infinity" if value.year == 9999 else "-infinity"
        return value.isoformat()
    return str(value)  # numbers, Decimal, UUID


def avro_keys(table: TableSchema, schema_of: Callable[[int], Any]) -> KeyDecoder:
    """Decodes Confluent-framed key images of ``table`` (any key schema id) to values in key order."""
    parsed: dict[int, Any] = {}

    def decode(image: bytes) -> list[Any]:
        writer = schema_id(image)
        schema: Any = parsed.get(writer)
        if schema is None:
            schema = parsed[writer] = fastavro.parse_schema(schema_of(writer))
        fields: Any = schema["fields"]
        record: Any = fastavro.schemaless_reader(io.BytesIO(body(image)), schema, None)
        return [record[f["name"]] for f in fields]

    return decode


def json_keys(table: TableSchema) -> KeyDecoder:
    """Decodes the json format's key images (objects keyed by column name) to values in key order;
    bytea, which the json format writes in base64, back to bytes."""
    columns = [table.columns[i] for i in table.key_indexes]
    raw = [c.pgtype.name == "bytea" for c in columns]

    def decode(image: bytes) -> list[Any]:
        row = json.loads(image)
        values = [row[c.name] for c in columns]
        return [base64.b64decode(v) if b and v is not None else v for v, b in zip(values, raw, strict=True)]

    return decode
