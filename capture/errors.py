"""Capture-specific errors: each names the fact (table, LSN, slot, setting) and the way out.

Promise: ``FatalError`` subclasses stop the agent with a message a person can act on;
``RetryableError`` subclasses are retried (or end the run with ``on_error = "exit"``).
"""

from __future__ import annotations

from tables.errors import FatalError, RetryableError


class SourceError(FatalError):
    """PostgreSQL cannot be used as configured (connection, settings, privileges); or a snapshot worker failed."""

    failed_deliveries = 0  # a snapshot worker's messages Kafka refused or timed out


class SourceUnreachableError(RetryableError):
    """PostgreSQL cannot be reached, or the connection to it was lost (a restart, a network fault)."""


class SlotLostError(FatalError):
    """The replication slot is gone or invalidated: changes were lost on the server side."""

    def __init__(self, slot: str, detail: str) -> None:
        super().__init__(
            f"replication slot '{slot}' {detail}",
            hint=(
                "the changes between the last checkpoint and now cannot be recovered from this slot: "
                f"drop it (SELECT pg_drop_replication_slot('{slot}')), delete the capture state directory, "
                "and run capture again to take a fresh snapshot"
            ),
        )
        self.slot = slot


class CheckpointMismatchError(FatalError):
    """The local checkpoint and the slot disagree about where the stream is."""


class UnsupportedValueError(FatalError):
    """A value cannot be represented in its column's Avro type."""

    def __init__(self, table: str, column: str, detail: str) -> None:
        super().__init__(f"{table}.{column}: {detail}", hint="change the column's type, or exclude the table")
        self.table = table
        self.column = column


class BrokerError(RetryableError):
    """Kafka did not acknowledge a message (broker down, timeout)."""

    failed_deliveries = 0  # messages of a snapshot's sender Kafka refused or timed out


class TopicLostError(FatalError):
    """The broker no longer has a topic capture wrote to: it was restarted without its data, or emptied."""

    def __init__(self, topic: str, slot: str, state: str) -> None:
        super().__init__(
            f"the broker no longer has {topic}: it was restarted or emptied, and the changes capture wrote "
            "to it are gone (capture does not create it again: the topic would start in the middle of the stream)",
            hint=(
                "to rebuild every topic from a fresh snapshot, drop the slot "
                f"(SELECT pg_drop_replication_slot('{slot}')) and delete {state}, then run capture again; "
                "if the broker keeps its data, check that capture points at the right one "
                "(bootstrap in [pipeline] or [capture])"
            ),
        )
        self.topic = topic
