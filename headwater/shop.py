"""The sample shop: its schema, a seeded starting state and a workload generator.

Promise: ``install`` creates the schema once (idempotent); ``seed`` adds a
deterministic starting population for a given seed and scale; ``Workload`` runs
random but reproducible transactions against it — inserts, updates (including
foreign-key moves and updates that leave the TOASTed description untouched),
deletes, multi-statement transactions and rollbacks — at a target rate.
Tests, benchmarks and the README demo all use it.
"""

from __future__ import annotations

import base64
import bisect
import io
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from importlib import resources
from typing import Any

import psycopg2
import psycopg2.extensions

from tables.errors import FatalError, HeadwaterError, first_line

log = logging.getLogger("headwater.shop")
Connection = psycopg2.extensions.connection
# The shop's view (README "Views"): an order with its customer, and its items each with their product —
# only the columns the report and the README need (not the products' TOASTed descriptions).
VIEWS_TOML = """\
[views.orders_enriched]
base = "orders"
joins = [
    "customer: customers on customer_id (name, region)",
    "items[]: order_items on order_id",
    "items[].product: products on product_id (name, category, price)",
]
"""
TABLES = ("customers", "products", "orders", "order_items")
KEYS = {"customers": ["id"], "products": ["id"], "orders": ["id"], "order_items": ["order_id", "line_no"]}
REGIONS = ("north", "south", "east", "west", "central")
CATEGORIES = ("books", "garden", "kitchen", "toys", "tools", "music")
STATUSES = ("pending", "paid", "shipped", "delivered", "cancelled")
SHOP_LOCK = 0x73686F70  # advisory lock taken while the shop is created ("shop")


def schema_sql() -> str:
    return resources.files("headwater").joinpath("shop.sql").read_text(encoding="utf-8")


def install(conn: Connection) -> bool:
    """Create the shop's tables unless they exist; True if this call created them."""
    with conn, conn.cursor() as cur:
        if _present(cur):
            return False
        cur.execute(schema_sql())
    return True


def _present(cur: Any) -> bool:
    """Whether the shop's tables exist; waits for a concurrent ``create`` or ``install`` to end first."""
    cur.execute("SELECT pg_advisory_xact_lock(%s)", (SHOP_LOCK,))
    cur.execute("SELECT to_regclass('customers') IS NOT NULL")
    return bool(cur.fetchone()[0])


