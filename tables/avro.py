"""A small Avro binary encoder compiled per schema, for the hot paths of capture and the fan-out.

Promise: ``compile_schema(schema)`` returns ``encode(value) -> bytes`` producing exactly
the Avro binary encoding of ``value`` (records given as sequences in field order, or
nested records as mappings), for the schema subset Headwater writes: primitives,
records, enums, arrays, maps, fixed, unions (null first or by value type), and the
logical types decimal (bytes), date, time-micros, timestamp-micros,
local-timestamp-micros (values already as ints) and uuid (string). It is checked
against fastavro's decoder in the tests; fastavro's generic writer costs ~10 µs per
record, this ~2 µs, which is most of capture's per-change budget. ``plain(schema)`` is a
schema without its logical types: records read with it give their raw ints and bytes, which
its compiled encoder writes back byte for byte (how a reader re-frames nested row images).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from decimal import Context, Decimal
from typing import Any

Encoder = Callable[[Any, list[bytes]], None]

_SMALL = [bytes([n]) for n in range(128)]
_TWO = [bytes([(n & 0x7F) | 0x80, n >> 7]) for n in range(1 << 14)]  # zig-zag values < 16384
_MORE = [sum(0x80 << (8 * j) for j in range(size - 1)) for size in range(9)]  # continuation bits
_FLOAT = struct.Struct("<f").pack
_DOUBLE = struct.Struct("<d").pack
_EXACT = Context(prec=1001)  # numeric has at most 1000 digits: scaling never rounds


def long_bytes(n: int) -> bytes:
    """Zig-zag varint of a signed 64-bit integer."""
    n = (n << 1) ^ (n >> 63)
    if n < 0x80:
        return _SMALL[n]
    if n < 0x4000:
        return _TWO[n]
    if n < 0x200000:
        return bytes(((n & 0x7F) | 0x80, ((n >> 7) & 0x7F) | 0x80, n >> 14))
    if n < 0x100000000000000:  # up to 8 bytes (timestamps, LSNs): spread the 7-bit groups, no loop
        x = (n & 0xFFFFFFF) | ((n & 0xFFFFFFF0000000) << 4)
        x = (x & 0x00003FFF00003FFF) | ((x & 0x0FFFC0000FFFC000) << 2)
        x = (x & 0x007F007F007F007F) | ((x & 0x3F803F803F803F80) << 1)
        size = (n.bit_length() + 6) // 7
        return (x | _MORE[size]).to_bytes(size, "little")
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _long(value: int, out: list[bytes]) -> None:
    out.append(long_bytes(value))


def _boolean(value: bool, out: list[bytes]) -> None:
    out.append(b"\x01" if value else b"\x00")


def _float(value: float, out: list[bytes]) -> None:
    out.append(_FLOAT(value))


def _double(value: float, out: list[bytes]) -> None:
    out.append(_DOUBLE(value))


def _bytes(value: bytes, out: list[bytes]) -> None:
    out.append(long_bytes(len(value)))
    out.append(value)


def _string(value: str, out: list[bytes]) -> None:
    data = value.encode("utf-8")
    out.append(long_bytes(len(data)))
    out.append(data)


def _null(value: None, out: list[bytes]) -> None:
    return None


def _decimal(scale: int) -> Encoder:
    def encode(value: Decimal, out: list[bytes]) -> None:
        unscaled = int(value.scaleb(scale, _EXACT))
        data = unscaled.to_bytes((unscaled.bit_length() + 8) // 8, "big", signed=True)
        out.append(long_bytes(len(data)))
        out.append(data)

    return encode


PRIMITIVES: dict[str, Encoder] = {
    "null": _null,
    "boolean": _boolean,
    "int": _long,
    "long": _long,
    "float": _float,
    "double": _double,
    "bytes": _bytes,
    "string": _string,
}
# which Python types a union branch accepts (checked in order)
_ACCEPTS: dict[str, tuple[type, ...]] = {
    "null": (type(None),),
    "boolean": (bool,),
    "int": (int,),
    "long": (int,),
    "float": (float, int),
    "double": (float, int),
    "bytes": (bytes, bytearray, Decimal),
    "string": (str,),
}


class _Compiler:
    def __init__(self) -> None:
        self.named: dict[str, Encoder] = {}
        self.kinds: dict[str, str] = {}

    def compile(self, schema: Any, namespace: str | None = None) -> Encoder:
        if isinstance(schema, str):
            if schema in PRIMITIVES:
                return PRIMITIVES[schema]
            full = full_name(schema, namespace)
            return self.named.get(full) or self.named[schema]
        if isinstance(schema, list):
            return self._union(schema, namespace)
        kind = schema["type"]
        if isinstance(kind, dict | list):
            return self.compile(kind, namespace)
        logical = schema.get("logicalType")
        if kind == "bytes" and logical == "decimal":
            return _decimal(int(schema.get("scale", 0)))
        if kind in PRIMITIVES:
            return PRIMITIVES[kind]
        if kind == "record":
            return self._record(schema, namespace)
        if kind == "enum":
            return self._enum(schema, namespace)
        if kind == "array":
            return self._array(self.compile(schema["items"], namespace))
        if kind == "map":
            return self._map(self.compile(schema["values"], namespace))
        if kind == "fixed":
            self._name(schema, namespace, lambda v, out: out.append(bytes(v)), "fixed")
            return self.named[_defined_name(schema, namespace)]
        raise ValueError(f"unsupported Avro type {kind!r}")

    def _name(self, schema: Mapping[str, Any], namespace: str | None, encoder: Encoder, kind: str) -> None:
        self.named[_defined_name(schema, namespace)] = encoder
        self.kinds[_defined_name(schema, namespace)] = kind

    def _record(self, schema: Mapping[str, Any], namespace: str | None) -> Encoder:
        full = _defined_name(schema, namespace)
        inner_ns = full.rpartition(".")[0] or None
        compiled: list[Encoder] = []

        def encode(value: Any, out: list[bytes]) -> None:  # until the generated one replaces it
            compiled[0](value, out)

        self._name(schema, namespace, encode, "record")
        names = [f["name"] for f in schema["fields"]]
        encoders = [self.compile(f["type"], inner_ns) for f in schema["fields"]]
        compiled.append(_generate(full, names, [f["type"] for f in schema["fields"]], encoders))
        self.named[full] = compiled[0]
        return compiled[0]

    def _enum(self, schema: Mapping[str, Any], namespace: str | None) -> Encoder:
        index = {symbol: long_bytes(i) for i, symbol in enumerate(schema["symbols"])}

        def encode(value: str, out: list[bytes]) -> None:
            out.append(index[value])

        self._name(schema, namespace, encode, "enum")
        return encode

    @staticmethod
    def _array(items: Encoder) -> Encoder:
        def encode(value: Sequence[Any], out: list[bytes]) -> None:
            if value:
                out.append(long_bytes(len(value)))
                for item in value:
                    items(item, out)
            out.append(b"\x00")

        return encode

    @staticmethod
    def _map(values: Encoder) -> Encoder:
        def encode(value: Mapping[str, Any], out: list[bytes]) -> None:
            if value:
                out.append(long_bytes(len(value)))
                for key, item in value.items():
                    _string(key, out)
                    values(item, out)
            out.append(b"\x00")

        return encode

    def _accepts(self, branch: Any) -> tuple[type, ...]:
        if isinstance(branch, dict):
            if branch.get("logicalType") == "decimal":
                return (Decimal,)
            kind = branch["type"]
            if kind in ("record", "map"):
                return (Mapping, list, tuple)
            if kind == "array":
                return (list, tuple)
            if kind == "enum" or kind == "fixed":
                return (str,) if kind == "enum" else (bytes,)
            return _ACCEPTS.get(kind, (object,))
        if isinstance(branch, str) and branch in _ACCEPTS:
            return _ACCEPTS[branch]
        named = self.kinds.get(branch) if isinstance(branch, str) else None
        return {"record": (Mapping, list, tuple), "enum": (str,), "fixed": (bytes,)}.get(named or "", (object,))

    def _union(self, branches: list[Any], namespace: str | None) -> Encoder:
        encoders = [self.compile(b, namespace) for b in branches]
        accepts = [self._accepts(b) for b in branches]
        indexes = [long_bytes(i) for i in range(len(branches))]
        if len(branches) == 2 and branches[0] == "null":  # the common nullable column
            some, tag = encoders[1], indexes[1]

            def nullable(value: Any, out: list[bytes]) -> None:
                if value is None:
                    out.append(b"\x00")
                else:
                    out.append(tag)
                    some(value, out)

            return nullable

        def encode(value: Any, out: list[bytes]) -> None:
            for i, types in enumerate(accepts):
                # bool is an int to Python, not to Avro
                if isinstance(value, types) and (not isinstance(value, bool) or bool in types or object in types):
                    out.append(indexes[i])
                    encoders[i](value, out)
                    return
            raise ValueError(f"{value!r} matches no branch of union {branches}")

        return encode


def _inline(kind: Any, var: str) -> list[str] | None:
    """Statements appending the encoding of ``var`` for simple types (None: call the encoder)."""
    if kind in ("int", "long"):
        return [f"a(lb({var}))"]
    if kind == "string":
        return [f"d = {var}.encode('utf-8')", "a(lb(len(d)))", "a(d)"]
    if kind == "bytes":
        return [f"a(lb(len({var})))", f"a({var})"]
    if kind == "boolean":
        return [f"a(b'\\x01' if {var} else b'\\x00')"]
    if kind == "double":
        return [f"a(D({var}))"]
    if isinstance(kind, dict) and kind.get("type") in ("int", "long") and "logicalType" in kind:
        return [f"a(lb({var}))"]
    return None


def _generate(name: str, names: list[str], kinds: list[Any], encoders: list[Encoder]) -> Encoder:
    """A record encoder as straight-line Python: sequences by position, mappings by name."""
    body: list[str] = []
    for i, (kind, field_name) in enumerate(zip(kinds, names, strict=True)):
        body.append(f"x = v[{i}] if seq else v.get({field_name!r})")
        if isinstance(kind, list) and len(kind) == 2 and kind[0] == "null" and _inline(kind[1], "x") is not None:
            body.append("if x is None:")
            body.append("    a(b'\\x00')")
            body.append("else:")
            body.append("    a(b'\\x02')")
            body.extend("    " + line for line in _inline(kind[1], "x") or [])
        else:
            body.extend(_inline(kind, "x") or [f"e{i}(x, out)"])
    source = "def encode(v, out):\n    a = out.append\n    seq = type(v) is not dict\n"
    source += "".join(f"    {line}\n" for line in body)
    namespace: dict[str, Any] = {"lb": long_bytes, "D": _DOUBLE}
    namespace.update({f"e{i}": enc for i, enc in enumerate(encoders)})
    exec(compile(source, f"<avro record {name}>", "exec"), namespace)  # noqa: S102 - generated from a schema
    return namespace["encode"]


def compile_schema(schema: Any) -> Callable[[Any], bytes]:
    """``encode(value) -> bytes`` for ``schema`` (a parsed JSON Avro schema)."""
    root = _Compiler().compile(schema)

    def encode(value: Any) -> bytes:
        out: list[bytes] = []
        root(value, out)
        return b"".join(out)

    return encode


def plain(schema: Any) -> Any:
    """The schema with every ``logicalType`` removed (values decode to raw ints and bytes)."""
    if isinstance(schema, list):
        return [plain(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: plain(v) for k, v in schema.items() if k != "logicalType"}
    if "logicalType" in schema:
        out.pop("precision", None)
        out.pop("scale", None)
    return out


NAMED = frozenset({"record", "error", "enum", "fixed"})


def full_name(name: str, namespace: str | None) -> str:
    """A named type's full name: ``name`` as is when dotted or without ``namespace``, else ``namespace.name``."""
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _defined_name(node: Mapping[str, Any], namespace: str | None) -> str:
    return full_name(node["name"], node.get("namespace", namespace))


