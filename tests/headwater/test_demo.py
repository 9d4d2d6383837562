"""The demo's pure parts: which metric samples it shows first."""

from __future__ import annotations

from headwater.demo import _shown_first


def test_samples_of_the_focus_table_come_first_in_label_order_whatever_order_they_were_counted_in() -> None:
    counted = [{"op": "DELETE", "table": "public.order_items"}, {"op": "UPDATE", "table": "public.orders"},
               {"op": "INSERT", "table": "public.customers"}, {"op": "INSERT", "table": "public.orders"}]  # fmt: skip
    shown = sorted(counted, key=lambda labels: _shown_first(labels, {"table": "public.orders"}))
    assert [(s["table"], s["op"]) for s in shown] == [
        ("public.orders", "INSERT"), ("public.orders", "UPDATE"),
        ("public.order_items", "DELETE"), ("public.customers", "INSERT")]  # fmt: skip (the rest: by op, then table)
    assert sorted(counted, key=lambda labels: _shown_first(labels, {}))[0] == counted[0]  # by op, then table
