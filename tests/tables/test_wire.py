"""The wire contract as pure functions: frame, body, LSN text."""

from __future__ import annotations

import fastavro
import pytest

from tables.wire import (
    FRAME_SIZE,
    UndecodableMessage,
    avro_body,
    body,
    frame,
    lsn_text,
    parse_lsn,
    read_framed,
    schema_id,
)

pytestmark = pytest.mark.unit


def test_a_frame_is_magic_zero_and_a_big_endian_id() -> None:
    assert frame(1) == b"\x00\x00\x00\x00\x01" and len(frame(2**31 - 1)) == FRAME_SIZE
    assert schema_id(frame(258) + b"rest") == 258 and body(frame(258) + b"rest") == b"rest"


@pytest.mark.parametrize("data", [b"", b"\x00\x00\x01", b"\x01\x00\x00\x00\x01body"])
def test_bytes_that_are_not_framed_are_refused(data: bytes) -> None:
    with pytest.raises(UndecodableMessage, match="not the Confluent wire format"):
        schema_id(data)


def test_a_framed_record_reads_back_with_the_schema_held() -> None:
    parsed = fastavro.parse_schema({"type": "record", "name": "r", "fields": [{"name": "a", "type": "string"}]})
    assert read_framed(frame(9) + avro_body(parsed, {"a": "é"}), parsed) == {"a": "é"}


@pytest.mark.parametrize("lsn", [0, 1, 0x16B3748, 0xFFFFFFFF, 0x1_00000000, 2**64 - 1])
def test_lsn_text_round_trips(lsn: int) -> None:
    assert parse_lsn(lsn_text(lsn)) == lsn


def test_lsn_text_is_postgres_notation() -> None:
    assert lsn_text(0x1_0000002A) == "1/2A" and parse_lsn("0/16B3748") == 0x16B3748
    with pytest.raises(ValueError, match="not an LSN"):
        parse_lsn("16B3748")