def walk_named(schema: Any, visit: Callable[[dict[str, Any], str], None], namespace: str | None = None) -> None:
    """Call ``visit(definition, full name)`` on every named type ``schema`` defines, in order, each before
    its fields are walked (so ``visit`` may check a definition before its fields are read)."""
    if isinstance(schema, list):
        for branch in schema:
            walk_named(branch, visit, namespace)
    elif isinstance(schema, dict):
        kind = schema.get("type")
        if kind in NAMED:
            full = _defined_name(schema, namespace)
            visit(schema, full)
            for f in schema.get("fields", ()):
                walk_named(f["type"], visit, full.rpartition(".")[0] or None)
        elif kind == "array":
            walk_named(schema["items"], visit, namespace)
        elif kind == "map":
            walk_named(schema["values"], visit, namespace)
        elif isinstance(kind, dict | list):
            walk_named(kind, visit, namespace)


def named_types(schema: Any) -> dict[str, Any]:
    """Every named type ``schema`` defines, by full name (the first definition of each)."""
    found: dict[str, Any] = {}
    walk_named(schema, lambda node, full: found.setdefault(full, node))
    return found


def define_once(schema: Any, known: Mapping[str, Any] | None = None) -> Any:
    """``schema`` with every named type defined at its first use and named (by full name) after it, as
    Avro requires; ``known`` (full name -> definition) gives the definitions of names used before or
    without one, so a record taken out of a larger schema stands alone again."""
    return _Once(dict(known or named_types(schema))).walk(schema, None)


class _Once:
    def __init__(self, known: dict[str, Any]) -> None:
        self.known, self.seen = known, set[str]()

    def walk(self, node: Any, namespace: str | None) -> Any:
        if isinstance(node, list):
            return [self.walk(branch, namespace) for branch in node]
        if isinstance(node, str):
            full = full_name(node, namespace)
            found = self.known.get(full, self.known.get(node))
            return node if found is None or full in self.seen or node in self.seen else self.walk(found, namespace)
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind in NAMED:
            return self.named(node, namespace)
        if kind == "array":
            return {**node, "items": self.walk(node["items"], namespace)}
        if kind == "map":
            return {**node, "values": self.walk(node["values"], namespace)}
        if isinstance(kind, dict | list):
            return {**node, "type": self.walk(kind, namespace)}
        return node

    def named(self, node: dict[str, Any], namespace: str | None) -> Any:
        full = _defined_name(node, namespace)
        if full in self.seen:
            return full
        self.seen.add(full)
        if "fields" not in node:
            return node
        inner = full.rpartition(".")[0] or None
        return {**node, "fields": [{**f, "type": self.walk(f["type"], inner)} for f in node["fields"]]}
