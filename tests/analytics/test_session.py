"""The Spark session users' jobs run in: its scratch files stay private to its owner."""

from __future__ import annotations

import signal
import stat
import subprocess
import sys
from pathlib import Path

from pyspark.sql import SparkSession

from analytics.session import SCRATCH, sweep
from tests.plugins.streams import REPO

HOLD = """import sys, time
from pathlib import Path
from analytics.session import _hold
lock = _hold(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(600)
"""


def test_spark_scratch_files_go_to_a_directory_only_its_owner_reads(spark: SparkSession) -> None:
    """Shuffle blocks (table rows) and the driver JVM's temporary files land in the session's own directory,
    mode 0700, not in the shared /tmp where Spark's default leaves them world-readable."""
    local = Path(spark.conf.get("spark.local.dir") or "")
    assert local.name.startswith("headwater-spark-"), local
    assert stat.S_IMODE(local.stat().st_mode) == 0o700
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    assert Path(jvm.System.getProperty("java.io.tmpdir")) == local
    frame = spark.range(20_000).selectExpr("id % 97 AS k", "id AS v").groupBy("k").sum("v")
    assert frame.count() == 97  # a shuffle: Spark's block manager writes under spark.local.dir
    assert any(p.name.startswith("blockmgr-") for p in local.iterdir()), sorted(p.name for p in local.iterdir())


def test_a_killed_process_s_scratch_directory_is_removed_by_the_next_sweep_a_live_one_is_kept(
    tmp_path: Path,
) -> None:  # fmt: skip
    """A job killed -9 cannot remove its scratch (table rows in shuffle blocks); the next session's sweep does,
    and leaves a live process's directory and one not yet locked alone."""
    killed, live, unlocked = (tmp_path / f"{SCRATCH}{name}" for name in ("killed", "live", "unlocked"))
    for directory in (killed, live, unlocked):
        directory.mkdir(mode=0o700)
        (directory / "blockmgr-rows").write_bytes(b"table rows")
    holders = [subprocess.Popen([sys.executable, "-c", HOLD, str(d)], stdout=subprocess.PIPE, cwd=REPO)
               for d in (killed, live)]  # fmt: skip
    try:
        assert all(h.stdout and h.stdout.readline() == b"held\n" for h in holders)
        assert sweep(tmp_path) == []  # both held
        holders[0].send_signal(signal.SIGKILL)
        holders[0].wait(10)
        assert sweep(tmp_path) == [killed]
        assert not killed.exists() and (live / "blockmgr-rows").exists() and (unlocked / "blockmgr-rows").exists()
    finally:
        for holder in holders:
            holder.kill()
            holder.communicate(timeout=10)
