"""The join engine behind the views: rows in, affected view rows and their documents out.

Promise: pure (no I/O of its own). ``Joiner`` keeps the rows of every table a view uses, and
an index on every join column, in a store (``streams.viewstore``: RocksDB in the workers, a dict
in tests) — only a bounded cache of decoded rows is held in memory, whatever the tables' size.
``apply`` takes one raw change (snapshot read, insert, update — a key change deletes the old
key — delete, truncate) and marks every view row it can affect *dirty*, in the old state and
in the new (a foreign key that moves dirties both parents); the rows that show a looked-up row
(every order holding a product) are found by ``expand``, once, when the views are published —
whoever holds the product then shows its change, and whoever stopped holding it is dirty by its
own change. Re-applying a change, or a run of
changes on top of a state committed part way through them, leaves the same rows and indexes
(rows are set to the change's image, index entries follow the rows). ``document`` builds a view
row from the current rows: the columns the spec keeps (``ViewSpec.kept``), lookups as a record
or null (inner: no view row), collects as a list sorted by key (inner: no view row when empty).
``view_schema`` is the Avro schema of a view's documents, composed from the tables' registered
schemas (every kept column nullable, named types defined once).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from streams import docbytes
from streams.docbytes import Encoders
from streams.fanout import Change
from streams.placement import Placement, placements
from tables.views import LSN_FIELD, Join, TableShape, ViewSpec
from tables.wire import SCHEMA_BASE, SCHEMA_VIEW

SEP = b"\x1f"
Row = dict[str, Any]
Decode = Callable[[bytes], Row]
CACHED_ROWS = 20_000  # decoded rows kept in memory (the rest are read from the store when needed)


class Store(Protocol):
    """What the joiner needs of a store (``streams.viewstore``)."""

    def get(self, key: bytes, default: bytes | None = None) -> bytes | None: ...
    def __setitem__(self, key: bytes, value: bytes) -> None: ...
    def pop(self, key: bytes, default: bytes | None = None) -> bytes | None: ...
    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]: ...


def canon(values: Sequence[Any]) -> bytes:
    """A key's identity in the store and indexes: the key columns' values as compact JSON."""
    if len(values) == 1 and type(values[0]) is int:  # the common key, 20 times faster than json.dumps
        return b"[%d]" % values[0]
    return json.dumps(list(values), default=str, separators=(",", ":")).encode()


def joined(row: Row | None, columns: Sequence[str]) -> list[Any] | None:
    """A row's values of join columns, None when there is no row or one of them is null (it joins nothing)."""
    if row is None:
        return None
    values = [row.get(c) for c in columns]
    return None if None in values else values


def store_key(kind: bytes, name: str, key: bytes) -> bytes:
    return kind + SEP + name.encode() + SEP + key


def index_prefix(table: str, columns: Sequence[str], value: bytes) -> bytes:
    """Where the keys of ``table``'s rows whose ``columns`` hold ``value`` (their values ``canon``-ed) are listed."""
    return store_key(b"i", table, ",".join(columns).encode() + SEP + value + SEP)


Space = int | None  # a view partition's share of the split tables, or None: the replicated tables
PartitionOf = Callable[[str, Sequence[Any]], int]  # (view, the base key's values in key order) -> partition
# (view, a base row's framed key image) -> its partition, or None when the image's frame does not tell it undecoded
ImagePartition = Callable[[str, bytes], int | None]
Dirty = tuple[str, bytes, int]  # (view, base key, partition) of a view row to build again


def space_name(table: str, space: Space) -> str:
    """Where a table's rows of one space live in the store: ``table``, or ``table`` and the partition."""
    return table if space is None else f"{table}\x1e{space}"


@dataclass(eq=False)
class Node:
    """A place in a view's document: the base row, or one join under its parent."""

    view: str
    table: str
    join: Join | None
    parent: Node | None
    columns: tuple[str, ...] = ()  # the columns the document holds here
    children: list[Node] = field(default_factory=list)
    path: str = ""  # the join's path ('' for the base row)


K = TypeVar("K")
V = TypeVar("V")


def newest(cache: OrderedDict[K, V], at: K, value: V, bound: int) -> V:
    """``value`` kept under ``at`` as ``cache``'s most recently used entry, its least recently used dropped past
    ``bound`` entries (the joiner's LRU caches)."""
    cache[at] = value
    cache.move_to_end(at)
    if len(cache) > bound:
        cache.popitem(last=False)
    return value


