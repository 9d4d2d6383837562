"""Declarative view specs: which tables join to which, on which columns — validated, no I/O.

Promise: a view is written in the config file as ``[views.<name>]`` with a ``base``
table and a list of ``joins``, one string per join::

    [views.orders_enriched]
    base = "orders"
    joins = [
        "customer: customers on customer_id",            # many-to-one: orders.customer_id -> customers' key
        "items[]: order_items on order_id",              # one-to-many: order_items.order_id -> orders' key
        "items[].product: inner products on product_id", # a lookup inside each item
    ]

``<path>: [left|inner] <table> on <column> [(<columns to keep>)]`` — ``on (<column>, ...)`` for a
composite key, ``on (...) = (...)`` writing the other side's key out — and ``base = "<table>
[(<columns>)]"``: a column list keeps only those columns of that table in the document (plus
the key and the join columns the view needs); without one every column is kept. A path
ending in ``[]`` collects the rows of ``<table>`` whose join columns hold the parent's key, as a
list; otherwise the parent's join columns hold the key of one ``<table>`` row (the key's
columns in its order). Paths nest under joins declared before them. ``parse_views`` reads the
specs (frozen dataclasses that check their own syntax); ``ViewSpec.check`` validates them
against the captured tables — unknown tables and columns, joins on columns that are not a key
(the view keeps an index only for the join columns of a collect), a key matched on fewer or more
columns than it has, a table joined back into its own path (a cycle), names clashing with
columns. Every error is a ``ConfigError`` naming the file and the spec's line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fastavro

from tables.errors import ConfigError
from tables.wire import read_framed

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
COLUMNS = r"[A-Za-z_][A-Za-z0-9_]*|\([^()]*\)"  # one column, or several in parentheses
JOIN = re.compile(
    r"^\s*(?P<path>[A-Za-z0-9_.\[\]]+)\s*:\s*(?:(?P<kind>left|inner)\s+)?(?P<table>[A-Za-z0-9_.]+)\s+on\s+"
    rf"(?P<column>{COLUMNS})(?:\s*=\s*(?P<target>{COLUMNS}))?"
    r"\s*(?:\((?P<columns>[^()]*)\))?\s*$",
    re.IGNORECASE,
)
BASE = re.compile(r"^\s*(?P<table>[A-Za-z0-9_.]+)\s*(?:\((?P<columns>[^()]*)\))?\s*$")
LSN_FIELD = "hw_commit_lsn"  # every view row carries the commit LSN it reflects
SPEC_KEYS = ("base", "joins", "doc")
JOIN_HINT = "see the views section of the README for the join syntax"
CAPTURED_WHEN = ("capture registers a table once it captures it: is the table in the publication and matched by "
                 "[capture] include, with a primary key or a replica identity index?")  # fmt: skip
UNCAPTURED = (f"{CAPTURED_WHEN} With [streams] discover_every above 0 (and no [streams] tables) a worker waits for "
              "its views' tables instead")  # fmt: skip
# A cut on <prefix>.views.cuts (key: the view's name): the view topic read up to `ends` is the view at commit_lsn.
CUT_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "ViewCut",
    "namespace": "headwater",
    "doc": "The view topic read up to these ends shows every source transaction up to commit_lsn, none after.",
    "fields": [
        {"name": "view", "type": "string"},
        {"name": "commit_lsn", "type": "long"},
        {"name": "topic", "type": "string"},
        {"name": "ends", "type": {"type": "array", "items": {
            "type": "record", "name": "PartitionEnd",
            "fields": [{"name": "partition", "type": "int"}, {"name": "offset", "type": "long"}]}}},
    ],
}  # fmt: skip
CUT_PARSED = fastavro.parse_schema(CUT_SCHEMA)


def last_cuts_start(low: int, end: int, views: int) -> int:
    """The offset from which the cuts topic holds the last cut of each of ``views`` views (read back four records
    a view from its ``end``, not before ``low``)."""
    return max(low, end - 1 - 4 * views)


def decode_cut(value: bytes) -> dict[str, Any]:
    """A cut record's value (Confluent-framed ``ViewCut``)."""
    return dict(read_framed(value, CUT_PARSED))


def qualify(table: str) -> str:
    """``customers`` -> ``public.customers``; ``shop.items`` stays."""
    return table if "." in table else f"public.{table}"


@dataclass(frozen=True)
class TableShape:
    """What a view needs to know of a captured table: its columns and key columns."""

    qualified: str
    columns: tuple[str, ...]
    key: tuple[str, ...]


