"""Where an agent stands in the raw change topic, and how it fills a gap Faust leaves.

Promise: ``Cursor.admit`` takes a batch as Faust delivered it — ``(offset, key, value)`` in
offset order — and returns exactly the records the agent has not handled yet, in order,
without a hole: offsets below ``next`` were handled already (dropped); when Faust starts
beyond ``next`` (it committed further than the agent's own checkpoint), the missing
offsets are read directly from Kafka (``fetch``) instead of seeking the consumer every
agent shares — unless retention deleted them (then the agent goes on at the first offset
Kafka still holds, logging the loss). Each agent keeps its own cursor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

log = logging.getLogger("headwater.streams")
Raw = tuple[int, bytes | None, bytes | None]  # offset, key, value


class Cursor:
    def __init__(self, topic: str, agent: str, low_watermark: Callable[[], int],
                 fetch: Callable[[int, int], list[Raw]]) -> None:  # fmt: skip
        self.topic = topic
        self.agent = agent
        self.low_watermark = low_watermark
        self.fetch = fetch  # (start, end) -> the records of [start, end)
        self.next = 0  # the raw offset to handle next; everything below is handled

    def reset(self, next_offset: int) -> None:
        self.next = next_offset

    def admit(self, batch: Sequence[Raw]) -> list[Raw]:
        out: list[Raw] = []
        for item in batch:
            if item[0] < self.next:
                continue
            if item[0] > self.next:
                out += self._fill(item[0])
            out.append(item)
            self.next = item[0] + 1
        return out

    def _fill(self, until: int) -> list[Raw]:
        low = self.low_watermark()
        if low > self.next:
            log.error("%s offsets %d..%d were deleted (retention) before the %s handled them; going on at %d",
                      self.topic, self.next, low - 1, self.agent, low)  # fmt: skip
            self.next = low
        if self.next >= until:
            return []
        log.info("%s: Faust delivered %s offset %d, %d expected: reading %d..%d directly", self.agent, self.topic,
                 until, self.next, self.next, until - 1)  # fmt: skip
        return self.fetch(self.next, until)
