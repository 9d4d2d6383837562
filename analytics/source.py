"""The ``headwater`` Spark data source: Headwater topics as typed DataFrames.

Promise: after ``register(spark)``, ``spark.read.format("headwater")`` with the option
``topic`` (or ``table`` = ``schema.table``, or ``view`` = a view's name) loads the topic
as a DataFrame whose columns are the Avro value's fields with Spark types (see
``analytics.types``); options ``mode`` (``changes`` | ``latest``), ``cut`` (``latest`` or a
commit LSN: a view exactly at a published cut), ``metadata``, ``bootstrap``,
``registry``, ``prefix``, ``config`` (a headwater.toml), ``task_records``, ``timeout`` and
``kafka.<librdkafka setting>``. Planning happens here (``analytics.plan``); the tasks
read with ``analytics.reader``. Both are Python: no JVM connector is needed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import StructType

from analytics.errors import SourceError
from analytics.plan import Request, Slice, plan, value_schema
from analytics.reader import SliceReader

NAME = "headwater"


class HeadwaterSource(DataSource):
    """``spark.read.format("headwater")``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType:
        req = Request.from_options(self.options)
        return SliceReader(req, value_schema(req)).schema

    def reader(self, schema: StructType) -> DataSourceReader:
        req = Request.from_options(self.options)
        found = SliceReader(req, value_schema(req))
        if found.schema != schema:
            raise SourceError("the columns asked for are not the value schema's", topic=req.topic,
                              hint="leave out .schema(...): the columns come from the registry; if the topic's "
                                   "schema changed while the read was planned, run it again")  # fmt: skip
        return TopicReader(found)


class TopicReader(DataSourceReader):
    """Partitions fixed on the driver, one task per slice."""

    def __init__(self, slices: SliceReader) -> None:
        self.slices = slices

    def partitions(self) -> Sequence[InputPartition]:
        planned = plan(self.slices.req)
        return planned or [Slice(self.slices.req.topic, 0, 0, 0)]  # an empty topic: one task, no rows

    def read(self, partition: Any) -> Iterator[pa.RecordBatch]:
        if partition.end > partition.start:
            yield from self.slices.read(partition)


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("headwater")`` available in this session."""
    spark.dataSource.register(HeadwaterSource)
