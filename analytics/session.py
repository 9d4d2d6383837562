"""The Spark session Headwater's jobs run in, with the ``headwater`` data source registered.

Promise: ``spark_session(cfg)`` builds (or reuses) a session on ``cfg.master`` whose
Python workers run this interpreter, whose SQL time zone is UTC (dates of timestamps
are UTC dates, as in the topics), and which binds to 127.0.0.1 with its web UI off
when the master is local — nothing listens beyond this machine unless the ``spark``
settings say so. The JVM logs warnings and errors only (``log4j2.properties``).
Spark's scratch files (shuffle blocks hold table rows; the JVM's own temporary files) go
to a directory of this process's, readable by its owner only and removed when the process
exits, unless the ``spark`` settings name a ``spark.local.dir`` (Spark's default, the
shared ``/tmp``, makes them world-readable and leaves directories behind). A process killed
before its exit cannot remove its directory; the next session made on this machine removes
it: each directory's ``.lock`` is held (``flock``) by its process while it lives, so a lock
that can be taken names a directory whose process is gone.
``cfg.spark`` settings are applied last.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import IO

from pyspark.sql import SparkSession

from analytics.config import AnalyticsConfig
from analytics.source import register

LOCAL_DEFAULTS = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
}
LOG4J = f"-Dlog4j2.configurationFile={resources.files('analytics') / 'log4j2.properties'}"
DEFAULTS = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.shuffle.partitions": "8",
    "spark.ui.showConsoleProgress": "false",
    "spark.pyspark.python": sys.executable,
    "spark.pyspark.driver.python": sys.executable,
    "spark.driver.extraJavaOptions": LOG4J,
}
SCRATCH = "headwater-spark-"
_HELD: list[IO[bytes]] = []  # the locks of this process's scratch directories, held until it exits


def spark_session(cfg: AnalyticsConfig, app_name: str = "headwater") -> SparkSession:
    local = cfg.master.startswith("local")
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # no "hostname resolves to a loopback" warning
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.master(cfg.master).appName(app_name)
    scratch = {} if "spark.local.dir" in cfg.spark or SparkSession.getActiveSession() else _scratch()
    for key, value in {**DEFAULTS, **(LOCAL_DEFAULTS if local else {}), **scratch, **cfg.spark}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("HEADWATER_SPARK_LOG_LEVEL", "ERROR"))
    register(spark)
    return spark


def _scratch() -> dict[str, str]:
    """A private directory for Spark's local files and the driver JVM's temporary ones, removed at exit."""
    sweep(Path(tempfile.gettempdir()))
    path = tempfile.mkdtemp(prefix=SCRATCH)  # mode 0700
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    _HELD.append(_hold(Path(path)))
    return {"spark.local.dir": path, "spark.driver.extraJavaOptions": f"{LOG4J} -Djava.io.tmpdir={path}"}


def _hold(path: Path) -> IO[bytes]:
    """Lock ``path/.lock`` for this process's life: locked before it has its name, so no sweep sees it free."""
    lock = (path / ".lock-new").open("wb")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    (path / ".lock-new").rename(path / ".lock")
    return lock


def sweep(tmp: Path) -> list[Path]:
    """Remove the scratch directories under ``tmp`` of this user's processes that are gone (killed before exit)."""
    gone = [d for d in tmp.glob(f"{SCRATCH}*") if d.is_dir() and d.stat().st_uid == os.getuid() and _free(d)]
    for directory in gone:
        shutil.rmtree(directory, ignore_errors=True)
    return gone


def _free(directory: Path) -> bool:
    """Whether ``directory``'s lock can be taken: the process that held it is gone."""
    try:
        with (directory / ".lock").open("rb") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (FileNotFoundError, BlockingIOError):
        return False  # not locked yet (just made, or made before locks) or held by a live process
    return True
