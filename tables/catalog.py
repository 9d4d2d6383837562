"""The shape of a captured table: columns, key, topic name and Avro key/value schemas.

Promise: pure. ``TableSchema.build`` turns a table's columns (as pgoutput's Relation
message and the catalog describe them) into the Avro schemas registered for its
topic and the converters that turn PostgreSQL's text output into Avro values. Two
builds of the same columns give equal schemas, so a schema change is exactly a
change of ``value_schema``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tables.topics import table_topic
from tables.types import Converter, PgType, avro_name
from tables.types import field as avro_field


@dataclass(frozen=True)
class ColumnInfo:
    name: str
    pgtype: PgType
    typmod: int
    nullable: bool
    is_key: bool


@dataclass(frozen=True)
class TableSchema:
    schema: str
    name: str
    topic: str
    columns: tuple[ColumnInfo, ...]
    key_schema: dict[str, Any] | None
    value_schema: dict[str, Any]
    converters: tuple[Converter, ...] = field(compare=False, repr=False)
    field_names: tuple[str, ...] = field(compare=False, repr=False)

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def key_indexes(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.columns) if c.is_key)

    @classmethod
    def build(cls, prefix: str, schema: str, name: str, columns: Sequence[ColumnInfo]) -> TableSchema:
        namespace = f"headwater.{avro_name(schema)}"
        seen: set[str] = set()
        fields, converters = [], []
        for col in columns:
            entry, conv = avro_field(
                col.name, col.pgtype, col.typmod, nullable=col.nullable and not col.is_key, seen=seen
            )
            fields.append(entry)
            converters.append(conv)
        value = {
            "type": "record",
            "name": avro_name(name),
            "namespace": namespace,
            "fields": fields,
            "pg.table": f"{schema}.{name}",
        }
        key_fields = [fields[i] for i, c in enumerate(columns) if c.is_key]
        key = (
            {"type": "record", "name": f"{avro_name(name)}_key", "namespace": namespace, "fields": key_fields}
            if key_fields
            else None
        )
        return cls(
            schema=schema,
            name=name,
            topic=table_topic(prefix, schema, name),
            columns=tuple(columns),
            key_schema=key,
            value_schema=value,
            converters=tuple(converters),
            field_names=tuple(f["name"] for f in fields),
        )
