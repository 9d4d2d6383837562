"""Topic names: the one rule every component, test and tool builds them with.

Promise: given the topic prefix (``topic_prefix``; may be empty), every Headwater topic has one
name: the raw topic ``<prefix>.changes``, its dead letters ``.dlq`` and the fan-out's
checkpoint ``.fanout``; a table's topic ``[prefix.][schema.]table`` (schema left out for
``public``, as in Bottled Water); a view's ``<prefix>.views.<view>``, the views' cuts
``<prefix>.views.cuts``, and the workers' publication points ``<prefix>.views.cuts.points`` and
cut fragments ``<prefix>.views.cuts.fragments`` (no view name has a dot); the Debezium-format topics
``<dbz>.<schema>.<table>`` and ``<dbz>.transaction`` (``<dbz>`` by default ``<prefix>.debezium``); the
registry subjects ``<topic>-key`` / ``<topic>-value`` (and ``<topic>-<record name>`` for a topic whose
records are registered per record type, Confluent's TopicRecordNameStrategy); and Redis keys under
``<prefix>`` (``headwater`` when the prefix is empty). Pure: no I/O.
"""

from __future__ import annotations

DEFAULT_PREFIX = "headwater"


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def under(prefix: str) -> str:
    """What every topic under ``prefix`` starts with: ``<prefix>.``, or nothing for an empty prefix."""
    return f"{prefix}." if prefix else ""


def changes_topic(prefix: str) -> str:
    """The raw change topic: one partition, every change in commit order."""
    return _join(prefix, "changes")


def dlq_topic(prefix: str) -> str:
    """Where raw messages that cannot be decoded go, with their offset and the reason."""
    return changes_topic(prefix) + ".dlq"


def progress_topic(prefix: str) -> str:
    """The fan-out's checkpoint: how far the raw topic is fully written to the table topics."""
    return changes_topic(prefix) + ".fanout"


def table_topic(prefix: str, schema: str, table: str) -> str:
    """``[prefix.][schema.]table``: the schema is left out for ``public`` (as in Bottled Water)."""
    return _join(prefix, "" if schema == "public" else schema, table)


def table_topic_of(prefix: str, qualified: str) -> str:
    """``table_topic`` of ``schema.table`` (or a bare ``table`` of ``public``)."""
    schema, _, table = qualified.rpartition(".")
    return table_topic(prefix, schema or "public", table)


def view_topic(prefix: str, view: str) -> str:
    return _join(prefix, "views", view)


def cuts_topic(prefix: str) -> str:
    """Where workers publish how far each view is complete (a commit LSN and the view topic's ends)."""
    return _join(prefix, "views", "cuts")


def points_topic(prefix: str) -> str:
    """Where the raw partition's owner says how far the raw topic goes and where views publish next."""
    return cuts_topic(prefix) + ".points"


def fragments_topic(prefix: str) -> str:
    """Where each worker says it published its view partitions at a point (a cut is made of them)."""
    return cuts_topic(prefix) + ".fragments"


CUTS_PARTITION = 0  # every cut goes to this partition of the cuts topic: one order for all of them


def debezium_prefix(prefix: str) -> str:
    """The Debezium-format topics' default prefix (Debezium's ``topic.prefix``): ``<prefix>.debezium``."""
    return _join(prefix, "debezium")


def debezium_topic(dbz_prefix: str, schema: str, table: str) -> str:
    """A table's Debezium-format topic, named as Debezium names it: ``<dbz_prefix>.<schema>.<table>``."""
    return _join(dbz_prefix, schema, table)


def debezium_transaction_topic(dbz_prefix: str) -> str:
    """Where Debezium-format transaction BEGIN and END events go: ``<dbz_prefix>.transaction``."""
    return _join(dbz_prefix, "transaction")


def internal_topics(prefix: str) -> set[str]:
    """The topics under ``prefix`` that hold no table: raw, dead letters, checkpoint, cuts, points, fragments."""
    return {changes_topic(prefix), dlq_topic(prefix), progress_topic(prefix), cuts_topic(prefix),
            points_topic(prefix), fragments_topic(prefix)}  # fmt: skip


def key_subject(topic: str) -> str:
    return f"{topic}-key"


def value_subject(topic: str) -> str:
    return f"{topic}-value"


def record_subject(topic: str, record: str) -> str:
    """``<topic>-<record full name>``: Confluent's TopicRecordNameStrategy, for a topic that holds several
    record types (the raw topic with nested row images: one change record per table)."""
    return f"{topic}-{record}"


def redis_prefix(prefix: str) -> str:
    """What Redis keys of views start with: the topic prefix, or ``headwater`` when it is empty."""
    return prefix or DEFAULT_PREFIX


def view_key(prefix: str, view: str) -> str:
    """The Redis hash of a view's published cut and offsets; its rows are ``<view_key>:<key text>``."""
    return f"{redis_prefix(prefix)}:{view}"


def view_staging_key(prefix: str, view: str, mirror: str) -> str:
    """The Redis list where one mirror stages the view records it read until a cut applies them (no
    row key matches it: rows are ``<view_key>:<key text>``)."""
    return f"{view_key(prefix, view)}#staged:{mirror}"


def table_topic_of_subject(prefix: str, subject: str) -> str | None:
    """The topic a ``<topic>-value`` subject registers, when it can be a table's topic under ``prefix``
    (not the raw, dead-letter, checkpoint, cuts, a view or a default-named Debezium-format topic); else None."""
    if not subject.endswith("-value"):
        return None
    topic = subject.removesuffix("-value")
    not_tables = (under(view_topic(prefix, "")), under(debezium_prefix(prefix)))
    if topic.startswith(not_tables) or topic in internal_topics(prefix):
        return None
    return topic if topic.startswith(under(prefix)) else None
