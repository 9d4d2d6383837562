"""Errors of the stream workers, on the shared hierarchy (``tables.errors``).

Promise: each carries the facts (topic, offset, table) as attributes and says what to do.
"""

from __future__ import annotations

from tables.errors import FatalError


class TopicLayoutError(FatalError):
    """A topic exists with a layout the workers cannot use (e.g. a different partition count)."""

    def __init__(self, topic: str, detail: str, hint: str) -> None:
        super().__init__(f"topic {topic}: {detail}", hint=hint)
        self.topic = topic


class KeyError400(ValueError):
    """A key in a URL that does not fit the table's key columns (answered with HTTP 400)."""
