"""The demo: which metric samples it shows first (pure), and starting over after the broker forgot its topics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import psycopg2

from capture.config import CaptureConfig
from headwater import demo
from headwater.demo import _shown_first
from headwater.stack import StackConfig


def test_samples_of_the_focus_table_come_first_in_label_order_whatever_order_they_were_counted_in() -> None:
    counted = [{"op": "DELETE", "table": "public.order_items"}, {"op": "UPDATE", "table": "public.orders"},
               {"op": "INSERT", "table": "public.customers"}, {"op": "INSERT", "table": "public.orders"}]  # fmt: skip
    shown = sorted(counted, key=lambda labels: _shown_first(labels, {"table": "public.orders"}))
    assert [(s["table"], s["op"]) for s in shown] == [
        ("public.orders", "INSERT"), ("public.orders", "UPDATE"),
        ("public.order_items", "DELETE"), ("public.customers", "INSERT")]  # fmt: skip (the rest: by op, then table)
    assert sorted(counted, key=lambda labels: _shown_first(labels, {}))[0] == counted[0]  # by op, then table


def _slot_exists(dsn: str, name: str) -> bool:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (name,))
            return cur.fetchone() is not None
    finally:
        conn.close()


def _leave_state(capture: CaptureConfig, dsn: str) -> None:
    """What a demo run leaves: capture's slot and state directory."""
    capture.state_dir.mkdir(parents=True, exist_ok=True)
    (capture.state_dir / "state").write_bytes(b"of the topics the broker had")
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (capture.slot,))
    finally:
        conn.close()


def test_a_demo_after_the_broker_forgot_its_topics_starts_capture_over(
    local_stack: StackConfig, pg_database: str, unique_name: str,
    capture_factory: Callable[..., Any], topic_factory: Callable[..., str],
) -> None:  # fmt: skip
    """``headwater stack down`` empties the in-memory broker (and the registry's schemas with it): the next demo
    drops the slot and capture's state (the stream worker drops its own: ``tests/streams/test_views.py``). While
    the raw topic is there, nothing is touched."""
    capture = capture_factory(pg_database).cfg
    _leave_state(capture, pg_database)
    topic_factory("changes")  # the raw topic, as capture names it for this prefix
    demo.reset_if_broker_forgot(capture)
    assert _slot_exists(pg_database, capture.slot) and (capture.state_dir / "state").exists()

    forgetful = replace(capture, topic_prefix=f"{unique_name}_gone")  # a raw topic the broker does not have
    demo.reset_if_broker_forgot(forgetful)
    assert not _slot_exists(pg_database, capture.slot)
    assert not capture.state_dir.exists()