class Joiner:
    """Rows of the joined tables, their join indexes and the dirty view rows, per space."""

    def __init__(self, views: Sequence[ViewSpec], shapes: Mapping[str, TableShape], store: Store,
                 decode: Decode, cached: int = CACHED_ROWS, encoders: Mapping[str, Encoders] | None = None,
                 partition_of: PartitionOf | None = None, held: set[int] | None = None, partitions: int = 1,
                 image_partition: ImagePartition | None = None) -> None:  # fmt: skip
        self.views = {v.name: v for v in views}
        self.encoders = dict(encoders or {})  # view -> its rows' encoders (``content``)
        self.shapes, self.store, self.decode = shapes, store, decode
        # without a partition function every table is replicated and every view row is in partition 0
        self.placed: dict[str, Placement] = {} if partition_of is None else placements(views, shapes)
        self.partition_of: PartitionOf = partition_of or (lambda view, values: 0)
        self.held: set[int] = {0} if held is None else set(held)  # the view partitions this worker publishes
        self.partitions = partitions  # of the view topics
        self.image_partition: ImagePartition = image_partition or (lambda view, image: None)
        self.roots: dict[str, Node] = {}
        self.nodes: dict[str, list[Node]] = {}  # table -> every place it appears
        self.indexed: dict[str, set[tuple[str, ...]]] = {}  # table -> the join columns to index
        for spec in views:
            self.roots[spec.name] = self._tree(spec)
        self.kept = {t: {c for n in nodes for c in n.columns} for t, nodes in self.nodes.items()}
        # the columns by which a table's rows sit in a parent's list (read by _up without decoding)
        self.linked = {t: sorted({c for n in nodes if n.join is not None and n.join.many for c in n.join.on})
                       for t, nodes in self.nodes.items()}  # fmt: skip
        self.cache: OrderedDict[tuple[str, bytes], Row | None] = OrderedDict()
        self.cached = cached
        self.encoded: OrderedDict[tuple[Node, Space, bytes], bytes] = OrderedDict()  # a row's own columns, encoded
        self.lists: OrderedDict[bytes, list[bytes]] = OrderedDict()  # an index prefix -> its keys in value order
        # a joined row with everything under it, encoded (``_child_content``): (node, key) -> (its partition if a
        # split table is under it, else None; the content)
        self.contents: OrderedDict[tuple[Node, bytes], tuple[Space, bytes | None]] = OrderedDict()
        self.split_below = {n: self._split_below(n) for nodes in self.nodes.values() for n in nodes}
        self.dirty: dict[str, dict[int, set[bytes]]] = {name: {} for name in self.views}  # view -> partition -> keys
        self.deferred: set[tuple[Node, bytes]] = set()  # looked-up rows that changed, not yet followed up

    # ---- structure ----------------------------------------------------------------------
    def _tree(self, spec: ViewSpec) -> Node:
        root = Node(spec.name, spec.base, None, None, spec.kept("", self.shapes[spec.base]))
        self.nodes.setdefault(spec.base, []).append(root)
        by_path = {"": root}
        for join in spec.joins:
            parent = by_path[join.parent]
            node = Node(spec.name, join.table, join, parent, spec.kept(join.path, self.shapes[join.table]),
                        path=join.path)
            parent.children.append(node)
            by_path[join.path] = node
            self.nodes.setdefault(join.table, []).append(node)
            holder = join.table if join.many else parent.table
            self.indexed.setdefault(holder, set()).add(join.on)
        return root

    def _split_below(self, node: Node) -> bool:
        """Whether a split table is at ``node`` or under it (its content then depends on the partition)."""
        return node.table in self.placed or any(self._split_below(child) for child in node.children)

    @property
    def tables(self) -> set[str]:
        return set(self.nodes)

    def spaces(self, table: str) -> list[Space]:
        """The spaces this worker keeps ``table``'s rows in: its partitions when the table is split."""
        out: list[Space] = [None]
        if table in self.placed:
            out = [*sorted(self.held)]
        return out

    def space_of(self, table: str, partition: int) -> Space:
        """The space holding ``table``'s rows for view partition ``partition``."""
        return partition if table in self.placed else None

    def partition(self, table: str, row: Row) -> int | None:
        """The view partition a row of a split table belongs to (None: a column holding the base key is null)."""
        placed = self.placed[table]
        values = [row.get(c) for c in placed.columns]
        return None if None in values else self.partition_of(placed.view, values)

    # ---- rows ---------------------------------------------------------------------------
    def row(self, table: str, key: bytes, space: Space = None) -> Row | None:
        """A row as the views keep it (its kept columns), from the cache or the store."""
        at = (space_name(table, space), key)
        if at in self.cache:
            self.cache.move_to_end(at)
            return self.cache[at]
        image = self.store.get(store_key(b"r", at[0], key))
        found = None if image is None else self._kept(table, self.decode(image))
        self._cache(at, found)
        return found

    def _kept(self, table: str, row: Row) -> Row:
        kept = self.kept[table]
        return {c: v for c, v in row.items() if c in kept}

    def _cache(self, at: tuple[str, bytes], row: Row | None) -> None:
        newest(self.cache, at, row, self.cached)

    def keys(self, table: str, space: Space = None) -> Iterator[bytes]:
        """The keys of every row of ``table`` the store holds in ``space``, in byte order."""
        prefix = store_key(b"r", space_name(table, space), b"")
        for entry, _ in self.store.scan(prefix):
            yield entry[len(prefix) :]

    def matching(self, table: str, columns: Sequence[str], value: bytes, space: Space = None) -> list[bytes]:
        """The keys of ``table``'s rows in ``space`` whose ``columns`` hold ``value`` (``canon``-ed), in byte order."""
        prefix = index_prefix(space_name(table, space), columns, value)
        return [entry[len(prefix) :] for entry, _ in self.store.scan(prefix)]

    def collected(self, table: str, columns: Sequence[str], value: bytes, space: Space = None) -> list[bytes]:
        """``matching`` in the order of the keys' values (a collect's order), kept while the index stays."""
        prefix = index_prefix(space_name(table, space), columns, value)
        found = self.lists.get(prefix)
        if found is not None:
            self.lists.move_to_end(prefix)
            return found
        return newest(self.lists, prefix, sorted(self.matching(table, columns, value, space), key=json.loads),
                      self.cached)  # fmt: skip

    # ---- changes ------------------------------------------------------------------------
    def key_of(self, table: str, record: Row) -> bytes:
        return canon([record[c] for c in self.shapes[table].key])

    def apply(self, change: Change, live: Callable[[Space], bool] = lambda space: True) -> None:
        """One raw change of a table the views use (others are ignored), in the spaces ``live`` says
        are at its offset (a space whose state is past it already skips it)."""
        table = f"{change.schema}.{change.table}"
        if table not in self.nodes:
            return
        if change.op == "TRUNCATE":
            for space in self.spaces(table):
                if live(space):
                    for key in list(self.keys(table, space)):
                        self._set(table, key, None, None, space)
            return
        if change.key is None or change.op not in ("READ", "INSERT", "UPDATE", "DELETE"):
            return
        home = self._key_home(table, change)
        if home is not None and home not in self.held:
            return
        after = None if change.op == "DELETE" or change.after is None else self.decode(change.after)
        record = self.decode(change.key) if after is None else after
        key = self.key_of(table, record)
        if change.op == "UPDATE" and change.before is not None:
            before = self.decode(change.before)  # an old key, or the old row (REPLICA IDENTITY FULL)
            old_key = self.key_of(table, before)
            if old_key != key:
                for space, _ in self._homes(table, before, None, live):
                    self._set(table, old_key, None, None, space)
        row = None if after is None else self._kept(table, after)
        for space, new in self._homes(table, record, after, live, home):
            self._set(table, key, row if new else None, change.after if new else None, space)

    def _key_home(self, table: str, change: Change) -> int | None:
        """The view partition of a change of a row split by its key, told by its key image alone (its key unchanged:
        no old image), so a change of a partition this worker does not hold is dropped before its row is decoded
        (``bench/RESULTS.md``, "The partitioner in C, and other workers' rows dropped"); None when the key does not
        tell it. A base row's key image tells it undecoded (the partitioner in C), so even a worker holding every
        partition asks it that way rather than encode the decoded key again (``_homes``); a key that needs decoding
        is decoded here only where the answer may drop the change."""
        placed = self.placed.get(table)
        if placed is None or not placed.by_key or change.before is not None:
            return None
        assert change.key is not None
        home = self.image_partition(placed.view, change.key) if table == self.views[placed.view].base else None
        if home is None and len(self.held) < self.partitions:
            home = self.partition(table, self.decode(change.key))
        return home

    def _homes(self, table: str, record: Row, after: Row | None, live: Callable[[Space], bool],
               home: int | None = None) -> Iterator[tuple[Space, bool]]:  # fmt: skip
        """The live spaces a change of a row touches (``record`` holds its key, ``after`` is its new image
        or None), each with whether the new row belongs there (``home``: its partition, when its key told it)."""
        placed = self.placed.get(table)
        if placed is None:
            if live(None):
                yield None, True
            return
        if placed.by_key:  # the key tells the partition: the old and the new row live in one space
            home = self.partition(table, record) if home is None else home
            if home in self.held and live(home):
                yield home, after is not None
            return
        home = None if after is None else self.partition(table, after)
        for space in sorted(self.held):
            if live(space):
                yield space, space == home

    def _set(self, table: str, key: bytes, row: Row | None, image: bytes | None, space: Space) -> None:
        old = self.row(table, key, space)
        if old is None and row is None:
            return
        name = space_name(table, space)
        if row is not None and image is not None and row == old:  # no column a view keeps changed
            self.store[store_key(b"r", name, key)] = image  # (the image stays current: a column list may grow)
            return
        affected = self._affected(table, key, old, space)
        self._index(table, key, old, row, space)
        if image is None or row is None:
            self.store.pop(store_key(b"r", name, key), None)
            self.store.pop(store_key(b"u", name, key), None)
        else:
            self.store[store_key(b"r", name, key)] = image
            links = [row.get(c) for c in self.linked[table]]
            if old is None or links != [old.get(c) for c in self.linked[table]]:
                self.store[store_key(b"u", name, key)] = canon(links)
        self._cache((name, key), row)
        for node in self.nodes[table]:
            self.encoded.pop((node, space, key), None)
        affected |= self._affected(table, key, row, space)
        for view, root, partition in affected:
            self.dirty[view].setdefault(partition, set()).add(root)

    def _index(self, table: str, key: bytes, old: Row | None, new: Row | None, space: Space) -> None:
        """Move ``key``'s index entries from the old row's join-column values to the new row's."""
        for columns in self.indexed.get(table, ()):
            before = joined(old, columns)
            after = joined(new, columns)
            if before == after:
                continue
            for values, present in ((before, False), (after, True)):
                if values is None:
                    continue
                prefix = index_prefix(space_name(table, space), columns, canon(values))
                if present:
                    self.store[prefix + key] = b""
                else:
                    self.store.pop(prefix + key, None)
                self.lists.pop(prefix, None)

    def _affected(self, table: str, key: bytes, row: Row | None, space: Space) -> set[Dirty]:
        """(view, base key, partition) of every view row that shows this row (or would)."""
        out: set[Dirty] = set()
        for node in self.nodes.get(table, ()):
            out.update((node.view, root, partition) for root, partition in self._up(node, key, row, space))
        return out

    def _up(self, node: Node, key: bytes, row: Row | None, space: Space) -> Iterator[tuple[bytes, int]]:
        """(base key, partition) of the view rows that show ``row`` at ``node`` (``row`` needs only the
        columns that link it to its parent: a full row, or ``_links``)."""
        self.contents.pop((node, key), None)  # every joined row on the way up shows the change
        parent, join = node.parent, node.join
        if parent is None or join is None:
            partition = self._root_partition(node, key, row, space)
            if partition is not None:
                yield key, partition
            return
        if not join.many:  # every parent row whose join column holds this row's key: found when published
            self.deferred.add((node, key))
            return
        values = joined(row, join.on)  # the parent whose key its columns hold
        if values is not None:
            yield from self._above(parent, [(canon(values), values)], space)

    def _above(self, parent: Node, parents: Sequence[tuple[bytes, Sequence[Any] | None]],
               space: Space) -> Iterator[tuple[bytes, int]]:  # fmt: skip
        """The view rows over each parent (its key, and its key's values when known)."""
        for parent_key, values in parents:
            if parent.parent is None:
                partition = self._root_partition(parent, parent_key, None, space, values)
                if partition is not None:
                    yield parent_key, partition
                continue
            for where in [space] if space is not None or parent.table not in self.placed else sorted(self.held):
                links = self._links(parent.table, parent_key, where)
                if links is not None:
                    yield from self._up(parent, parent_key, links, where)

    def _root_partition(self, root: Node, key: bytes, row: Row | None, space: Space,
                        values: Sequence[Any] | None = None) -> int | None:  # fmt: skip
        """The partition of a view row (None: not one this worker holds, or no base row to tell it)."""
        if space is not None and root.table in self.placed:
            return space
        if values is None:
            base = row if row is not None and root.table not in self.placed else self._base_row(root, key)
            values = None if base is None else [base[c] for c in self.shapes[root.table].key]
        if values is None:
            return None
        partition = self.partition_of(root.view, values)
        return partition if partition in self.held else None

    def _base_row(self, root: Node, key: bytes) -> Row | None:
        """A base row by key, in whichever space holds it."""
        for space in self.spaces(root.table):
            found = self.row(root.table, key, space)
            if found is not None:
                return found
        return None

    def _links(self, table: str, key: bytes, space: Space) -> Row | None:
        """The columns that link a row to its parents (``u`` entries: no Avro decoding), None if no row."""
        found = self.store.get(store_key(b"u", space_name(table, space), key))
        if found is None:
            return None
        return dict(zip(self.linked[table], json.loads(found), strict=True))

    def expand(self) -> None:
        """Mark dirty the view rows that show a looked-up row that changed (a product: every order
        holding it), found in the current state: once per row however often it changed since."""
        while self.deferred:  # a lookup under a lookup defers again: followed in the next round
            deferred, self.deferred = self.deferred, set()
            for node, key in deferred:
                parent, join = node.parent, node.join
                assert parent is not None and join is not None
                for space in self.spaces(parent.table):
                    found = [(k, None) for k in self.matching(parent.table, join.on, key, space)]
                    for root, partition in self._above(parent, found, space):
                        self.dirty[node.view].setdefault(partition, set()).add(root)

    def waiting(self) -> bool:
        """Whether any view row is (or may be) dirty."""
        return bool(self.deferred) or any(keys for parts in self.dirty.values() for keys in parts.values())

    # ---- documents ----------------------------------------------------------------------
    def document(self, view: str, key: bytes, partition: int = 0) -> Row | None:
        """The view row for a base key now, or None if there is none (no base row, inner join unmet)."""
        root = self.roots[view]
        row = self.row(root.table, key, self.space_of(root.table, partition))
        return None if row is None else self._doc(root, row, partition)

    def _doc(self, node: Node, row: Row, partition: int) -> Row | None:
        doc = {c: row.get(c) for c in node.columns}
        for child in node.children:
            join = child.join
            assert join is not None
            space = self.space_of(child.table, partition)
            if join.many:
                parent_key = canon([row[k] for k in self.shapes[node.table].key])
                found = [self._child(child, k, partition) for k in self.collected(child.table, join.on,
                                                                                    parent_key, space)]  # fmt: skip
                present = [item for item in found if item is not None]
                if join.inner and not present:
                    return None
                doc[join.name] = present
            else:
                values = joined(row, join.on)
                sub = None if values is None else self._child(child, canon(values), partition)
                if sub is None and join.inner:
                    return None
                doc[join.name] = sub
        return doc

    def _child(self, node: Node, key: bytes, partition: int) -> Row | None:
        found = self.row(node.table, key, self.space_of(node.table, partition))
        return None if found is None else self._doc(node, found, partition)

    # ---- contents (the documents' Avro, from the rows' own encodings) ----------------------
    def content(self, view: str, key: bytes, partition: int = 0) -> bytes | None:
        """The view row's Avro content now (``streams.docbytes``), None when there is no view row:
        ``document`` encoded, each row's own columns encoded once while the row stays the same."""
        if self.deferred:  # the joined rows over a changed looked-up row are forgotten on the way up
            self.expand()
        root = self.roots[view]
        row = self.row(root.table, key, self.space_of(root.table, partition))
        return None if row is None else self._content(self.encoders[view], root, key, row, partition)

    def _content(self, encoders: Encoders, node: Node, key: bytes, row: Row, partition: int) -> bytes | None:
        parts = [self._own(encoders, node, key, row, partition)]
        for child in node.children:
            join = child.join
            assert join is not None
            if join.many:
                parent_key = canon([row[k] for k in self.shapes[node.table].key])
                keys = self.collected(child.table, join.on, parent_key, self.space_of(child.table, partition))
                items = [c for k in keys if (c := self._child_content(encoders, child, k, partition)) is not None]
                if join.inner and not items:
                    return None
                parts.append(docbytes.collect(items))
            else:
                values = joined(row, join.on)
                sub = None if values is None else self._child_content(encoders, child, canon(values), partition)
                if sub is None and join.inner:
                    return None
                parts.append(docbytes.lookup(sub))
        return b"".join(parts)

    def _child_content(self, encoders: Encoders, node: Node, key: bytes, partition: int) -> bytes | None:
        """A joined row's content with everything under it, from the cache while none of those rows changed (``_up``
        forgets it): a view row whose base row changed is built from its own columns and its joined rows' contents
        (``bench/RESULTS.md``, "A joined row's content kept")."""
        part, at = partition if self.split_below[node] else None, (node, key)
        found = self.contents.get(at)
        if found is not None and found[0] == part:
            self.contents.move_to_end(at)
            return found[1]
        row = self.row(node.table, key, self.space_of(node.table, partition))
        content = None if row is None else self._content(encoders, node, key, row, partition)
        return newest(self.contents, at, (part, content), self.cached)[1]

    def _own(self, encoders: Encoders, node: Node, key: bytes, row: Row, partition: int) -> bytes:
        """A row's own columns at ``node``, encoded (from the cache while the row is unchanged)."""
        at = (node, self.space_of(node.table, partition), key)
        found = self.encoded.get(at)
        if found is not None:
            self.encoded.move_to_end(at)
            return found
        return newest(self.encoded, at, encoders.own(node.path, row), self.cached)

    def recode(self) -> None:
        """Forget every encoding (a view's encoders were replaced: a wider schema)."""
        self.encoded.clear()
        self.contents.clear()

    def base_row(self, view: str, key: bytes, partition: int = 0) -> Row | None:
        """The base row of a view row (its kept columns), None when there is none."""
        root = self.roots[view]
        return self.row(root.table, key, self.space_of(root.table, partition))

    def base_keys(self, view: str, partition: int = 0) -> Iterator[bytes]:
        """The keys of every base row of ``view`` in ``partition`` (each may have a view row)."""
        root = self.roots[view]
        space = self.space_of(root.table, partition)
        for key in self.keys(root.table, space):
            if space is not None or self._root_partition(root, key, None, None) == partition:
                yield key


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


