"""Where a stream of a Headwater topic stands, and how far its next micro-batch goes (pure).

Promise: pure functions over offsets. A stream's offset is what Spark keeps in the query's
checkpoint: ``{"<topic>": {"<partition>": <next offset>}}``, as Spark's Kafka source writes
it, plus ``"cut": {"lsn", "commit_lsn", "next"}`` on a view — the cut the stream stands at
and the cuts-topic offset after it. ``encode``/``decode`` turn a ``Position`` into that JSON
and back (same position, same text: Spark compares offsets as text). ``parse_start`` reads
the ``startingOffsets`` option: ``earliest``, ``latest``, Kafka's per-partition JSON
(-2 earliest, -1 latest) or, on a view, a commit LSN. ``admit`` bounds a batch to ``limit``
messages shared among partitions in proportion to their backlogs; ``next_cut`` picks the
cut a view's batch ends at: the newest past the current cut whose batch stays within the
limit, else the very next one — never a point between cuts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from analytics.errors import SourceError
from tables.wire import lsn_text, parse_lsn

EARLIEST, LATEST = -2, -1  # as in Spark's Kafka source
Offsets = dict[int, int]  # partition -> next offset to read


@dataclass(frozen=True)
class CutAt:
    """A published cut of a view: its topic read up to ``ends`` is the view at ``commit_lsn``.

    ``next`` is the cuts-topic offset after this cut's record (where to look for newer ones)."""

    commit_lsn: int
    ends: Offsets
    next: int


NO_CUT = CutAt(0, {}, 0)  # a view stream before its first cut: from the start of the cuts topic


@dataclass(frozen=True)
class Position:
    """The next offset of every partition; on a view, the cut those offsets are at."""

    topic: str
    offsets: Offsets
    cut: CutAt | None = None

    def encode(self) -> dict[str, Any]:
        out: dict[str, Any] = {self.topic: {str(p): o for p, o in sorted(self.offsets.items())}}
        if self.cut is not None:
            out["cut"] = {"lsn": lsn_text(self.cut.commit_lsn), "commit_lsn": self.cut.commit_lsn,
                          "next": self.cut.next}  # fmt: skip
        return out

    @classmethod
    def decode(cls, data: dict[str, Any], topic: str, *, view: bool) -> Position:
        if topic not in data:
            raise SourceError(f"the checkpoint's offsets are of another topic: {json.dumps(data)[:200]}", topic=topic,
                              hint="a checkpoint belongs to one query: give this one a new checkpointLocation")
        offsets = {int(p): int(o) for p, o in data[topic].items()}
        if not view:
            return cls(topic, offsets)
        mark = data.get("cut") or {}
        return cls(topic, offsets, CutAt(int(mark.get("commit_lsn", 0)), offsets, int(mark.get("next", 0))))


@dataclass(frozen=True)
class Start:
    """The ``startingOffsets`` option: ``earliest``, ``latest``, per partition, or (views) a commit LSN."""

    kind: str  # earliest | latest | partitions | lsn
    offsets: Offsets = field(default_factory=dict)
    lsn: int = 0


def parse_start(text: str | None, topic: str, *, view: bool) -> Start:
    """The ``startingOffsets`` option, checked (``earliest`` when not given)."""
    given = (text or "earliest").strip()
    if given.lower() in ("earliest", "latest"):
        return Start(given.lower())
    if view:
        try:
            return Start("lsn", lsn=parse_lsn(given))
        except ValueError:
            raise SourceError(f"startingOffsets {given!r} is not earliest, latest or a commit LSN", topic=topic,
                              hint="a view is read cut by cut: start at its first cut (earliest), its newest "
                                   "(latest) or the newest at or before an LSN like 0/1A7A908") from None  # fmt: skip
    return Start("partitions", _partitions(given, topic))


def _partitions(text: str, topic: str) -> Offsets:
    example = f'{{"{topic}": {{"0": 23, "1": -2}}}}'
    try:
        data = json.loads(text)
        given = data[topic] if isinstance(data, dict) and len(data) == 1 else None
        offsets = {int(p): int(o) for p, o in given.items()} if isinstance(given, dict) else None
    except (ValueError, AttributeError, TypeError, KeyError):
        offsets = None
    if offsets is None or any(o < EARLIEST for o in offsets.values()):
        raise SourceError(f"startingOffsets {text[:200]!r} is not earliest, latest or offsets of this topic",
                          topic=topic, hint=f"per partition as Spark's Kafka source takes them: {example} "
                                            "(-2: earliest, -1: latest)")  # fmt: skip
    return offsets


def backlog(start: Offsets, ends: Offsets) -> int:
    """Messages from ``start`` to ``ends`` (a partition ``start`` lacks counts from 0)."""
    return sum(max(end - start.get(p, 0), 0) for p, end in ends.items())


def admit(start: Offsets, ends: Offsets, limit: int | None) -> Offsets:
    """The next batch's ends: ``ends``, or ``limit`` messages shared in proportion to each partition's backlog."""
    reached = {**start, **{p: max(end, start.get(p, 0)) for p, end in ends.items()}}
    behind = {p: reached[p] - start.get(p, 0) for p in ends}
    total = sum(behind.values())
    if limit is None or total <= limit:
        return reached
    share = {p: n * limit // total for p, n in behind.items()}
    by_rest = sorted(behind, key=lambda p: (-(behind[p] * limit % total), p))  # largest remainders first
    for p in by_rest[: limit - sum(share.values())]:
        share[p] += 1
    return {**start, **{p: start.get(p, 0) + n for p, n in share.items()}}


def next_cut(at: Position, cuts: list[CutAt], limit: int | None) -> CutAt | None:
    """The cut the next batch of a view stream ends at, or None when no cut is past ``at``'s."""
    assert at.cut is not None
    ahead = sorted((c for c in cuts if c.commit_lsn > at.cut.commit_lsn), key=lambda c: c.commit_lsn)
    if not ahead:
        return None
    within = [c for c in ahead if limit is None or backlog(at.offsets, c.ends) <= limit]
    return within[-1] if within else ahead[0]


def at_cut(at: Position, cut: CutAt) -> Position:
    """The position a view stream reaches at ``cut`` (a partition the cut does not name stays put)."""
    offsets = {**at.offsets, **{p: max(end, at.offsets.get(p, 0)) for p, end in cut.ends.items()}}
    return Position(at.topic, offsets, CutAt(cut.commit_lsn, offsets, cut.next))
