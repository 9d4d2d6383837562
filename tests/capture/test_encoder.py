"""Raw-topic records with nested row images: what ``NestedChangeWriter`` writes is what ``ChangeWriter`` writes,
read whole by fastavro with the registered schema, and re-framed byte for byte by ``ChangeReader``."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import fastavro
import httpx
import pytest

from capture._copier import Sender, send_envelopes
from capture.config import CaptureConfig
from capture.encoder import ChangeWriter, NestedChangeWriter, RowEncoder
from capture.errors import BrokerError
from capture.producer import librdkafka_library, librdkafka_line, librdkafka_settings
from capture.schemas import register_changes, register_table
from tables.catalog import ColumnInfo, TableSchema
from tables.change import ChangeReader
from tables.config import Secret, StackConfig
from tables.kafka import read_topic
from tables.registry import Registry
from tables.wire import UndecodableMessage, body, schema_id
from tests.capture.test_transcoder import COLUMNS, ROW

pytestmark = pytest.mark.usefixtures("local_stack")

# the key holds an enum the value uses again: the nested record defines it once, in the key
KEYED = [(n, p, m, nullable, key or n == "mood") for n, p, m, nullable, key in COLUMNS if n != "code"]
UNKEYED = [(n, p, m, nullable, False) for n, p, m, nullable, _ in COLUMNS[:6]]
TEXTS = {c[0]: text for c, text in zip(COLUMNS, ROW, strict=True)}


def writers(local_stack: StackConfig, prefix: str, columns: list[Any]) -> tuple[Registry, RowEncoder, Any, Any]:
    """The table registered both ways, a row encoder, and the framed and nested writers that learned it."""
    registry = Registry(local_stack.registry_url)
    table = TableSchema.build(prefix, "public", "every", [ColumnInfo(*c) for c in columns])
    framed_cfg = CaptureConfig(topic_prefix=prefix, registry_url=local_stack.registry_url)
    nested_cfg = CaptureConfig(topic_prefix=prefix, registry_url=local_stack.registry_url, raw_images="nested")
    ids = register_table(registry, table, nested_cfg)
    assert register_table(registry, table) == (*ids[:2], None)  # the table topic's ids are the same either way
    framed, nested = ChangeWriter(*register_changes(registry, framed_cfg)), NestedChangeWriter(
        *register_changes(registry, nested_cfg))  # fmt: skip
    for writer in (framed, nested):
        writer.learn(table, ids)
    return registry, RowEncoder(table, ids.value, ids.key), framed, nested


def changes(encoder: RowEncoder) -> list[tuple[Any, ...]]:
    """Every shape of change: insert, update (no old, old key, old row), delete (key, old row), truncate."""
    t = encoder.table
    row = encoder.convert([TEXTS[c.name] for c in t.columns])
    other = list(row)
    other[0] = 43
    value, key, old_value, old_key = (encoder.encode_value(row), encoder.encode_key(row), encoder.encode_value(other),
                                      encoder.encode_key(other))  # fmt: skip
    head = ("public", t.name, t.topic)
    return [("INSERT", *head, key, None, value), ("UPDATE", *head, key, None, value),
            ("UPDATE", *head, key, old_key, value), ("UPDATE", *head, key, old_value, value),
            ("DELETE", *head, key, None, None), ("DELETE", *head, key, old_value, None),
            ("TRUNCATE", *head, None, None, None), ("SNAPSHOT_END", "", "", "", None, None, None)]  # fmt: skip


def same_both_ways(registry: Registry, framed: list[bytes], nested: list[bytes]) -> None:
    """Each nested record re-framed (cut out, or read whole and written again) equals the framed one; fastavro
    alone reads its images as the framed decode."""
    read, whole = ChangeReader(registry), ChangeReader(registry, cut=False)
    for f, n in zip(framed, nested, strict=True):
        assert read(n) == whole(n) == read(f) == registry.decode(f)
        alone = fastavro.schemaless_reader(io.BytesIO(body(n)), fastavro.parse_schema(registry.schema(schema_id(n))),
                                           None)  # fmt: skip
        plain = registry.decode(f)
        for image in ("key", "before", "after"):
            assert alone[image] == registry.decode(plain[image]), image
        assert {k: v for k, v in alone.items() if k not in ("key", "before", "after")} == {
            k: v for k, v in plain.items() if k not in ("key", "before", "after")}  # fmt: skip


@pytest.mark.parametrize("columns", [KEYED, UNKEYED], ids=["keyed", "unkeyed"])
def test_nested_changes_read_as_the_framed_ones(local_stack: StackConfig, unique_name: str,
                                                columns: list[Any]) -> None:  # fmt: skip
    registry, encoder, framed, nested = writers(local_stack, unique_name, columns)
    tx = ChangeWriter.transaction(0x1A2B3C, 77, 1_700_000_000_000_000)
    found = changes(encoder)
    if encoder.key is None:  # an unkeyed table: rows without key, old rows only
        found = [(op, s, n, t, None, b if b is None or b[:5] != (k or b"")[:5] else None, a)
                 for op, s, n, t, k, b, a in found]  # fmt: skip
    same_both_ways(registry, [v for _, v in framed.records(found, tx, framed.size(len(found)), 3)],
                   [v for _, v in nested.records(found, tx, nested.size(len(found)), 3)])  # fmt: skip
    one = found[3]
    args = (tx, 5, framed.size(9), *one[4:])
    same_both_ways(registry, [framed.encode(*one[:4], *args)], [nested.encode(*one[:4], *args)])
    t = encoder.table
    rows = [(c[4], c[6]) for c in found[:2]]  # a backfill's chunk: through the compiled envelopes
    same_both_ways(registry, [v for _, v in framed.chunk("READ", "public", t.name, t.topic, tx, rows, 4)],
                   [v for _, v in nested.chunk("READ", "public", t.name, t.topic, tx, rows, 4)])  # fmt: skip
    snapshot = [w.read_encoder("public", t.name, t.topic, tx, w.size(0))(7, *rows[0]) for w in (framed, nested)]
    same_both_ways(registry, [snapshot[0]], [snapshot[1]])  # the snapshot's general path
    counts = nested.take_counts()
    assert counts[("public", t.name, "UPDATE")] == 3 and counts[("public", t.name, "READ")] == 2
    assert len(nested.records(found[:1], tx, b"\x02").__next__()[1]) < len(
        next(framed.records(found[:1], tx, b"\x02"))[1])  # no frames, no lengths  # fmt: skip


def test_a_chunk_sent_from_c_is_what_the_envelopes_write_framed_and_nested(
    local_stack: StackConfig, unique_name: str, topic_factory: Callable[..., str]
) -> None:
    """A backfill's chunk goes out through the C sender (``send_envelopes``, in slices): on the topic, each
    message is what ``envelopes`` writes for it, with either encoding of the row images."""
    registry, encoder, framed, nested = writers(local_stack, unique_name, KEYED)
    tx, t = ChangeWriter.transaction(0x1A2B3C, 77, 1_700_000_000_000_000), encoder.table
    rows = [(c[4], c[6]) for c in changes(encoder) if c[6] is not None][:3]
    cfg = CaptureConfig(dsn=Secret("postgresql:///unused"), bootstrap=local_stack.bootstrap)
    for writer, name in ((framed, "framed"), (nested, "nested")):
        topic = topic_factory(name)
        kafka_key, head, size, parts, tail, is_nested = writer.chunk_parts("READ", "public", t.name, t.topic, tx,
                                                                           rows, 4)  # fmt: skip
        assert is_nested == (writer is nested)
        sender = Sender(librdkafka_library() or "", librdkafka_settings(cfg), topic, BrokerError, librdkafka_line)
        send_envelopes(sender, kafka_key, head, size, parts[:2], tail, 0, is_nested)
        send_envelopes(sender, kafka_key, head, size, parts[2:], tail, 2, is_nested)
        assert sender.flush(30.0) == 0 and sender.failure is None
        sender.close()
        expected = [v for _, v in writer.chunk("READ", "public", t.name, t.topic, tx, rows, 4)]
        assert len(expected) == 3 and [r.value for r in read_topic(local_stack.bootstrap, topic)] == expected
    same_both_ways(registry, [v for _, v in framed.chunk("READ", "public", t.name, t.topic, tx, rows, 4)],
                   [v for _, v in nested.chunk("READ", "public", t.name, t.topic, tx, rows, 4)])  # fmt: skip


def test_a_record_without_a_learned_shape_is_refused(local_stack: StackConfig, unique_name: str) -> None:
    nested = writers(local_stack, unique_name, KEYED)[3]
    with pytest.raises(RuntimeError, match=r"no nested change schema learned for public\.elsewhere"):
        list(nested.records([("INSERT", "public", "elsewhere", "x", None, None, None)], b"", b"\x02"))
    subjects = httpx.get(f"{local_stack.registry_url}/subjects").json()
    assert f"{unique_name}.changes-headwater.public.every.Change" in subjects


def test_a_nested_message_cut_short_is_undecodable(local_stack: StackConfig, unique_name: str) -> None:
    registry, encoder, _, nested = writers(local_stack, unique_name, KEYED)
    value = next(nested.records(changes(encoder)[3:4], ChangeWriter.transaction(1, 2, 3), b"\x02"))[1]
    for read in (ChangeReader(registry), ChangeReader(registry, cut=False)):
        with pytest.raises(UndecodableMessage, match="does not match schema"):
            read(value[:40])  # inside the fields before the images
        with pytest.raises(UndecodableMessage, match="does not match schema"):
            read(value[: len(value) - len(encoder.encode_value(encoder.convert([TEXTS[c.name] for c in
                                                                                encoder.table.columns])))])  # fmt: skip
