"""pgoutput decoding: hand-built messages per the protocol, and real bytes from PostgreSQL."""

from __future__ import annotations

import struct

import psycopg2
import pytest

from capture import decoder as pg


def s(text: str) -> bytes:
    return text.encode() + b"\0"


def tup(*cols: bytes | str | None) -> bytes:
    out = struct.pack("!h", len(cols))
    for col in cols:
        if col is None:
            out += b"n"
        elif col == "u":
            out += b"u"
        else:
            assert isinstance(col, bytes)
            out += b"t" + struct.pack("!i", len(col)) + col
    return out


@pytest.mark.unit
class TestMessages:
    def test_begin_commit(self) -> None:
        assert pg.decode(b"B" + struct.pack("!QqI", 0x16B3748, 123456, 777)) == pg.Begin(0x16B3748, 123456, 777)
        commit = pg.decode(b"C" + struct.pack("!bQQq", 0, 10, 20, 99))
        assert commit == pg.Commit(0, 10, 20, 99)

    def test_relation(self) -> None:
        body = struct.pack("!I", 16384) + s("public") + s("orders") + b"d" + struct.pack("!h", 2)
        body += b"\x01" + s("id") + struct.pack("!Ii", 20, -1) + b"\x00" + s("total") + struct.pack("!Ii", 1700, 917510)
        rel = pg.decode(b"R" + body)
        assert rel == pg.Relation(
            16384, "public", "orders", "d",
            (pg.Column("id", 20, -1, True), pg.Column("total", 1700, 917510, False)),
        )  # fmt: skip

    def test_insert_update_delete_tuples(self) -> None:
        assert pg.decode(b"I" + struct.pack("!I", 7) + b"N" + tup(b"1", None, "é".encode())) == pg.Insert(
            7, ("1", None, "é")
        )
        upd = pg.decode(b"U" + struct.pack("!I", 7) + b"K" + tup(b"1", None) + b"N" + tup(b"2", "u"))
        assert upd == pg.Update(7, ("1", None), "K", ("2", pg.UNCHANGED))
        plain = pg.decode(b"U" + struct.pack("!I", 7) + b"N" + tup(b"2"))
        assert plain == pg.Update(7, None, None, ("2",))
        assert pg.decode(b"D" + struct.pack("!I", 7) + b"O" + tup(b"1", b"a")) == pg.Delete(7, ("1", "a"), "O")

    def test_truncate_type_origin_message(self) -> None:
        assert pg.decode(b"T" + struct.pack("!ib", 2, 3) + struct.pack("!II", 5, 6)) == pg.Truncate((5, 6), True, True)
        assert pg.decode(b"Y" + struct.pack("!I", 900) + s("public") + s("mood")) == pg.Type(900, "public", "mood")
        assert pg.decode(b"O" + struct.pack("!Q", 42) + s("node1")) == pg.Origin(42, "node1")
        msg = pg.decode(b"M" + struct.pack("!bQ", 1, 55) + s("headwater.heartbeat") + struct.pack("!i", 3) + b"abc")
        assert msg == pg.Message(True, 55, "headwater.heartbeat", b"abc")

    @pytest.mark.parametrize(
        "payload",
        [b"", b"Z123", b"B\x00\x01", b"I" + struct.pack("!I", 7) + b"X", b"I" + struct.pack("!I", 7) + b"N\x00\x01q"],
    )
    def test_bad_messages_raise_decode_error(self, payload: bytes) -> None:
        with pytest.raises(pg.DecodeError):
            pg.decode(payload)

    def test_pg_time_starts_at_postgres_epoch(self) -> None:
        assert pg.pg_time(0).isoformat() == "2000-01-01T00:00:00+00:00"


def test_decodes_what_postgresql_sends(pg_database: str, unique_name: str) -> None:
    """Real pgoutput bytes (via SQL, no replication protocol) decode into the expected sequence."""
    conn = psycopg2.connect(pg_database)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE TYPE mood AS ENUM ('ok', 'meh'); CREATE TABLE t (id int PRIMARY KEY, m mood, big text)")
        cur.execute("ALTER TABLE t ALTER COLUMN big SET STORAGE EXTERNAL")
        cur.execute(f"CREATE PUBLICATION {unique_name} FOR TABLE t")
        cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (unique_name,))
        cur.execute("INSERT INTO t VALUES (1, 'ok', repeat('z', 10000))")
        cur.execute("UPDATE t SET m = 'meh' WHERE id = 1")
        cur.execute("BEGIN; DELETE FROM t; TRUNCATE t; COMMIT")
        cur.execute(
            "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL,"
            " 'proto_version', '1', 'publication_names', %s)",
            (unique_name, unique_name),
        )
        messages = [pg.decode(bytes(row[0])) for row in cur.fetchall()]
        cur.execute("SELECT pg_drop_replication_slot(%s)", (unique_name,))
    conn.close()
    kinds = [type(m).__name__ for m in messages]
    assert kinds == [
        "Begin", "Type", "Relation", "Insert", "Commit",
        "Begin", "Update", "Commit",
        "Begin", "Delete", "Type", "Relation", "Truncate", "Commit",  # TRUNCATE resends the relation
    ]  # fmt: skip
    update = next(m for m in messages if isinstance(m, pg.Update))
    assert update.new == ("1", "meh", pg.UNCHANGED)  # the TOASTed column was not touched
    begin, commit = messages[0], messages[4]
    assert isinstance(begin, pg.Begin) and isinstance(commit, pg.Commit) and begin.final_lsn == commit.commit_lsn
