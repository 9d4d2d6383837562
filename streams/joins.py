"""The join engine behind the views: rows in, affected view rows and their documents out.

Promise: pure (no I/O). ``Joiner`` keeps the rows of every table a view uses in a
store (any ``MutableMapping[bytes, bytes]``: a Faust table in the workers, a dict in
tests) and derives from them, in memory, an index on every join column. ``apply``
takes one raw change (snapshot read, insert, update — a key change deletes the old
key — delete, truncate) and marks every view row it can affect *dirty*, in the old
state and in the new (a foreign key that moves dirties both parents), writing the
marks to the store *before* the row itself. Re-applying a change, or a run of changes
whose writes partly reached the store before a crash, leaves the same rows and
indexes (rows are set to the change's image, indexes follow the rows). ``document``
builds a view row from the current rows: lookups as a record or null (inner: no view
row), collects as a list sorted by key (inner: no view row when empty).
``view_schema`` is the Avro schema of a view's documents, composed from the tables'
registered schemas (every copied column nullable, named types defined once).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from streams.fanout import Change
from tables.views import LSN_FIELD, Join, TableShape, ViewSpec
from tables.wire import SCHEMA_BASE, SCHEMA_VIEW

SEP = b"\x1f"
Row = dict[str, Any]
Decode = Callable[[bytes], Row]


def canon(values: Sequence[Any]) -> bytes:
    """A key's identity in the store and indexes: the key columns' values as compact JSON."""
    return json.dumps(list(values), default=str, separators=(",", ":")).encode()


def store_key(kind: bytes, name: str, key: bytes) -> bytes:
    return kind + SEP + name.encode() + SEP + key


def split_key(entry: bytes) -> tuple[bytes, str, bytes]:
    kind, name, key = entry.split(SEP, 2)
    return kind, name.decode(), key


@dataclass(eq=False)
class Node:
    """A place in a view's document: the base row, or one join under its parent."""

    view: str
    table: str
    join: Join | None
    parent: Node | None
    children: list[Node] = field(default_factory=list)


class Joiner:
    """Rows of the joined tables, their join indexes and the dirty view rows."""

    def __init__(self, views: Sequence[ViewSpec], shapes: Mapping[str, TableShape],
                 store: MutableMapping[bytes, bytes], decode: Decode) -> None:  # fmt: skip
        self.views = {v.name: v for v in views}
        self.shapes = shapes
        self.store = store
        self.decode = decode
        self.roots: dict[str, Node] = {}
        self.nodes: dict[str, list[Node]] = {}  # table -> every place it appears
        self.indexed: dict[str, set[str]] = {}  # table -> join columns to index
        for spec in views:
            self.roots[spec.name] = self._tree(spec)
        self.rows: dict[str, dict[bytes, Row]] = {t: {} for t in self.nodes}
        self.index: dict[tuple[str, str], dict[bytes, set[bytes]]] = {
            (t, c): {} for t, cols in self.indexed.items() for c in cols
        }
        self.dirty: dict[str, set[bytes]] = {name: set() for name in self.views}
        self._load()

    # ---- structure ----------------------------------------------------------------------
    def _tree(self, spec: ViewSpec) -> Node:
        root = Node(spec.name, spec.base, None, None)
        self.nodes.setdefault(spec.base, []).append(root)
        by_path = {"": root}
        for join in spec.joins:
            parent = by_path[join.parent]
            node = Node(spec.name, join.table, join, parent)
            parent.children.append(node)
            by_path[join.path] = node
            self.nodes.setdefault(join.table, []).append(node)
            holder = join.table if join.many else parent.table
            self.indexed.setdefault(holder, set()).add(join.column)
        return root

    @property
    def tables(self) -> set[str]:
        return set(self.nodes)

    def _load(self) -> None:
        """Rows from the store (after a restart); indexes rebuilt from the rows."""
        for entry, value in list(self.store.items()):
            if entry.startswith(b"r" + SEP):
                _, name, key = split_key(entry)
                if name in self.rows:
                    self._remember(name, key, self.decode(value))

    # ---- changes ------------------------------------------------------------------------
    def key_of(self, table: str, record: Row) -> bytes:
        return canon([record[c] for c in self.shapes[table].key])

    def apply(self, change: Change) -> None:
        """One raw change of a table the views use (others are ignored)."""
        table = f"{change.schema}.{change.table}"
        if table not in self.rows:
            return
        if change.op == "TRUNCATE":
            for key in list(self.rows[table]):
                self._set(table, key, None)
            return
        if change.key is None or change.op not in ("READ", "INSERT", "UPDATE", "DELETE"):
            return
        key = self.key_of(table, self.decode(change.key))
        if change.op == "UPDATE" and change.before is not None:
            old_key = self.key_of(table, self.decode(change.before))  # an old key, or the old row (FULL)
            if old_key != key:
                self._set(table, old_key, None)
        if change.op == "DELETE" or change.after is None:
            self._set(table, key, None)
        else:
            self._set(table, key, self.decode(change.after), change.after)

    def _set(self, table: str, key: bytes, row: Row | None, image: bytes | None = None) -> None:
        affected = self._affected(table, key, self.rows[table].get(key))
        self._forget(table, key)
        if row is not None:
            self._remember(table, key, row)
        affected |= self._affected(table, key, row)
        for view, root in affected:
            self.dirty[view].add(root)
        if image is None:
            self.store.pop(store_key(b"r", table, key), None)
        else:
            self.store[store_key(b"r", table, key)] = image

    def _remember(self, table: str, key: bytes, row: Row) -> None:
        self.rows[table][key] = row
        for column in self.indexed.get(table, ()):
            if row.get(column) is not None:
                self.index[(table, column)].setdefault(canon([row[column]]), set()).add(key)

    def _forget(self, table: str, key: bytes) -> None:
        row = self.rows[table].pop(key, None)
        if row is None:
            return
        for column in self.indexed.get(table, ()):
            if row.get(column) is not None:
                bucket = self.index[(table, column)].get(canon([row[column]]))
                if bucket is not None:
                    bucket.discard(key)
                    if not bucket:
                        del self.index[(table, column)][canon([row[column]])]

    def _affected(self, table: str, key: bytes, row: Row | None) -> set[tuple[str, bytes]]:
        """(view, base key) of every view row that shows this row (or would)."""
        out: set[tuple[str, bytes]] = set()
        for node in self.nodes.get(table, ()):
            out.update((node.view, root) for root in self._up(node, key, row))
        return out

    def _up(self, node: Node, key: bytes, row: Row | None) -> Iterator[bytes]:
        parent, join = node.parent, node.join
        if parent is None or join is None:
            yield key
            return
        if join.many:  # this row sits in the list of the parent whose key its column holds
            value = None if row is None else row.get(join.column)
            parents = [] if value is None else [canon([value])]
        else:  # every parent row whose join column holds this row's key
            parents = sorted(self.index[(parent.table, join.column)].get(key, ()))
        for parent_key in parents:
            parent_row = self.rows[parent.table].get(parent_key)
            if parent.parent is None or parent_row is not None:
                yield from self._up(parent, parent_key, parent_row)

    # ---- documents ----------------------------------------------------------------------
    def document(self, view: str, key: bytes) -> Row | None:
        """The view row for a base key now, or None if there is none (no base row, inner join unmet)."""
        row = self.rows[self.roots[view].table].get(key)
        return None if row is None else self._doc(self.roots[view], row)

    def _doc(self, node: Node, row: Row) -> Row | None:
        doc = dict(row)
        for child in node.children:
            join = child.join
            assert join is not None
            if join.many:
                parent_key = canon([row[self.shapes[node.table].key[0]]])
                keys = self.index[(child.table, join.column)].get(parent_key, set())
                items = [self._doc(child, self.rows[child.table][k]) for k in sorted(keys, key=json.loads)]
                present = [item for item in items if item is not None]
                if join.inner and not present:
                    return None
                doc[join.name] = present
            else:
                value = row.get(join.column)
                found = None if value is None else self.rows[child.table].get(canon([value]))
                sub = None if found is None else self._doc(child, found)
                if sub is None and join.inner:
                    return None
                doc[join.name] = sub
        return doc

    def base_keys(self, view: str) -> list[bytes]:
        """The keys of every base row of ``view`` (each may have a view row)."""
        return list(self.rows[self.roots[view].table])


