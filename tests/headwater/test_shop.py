"""The sample shop against a real PostgreSQL: schema, seed, workload, TOAST storage."""

from __future__ import annotations

import random
import threading
import time

import psycopg2
import psycopg2.extensions
import pytest

from headwater import shop, stack
from tests.plugins.stack import restart_postgres


def test_seed_creates_related_rows(shop_db: psycopg2.extensions.connection) -> None:
    counts = shop.counts(shop_db)
    assert counts["customers"] == 30 and counts["products"] == 10 and counts["orders"] == 40
    assert counts["order_items"] >= 40
    with shop_db, shop_db.cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM orders o WHERE total <> (SELECT coalesce(sum(quantity * unit_price), 0)"
            " FROM order_items i WHERE i.order_id = o.id)"
        )
        assert cur.fetchone() == (0,)


def test_install_is_idempotent(shop_db: psycopg2.extensions.connection) -> None:
    assert shop.install(shop_db) is False


def test_descriptions_are_toasted_out_of_line(shop_db: psycopg2.extensions.connection) -> None:
    with shop_db, shop_db.cursor() as cur:
        cur.execute("SELECT c.reltoastrelid::regclass::text FROM pg_class c WHERE c.relname = 'products'")
        toast = cur.fetchone()[0]
        cur.execute(f"SELECT count(DISTINCT chunk_id) FROM {toast}")  # noqa: S608 - a catalog name
        assert cur.fetchone()[0] == 10  # one out-of-line value per product


def test_workload_commits_every_kind_and_rolls_back_some(shop_db: psycopg2.extensions.connection) -> None:
    before = shop.counts(shop_db)
    work = shop.Workload(shop_db, rng_seed=3, rollback_share=0.1)
    work.run(rate=0, transactions=400)
    assert work.committed + work.rolled_back == 400
    assert work.rolled_back > 0
    assert set(work.by_kind) == {fn.__name__.removeprefix("_tx_") for fn, _ in shop.MIX}
    assert shop.counts(shop_db) != before
    with shop_db, shop_db.cursor() as cur:  # foreign keys and totals hold after the mix
        cur.execute("SELECT count(*) FROM orders o LEFT JOIN customers c ON c.id = o.customer_id WHERE c.id IS NULL")
        assert cur.fetchone() == (0,)


def test_workload_is_reproducible(pg_database: str) -> None:
    results = []
    for _ in range(2):
        conn = psycopg2.connect(pg_database)
        with conn, conn.cursor() as cur:
            cur.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        shop.install(conn)
        shop.seed(conn, shop.Scale(customers=10, products=5, orders=10, description_size=2500), rng_seed=5)
        work = shop.Workload(conn, rng_seed=9)
        work.run(rate=0, transactions=100)
        results.append((work.by_kind, shop.counts(conn)))
        conn.close()
    assert results[0] == results[1]


def _connect_in(dsn: str, schema: str) -> psycopg2.extensions.connection:
    """A connection whose unqualified names resolve in ``schema`` (two shops in one database)."""
    conn = psycopg2.connect(dsn, options=f"-c search_path={schema}")
    with conn, conn.cursor() as cur:
        cur.execute(f"CREATE SCHEMA {schema}")
    return conn


def _rows(conn: psycopg2.extensions.connection, query: str) -> list[tuple[object, ...]]:
    with conn, conn.cursor() as cur:
        cur.execute(query)
        return cur.fetchall()


def test_create_loads_the_requested_shop_with_valid_keys(pg_database: str) -> None:
    conn = psycopg2.connect(pg_database)
    try:
        assert shop.create(conn, shop.Scale(customers=50, products=8, orders=300, description_size=2500))
        counts = shop.counts(conn)
        assert (counts["customers"], counts["products"], counts["orders"]) == (50, 8, 300)
        assert 300 <= counts["order_items"] <= 1200
        assert _rows(conn, "SELECT min(id), max(id) FROM orders") == [(1, 300)]
        dangling = (
            "SELECT (SELECT count(*) FROM orders o LEFT JOIN customers c ON c.id = o.customer_id WHERE c.id IS NULL)"
            " + (SELECT count(*) FROM order_items i LEFT JOIN products p ON p.id = i.product_id WHERE p.id IS NULL)"
            " + (SELECT count(*) FROM orders o WHERE total <> (SELECT coalesce(sum(quantity * unit_price), 0)"
            " FROM order_items i WHERE i.order_id = o.id))"
        )
        assert _rows(conn, dangling) == [(0,)]
        days = "SELECT count(DISTINCT date_trunc('day', now() - placed_at)) FROM orders WHERE placed_at <= now()"
        assert _rows(conn, days) == [(14,)]  # spread over the last two weeks
        toast = _rows(conn, "SELECT reltoastrelid::regclass::text FROM pg_class WHERE relname = 'products'")[0][0]
        assert _rows(conn, f"SELECT count(DISTINCT chunk_id) FROM {toast}") == [(8,)]  # noqa: S608 - a catalog name
        assert shop.create(conn) is False  # present: left as it is
        assert shop.counts(conn) == counts
    finally:
        conn.close()


