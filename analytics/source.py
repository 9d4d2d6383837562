"""The ``headwater`` Spark data source: Headwater topics as typed DataFrames, in batches or as streams.

Promise: after ``register(spark)``, ``spark.read.format("headwater")`` with the option
``topic`` (or ``table`` = ``schema.table``, or ``view`` = a view's name) loads the topic
as a DataFrame whose columns are the Avro value's fields with Spark types (see
``analytics.types``); options ``mode`` (``changes`` | ``latest``), ``cut`` (``latest`` or a
commit LSN: a view exactly at a published cut), ``metadata``, ``bootstrap``,
``registry``, ``prefix``, ``config`` (a headwater.toml), ``task_records``, ``timeout`` and
``kafka.<librdkafka setting>``. Planning happens here (``analytics.plan``); the tasks
read with ``analytics.reader``. Both are Python: no JVM connector is needed.
``spark.readStream.format("headwater")`` takes the same options and reads the topic's
changes micro-batch by micro-batch (``analytics.stream``: starting offsets, offsets in
Spark's checkpoint, availableNow, views cut by cut).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from analytics.errors import SourceError
from analytics.plan import Request, Slice, plan, value_schema
from analytics.reader import SliceReader
from analytics.stream import stream_reader

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
        return TopicReader(self._slices(schema))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return stream_reader(self.options, self._slices(schema))

    def _slices(self, schema: StructType) -> SliceReader:
        req = Request.from_options(self.options)
        found = SliceReader(req, value_schema(req))
        if found.schema != schema:
            raise SourceError("the columns asked for are not the value schema's", topic=req.topic,
                              hint="leave out .schema(...): the columns come from the registry; if the topic's "
                                   "schema changed while the read was planned, run it again")  # fmt: skip
        return found


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
