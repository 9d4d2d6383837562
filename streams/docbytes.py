"""A view row's Avro content, put together from the encodings of the rows it shows.

Promise: pure. Avro's binary encoding frames nothing inside a value: a record is its fields'
encodings one after the other, a union the branch's index then the value, an array each block's
item count, the items, and a 0. So a view row's content — its value without the Confluent frame
and the trailing commit LSN (``streams.viewtopic.ViewTopic`` adds both) — is the encoding of the
base row's own columns, then per join in the schema's order: a lookup as ``0`` (null) or ``2``
followed by the looked-up row's content, a collect as its count, its items' contents and ``0``.
``Encoders(schema)`` holds, for each path of a view (``''`` for the base row, ``customer``,
``items[]``, ``items[].product``), the record of that path's own columns as the view schema
writes them, and ``own`` encodes a row's own columns with it (in C, ``tables.flatavro``, when the
record is flat). The joiner caches each row's own
encoding while the row stays the same, so a document is encoded in the parts that changed — a
price change re-encodes one product, not the 5,000 orders that show it. The result is byte for
byte what fastavro writes for the whole document (``tests/streams/test_docbytes.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import fastavro

from tables.flatavro import writer
from tables.views import LSN_FIELD
from tables.wire import SCHEMA_VIEW, avro_body

NULL = b"\x00"  # union index 0 (every lookup is ["null", record]); also an array's closing block
PRESENT = b"\x02"  # union index 1


def long_bytes(n: int) -> bytes:
    """An Avro long: zig-zag, then 7 bits a byte, low bits first."""
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def lookup(content: bytes | None) -> bytes:
    """A lookup's encoding: null, or the looked-up row's content."""
    return NULL if content is None else PRESENT + content


def collect(items: Sequence[bytes]) -> bytes:
    """A collect's encoding: one block of its items' contents (an empty list is a single 0)."""
    return long_bytes(len(items)) + b"".join(items) + NULL if items else NULL


class Encoders:
    """Per path of a view, the parsed record of that path's own columns (see the module promise)."""

    def __init__(self, schema: dict[str, Any]) -> None:
        self.view = schema.get(SCHEMA_VIEW, schema.get("name", ""))
        named: dict[str, Any] = {}
        fastavro.parse_schema(schema, named_schemas=named)  # every named type the view schema defines
        self.paths: dict[str, Any] = {}
        for n, (path, namespace, fields) in enumerate(_records(schema, "")):
            own = [{**f, "type": _named(f["type"], namespace)} for f in fields]
            record = {"type": "record", "name": f"own{n}", "namespace": "headwater.docbytes", "fields": own}
            self.paths[path] = fastavro.parse_schema(record, named_schemas=dict(named))
        self.compiled = {path: writer(parsed) for path, parsed in self.paths.items()}  # None: fastavro writes

    def own(self, path: str, row: Mapping[str, Any]) -> bytes:
        """A row's own columns at ``path``, encoded as they stand at the start of its record."""
        compiled = self.compiled[path]  # its write gives None for what fastavro must write (not a dict, say)
        try:
            out = None if compiled is None else compiled.write(row)
            return avro_body(self.paths[path], row) if out is None else out
        except ValueError as exc:  # a type the view cannot follow (streams.follow): say where, not the values
            where = f"view {self.view}" + (f", {path}" if path else "")
            raise ValueError(f"{where}: a row does not fit the view's schema ({exc}); a column's type changed in a way "
                             "the view does not follow: start the worker again to compose the view from the "
                             "tables' schemas now") from exc


def _records(record: dict[str, Any], path: str) -> Iterator[tuple[str, str, list[dict[str, Any]]]]:
    """(path, namespace, own fields) of ``record`` and of every record nested in it by a join."""
    namespace = record.get("namespace", "")
    own = [f for f in record["fields"] if "pg.join" not in f and f["name"] != LSN_FIELD]
    yield path, namespace, own
    for f in record["fields"]:
        if "pg.join" not in f:
            continue
        many = isinstance(f["type"], dict) and f["type"].get("type") == "array"
        child = f"{path}.{f['name']}" if path else f["name"]
        yield from _records(f["type"]["items"] if many else f["type"][1], child + ("[]" if many else ""))


def _named(kind: Any, namespace: str) -> Any:
    """``kind`` with every named type it defines replaced by its full name (the whole schema defined them)."""
    if isinstance(kind, list):
        return [_named(k, namespace) for k in kind]
    if isinstance(kind, dict) and kind.get("type") in ("record", "enum", "fixed"):
        space = kind.get("namespace", namespace)
        return kind["name"] if "." in kind["name"] else f"{space}.{kind['name']}".lstrip(".")
    if isinstance(kind, dict) and kind.get("type") == "array":
        return {**kind, "items": _named(kind["items"], namespace)}
    if isinstance(kind, dict) and kind.get("type") == "map":
        return {**kind, "values": _named(kind["values"], namespace)}
    return kind
