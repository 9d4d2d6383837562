"""The Java default partitioner, bit for bit."""

from __future__ import annotations

import random

import pytest
from aiokafka.partitioner import murmur2 as aiokafka_murmur2

from tables.partition import murmur2, partition_for, reference_murmur2

pytestmark = pytest.mark.unit

# org.apache.kafka.common.utils.UtilsTest#testMurmur2
JAVA = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize(("data", "expected"), JAVA.items())
def test_murmur2_matches_java(data: bytes, expected: int) -> None:
    assert murmur2(data) == expected
    assert reference_murmur2(data) == expected


def test_the_compiled_murmur2_is_the_reference_for_every_length_and_buffer() -> None:
    rng = random.Random(7)
    for length in range(300):
        data = bytes(rng.randrange(256) for _ in range(length))
        assert murmur2(data) == reference_murmur2(data)
        assert murmur2(memoryview(bytearray(data))) == reference_murmur2(data)
        assert partition_for(memoryview(data), 7) == (reference_murmur2(data) & 0x7FFFFFFF) % 7


def test_partition_agrees_with_aiokafka_for_every_length() -> None:
    rng = random.Random(5)
    for length in range(64):
        data = bytes(rng.randrange(256) for _ in range(length))
        expected = (aiokafka_murmur2(data) & 0x7FFFFFFF) % 12  # what Faust's producer computes
        assert partition_for(data, 12) == expected


def test_partition_refuses_zero_partitions_and_what_is_not_bytes() -> None:
    with pytest.raises(ValueError, match="at least one partition, got 0"):
        partition_for(b"k", 0)
    with pytest.raises(TypeError):
        partition_for("k", 4)  # type: ignore[arg-type]
