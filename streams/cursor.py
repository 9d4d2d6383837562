"""Where a reader of the raw change topic stands, and what it does about a hole.

Promise: ``Cursor.admit`` takes a batch as the feed read it — ``(offset, key, value)`` in
offset order — and returns exactly the records the reader has not handled yet, in
order: offsets below ``next`` were handled already (dropped). Offsets the topic skips
are no loss unless retention deleted them before the reader handled them: then it goes
on at the first offset Kafka still holds and logs what was lost. Each reader (the
fan-out, the views) keeps its own cursor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

log = logging.getLogger("headwater.streams")
Raw = tuple[int, bytes | None, bytes | None]  # offset, key, value


class Cursor:
    def __init__(self, topic: str, reader: str, low_watermark: Callable[[], int]) -> None:
        self.topic = topic
        self.reader = reader
        self.low_watermark = low_watermark
        self.next = 0  # the raw offset to handle next; everything below is handled

    def reset(self, next_offset: int) -> None:
        self.next = next_offset

    def admit(self, batch: Sequence[Raw]) -> list[Raw]:
        out: list[Raw] = []
        for item in batch:
            if item[0] < self.next:
                continue
            if item[0] > self.next:
                self._skipped(item[0])
            out.append(item)
            self.next = item[0] + 1
        return out

    def _skipped(self, until: int) -> None:
        low = self.low_watermark()
        if low > self.next:
            log.error("%s offsets %d..%d were deleted (retention) before the %s handled them; going on at %d",
                      self.topic, self.next, min(low, until) - 1, self.reader, until)  # fmt: skip
        else:
            log.info("%s: no records at offsets %d..%d; the %s goes on at %d", self.topic, self.next, until - 1,
                     self.reader, until)  # fmt: skip