# ---- schemas ----------------------------------------------------------------------------
def _nullable(entry: dict[str, Any]) -> dict[str, Any]:
    kind = entry["type"]
    if isinstance(kind, list):
        kind = kind if "null" in kind else ["null", *kind]
        if kind[0] != "null":
            kind = ["null", *[k for k in kind if k != "null"]]
    else:
        kind = ["null", kind]
    return {**entry, "type": kind, "default": None}


def _dedupe(kind: Any, seen: set[str], namespace: str = "") -> Any:
    """``kind`` with every named type already defined (in ``seen``) replaced by its full name."""
    if isinstance(kind, list):
        return [_dedupe(k, seen, namespace) for k in kind]
    if not isinstance(kind, dict):
        return kind
    if kind.get("type") in ("record", "enum", "fixed"):
        space = kind.get("namespace", namespace)
        full = kind["name"] if "." in kind["name"] else f"{space}.{kind['name']}".lstrip(".")
        if full in seen:
            return full
        seen.add(full)
        if kind["type"] == "record":
            return {**kind, "namespace": space,
                    "fields": [{**f, "type": _dedupe(f["type"], seen, space)} for f in kind["fields"]]}  # fmt: skip
        return kind
    if kind.get("type") == "array":
        return {**kind, "items": _dedupe(kind["items"], seen, namespace)}
    if kind.get("type") == "map":
        return {**kind, "values": _dedupe(kind["values"], seen, namespace)}
    return kind


def view_schema(spec: ViewSpec, value_schemas: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The Avro record of ``spec``'s documents from its tables' value schemas."""
    namespace = f"headwater.views.{spec.name}"
    seen: set[str] = set()

    def record(path: str, table: str, name: str) -> dict[str, Any]:
        source = value_schemas[table]
        fields = [_nullable({**f, "type": _dedupe(f["type"], seen, source.get("namespace", ""))})
                  for f in source["fields"]]  # fmt: skip
        for join in spec.children(path):
            sub = record(join.path, join.table, f"{name}_{join.name}")
            if join.many:
                fields.append({"name": join.name, "type": {"type": "array", "items": sub}, "default": [],
                               "pg.join": f"collect {join.table} on {join.column}"})  # fmt: skip
            else:
                fields.append({"name": join.name, "type": ["null", sub], "default": None,
                               "pg.join": f"lookup {join.table} on {join.column}"})  # fmt: skip
        return {"type": "record", "name": name, "namespace": namespace, "fields": fields, "pg.table": table}

    root = record("", spec.base, spec.name)
    reflects = "the commit LSN this row reflects: every transaction up to it, none after"
    root["fields"].append({"name": LSN_FIELD, "type": "long", "doc": reflects})
    del root["pg.table"]  # a view is not a captured table (the workers discover tables by pg.table)
    root[SCHEMA_VIEW] = spec.name
    root[SCHEMA_BASE] = spec.base
    if spec.doc:
        root["doc"] = spec.doc
    return root
