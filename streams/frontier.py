"""How the workers agree on where views are published, and how cuts are made of their parts: pure.

Promise: no I/O and no clock of its own (times are passed in). Every worker holding view
partitions reads the raw topic in commit order; a view row is published only at a *point*, and a
cut at commit LSN L needs every partition of the view published at exactly L. So the workers
publish at the same points, chosen by one of them (the raw partition's owner, ``streams.leader``)
and written to ``<prefix>.views.cuts.points`` (``POINT_SCHEMA``): ``{raw_end: X, point}`` where
X is a true end of the raw topic (the writer received every offset below it).

- ``Points`` is a worker's reading of that topic. A record is *valid* iff its X is at least the X
  of every valid record before it: everyone reads the topic in one order, so everyone agrees,
  and a second writer left over from a rebalance cannot move anything back. The *barrier* is
  the highest valid X: a publishing worker applies raw offsets below it only, so it never passes
  a place where a point may still be announced. A valid ``point`` record at X asks for a
  publication at the first consistent point (end of a transaction or of the snapshot) at or after
  raw offset X - 1 — the same offset for every worker (``resolves``); a worker that reaches it
  already knowing of a later point (it is behind) publishes at that one instead, so its
  publications are some of the others', at the same offsets.
- ``Assembly`` makes cuts of *fragments* (``FRAGMENT_SCHEMA``, on
  ``<prefix>.views.cuts.fragments``): a worker's word that the partitions it names were published
  at commit LSN L and end at the given offsets. A view's cut at L exists once every partition has a
  fragment at L; cuts only move forward.
- ``Pace`` says when the next point is due: no sooner than the slowest worker's last publication
  took, and no sooner than a floor; and not while the last point is still to be published by some
  partition of a view (at most one point in flight, as a stream processor runs one checkpoint at a
  time). A worker behind — catching up after a restart, or one whose publications rewrite most of
  a view, as a product's price change does — thus finds one point ahead of it, at the raw topic's
  end when the last one was done, not one for every gap it was behind: it applies the changes in
  between and publishes once, so a change that dirties most of a view is rewritten once per
  publication, not per change. A point that some part never publishes (its worker gone or
  replaying) holds the next back ``PATIENCE`` times the longest publication remembered (at least
  ``PATIENCE_FLOOR`` seconds) only. A worker that resumes reads the points topic from its last
  records, which may no longer hold the point in flight: once caught up it asks itself for a
  publication (``Points.owe``), so its parts reach that point and the pace goes on without
  waiting that long (the 720k shop's 160 s publications made it ten minutes).

Agreement is for liveness only: a fragment is a true statement about its partitions whatever
other workers did, so a worker that publishes at a point the others skipped (one that started
reading the points topic later) only adds a fragment no cut uses.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import fastavro

from tables.wire import avro_body, read_framed

POINT_SCHEMA: dict[str, Any] = {
    "type": "record", "name": "ViewPoint", "namespace": "headwater",
    "doc": "The writer received every raw offset below raw_end; point: publish at the first consistent point at or "
           "after raw_end - 1.",
    "fields": [{"name": "raw_end", "type": "long"}, {"name": "point", "type": "boolean"},
               {"name": "writer", "type": "string"}],
}  # fmt: skip
FRAGMENT_SCHEMA: dict[str, Any] = {
    "type": "record", "name": "ViewFragment", "namespace": "headwater",
    "doc": "Every partition named was published at commit_lsn: its view topic read up to offset is the view there.",
    "fields": [
        {"name": "writer", "type": "string"}, {"name": "commit_lsn", "type": "long"},
        {"name": "raw_offset", "type": "long"}, {"name": "publish_seconds", "type": "double"},
        {"name": "parts", "type": {"type": "array", "items": {
            "type": "record", "name": "FragmentPart",
            "fields": [{"name": "view", "type": "string"}, {"name": "partition", "type": "int"},
                       {"name": "offset", "type": "long"}]}}},
    ],
}  # fmt: skip
PATIENCE, PATIENCE_FLOOR = 4.0, 5.0  # a point not published everywhere holds the next back this long at most
REMEMBER = 3.0  # a publication's time counts for at least this many times as long: the 720k shop's 65 s ones,
# forgotten after a minute or outweighed by a quick one since, let points come every few seconds while it published
POINT_PARSED = fastavro.parse_schema(POINT_SCHEMA)
FRAGMENT_PARSED = fastavro.parse_schema(FRAGMENT_SCHEMA)


@dataclass
class Points:
    """A worker's reading of the points topic (see the module promise)."""

    barrier: int = -1  # the highest valid raw_end: raw offsets below it may be applied
    requests: deque[int] = field(default_factory=deque)  # raw_end of valid, unresolved point requests

    def read(self, raw_end: int, point: bool) -> bool:
        """One record, in the topic's order: whether it is valid."""
        if raw_end < self.barrier:
            return False
        self.barrier = raw_end
        if point and (not self.requests or self.requests[-1] != raw_end):
            self.requests.append(raw_end)
        return True

    def allows(self, offset: int) -> bool:
        """Whether a publishing worker may apply raw ``offset`` now."""
        return offset < self.barrier

    def owe(self, position: int) -> bool:
        """A worker that resumed owes a publication (a point asked for before it began reading this topic is out of
        its window, and the pace waits for every part): once it applied all the barrier allows (``position``, the
        next raw offset to apply, at the barrier) with no point asked for ahead, it asks itself for one at the next
        consistent point. Whether it did."""
        if self.barrier < 0 or position < self.barrier or self.requests:
            return False
        self.requests.append(position)
        return True

    def resolves(self, offset: int) -> bool:
        """At consistent point ``offset`` (its change applied): whether a request asks for a publication
        here. The requests it answers are done; while a later one is known, none asks (a worker behind
        publishes once, at the last point it knows of, not at each: at 720k under the shop's load each
        publication rewrote a worker's whole share, 150-250 s, and a worker two points behind did it twice)."""
        found = False
        while self.requests and self.requests[0] - 1 <= offset:
            self.requests.popleft()
            found = True
        return found and not self.requests


