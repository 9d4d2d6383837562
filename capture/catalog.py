"""What PostgreSQL's catalog says about the captured tables (queries only; SELECT is enough).

Promise: connection checks that name the setting or privilege to fix (wal_level,
REPLICATION), the list of tables to capture from the include/exclude patterns (an
include pattern matching nothing is an error), the publication (created if missing,
else used as is), and the column and type facts ``tables.catalog`` needs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psycopg2
import psycopg2.extensions
from psycopg2 import sql

from capture.config import CaptureConfig
from capture.errors import SourceError, SourceUnreachableError
from tables.catalog import ColumnInfo, TableSchema
from tables.config import DSN_EXAMPLE, dsn_problem
from tables.errors import ConfigError, first_line
from tables.types import SESSION_OPTIONS, PgType

log = logging.getLogger("headwater.capture")
Connection = psycopg2.extensions.connection
DSN_HINT = f"set [capture] dsn (or --dsn, HEADWATER_CAPTURE_DSN) to {DSN_EXAMPLE}"


def connect(dsn: str, *, replication: bool = False) -> Connection:
    """A connection with the session settings the type converters rely on."""
    from psycopg2.extras import LogicalReplicationConnection

    problem = dsn_problem(dsn)
    if problem:
        raise ConfigError(f"not a valid PostgreSQL connection string: {problem}", key="dsn", hint=DSN_HINT)
    try:
        return psycopg2.connect(
            dsn,
            options=SESSION_OPTIONS,
            connection_factory=LogicalReplicationConnection if replication else None,
            connect_timeout=10,
            application_name="headwater-capture",
        )
    except psycopg2.OperationalError as exc:
        raise SourceUnreachableError(
            f"cannot connect to PostgreSQL: {first_line(exc)}",
            hint="check [capture] dsn (host, port, user, password, dbname, sslmode); the password is not shown",
        ) from exc


def connection_lost(exc: psycopg2.Error) -> bool:
    """The error says the connection is gone (server restart or shutdown, network), not that SQL failed."""
    if isinstance(exc, psycopg2.OperationalError | psycopg2.InterfaceError):
        return True
    code = exc.pgcode or ""
    return not code or code.startswith(("08", "57P"))  # no SQLSTATE: the protocol broke (e.g. "no COPY in progress")


def check_source(conn: Connection) -> None:
    """wal_level must be logical and the role must be allowed to replicate."""
    with conn.cursor() as cur:
        cur.execute("SHOW wal_level")
        level = cur.fetchone()[0]  # type: ignore[index]
        if level != "logical":
            raise SourceError(
                f"PostgreSQL runs with wal_level = {level}; logical decoding needs wal_level = logical",
                hint="run ALTER SYSTEM SET wal_level = logical (or set it in postgresql.conf) and restart PostgreSQL",
            )
        cur.execute("SELECT current_user, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user")
        user, can_replicate = cur.fetchone()  # type: ignore[misc]
        if not can_replicate:
            raise SourceError(
                f"role '{user}' may not replicate: it lacks the REPLICATION attribute",
                hint=f'ALTER ROLE "{user}" WITH REPLICATION (capture needs REPLICATION and SELECT, nothing more)',
            )


def server_utf8(conn: Connection) -> bool:
    """Whether the server's text is UTF-8 (then capture may pass text through as bytes)."""
    with conn.cursor() as cur:
        cur.execute("SHOW server_encoding")
        encoding = cur.fetchone()[0]  # type: ignore[index]
    conn.commit()
    return bool(encoding == "UTF8")


@dataclass(frozen=True)
class TableRef:
    oid: int
    schema: str
    name: str
    keyed: bool

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


TABLES_SQL = """
SELECT c.oid, n.nspname, c.relname,
       EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND (i.indisprimary OR i.indisreplident))
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
  AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg\\_%%'
ORDER BY n.nspname, c.relname
"""


def table_ref(conn: Connection, schema: str, name: str) -> TableRef | None:
    """The table ``schema.name`` as ``select_tables`` would list it (None: no such table)."""
    query = TABLES_SQL.replace("ORDER BY", "AND n.nspname = %s AND c.relname = %s ORDER BY")
    with conn.cursor() as cur:
        cur.execute(query, (schema, name))
        row = cur.fetchone()
    conn.commit()
    return TableRef(*row) if row else None


def published(conn: Connection, publication: str) -> set[tuple[str, str]]:
    """(schema, table) of every table the publication publishes now."""
    with conn.cursor() as cur:
        cur.execute("SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (publication,))
        found = {(s, t) for s, t in cur.fetchall()}
    conn.commit()
    return found


def select_tables(conn: Connection, cfg: CaptureConfig) -> list[TableRef]:
    """Tables matching the patterns; unkeyed ones are skipped with a warning unless allowed (and the signal
    table, if any, is never one of them: its rows are signals)."""
    with conn.cursor() as cur:
        cur.execute(TABLES_SQL)
        everything = [TableRef(*row) for row in cur.fetchall() if cfg.signal != (row[1], row[2])]
    for pattern in cfg.patterns(cfg.include):
        probe = CaptureConfig(include=pattern)
        if not any(probe.wants(t.schema, t.name) for t in everything):
            raise SourceError(
                f"include pattern '{pattern}' matches no table in this database",
                hint="patterns are schema.table globs, e.g. public.* or shop.orders; check the spelling",
            )
    chosen = []
    for table in everything:
        if not cfg.wants(table.schema, table.name):
            continue
        if not table.keyed and not cfg.allow_unkeyed:
            log.warning(
                "skipping %s: no primary key or replica identity index (set allow_unkeyed to capture it)",
                table.qualified,
            )
            continue
        chosen.append(table)
    if not chosen:
        raise SourceError("no table to capture after applying include, exclude and the key rule")
    return chosen


def publication_exists(conn: Connection, name: str) -> bool:
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,))
        found = cur.fetchone() is not None
    conn.commit()
    return found