def _description(rng: random.Random, size: int) -> str:
    """Incompressible-looking text of ``size`` characters: it is stored out of line."""
    return base64.b64encode(rng.randbytes(size * 3 // 4)).decode()[:size]


@dataclass(frozen=True)
class Scale:
    customers: int = 200
    products: int = 50
    orders: int = 400
    description_size: int = 4000


def create(conn: Connection, scale: Scale = Scale(), *, rng_seed: int = 1) -> bool:
    """Create and seed the shop in one transaction unless it exists; True if this call did.

    Interrupted at any point (an error, a lost connection, the process killed), it leaves
    nothing behind: no tables, no rows, so the next call starts clean.
    """
    with conn, conn.cursor() as cur:
        if _present(cur):
            return False
        cur.execute(schema_sql())
        _load(cur, scale, random.Random(rng_seed))
    return True


def seed(conn: Connection, scale: Scale = Scale(), *, rng_seed: int = 1) -> dict[str, int]:
    """Add a starting population in one transaction; returns the row count of each table afterwards."""
    with conn, conn.cursor() as cur:
        _load(cur, scale, random.Random(rng_seed))
    return counts(conn)


def counts(conn: Connection) -> dict[str, int]:
    with conn, conn.cursor() as cur:
        out = {}
        for table in TABLES:
            cur.execute(f"SELECT count(*) FROM {table}")  # noqa: S608 - fixed table names
            out[table] = cur.fetchone()[0]  # type: ignore[index]
    return out


# ---- the seed: rows made in memory, loaded with COPY ----------------------------------------
# The random draws are the same, in the same order, as inserting row by row through the
# workload's functions (``_insert_customer``, ``_insert_product``, ``_insert_order``) would make.
CUSTOMER_COLUMNS = ("email", "name", "region", "profile")
PRODUCT_COLUMNS = ("sku", "name", "category", "price", "description", "attributes")
ORDER_COLUMNS = ("id", "customer_id", "total", "placed_at")
ITEM_COLUMNS = ("order_id", "line_no", "product_id", "quantity", "unit_price")
COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _load(cur: Any, scale: Scale, rng: random.Random) -> None:
    _copy(cur, "customers", CUSTOMER_COLUMNS, [_customer_values(rng) for _ in range(scale.customers)])
    products = [_product_values(rng, scale.description_size) for _ in range(scale.products)]
    _copy(cur, "products", PRODUCT_COLUMNS, products)
    cur.execute("SELECT id FROM customers ORDER BY id")
    customers = [row[0] for row in cur.fetchall()]
    if not customers:
        return  # as row by row: an order needs a customer
    cur.execute("SELECT id, price FROM products ORDER BY id")
    prices = dict(cur.fetchall())
    cur.execute("SELECT nextval(pg_get_serial_sequence('orders', 'id')) FROM generate_series(1, %s)", (scale.orders,))
    order_ids = sorted(row[0] for row in cur.fetchall())
    cur.execute("SELECT now()")
    now = cur.fetchone()[0]
    orders, items = _orders(rng, order_ids, customers, prices)
    _copy(cur, "orders", ORDER_COLUMNS, [(o, c, total, _placed_at(now, o)) for o, c, total in orders])
    _copy(cur, "order_items", ITEM_COLUMNS, items)


def _pick(ids: list[int], rng: random.Random) -> int:
    """As ``_random_id``: the first existing id at or after a random point between the lowest and highest."""
    return ids[bisect.bisect_left(ids, rng.randint(ids[0], ids[-1]))]


def _orders(
    rng: random.Random, order_ids: list[int], customers: list[int], prices: dict[int, Decimal]
) -> tuple[list[tuple[int, int, Decimal]], list[tuple[Any, ...]]]:
    """Each order's (id, customer, total) and its 1 to 4 items (order, line, product, quantity, price)."""
    products = sorted(prices)
    orders, items = [], []
    for order_id in order_ids:
        customer, total = _pick(customers, rng), Decimal(0)
        for line_no in range(1, rng.randint(1, 4) + 1):
            if not products:
                break
            product = _pick(products, rng)
            quantity = rng.randint(1, 5)
            items.append((order_id, line_no, product, quantity, prices[product]))
            total += quantity * prices[product]
        orders.append((order_id, customer, total))
    return orders, items


def _placed_at(now: datetime, order_id: int) -> datetime:
    """Seeded orders spread over the last two weeks, so reports by day have days to show."""
    return now - timedelta(days=order_id % 14, seconds=order_id * 7919 % 86400)


def _copy(cur: Any, table: str, columns: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    """``COPY table FROM STDIN`` of ``rows`` in PostgreSQL's text format, from a buffer in memory."""
    buffer = io.StringIO()
    for row in rows:
        buffer.write("\t".join(_copy_text(value) for value in row) + "\n")
    buffer.seek(0)
    cur.copy_expert(f"COPY {table} ({', '.join(columns)}) FROM STDIN", buffer, size=1 << 20)


def _copy_text(value: Any) -> str:
    if value is None:
        return "\\N"
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value).translate(COPY_ESCAPES) if isinstance(value, str) else str(value)


def _customer_values(rng: random.Random) -> tuple[str, str, str, str]:
    tag = rng.getrandbits(48)
    profile = {"tier": rng.choice(["basic", "gold"]), "tags": rng.sample(["a", "b", "c", "d"], 2)}
    return f"c{tag:x}@example.com", f"Customer {tag % 100000}", rng.choice(REGIONS), json.dumps(profile)


def _product_values(rng: random.Random, description_size: int) -> tuple[str, ...]:
    tag = rng.getrandbits(48)
    return (
        f"SKU-{tag:x}",
        f"Product {tag % 10000}",
        rng.choice(CATEGORIES),
        f"{rng.randint(100, 99999) / 100:.2f}",
        _description(rng, description_size),
        json.dumps({"color": rng.choice(["red", "blue", "green"]), "weight_g": rng.randint(10, 5000)}),
    )


# ---- row by row: the workload's inserts ------------------------------------------------
def _insert_customer(cur: Any, rng: random.Random) -> None:
    cur.execute("INSERT INTO customers (email, name, region, profile) VALUES (%s, %s, %s, %s)", _customer_values(rng))


def _insert_product(cur: Any, rng: random.Random, description_size: int) -> None:
    cur.execute(
        "INSERT INTO products (sku, name, category, price, description, attributes) VALUES (%s, %s, %s, %s, %s, %s)",
        _product_values(rng, description_size),
    )


def _random_id(cur: Any, table: str, rng: random.Random) -> int | None:
    """A random existing id (fast on a bigserial key: probe a random point in the range)."""
    cur.execute(f"SELECT min(id), max(id) FROM {table}")  # noqa: S608 - fixed table names
    low, high = cur.fetchone()
    if low is None:
        return None
    cur.execute(f"SELECT id FROM {table} WHERE id >= %s ORDER BY id LIMIT 1", (rng.randint(low, high),))  # noqa: S608
    row = cur.fetchone()
    return row[0] if row else int(low)


def _insert_order(cur: Any, rng: random.Random) -> None:
    customer = _random_id(cur, "customers", rng)
    if customer is None:
        return
    cur.execute("INSERT INTO orders (customer_id, note) VALUES (%s, %s) RETURNING id", (customer, None))
    order_id = cur.fetchone()[0]
    for line_no in range(1, rng.randint(1, 4) + 1):
        product = _random_id(cur, "products", rng)
        if product is None:
            break
        cur.execute(
            "INSERT INTO order_items (order_id, line_no, product_id, quantity, unit_price)"
            " SELECT %s, %s, id, %s, price FROM products WHERE id = %s",
            (order_id, line_no, rng.randint(1, 5), product),
        )
    _retotal(cur, order_id)


def _retotal(cur: Any, order_id: int) -> None:
    cur.execute(
        "UPDATE orders SET total = coalesce((SELECT sum(quantity * unit_price) FROM order_items"
        " WHERE order_id = %s), 0) WHERE id = %s",
        (order_id, order_id),
    )


# ---- the workload: one function per kind of transaction ---------------------------------
def _tx_new_customer(cur: Any, rng: random.Random) -> None:
    _insert_customer(cur, rng)


def _tx_new_order(cur: Any, rng: random.Random) -> None:
    _insert_order(cur, rng)


def _tx_order_status(cur: Any, rng: random.Random) -> None:
    order = _random_id(cur, "orders", rng)
    if order is not None:
        cur.execute("UPDATE orders SET status = %s WHERE id = %s", (rng.choice(STATUSES), order))


def _tx_price_change(cur: Any, rng: random.Random) -> None:
    """Touches only small columns: the TOASTed description stays 'unchanged' in the WAL."""
    product = _random_id(cur, "products", rng)
    if product is not None:
        cur.execute(
            "UPDATE products SET price = round(price * %s, 2), updated_at = now() WHERE id = %s",
            (rng.choice([0.9, 1.05, 1.1]), product),
        )


def _tx_move_order(cur: Any, rng: random.Random) -> None:
    """A foreign-key change: the order moves to another customer."""
    order, customer = _random_id(cur, "orders", rng), _random_id(cur, "customers", rng)
    if order is not None and customer is not None:
        cur.execute("UPDATE orders SET customer_id = %s WHERE id = %s", (customer, order))


def _tx_change_item(cur: Any, rng: random.Random) -> None:
    """A multi-statement transaction: swap an item's product, then fix the order total."""
    order, product = _random_id(cur, "orders", rng), _random_id(cur, "products", rng)
    if order is None or product is None:
        return
    cur.execute(
        "UPDATE order_items SET product_id = %s, quantity = quantity + 1 WHERE order_id = %s AND line_no = 1",
        (product, order),
    )
    _retotal(cur, order)


def _tx_customer_region(cur: Any, rng: random.Random) -> None:
    customer = _random_id(cur, "customers", rng)
    if customer is not None:
        cur.execute("UPDATE customers SET region = %s WHERE id = %s", (rng.choice(REGIONS), customer))


def _tx_delete_order(cur: Any, rng: random.Random) -> None:
    order = _random_id(cur, "orders", rng)
    if order is not None:
        cur.execute("DELETE FROM orders WHERE id = %s", (order,))  # items go by cascade


def _tx_delete_customer(cur: Any, rng: random.Random) -> None:
    """Deletes a customer with all their orders in one transaction."""
    customer = _random_id(cur, "customers", rng)
    if customer is not None:
        cur.execute("DELETE FROM orders WHERE customer_id = %s", (customer,))
        cur.execute("DELETE FROM customers WHERE id = %s", (customer,))


TxFn = Callable[[Any, random.Random], None]
MIX: tuple[tuple[TxFn, int], ...] = (
    (_tx_new_order, 25),
    (_tx_order_status, 20),
    (_tx_price_change, 10),
    (_tx_move_order, 10),
    (_tx_change_item, 10),
    (_tx_new_customer, 8),
    (_tx_customer_region, 8),
    (_tx_delete_order, 6),
    (_tx_delete_customer, 3),
)


@dataclass
class Workload:
    """Runs the transaction mix; a share of transactions is rolled back on purpose."""

    conn: Connection
    rng_seed: int = 7
    rollback_share: float = 0.05
    committed: int = 0
    rolled_back: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    # a new connection when the server went away (a restart); None: a lost connection ends the run
    reconnect: Callable[[], Connection] | None = None
    interrupted: int = 0  # transactions cut by a lost connection: committed or not, nobody knows
    reconnect_wait: float = 60.0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.rng_seed)
        self.kinds = [fn for fn, _ in MIX]
        self.weights = [w for _, w in MIX]

    def step(self) -> None:
        """Run one transaction: commit it, or roll it back at the configured share; a lost connection
        is made again with ``reconnect`` (the transaction counts as interrupted)."""
        fn = self.rng.choices(self.kinds, self.weights)[0]
        rollback = self.rng.random() < self.rollback_share
        try:
            self._transaction(fn, rollback)
        except (psycopg2.OperationalError, psycopg2.InterfaceError) as exc:
            if self.reconnect is None:
                raise
            self.interrupted += 1
            self._connect_again(exc)

    def _connect_again(self, exc: psycopg2.Error) -> None:
        first = first_line(exc)
        log.warning("lost the connection to PostgreSQL (%s): reconnecting", first)
        assert self.reconnect is not None
        deadline = time.monotonic() + self.reconnect_wait
        while True:
            try:
                self.conn = self.reconnect()
                log.warning("reconnected to PostgreSQL; the workload goes on")
                return
            except (psycopg2.Error, HeadwaterError):
                if time.monotonic() > deadline:
                    raise FatalError(f"PostgreSQL did not come back within {self.reconnect_wait:.0f} s: {first}",
                                     hint="start it again, then rerun the workload") from exc  # fmt: skip
                time.sleep(0.5)

    def _transaction(self, fn: Callable[[Any, random.Random], None], rollback: bool) -> None:
        with self.conn.cursor() as cur:
            try:
                fn(cur, self.rng)
            except psycopg2.Error:
                if self.conn.closed:
                    raise
                self.conn.rollback()  # e.g. a foreign key raced away: count as rolled back
                self.rolled_back += 1
                return
        if rollback:
            self.conn.rollback()
            self.rolled_back += 1
        else:
            self.conn.commit()
            self.committed += 1
            name = fn.__name__.removeprefix("_tx_")
            self.by_kind[name] = self.by_kind.get(name, 0) + 1

    def run(self, *, rate: float, duration: float | None = None, transactions: int | None = None) -> None:
        """Run at ``rate`` transactions per second (0: as fast as possible) until a limit."""
        start = time.monotonic()
        done = 0
        while (duration is None or time.monotonic() - start < duration) and (
            transactions is None or done < transactions
        ):
            self.step()
            done += 1
            if rate > 0:
                delay = start + done / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
