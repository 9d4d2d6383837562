"""Errors of the stream workers, on the shared hierarchy (``tables.errors``).

Promise: each carries the facts (topic, offset, table) as attributes and says what to do.
"""

from __future__ import annotations

from confluent_kafka import KafkaError

from tables.errors import FatalError

GONE = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION})


class TopicLayoutError(FatalError):
    """A topic exists with a layout the workers cannot use (e.g. a different partition count)."""

    def __init__(self, topic: str, detail: str, hint: str) -> None:
        super().__init__(f"topic {topic}: {detail}", hint=hint)
        self.topic = topic


class KeyError400(ValueError):
    """A key in a URL that does not fit the table's key columns (answered with HTTP 400)."""


def gone(topic: str, detail: str) -> FatalError:
    """The broker lost ``topic`` (restarted without its data, or emptied)."""
    return FatalError(
        f"the broker no longer has {topic}: it was restarted or emptied, and the changes on it are gone ({detail})",
        hint="rebuild from a fresh snapshot: drop capture's slot and state (capture says how), start capture, "
        "then start the workers again: they see that the topics are new (Kafka's topic ids) and rebuild their state",
    )


def refused(error: KafkaError, topic: str, what: str, hint: str) -> FatalError:
    """Kafka refused ``what`` written to ``topic``: ``gone`` when the broker no longer has the topic (a broker
    restarted empty fails the records in flight once its metadata shows the topic missing), else Kafka's reason."""
    if error.code() in GONE:
        return gone(topic, error.str())
    return FatalError(f"Kafka refused {what} for {topic or 'a topic'}: {error}", hint=hint)