@dataclass(frozen=True)
class Join:
    """One join of a view: ``path`` names where its rows go in the document."""

    path: str
    table: str  # schema.table
    on: tuple[str, ...]  # lookup: the parent's columns; collect: this table's — holding the other side's key, in order
    many: bool  # collect (one-to-many, a list) or lookup (many-to-one, a record or null)
    inner: bool
    target: tuple[str, ...] | None = None  # the other side's columns when written out (must be its key, in order)
    line: int | None = field(default=None, compare=False)
    columns: tuple[str, ...] | None = None  # the columns the document keeps (None: every column)

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1].removesuffix("[]")

    @property
    def parent(self) -> str:
        """The parent's path ('' for the base row)."""
        return self.path.rsplit(".", 1)[0] if "." in self.path else ""


@dataclass(frozen=True)
class ViewSpec:
    """A view: one document per ``base`` row, keyed by the base row's key."""

    name: str
    base: str
    joins: tuple[Join, ...] = ()
    path: str | None = field(default=None, compare=False)
    line: int | None = field(default=None, compare=False)
    doc: str = ""
    columns: tuple[str, ...] | None = None  # the base row's columns the document keeps (None: all)

    def __post_init__(self) -> None:
        if not NAME.match(self.name):
            self.fail("view names are letters, digits and '_'", self.line)
        self._check_listed("the base", self.columns, self.line)
        seen = {""}
        for join in self.joins:
            segments = join.path.split(".")
            if not all(NAME.match(s.removesuffix("[]")) for s in segments):
                self.fail(f"join path {join.path!r}: each part is a name, a list ends in []", join.line)
            if join.path in seen:
                self.fail(f"join path {join.path!r} is declared twice", join.line)
            if join.parent not in seen:
                self.fail(f"join path {join.path!r}: its parent {join.parent!r} must be declared before it", join.line)
            self._check_listed(join.path, join.columns, join.line)
            seen.add(join.path)

    def _check_listed(self, where: str, columns: tuple[str, ...] | None, line: int | None) -> None:
        if columns is None:
            return
        if not columns or not all(NAME.match(c) for c in columns):
            self.fail(f"{where}: list the columns to keep as (name, name, ...), got ({', '.join(columns)})", line)
        if len(set(columns)) < len(columns):
            self.fail(f"{where}: a column is listed twice in ({', '.join(columns)})", line)

    def listed(self, path: str) -> tuple[str, ...] | None:
        """The columns written out for ``path`` ('' for the base row), None when every column is kept."""
        return self.columns if path == "" else next(j.columns for j in self.joins if j.path == path)

    def needed(self, path: str, shape: TableShape) -> set[str]:
        """The columns of ``path``'s rows the joins need whatever is listed: the key and the join columns."""
        out = set(shape.key)
        here = next((j for j in self.joins if j.path == path), None)
        if here is not None and here.many:
            out.update(here.on)  # a collected row names its parent here
        out.update(c for j in self.children(path) if not j.many for c in j.on)  # the key each lookup follows
        return out

    def kept(self, path: str, shape: TableShape) -> tuple[str, ...]:
        """The columns a document holds at ``path``, in the table's order: the listed ones (all when none
        are listed) plus those the joins need."""
        listed = self.listed(path)
        if listed is None:
            return shape.columns
        needed = self.needed(path, shape)
        if not shape.columns:  # columns not known (a shape made for the SQL): listed, then needed
            return (*listed, *sorted(needed - set(listed)))
        wanted = set(listed) | needed
        return tuple(c for c in shape.columns if c in wanted)

    def fail(self, message: str, line: int | None, hint: str = JOIN_HINT) -> None:
        raise ConfigError(f"view {self.name}: {message}", path=self.path, line=line or self.line, hint=hint)

    def table_of(self, path: str) -> str:
        return self.base if path == "" else next(j.table for j in self.joins if j.path == path)

    def children(self, path: str) -> list[Join]:
        return [j for j in self.joins if j.parent == path]

    @property
    def tables(self) -> set[str]:
        return {self.base, *(j.table for j in self.joins)}

    def check(self, shapes: Mapping[str, TableShape]) -> None:
        """Validate against the captured (keyed) tables; a ``ConfigError`` with the line if wrong."""
        known = ", ".join(sorted(shapes)) or "none"
        if self.base not in shapes:
            self.fail(f"base table {self.base} is not captured with a key (captured: {known})", self.line, UNCAPTURED)
        self._check_columns("the base", self.base, self.columns, shapes, self.line)
        for join in self.joins:
            if join.table not in shapes:
                self.fail(f"{join.path}: table {join.table} is not captured with a key (captured: {known})", join.line,
                          UNCAPTURED)  # fmt: skip
            self._check_join(join, shapes)
            self._check_columns(join.path, join.table, join.columns, shapes, join.line)

    def _check_columns(self, where: str, table: str, columns: tuple[str, ...] | None,
                       shapes: Mapping[str, TableShape], line: int | None) -> None:  # fmt: skip
        missing = [c for c in columns or () if c not in shapes[table].columns]
        if missing:
            self.fail(f"{where}: {table} has no column {', '.join(map(repr, missing))} "
                      f"(its columns: {', '.join(shapes[table].columns)})", line)  # fmt: skip

    def _check_join(self, join: Join, shapes: Mapping[str, TableShape]) -> None:
        parent_table = self.table_of(join.parent)
        parent, child = shapes[parent_table], shapes[join.table]
        chain = self._ancestors(join)
        if join.table in chain:
            self.fail(f"{join.path}: joins {join.table} back into its own path ({' -> '.join(chain)}): a cycle",
                      join.line)  # fmt: skip
        if join.name in parent.columns or join.name == LSN_FIELD:
            self.fail(f"{join.path}: the name {join.name!r} is already a column of {parent_table}", join.line)
        holder, keyed = (child, parent) if join.many else (parent, child)
        missing = [c for c in join.on if c not in holder.columns]
        if missing:
            self.fail(f"{join.path}: {holder.qualified} has no column {missing[0]!r}", join.line)
        if len(join.on) != len(keyed.key):
            self.fail(f"{join.path}: {keyed.qualified} has {'a composite key' if len(keyed.key) > 1 else 'a key'} "
                      f"({', '.join(keyed.key)}); a join matches as many columns, in its order: "
                      f"'on ({', '.join(keyed.key)})' names them (got {', '.join(join.on)})", join.line)  # fmt: skip
        if join.target is not None and join.target != keyed.key:
            where = "collect" if join.many else "lookup"
            self.fail(
                f"{join.path}: joins on {keyed.qualified}.{', '.join(join.target)}, which is not its key "
                f"({', '.join(keyed.key)}) and has no index of its own; a {where} matches {holder.qualified}."
                f"{', '.join(join.on)} to the key of {keyed.qualified} — join on the key, or turn the join around "
                "(a list: 'name[]: ...')",
                join.line,
            )

    def sql(self, shapes: Mapping[str, TableShape]) -> str:
        """The same view as one PostgreSQL query: ``(key columns..., doc jsonb)`` per view row.

        Identifiers are quoted; there are no values in it. Lookups are correlated subqueries
        (a left join), collects ``jsonb_agg`` ordered by key; an unmet inner join makes the
        document NULL, and NULL documents are left out.
        """
        key = shapes[self.base].key
        doc = self._sql_doc("", self.base, "t0", shapes, [0])
        keys = ", ".join(f"t0.{quote(k)}" for k in key)
        base = quote_table(self.base)
        return f"SELECT * FROM (SELECT {keys}, {doc} AS doc FROM {base} t0) v WHERE doc IS NOT NULL"  # noqa: S608

    def _sql_doc(self, path: str, table: str, alias: str, shapes: Mapping[str, TableShape], n: list[int]) -> str:
        parts, required = [], []
        for join in self.children(path):
            n[0] += 1
            inner_alias = f"t{n[0]}"
            child = self._sql_doc(join.path, join.table, inner_alias, shapes, n)
            source = f"{quote_table(join.table)} {inner_alias}"
            if join.many:
                order = ", ".join(f"k{i}" for i in range(len(shapes[join.table].key)))
                keys = ", ".join(f"{inner_alias}.{quote(k)} AS k{i}" for i, k in enumerate(shapes[join.table].key))
                match = " AND ".join(f"{inner_alias}.{quote(c)} = {alias}.{quote(k)}"
                                     for c, k in zip(join.on, shapes[table].key, strict=True))  # fmt: skip
                rows = f"(SELECT {child} AS d, {keys} FROM {source} WHERE {match}) s"  # noqa: S608
                sub = f"(SELECT coalesce(jsonb_agg(d ORDER BY {order}), '[]'::jsonb) FROM {rows} WHERE d IS NOT NULL)"  # noqa: S608
                if join.inner:
                    required.append(f"{sub} = '[]'::jsonb")
            else:
                match = " AND ".join(f"{inner_alias}.{quote(k)} = {alias}.{quote(c)}"
                                     for c, k in zip(join.on, shapes[join.table].key, strict=True))  # fmt: skip
                sub = f"(SELECT {child} FROM {source} WHERE {match})"  # noqa: S608 - quoted identifiers
                if join.inner:
                    required.append(f"{sub} IS NULL")
            parts.append(f"'{join.name}', {sub}")
        doc = self._sql_row(path, table, alias, shapes) + (
            f" || jsonb_build_object({', '.join(parts)})" if parts else ""
        )
        return f"(CASE WHEN {' OR '.join(required)} THEN NULL ELSE {doc} END)" if required else doc

    def _sql_row(self, path: str, table: str, alias: str, shapes: Mapping[str, TableShape]) -> str:
        """The row's own columns as jsonb: the whole row, or the kept columns."""
        if self.listed(path) is None:
            return f"to_jsonb({alias})"
        pairs = ", ".join(f"'{c}', {alias}.{quote(c)}" for c in self.kept(path, shapes[table]))
        return f"jsonb_build_object({pairs})"

    def _ancestors(self, join: Join) -> list[str]:
        chain: list[str] = []
        path = join.parent
        while True:
            chain.insert(0, self.table_of(path))
            if path == "":
                return chain
            path = next(j for j in self.joins if j.path == path).parent


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_table(qualified: str) -> str:
    schema, _, table = qualified.partition(".")
    return f"{quote(schema)}.{quote(table)}"