class HandOff:
    """Points records handed over in memory, before the topic holds them, and their copies read back dropped.

    The announcer beside this worker's views (``streams.leader``) tells them each record it writes: a read
    of the topic costs a write and a fetch, ~30 ms of each point's ~75 ms cycle on the local broker
    (bench/RESULTS.md). A handed record is applied before any record read after it was told, which
    may put it ahead of another writer's earlier ones: agreement is for liveness only (module promise),
    and its raw_end is a true end. ``tell`` is called from the announcer's thread, ``take`` from the feed's.
    """

    AWAITED = 1000  # copies awaited at most (one whose write failed never comes)

    def __init__(self) -> None:
        self.told: deque[bytes] = deque()  # handed over, not yet taken
        self.awaited: deque[bytes] = deque(maxlen=self.AWAITED)  # taken, their copies not yet read back

    def tell(self, value: bytes) -> None:
        self.told.append(value)

    def take(self, read: Sequence[bytes]) -> list[bytes]:
        """The records to apply, in order: those handed over since the last take, then those ``read`` from the
        topic that are no copy of a handed one (a copy is the first awaited record equal to it: the announcer's
        records reach the topic in the order it told them; those before it never came)."""
        handed = []
        while self.told:
            handed.append(self.told.popleft())
        self.awaited.extend(handed)
        return handed + [value for value in read if not self._copy(value)]

    def _copy(self, value: bytes) -> bool:
        if value not in self.awaited:
            return False
        while self.awaited.popleft() != value:
            pass
        return True


@dataclass
class Cut:
    """A view's cut: its topic read up to ``ends`` (partition -> offset) is the view at ``lsn``."""

    view: str
    lsn: int
    ends: dict[int, int]


class Assembly:
    """Cuts from fragments (see the module promise); remembers at most ``keep`` points per view."""

    def __init__(self, views: Iterable[str], partitions: int, keep: int = 2000) -> None:
        self.partitions, self.keep = partitions, keep
        self.last: dict[str, int] = {view: -1 for view in views}  # view -> commit LSN of its last cut
        self.parts: dict[str, dict[int, dict[int, int]]] = {view: {} for view in self.last}  # view -> lsn -> ends

    def seen(self, view: str, lsn: int) -> None:
        """A cut at ``lsn`` exists already (read back from the cuts topic)."""
        if view in self.last and lsn > self.last[view]:
            self.last[view] = lsn
            self.parts[view] = {at: ends for at, ends in self.parts[view].items() if at > lsn}

    def add(self, view: str, lsn: int, partition: int, offset: int) -> None:
        """One part of a fragment: ``partition`` of ``view`` published at ``lsn``, its topic ending at ``offset``."""
        points = self.parts.get(view)
        if points is None or lsn <= self.last[view] or not 0 <= partition < self.partitions:
            return
        ends = points.setdefault(lsn, {})
        ends[partition] = max(ends.get(partition, 0), offset)
        if len(points) > self.keep:
            del points[min(points)]

    def cuts(self) -> list[Cut]:
        """Each view's newest point that every partition published, above its last cut (then its cut)."""
        out = []
        for view, points in self.parts.items():
            whole = [lsn for lsn, ends in points.items() if len(ends) == self.partitions]
            if whole:
                lsn = max(whole)
                out.append(Cut(view, lsn, dict(sorted(points[lsn].items()))))
                self.seen(view, lsn)
        return out