def test_seed_draws_the_same_rows_as_inserting_one_by_one(pg_database: str) -> None:
    """The COPY seed keeps the row-by-row seed's data: same random draws, same rows."""
    scale = shop.Scale(customers=40, products=6, orders=120, description_size=2100)
    copied, one_by_one = _connect_in(pg_database, "copied"), _connect_in(pg_database, "one_by_one")
    try:
        shop.create(copied, scale, rng_seed=4)
        shop.install(one_by_one)
        rng = random.Random(4)
        with one_by_one, one_by_one.cursor() as cur:
            for _ in range(scale.customers):
                shop._insert_customer(cur, rng)
            for _ in range(scale.products):
                shop._insert_product(cur, rng, scale.description_size)
            for _ in range(scale.orders):
                shop._insert_order(cur, rng)
        for query in (
            "SELECT id, email, name, region, profile FROM customers ORDER BY id",
            "SELECT id, sku, name, category, price, description, attributes FROM products ORDER BY id",
            "SELECT id, customer_id, status, total, note FROM orders ORDER BY id",
            "SELECT * FROM order_items ORDER BY order_id, line_no",
        ):
            assert _rows(copied, query) == _rows(one_by_one, query), query
    finally:
        copied.close()
        one_by_one.close()


def test_a_failed_seed_leaves_nothing_and_the_next_starts_clean(
    pg_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = psycopg2.connect(pg_database)
    copy = shop._copy

    def fail_on_items(cur: object, table: str, columns: tuple[str, ...], rows: list[tuple[object, ...]]) -> None:
        if table == "order_items":
            raise RuntimeError("interrupted")
        copy(cur, table, columns, rows)

    try:
        monkeypatch.setattr(shop, "_copy", fail_on_items)
        with pytest.raises(RuntimeError, match="interrupted"):
            shop.create(conn, shop.Scale(customers=20, products=4, orders=50))
        leftovers = "SELECT to_regclass('customers'), to_regclass('orders'), to_regtype('order_status')"
        assert _rows(conn, leftovers) == [(None, None, None)]
        monkeypatch.setattr(shop, "_copy", copy)
        assert shop.create(conn, shop.Scale(customers=20, products=4, orders=50))
        assert [shop.counts(conn)[t] for t in ("customers", "products", "orders")] == [20, 4, 50]
        assert _rows(conn, "SELECT min(id) FROM customers UNION ALL SELECT min(id) FROM orders") == [(1,), (1,)]
    finally:
        conn.close()


@pytest.mark.slow
def test_workload_goes_on_across_a_postgresql_restart(own_postgres: stack.Postgres) -> None:
    dsn = own_postgres.cfg.dsn()
    conn = psycopg2.connect(dsn)
    shop.install(conn)
    shop.seed(conn, shop.Scale(customers=30, products=10, orders=40, description_size=300))
    work = shop.Workload(conn, reconnect=lambda: psycopg2.connect(dsn), rollback_share=0)
    thread = threading.Thread(target=work.run, kwargs={"rate": 100, "duration": 8}, daemon=True)
    thread.start()
    time.sleep(2)
    before = work.committed
    restart_postgres(own_postgres, "fast")
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert before > 50 and work.committed > before + 100, "it went on after the restart"
    assert work.interrupted <= 2  # the transactions cut by the restart, counted apart
    work.conn.close()


def test_workload_without_reconnect_stops_on_a_lost_connection(pg_database: str) -> None:
    conn = psycopg2.connect(pg_database)
    shop.install(conn)
    shop.seed(conn, shop.Scale(customers=5, products=3, orders=5, description_size=300))
    work = shop.Workload(conn)
    conn.close()
    with pytest.raises(psycopg2.InterfaceError):
        work.step()
