from typing import Any

Spec = tuple[str, bool, tuple[tuple[int, Any, Any, Any], ...]]

class Reader:
    def __init__(self, fields: tuple[Spec, ...]) -> None: ...
    def read(self, data: bytes | memoryview, start: int = 0) -> dict[str, Any]: ...

class Writer:
    def __init__(self, fields: tuple[Spec, ...]) -> None: ...
    def write(self, record: object) -> bytes | None: ...  # None for anything but a dict of the fields
