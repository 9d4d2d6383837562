"""Where an agent stands in the raw change topic, and when it must seek back.

Promise: ``Cursor.admit`` says, for each raw offset Faust delivers, whether the agent
handles it now: offsets below ``next`` were handled already (a re-delivery after a
seek); an offset above ``next`` means Faust skipped ahead of the agent's own
checkpoint, so the agent seeks back to ``next`` once and drops what was fetched before
the seek — unless retention already deleted those offsets (then it goes on, logging the
gap). Two agents reading the same topic each keep their own cursor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("headwater.streams")


class Cursor:
    def __init__(self, topic: str, agent: str, low_watermark: Callable[[], int]) -> None:
        self.topic = topic
        self.agent = agent
        self.low_watermark = low_watermark
        self.next = 0  # the raw offset to handle next; everything below is handled
        self.seeking: int | None = None  # a seek back to this offset was asked for

    def reset(self, next_offset: int) -> None:
        self.next, self.seeking = next_offset, None

    def admit(self, offset: int) -> tuple[bool, int | None]:
        """(handle this offset now?, raw offset to seek back to, if any)."""
        if offset < self.next:
            return False, None
        seek = None
        if offset > self.next:
            seek = self.gap(offset)
            if offset > self.next:
                return False, seek  # fetched before the seek back: it comes again in order
        self.seeking, self.next = None, offset + 1
        return True, seek

    def gap(self, offset: int) -> int | None:
        """Faust delivered ``offset`` beyond ``next``: seek back, or accept what retention deleted."""
        if self.seeking == self.next:
            return None  # already asked: drop what was fetched before the seek
        low = self.low_watermark()
        if low > self.next:
            log.error("%s offsets %d..%d were deleted (retention) before the %s handled them; going on at %d",
                      self.topic, self.next, low - 1, self.agent, low)  # fmt: skip
            self.next = low
            return None if offset == low else self.gap(offset)
        self.seeking = self.next
        log.info("%s: raw offset %d delivered, %d expected: seeking back to its checkpoint", self.agent, offset,
                 self.next)  # fmt: skip
        return self.next