class Pace:
    """When the next point is due (see the module promise); times are monotonic seconds. ``parts`` are
    the (view, partition) pairs a point is published for; none: points never wait for a publication."""

    def __init__(self, floor: float, parts: Iterable[tuple[str, int]] = (), forget: float = 60.0) -> None:
        self.floor, self.forget, self.parts = floor, forget, frozenset(parts)
        self.took: dict[str, list[tuple[float, float]]] = {}  # writer -> remembered (seconds, when told)
        self.announced = float("-inf")  # when the last point was announced
        self.pending: int | None = None  # raw_end of the last point, until every part was published at or past it
        self.reached: dict[tuple[str, int], int] = {}  # part -> the raw offset it was last published at

    def report(self, writer: str, seconds: float, now: float) -> None:
        """A publication by ``writer`` took ``seconds``; earlier ones no longer than it no longer matter."""
        longer = [(took, at) for took, at in self._remembered(self.took.get(writer, []), now) if took > seconds]
        self.took[writer] = [*longer, (seconds, now)]

    def _remembered(self, reports: list[tuple[float, float]], now: float) -> list[tuple[float, float]]:
        """The reports still counted: told within the last minute, or within ``REMEMBER`` times what they took."""
        return [(seconds, at) for seconds, at in reports if now - at <= max(self.forget, REMEMBER * seconds)]

    def published(self, offset: int, parts: Iterable[tuple[str, int]]) -> None:
        """A fragment: ``parts`` were published at raw ``offset``."""
        for part in parts:
            self.reached[part] = max(self.reached.get(part, -1), offset)
        if self.pending is not None and all(self.reached.get(part, -1) >= self.pending - 1 for part in self.parts):
            self.pending = None

    def gap(self, now: float) -> float:
        """Seconds between two points now: the slowest writer's last publication, at least the floor."""
        last = [kept[-1][0] for reports in self.took.values() if (kept := self._remembered(reports[-1:], now))]
        return max([self.floor, *last])

    def patience(self, now: float) -> float:
        """How long a point in flight holds the next back: ``PATIENCE`` times the longest publication
        remembered (a quick one after a long one must not cut the wait short: the next may be long
        again), at least ``PATIENCE_FLOOR``."""
        longest = [seconds for reports in self.took.values() for seconds, _ in self._remembered(reports, now)]
        return max(PATIENCE_FLOOR, PATIENCE * max([self.floor, *longest]))

    def due(self, now: float) -> bool:
        """The gap passed, and every part was published at the last point (or it waited ``patience``: a part
        nobody publishes, one replaying, must not stop the points)."""
        since = now - self.announced
        if since < self.gap(now):
            return False
        return self.pending is None or since >= self.patience(now)

    def missing(self) -> list[tuple[str, int]]:
        """The parts not yet published at the point in flight (none when every part was, or no point is)."""
        if self.pending is None:
            return []
        return sorted(part for part in self.parts if self.reached.get(part, -1) < self.pending - 1)

    def point(self, now: float, raw_end: int) -> None:
        """A point was announced at ``now`` for ``raw_end``."""
        self.announced = now
        self.pending = raw_end if self.parts else None


def point_value(frame: bytes, raw_end: int, point: bool, writer: str) -> bytes:
    """A points record (``frame``: ``POINT_SCHEMA`` registered under the points topic's value subject)."""
    return frame + avro_body(POINT_PARSED, {"raw_end": raw_end, "point": point, "writer": writer})


def read_point(value: bytes) -> tuple[int, bool]:
    """(raw_end, point) of a points record."""
    record = read_framed(value, POINT_PARSED)
    return int(record["raw_end"]), bool(record["point"])


def fragment_value(frame: bytes, writer: str, lsn: int, offset: int, seconds: float,
                   ends: Sequence[tuple[str, int, int]]) -> bytes:  # fmt: skip
    """A fragment record: ``ends`` are (view, partition, end offset) published at ``lsn``."""
    parts = [{"view": view, "partition": partition, "offset": end} for view, partition, end in ends]
    return frame + avro_body(FRAGMENT_PARSED, {"writer": writer, "commit_lsn": lsn, "raw_offset": offset,
                                               "publish_seconds": seconds, "parts": parts})  # fmt: skip


def read_fragment(value: bytes) -> dict[str, Any]:
    return dict(read_framed(value, FRAGMENT_PARSED))
