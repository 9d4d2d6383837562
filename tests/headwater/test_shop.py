"""The sample shop against a real PostgreSQL: schema, seed, workload, TOAST storage."""

from __future__ import annotations

import psycopg2.extensions

from headwater import shop


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
