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

def change_head(value: bytes) -> tuple[int, str, str, bytes | None, bytes | None]: ...

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
        on_batch: Callable[[Any, list[tuple[bytes, int, str]]], None],
        batch_rows: int,
        sender: Sender | None = None,
        tail: bytes = b"\x00",
        rows: bool = False,
        nested: bool = False,
    ) -> None: ...
    def write(self, data: bytes) -> int: ...
    def finish(self) -> None: ...

class Sender:
    sent: int
    errors: int
    failure: str | None
    def __init__(
        self,
        library: str,
        settings: dict[str, str],
        topic: str,
        error: type[BaseException],
        log: Callable[[int, str], None],
    ) -> None: ...
    def send(self, value: bytes, key: bytes) -> None: ...
    def flush(self, timeout: float) -> int: ...
    def poll(self, timeout: float) -> None: ...
    def open(self) -> None: ...
    def close(self) -> None: ...
    def __len__(self) -> int: ...

def envelopes(
    head: bytes, size: bytes, rows: list[tuple[bytes | None, bytes | None]], tail: bytes, nested: bool = False
) -> list[bytes]: ...
def send_envelopes(
    sender: Sender,
    kafka_key: bytes,
    head: bytes,
    size: bytes,
    rows: list[tuple[bytes | None, bytes | None]],
    tail: bytes,
    first: int,
    nested: bool = False,
) -> None: ...
