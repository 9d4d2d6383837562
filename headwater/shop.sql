-- The sample shop: a small, realistic schema that exercises what CDC must get right.
-- Foreign keys, numeric money, timestamptz, jsonb, an enum, a composite primary key
-- and a large text column stored out of line (TOAST).
CREATE TYPE order_status AS ENUM ('pending', 'paid', 'shipped', 'delivered', 'cancelled');

CREATE TABLE customers (
    id          bigserial PRIMARY KEY,
    email       text NOT NULL UNIQUE,
    name        text NOT NULL,
    region      text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    profile     jsonb NOT NULL DEFAULT '{}'
);

CREATE TABLE products (
    id          bigserial PRIMARY KEY,
    sku         text NOT NULL UNIQUE,
    name        text NOT NULL,
    category    text NOT NULL,
    price       numeric(12, 2) NOT NULL CHECK (price >= 0),
    description text NOT NULL,
    attributes  jsonb,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
-- Out of line and uncompressed: every description is TOASTed, so an update that
-- leaves it alone sends it as "unchanged" in the WAL.
ALTER TABLE products ALTER COLUMN description SET STORAGE EXTERNAL;

CREATE TABLE orders (
    id          bigserial PRIMARY KEY,
    customer_id bigint NOT NULL REFERENCES customers (id),
    status      order_status NOT NULL DEFAULT 'pending',
    total       numeric(14, 2) NOT NULL DEFAULT 0,
    placed_at   timestamptz NOT NULL DEFAULT now(),
    note        text
);
CREATE INDEX orders_customer_id ON orders (customer_id);

CREATE TABLE order_items (
    order_id    bigint NOT NULL REFERENCES orders (id) ON DELETE CASCADE,
    line_no     integer NOT NULL,
    product_id  bigint NOT NULL REFERENCES products (id),
    quantity    integer NOT NULL CHECK (quantity > 0),
    unit_price  numeric(12, 2) NOT NULL,
    PRIMARY KEY (order_id, line_no)
);
CREATE INDEX order_items_product_id ON order_items (product_id);