def drop_publication(conn: Connection, name: str) -> bool:
    """Drop publication ``name`` if it exists; True if it did."""
    if not publication_exists(conn, name):
        return False
    with conn.cursor() as cur:
        cur.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(name)))
    conn.commit()
    return True


def ensure_publication(conn: Connection, cfg: CaptureConfig, tables: list[TableRef]) -> list[TableRef]:
    """Create the publication for ``tables`` (and the signal table) if missing; else use it as is. Returns
    what it publishes of ``tables``; a signal table it does not publish is refused (its rows would never
    come through the stream)."""
    if not publication_exists(conn, cfg.publication):
        _create_publication(conn, cfg, tables)
    found = published(conn, cfg.publication)
    chosen = [t for t in tables if (t.schema, t.name) in found]
    missing = [t.qualified for t in tables if (t.schema, t.name) not in found]
    if missing:
        log.warning("publication %s does not include %s; they are not captured", cfg.publication, ", ".join(missing))
    if not chosen:
        raise SourceError(
            f"publication '{cfg.publication}' publishes none of the chosen tables",
            hint=f"ALTER PUBLICATION {cfg.publication} ADD TABLE ..., or choose another publication",
        )
    if cfg.signal is not None and cfg.signal not in found:
        raise SourceError(
            f"publication '{cfg.publication}' does not publish the signal table {cfg.signal_table}",
            hint=f"ALTER PUBLICATION {cfg.publication} ADD TABLE {cfg.signal_table} (signals come through the "
            "stream), or unset signal_table",
        )
    return chosen


def _create_publication(conn: Connection, cfg: CaptureConfig, tables: list[TableRef]) -> None:
    qualified = [(t.schema, t.name) for t in tables] + ([cfg.signal] if cfg.signal else [])
    names = sql.SQL(", ").join(sql.Identifier(*t) for t in qualified)
    try:
        with conn.cursor() as cur:
            cur.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(cfg.publication), names))
        conn.commit()
    except psycopg2.Error as exc:
        conn.rollback()
        raise SourceError(
            f"cannot create publication '{cfg.publication}': {str(exc).strip().splitlines()[0]}",
            hint=(
                "a table owner or superuser must run CREATE PUBLICATION "
                f"{cfg.publication} FOR TABLE {', '.join('.'.join(t) for t in qualified)}"
            ),
        ) from exc
    log.info("created publication %s for %d tables", cfg.publication, len(tables))


TYPES_SQL = """
SELECT t.oid, t.typname, n.nspname, t.typtype, t.typcategory, t.typelem, t.typbasetype, t.typdelim,
       (SELECT array_agg(e.enumlabel ORDER BY e.enumsortorder) FROM pg_enum e WHERE e.enumtypid = t.oid)
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE t.oid = ANY(%s)
"""


class TypeCache:
    """PgType by oid, loaded from pg_type on first use (arrays and domains resolved)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.types: dict[int, PgType] = {}

    def get(self, oid: int) -> PgType:
        if oid not in self.types:
            self.load([oid])
        return self.types[oid]

    def load(self, oids: list[int]) -> None:
        with self.conn.cursor() as cur:
            cur.execute(TYPES_SQL, (oids,))
            rows = cur.fetchall()
        self.conn.commit()
        for oid, name, nsp, typtype, category, elem, base, delim, labels in rows:
            element = self.get(elem) if category == "A" and elem else None
            base_type = self.get(base) if typtype == "d" and base else None
            self.types[oid] = PgType(oid, name, nsp, typtype, element, base_type, tuple(labels or ()), delim)
        for oid in oids:
            if oid not in self.types:
                self.types[oid] = PgType(oid, f"oid_{oid}", "unknown")


COLUMNS_SQL = """
SELECT a.attname, a.atttypid, a.atttypmod, NOT a.attnotnull,
       COALESCE(a.attnum = ANY(
           (SELECT i.indkey FROM pg_index i WHERE i.indrelid = a.attrelid
              AND (i.indisreplident OR i.indisprimary) ORDER BY i.indisreplident DESC LIMIT 1)::int2[]), false)
FROM pg_attribute a
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum
"""


def nullability(conn: Connection, oid: int) -> dict[str, bool]:
    """Column name to 'may be NULL' for a table, as of now."""
    with conn.cursor() as cur:
        cur.execute("SELECT attname, NOT attnotnull FROM pg_attribute WHERE attrelid = %s AND attnum > 0", (oid,))
        out = dict(cur.fetchall())
    conn.commit()
    return out


def key_names(conn: Connection, oid: int) -> set[str]:
    """The key columns ``table_schema`` gives the table: its replica identity index's, else its primary key's."""
    with conn.cursor() as cur:
        cur.execute(COLUMNS_SQL, (oid,))
        out = {name for name, _, _, _, is_key in cur.fetchall() if is_key}
    conn.commit()
    return out


def table_schema(conn: Connection, types: TypeCache, prefix: str, table: TableRef) -> TableSchema:
    """The table's shape from the catalog (the snapshot uses this; streaming uses Relation messages)."""
    with conn.cursor() as cur:
        cur.execute(COLUMNS_SQL, (table.oid,))
        rows = cur.fetchall()
    conn.commit()
    columns = [
        ColumnInfo(name, types.get(typ), typmod, nullable, is_key) for name, typ, typmod, nullable, is_key in rows
    ]
    return TableSchema.build(prefix, table.schema, table.name, columns)