def view_schema(spec: ViewSpec, value_schemas: Mapping[str, dict[str, Any]],
                keys: Mapping[str, Sequence[str]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The Avro record of ``spec``'s documents from its tables' value schemas (and key columns,
    which column lists always keep)."""

    def shape_of(table: str, source: dict[str, Any]) -> TableShape:
        columns = tuple(f["name"] for f in source["fields"])
        return TableShape(table, columns, tuple((keys or {}).get(table, ())))

    namespace = f"headwater.views.{spec.name}"
    seen: set[str] = set()

    def record(path: str, table: str, name: str) -> dict[str, Any]:
        source = value_schemas[table]
        listed = spec.listed(path)
        wanted = None if listed is None else set(spec.kept(path, shape_of(table, source)))
        fields = [_nullable({**f, "type": _dedupe(f["type"], seen, source.get("namespace", ""))})
                  for f in source["fields"] if wanted is None or f["name"] in wanted]  # fmt: skip
        for join in spec.children(path):
            sub = record(join.path, join.table, f"{name}_{join.name}")
            if join.many:
                fields.append({"name": join.name, "type": {"type": "array", "items": sub}, "default": [],
                               "pg.join": f"collect {join.table} on {', '.join(join.on)}"})  # fmt: skip
            else:
                fields.append({"name": join.name, "type": ["null", sub], "default": None,
                               "pg.join": f"lookup {join.table} on {', '.join(join.on)}"})  # fmt: skip
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