def _line_of(text: str, needle: str, start: int = 0) -> int | None:
    """The 1-based line where ``needle`` first appears at or after line ``start``."""
    for number, raw in enumerate(text.splitlines(), start=1):
        if number >= start and needle in raw:
            return number
    return None


def parse_join(spec: str, line: int | None, view: str, path: str | None) -> Join:
    found = JOIN.match(spec)
    if not found:
        raise ConfigError(
            f"view {view}: cannot read the join {spec!r}",
            path=path,
            line=line,
            hint="write '<path>: [left|inner] <table> on <column> [(columns to keep)]', e.g. 'customer: customers "
            "on customer_id (id, name)' or 'items[]: order_items on order_id'",
        )
    kind = (found.group("kind") or "left").lower()
    on, target = join_columns(found.group("column")), found.group("target")
    if not on or not all(NAME.match(c) for c in on):
        raise ConfigError(f"view {view}: {found.group('path')}: name the columns to join on, as 'on column' or "
                          "'on (column, column)'", path=path, line=line)  # fmt: skip
    return Join(path=found.group("path"), table=qualify(found.group("table")), on=on,
                many=found.group("path").endswith("[]"), inner=kind == "inner",
                target=None if target is None else join_columns(target), line=line,
                columns=column_list(found.group("columns")))  # fmt: skip


