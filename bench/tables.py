"""Tables at a real size: pgbench's data set captured, fanned out and served by one worker, in one run.

``pgbench -i -s SCALE`` (SCALE x 100,000 accounts, 10 tellers and 1 branch per scale) is
captured (``include`` = the three keyed pgbench tables) and one ``faust -A streams worker``
fans it out and loads its table store. Printed: the fan-out's own time (its counters: first
raw change to the last), the time until the endpoint serves every row (``GET /tables/`` says
every partition is loaded and holds the table's rows) and its ratio to the fan-out's (target
1.5x), the worker's peak RSS while loading (target 300 MB), the time to serve every key again
after SIGTERM and after ``kill -9`` (target 30 s), and pgbench's own load (``pgbench -c 4 -T
30``) through capture and the worker: transactions, and how long after the load ended the
endpoint held the last account written. Producer settings: capture's defaults (lz4, linger 5
ms, batches of 10,000); the fan-out's table producer (idempotent, acks=all, linger 5 ms).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg2

from bench import capture
from bench.fanout import spawn_worker
from headwater import stack

PORT = 26067
TABLES = "public.pgbench_accounts,public.pgbench_branches,public.pgbench_tellers"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Peak:
    """The peak RSS of a process (``pid()``: the one running now, after a restart too), sampled twice a second."""

    def __init__(self, pid: Callable[[], int]) -> None:
        self.pid, self.peak, self.stop = pid, 0.0, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self.peak = max(self.peak, rss_mb(self.pid()))
            except OSError:
                continue  # killed by a fault: its successor is sampled next

    def take(self) -> float:
        """The peak so far, and start over."""
        peak, self.peak = self.peak, 0.0
        return peak


def get(path: str) -> Any:
    try:
        return httpx.get(f"http://127.0.0.1:{PORT}{path}", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None


def served(rows: int) -> bool:
    """The endpoint says every table is loaded and the worker holds ``rows`` rows."""
    answer = get("/tables/")
    if not answer:
        return False
    tables = answer["tables"]
    return all(t["loaded"] for t in tables) and sum(t["rows_here"] for t in tables) == rows


def pgbench(cfg: stack.StackConfig, *args: str) -> str:
    argv = [str(capture.bindir() / "pgbench"), "-h", cfg.host, "-p", str(cfg.postgres_port),
            "-U", cfg.postgres_user, *args, cfg.database]  # fmt: skip
    env = {**os.environ, "PGPASSWORD": cfg.postgres_password.reveal()}
    return subprocess.run(argv, check=True, env=env, capture_output=True, text=True).stdout


def start_capture(cfg: stack.StackConfig, dsn: str, work: Path) -> subprocess.Popen[bytes]:
    argv = capture.capture_argv(cfg, "pgb", "bench_tables", work / "state-tables", "--include", TABLES)
    argv[argv.index("--publication") + 1] = "bench_tables"
    log = (work / "capture-tables.log").open("ab")
    return subprocess.Popen(argv, env={**os.environ, "HEADWATER_CAPTURE_DSN": dsn}, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip


def load(proc: subprocess.Popen[bytes], rows: int, work: Path, timeout: float = 3600) -> tuple[float, float, float]:
    """(seconds until the fan-out counted every change, seconds until every row is served, peak RSS MB)."""
    started = time.monotonic()
    fanned, peak = 0.0, 0.0
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited:\n{(work / 'worker.log').read_text(errors='replace')[-3000:]}")
        peak = max(peak, rss_mb(proc.pid))
        counters = get("/fanout/") or {}
        if not fanned and counters.get("changes", 0) >= rows + 1:  # the rows and SNAPSHOT_END
            fanned = time.monotonic() - started
        if fanned and served(rows):
            return fanned, time.monotonic() - started, peak
        time.sleep(0.1)
    raise RuntimeError("the worker did not serve every row in time")


def restart(cfg: stack.StackConfig, work: Path, proc: subprocess.Popen[bytes], sig: int, rows: int
            ) -> tuple[subprocess.Popen[bytes], float]:  # fmt: skip
    proc.send_signal(sig)
    proc.wait(timeout=120)
    started = time.monotonic()
    proc = spawn_worker(cfg, work, "pgb", PORT)
    while not served(rows):
        if proc.poll() is not None or time.monotonic() - started > 600:
            raise RuntimeError(f"worker did not serve again:\n{(work / 'worker.log').read_text()[-3000:]}")
        time.sleep(0.05)
    return proc, time.monotonic() - started


def steady_load(cfg: stack.StackConfig, dsn: str, rows: int) -> tuple[str, float]:
    """pgbench -c 4 -T 30, then seconds from its end until the endpoint shows the last account it wrote."""
    out = pgbench(cfg, "-c", "4", "-j", "2", "-T", "30", "-n")
    ended = time.monotonic()
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT aid, abalance FROM pgbench_accounts WHERE aid = (SELECT aid FROM pgbench_history"
                    " ORDER BY mtime DESC LIMIT 1)")  # fmt: skip
        aid, balance = cur.fetchone()  # type: ignore[misc]
    conn.close()
    while (get(f"/tables/pgbench_accounts/{aid}") or {}).get("row", {}).get("abalance") != balance:
        if time.monotonic() - ended > 600:
            raise RuntimeError("the last account written never reached the endpoint")
        time.sleep(0.05)
    tps = next((line for line in out.splitlines() if line.startswith("tps")), "tps ?")
    return tps, time.monotonic() - ended


def main(scale: int) -> None:
    with capture.seeded_stack() as (cfg, dsn, work):
        print(f"pgbench -i -s {scale} ...", flush=True)
        pgbench(cfg, "-i", "-s", str(scale), "-q")
        rows = scale * (100_000 + 10 + 1)
        cap = start_capture(cfg, dsn, work)
        try:
            capture.wait_confirmed(dsn, "bench_tables", cap)
            worker = spawn_worker(cfg, work, "pgb", PORT)
            fanned, tables, peak = load(worker, rows, work)
            resident = rss_mb(worker.pid)
            worker, after_term = restart(cfg, work, worker, signal.SIGTERM, rows)
            worker, after_kill = restart(cfg, work, worker, signal.SIGKILL, rows)
            tps, lag = steady_load(cfg, dsn, rows)
            worker.terminate()
            worker.wait(timeout=120)
        finally:
            cap.terminate()
            cap.wait(timeout=120)
    print(f"\ntables: pgbench -s {scale}, {rows} rows, one worker, {os.cpu_count()} cores")
    print(f"  fan-out (its counters: every raw change routed):  {fanned:7.1f} s  {rows / fanned:9.0f} rows/s")
    print(f"  endpoint serves every row:                         {tables:7.1f} s  {rows / tables:9.0f} rows/s")
    print(f"  ratio: {tables / fanned:.2f}x the fan-out's time (target <= 1.5x)")
    print(f"  worker RSS: peak {peak:.0f} MB while loading, {resident:.0f} MB loaded (target <= 300 MB)")
    print(
        f"  serves every key again after SIGTERM: {after_term:.1f} s, after kill -9: {after_kill:.1f} s (target 30 s)"
    )
    print(f"  pgbench -c 4 -T 30 through capture and the worker: {tps}; the last account written was served")
    print(f"  {lag:.1f} s after the load ended")
