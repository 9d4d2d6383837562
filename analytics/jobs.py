"""The batch jobs ``headwater analytics <job>`` runs, and how their failures read.

Promise: every job reads Headwater topics through the ``headwater`` data source only,
prints its result as a table and writes it as Parquet under ``cfg.output/<job>``; ``output``
makes that directory, when missing, readable by its owner only (the Parquet holds table data,
and Spark writes its files world-readable under the usual umask).
``shop-report``: revenue, orders and units by day (UTC), customer region and product
category, from the ``orders_enriched`` view read exactly at its newest cut (so no
source transaction is half in it); cancelled orders do not count. ``REPORT_SQL`` is the
same report as one PostgreSQL query (tests compare the two). ``tables``: the latest
state of every table topic under the prefix, one Parquet dataset per table.
``explain`` turns an error Spark relays from a task into the ``HeadwaterError`` it was.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from analytics.config import AnalyticsConfig
from analytics.errors import SourceError
from analytics.plan import Cut, Request, find_cut, plan
from tables.errors import FatalError, HeadwaterError, RetryableError
from tables.registry import Registry, shown
from tables.topics import table_topic_of_subject

REPORT_VIEW = "orders_enriched"
REPORT_SQL = """
SELECT (o.placed_at AT TIME ZONE 'UTC')::date AS day, c.region, p.category,
       sum(i.quantity * i.unit_price) AS revenue, count(DISTINCT o.id) AS orders, sum(i.quantity) AS units
FROM orders o
LEFT JOIN customers c ON c.id = o.customer_id
JOIN order_items i ON i.order_id = o.id
LEFT JOIN products p ON p.id = i.product_id
WHERE o.status <> 'cancelled'
GROUP BY 1, 2, 3
ORDER BY 1, 2 NULLS FIRST, 3 NULLS FIRST
"""


@dataclass(frozen=True)
class Result:
    """What a job produced: the rows it printed and where the Parquet went."""

    title: str
    frame: DataFrame
    path: Path


def read(spark: SparkSession, cfg: AnalyticsConfig, **options: str) -> DataFrame:
    """A Headwater topic as a DataFrame, with the config's broker, registry and Kafka settings."""
    return spark.read.format("headwater").options(**cfg.source_options(), **options).load()


def report_cut(cfg: AnalyticsConfig, view: str = REPORT_VIEW) -> Cut:
    """The newest cut of a view (by default the report's)."""
    return find_cut(Request.from_options({**cfg.source_options(), "view": view, "cut": "latest"}))


def view_at_rest(cfg: AnalyticsConfig, view: str = REPORT_VIEW) -> bool:
    """The view's newest cut reaches the end of every partition of its topic (nothing published after it)."""
    try:
        cut = report_cut(cfg, view)
    except SourceError:
        return False
    planned = plan(Request.from_options({**cfg.source_options(), "view": view}))
    return all(cut.ends.get(s.partition, 0) >= s.end for s in planned)


def shop_report_frame(spark: SparkSession, cfg: AnalyticsConfig, cut: Cut) -> DataFrame:
    orders = read(spark, cfg, view=REPORT_VIEW, cut=str(cut.commit_lsn))
    return report_of(contributions(orders))


def contributions(orders: DataFrame) -> DataFrame:
    """Each order item's part of the report: (id, day, region, category, revenue, units); cancelled orders none."""
    items = orders.where(F.col("status") != "cancelled").select(
        F.col("id"), F.to_date("placed_at").alias("day"), F.col("customer.region").alias("region"),
        F.explode("items").alias("item"),
    )  # fmt: skip
    return items.select(
        "id", "day", "region", F.col("item.product.category").alias("category"),
        (F.col("item.quantity") * F.col("item.unit_price")).alias("revenue"), F.col("item.quantity").alias("units"),
    )  # fmt: skip


def report_of(parts: DataFrame) -> DataFrame:
    """The report from its ``contributions``: revenue, orders and units by day, region and category."""
    return (
        parts.groupBy("day", "region", "category")
        .agg(F.sum("revenue").alias("revenue"), F.countDistinct("id").alias("orders"), F.sum("units").alias("units"))
        .orderBy("day", "region", "category")
    )


def output(cfg: AnalyticsConfig) -> Path:
    """``cfg.output``, made with mode 0700 if missing (a directory the user made is left as it is)."""
    cfg.output.mkdir(mode=0o700, parents=True, exist_ok=True)
    return cfg.output


def shop_report(spark: SparkSession, cfg: AnalyticsConfig) -> list[Result]:
    cut = report_cut(cfg)
    frame = shop_report_frame(spark, cfg, cut).cache()
    path = output(cfg) / "shop-report"
    frame.write.mode("overwrite").parquet(str(path))
    title = f"revenue by day, region and category from {cut.topic} at commit LSN {cut.lsn}"
    return [Result(title, frame, path)]


def table_topics(cfg: AnalyticsConfig) -> list[str]:
    """Topics under the prefix with a registered value schema, except the raw, view and internal ones."""
    found = (table_topic_of_subject(cfg.topic_prefix, s) for s in Registry(cfg.registry_url).subjects())
    return sorted(t for t in found if t is not None)


def tables(spark: SparkSession, cfg: AnalyticsConfig) -> list[Result]:
    out, base = [], output(cfg) / "tables"
    for topic in table_topics(cfg):
        frame = read(spark, cfg, topic=topic, mode="latest").cache()
        path = base / topic
        frame.write.mode("overwrite").parquet(str(path))
        out.append(Result(f"{topic}: {frame.count()} rows (latest state)", frame.limit(5), path))
    if not out:
        raise FatalError(f"no table topics under the prefix {cfg.topic_prefix!r} in {shown(cfg.registry_url)}",
                         hint="run capture first, or set topic_prefix in [pipeline] or [analytics]")  # fmt: skip
    return out


JOBS: dict[str, Callable[[SparkSession, AnalyticsConfig], list[Result]]] = {
    "shop-report": shop_report,
    "tables": tables,
}  # described in analytics.config.JOB_HELP


def show(result: Result, rows: int = 50) -> str:
    """The result as a text table (at most ``rows`` rows), with its title and Parquet path."""
    frame = result.frame
    names = frame.columns
    data = [[_cell(v) for v in row] for row in frame.limit(rows).collect()]
    widths = [max([len(n)] + [len(r[i]) for r in data]) for i, n in enumerate(names)]
    lines = [result.title, "  ".join(n.ljust(w) for n, w in zip(names, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths, strict=True))
              for r in data]  # fmt: skip
    lines.append(f"written to {result.path}")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    text = "null" if value is None else str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _numeric(text: str) -> bool:
    return bool(re.fullmatch(r"-?[0-9.]+", text))


ERROR_LINE = re.compile(r"^(?:analytics|headwater)\.errors\.(\w+): (.*)$", re.MULTILINE)


def explain(exc: Exception) -> HeadwaterError | None:
    """The Headwater error a Spark exception relays from a Python worker, if it is one."""
    text = str(exc)
    found = list(ERROR_LINE.finditer(text))
    if not found:
        return None
    last = found[-1]
    hint = re.match(r"\n  hint: (.*)", text[last.end() :])
    kind = {"SourceUnavailable": RetryableError, "RetryableError": RetryableError}.get(last.group(1), FatalError)
    return kind(last.group(2), hint=hint.group(1) if hint else None)
