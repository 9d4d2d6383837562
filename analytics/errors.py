"""What can go wrong reading Headwater topics into Spark.

Promise: every error names the topic (and the partition and offset when one record is
at fault) as attributes and in its message, with what to do. ``SourceError`` is fatal
(a missing topic, a record no registered schema decodes, no cut to read at);
``SourceUnavailable`` may pass by itself (the broker or registry not answering).
"""

from __future__ import annotations

from tables.errors import FatalError, HeadwaterError, RetryableError


def _where(topic: str, partition: int | None, offset: int | None) -> str:
    where = f"topic {topic}"
    if partition is not None:
        where += f", partition {partition}"
    if offset is not None:
        where += f", offset {offset}"
    return where


class Located(HeadwaterError):
    """An error about a topic, and maybe one record of it: where it is rides along."""

    def __init__(self, message: str, *, topic: str, partition: int | None = None, offset: int | None = None,
                 hint: str | None = None) -> None:  # fmt: skip
        super().__init__(f"{_where(topic, partition, offset)}: {message}", hint=hint)
        self.topic = topic
        self.partition = partition
        self.offset = offset


class SourceError(Located, FatalError):
    """A topic that cannot be read as asked; a person has to change the query or the data."""


class SourceUnavailable(Located, RetryableError):
    """Kafka or the schema registry did not answer while reading a topic."""
