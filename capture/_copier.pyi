"""Types of the compiled ``capture._copier`` (see ``capture/_copier.c``)."""

from collections.abc import Callable
from typing import Any

LONG: int
STRING: int
DECIMAL: int
TIMESTAMP: int
DATE: int
ENUM: int
BOOL: int
DOUBLE: int
OTHER: int
TOAST_MIN: int

class Copier:
    position: int
    rows: int
    fast: int
    def __init__(
        self,
        columns: list[tuple[int, bool, bool, bool, int, tuple[bytes, ...], Callable[[bytes], bytes]]],
        value_prefix: bytes,
        key_prefix: bytes | None,
        head: bytes,
        size: bytes,
        kafka_key: bytes,
        position: int,
        stride: int,
        fallback: Callable[[bytes], tuple[bytes, bytes | None, list[tuple[int, str]] | None]],
        on_batch: Callable[[list[dict[str, Any]], list[tuple[bytes, int, str]]], None],
        batch_rows: int,
    ) -> None: ...
    def write(self, data: bytes) -> int: ...
    def finish(self) -> None: ...
