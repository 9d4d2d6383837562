"""Where the views' state lives among the workers: which tables are split by view partition, which kept whole.

Promise: pure. A view row's partition is its view topic's: the base row's key under the view's
key subject, murmur2 (``tables.partition``); each worker holds some of those partitions. A table's
rows can be split the same way when each row tells its own partition: a view's base table (by
its key) and a table collected directly under the base (by the columns that hold the base row's
key) — their rows of partition p are needed by p's view rows only, and kept by p's worker only
(``Placement``). Every other table is *replicated*, kept whole by every worker: a looked-up table
(a product shows in orders of every partition), a table collected deeper (an item's notes: their
partition is their item's, which the row does not say), and a table used by two views or in two
ways. ``placements`` says which tables are split and how.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tables.views import TableShape, ViewSpec


@dataclass(frozen=True)
class Placement:
    """A table split by the partitions of ``view``."""

    view: str
    columns: tuple[str, ...]  # the table's columns that hold the base row's key, in the base key's order
    by_key: bool  # every one of them is a key column: a row's key alone tells its partition


def placements(views: Sequence[ViewSpec], shapes: Mapping[str, TableShape]) -> dict[str, Placement]:
    """The tables split by view partition (see the module promise); every other table is replicated."""
    seen: dict[str, set[Placement | None]] = {}
    for spec in views:
        base_key = shapes[spec.base].key
        seen.setdefault(spec.base, set()).add(Placement(spec.name, tuple(base_key), True))
        for join in spec.joins:
            placed = None
            if join.parent == "" and join.many:
                columns = join.on
                placed = Placement(spec.name, columns, set(columns) <= set(shapes[join.table].key))
            seen.setdefault(join.table, set()).add(placed)
    return {table: only for table, found in seen.items() if len(found) == 1 and (only := next(iter(found)))}