def join_columns(text: str) -> tuple[str, ...]:
    """``customer_id`` or ``(region, code)`` as a tuple of column names."""
    inner = text.strip()
    if inner.startswith("("):
        inner = inner[1:-1]
    return tuple(c.strip() for c in inner.split(",") if c.strip())


def column_list(text: str | None) -> tuple[str, ...] | None:
    """``"id, name"`` as ``("id", "name")``; None when no list was written."""
    return None if text is None else tuple(c.strip() for c in text.split(",") if c.strip())


def parse_view(name: str, body: Any, text: str, path: str | None) -> ViewSpec:
    header = _line_of(text, f"[views.{name}]") or _line_of(text, name)
    if not isinstance(body, dict):
        raise ConfigError(f"views.{name} must be a table with base and joins", path=path, line=header)
    unknown = sorted(set(body) - set(SPEC_KEYS))
    if unknown or not isinstance(body.get("base"), str):
        what = f"unknown key {unknown[0]!r}" if unknown else 'needs base = "<table>"'
        raise ConfigError(f"view {name}: {what}", path=path, line=header, hint=f"a view has {', '.join(SPEC_KEYS)}")
    joins = body.get("joins", [])
    if not isinstance(joins, list) or not all(isinstance(j, str) for j in joins):
        raise ConfigError(f"view {name}: joins must be a list of strings", path=path, line=header)
    parsed = tuple(parse_join(j, _line_of(text, j, header or 0), name, path) for j in joins)
    base = BASE.match(body["base"])
    if base is None:
        raise ConfigError(f"view {name}: cannot read base = {body['base']!r}", path=path, line=header,
                          hint='write base = "<table>" or base = "<table> (columns to keep)"')  # fmt: skip
    return ViewSpec(name=name, base=qualify(base.group("table")), joins=parsed, path=path, line=header,
                    doc=str(body.get("doc", "")), columns=column_list(base.group("columns")))  # fmt: skip


def parse_views(data: Mapping[str, Any], text: str = "", path: Path | None = None) -> list[ViewSpec]:
    """The ``[views]`` section of a parsed config file (``text`` gives the lines)."""
    section = data.get("views", {})
    where = str(path) if path else None
    if not isinstance(section, dict):
        raise ConfigError("views must be a table of [views.<name>] tables", path=where, line=_line_of(text, "views"))
    return [parse_view(name, body, text, where) for name, body in section.items()]
