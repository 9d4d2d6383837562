"""Topic names, one rule for every component."""

from __future__ import annotations

import pytest

from tables import topics

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("prefix", ["headwater", "pgb", ""])
def test_every_name_follows_the_prefix(prefix: str) -> None:
    head = f"{prefix}." if prefix else ""
    assert topics.changes_topic(prefix) == f"{head}changes"
    assert topics.dlq_topic(prefix) == f"{head}changes.dlq" and topics.progress_topic(prefix) == f"{head}changes.fanout"
    assert topics.table_topic(prefix, "public", "orders") == f"{head}orders"
    assert topics.table_topic(prefix, "sales", "orders") == f"{head}sales.orders"
    assert topics.table_topic_of(prefix, "sales.orders") == f"{head}sales.orders"
    assert topics.table_topic_of(prefix, "orders") == f"{head}orders"
    assert topics.view_topic(prefix, "v") == f"{head}views.v" and topics.cuts_topic(prefix) == f"{head}views.cuts"
    assert topics.view_key(prefix, "v") == f"{prefix or 'headwater'}:v"


@pytest.mark.parametrize("prefix", ["headwater", ""])
def test_only_table_subjects_name_table_topics(prefix: str) -> None:
    head = f"{prefix}." if prefix else ""
    assert topics.table_topic_of_subject(prefix, f"{head}orders-value") == f"{head}orders"
    assert topics.table_topic_of_subject(prefix, f"{head}orders-key") is None
    for internal in topics.internal_topics(prefix) | {topics.view_topic(prefix, "v")}:
        assert topics.table_topic_of_subject(prefix, f"{internal}-value") is None
    if prefix:
        assert topics.table_topic_of_subject(prefix, "other.orders-value") is None
