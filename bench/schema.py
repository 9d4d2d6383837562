"""A key column's type change and a TRUNCATE at a real size: pgbench's accounts moved to a new key, then emptied.

``pgbench -i -s SCALE`` is captured and served by one worker, as in ``bench.tables``; its first load (the fan-out's
own time for every row) is the baseline the rest is a ratio of, in the same run. Then ``ALTER TABLE
pgbench_accounts ALTER COLUMN aid TYPE bigint`` gives the table a new key schema, and ``pgbench -c 2 -R 200 -T
60`` runs: the fan-out moves every account to the new key (``streams.fanout.Rekey``). Printed: the move's read
and write times (the worker's log), the statuses of random accounts asked for from the ``ALTER`` on (every one
exists: a 404 is wrong), when every account was served under its new key with 300 sampled accounts and
the last one written equal to PostgreSQL, the worker's peak RSS, and the records on the table topic afterwards
(each account once, all under the new key schema). Then ``aid`` is made ``integer`` again, under the same load: the
key schema is the first one again (the registry answers its id; its newest version stays ``bigint``'s), the rows move
back, and the same is printed (the endpoint must read keys with the first key schema for the accounts to be served).
Then ``TRUNCATE pgbench_accounts``: the time until the worker holds no account, and its peak RSS.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen, TimeoutExpired

import httpx
import psycopg2

from bench import capture
from bench import tables as bt
from bench.fanout import spawn_worker
from headwater import stack
from tables.kafka import read_on_batches

ACCOUNTS = "pgbench_accounts"
MOVED = re.compile(r"(\d+) records moved its rows to key schema \d+ \(the topic read in ([\d.]+) s, the moves "
                   r"written in ([\d.]+) s\)")  # fmt: skip


def accounts_held() -> int | None:
    answer = bt.get("/tables/") or {}
    return next((t["rows_here"] for t in answer.get("tables", []) if t["name"] == ACCOUNTS), None)


def equal(rows: list[tuple[int, int]]) -> bool:
    return all((bt.get(f"/tables/{ACCOUNTS}/{aid}") or {}).get("row", {}).get("abalance") == b for aid, b in rows)


def sampled(cur: psycopg2.extensions.cursor) -> list[tuple[int, int]]:
    cur.execute("SELECT aid, abalance FROM pgbench_accounts ORDER BY random() LIMIT 300")
    rows = cur.fetchall()
    cur.execute("SELECT aid, abalance FROM pgbench_accounts WHERE aid = (SELECT aid FROM pgbench_history "
                "ORDER BY mtime DESC LIMIT 1)")  # fmt: skip
    return rows + cur.fetchall()


def wait_for(done: Callable[[], bool], worker: Popen[bytes], work: Path, timeout: float = 1800) -> float:
    started = time.monotonic()
    while not done():
        if worker.poll() is not None:
            raise RuntimeError(f"worker exited:\n{(work / 'worker.log').read_text(errors='replace')[-3000:]}")
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"not done in {timeout:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - started


class Prober:
    """Random accounts asked for, five a second, while a move runs: every one exists, so a 404 is a wrong answer
    (503 with ``Retry-After`` is the endpoint saying to ask again). Their statuses, counted."""

    def __init__(self, rows: int) -> None:
        self.statuses: Counter[int] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(rows,), daemon=True)
        self.thread.start()

    def _run(self, rows: int) -> None:
        rng = random.Random(7)
        with httpx.Client(timeout=5) as client:
            while not self.stop.wait(0.2):
                try:
                    status = client.get(f"http://127.0.0.1:{bt.PORT}/tables/{ACCOUNTS}/{rng.randint(1, rows)}")
                    self.statuses[status.status_code] += 1
                except httpx.HTTPError:
                    self.statuses[0] += 1

    def take(self) -> Counter[int]:
        self.stop.set()
        self.thread.join()
        return self.statuses


def topic_keys(cfg: stack.StackConfig) -> Counter[bytes]:
    """Live keys of the accounts' table topic, counted by key frame."""
    live: dict[bytes | None, bool] = {}
    starts = {(f"pgb.{ACCOUNTS}", p): 0 for p in range(4)}  # a whole topic: in bulk (a second move's 4.5M records
    settings = {"bootstrap.servers": f"127.0.0.1:{cfg.kafka_port}"}  # stalled a plain reader on the local broker)
    for batch in read_on_batches(settings, starts, timeout=600, bulk=True, idle=True):
        live.update((m.key(), m.value() is not None) for m in batch)
    return Counter(key[:5] for key, alive in live.items() if alive and key is not None)


def rekey(cfg: stack.StackConfig, dsn: str, work: Path, worker: Popen[bytes], rows: int, to: str
          ) -> tuple[dict[str, float], Counter[int]]:  # fmt: skip
    """``aid`` made of type ``to`` under load: the move's figures, from the worker's log (its newest move), and the
    statuses of the accounts asked for meanwhile."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True  # and no ``with conn``: psycopg2 2.9 opens a transaction there, which would hold the ALTER
    peak = bt.Peak(lambda: worker.pid)
    try:
        with conn.cursor() as cur:
            cur.execute(f"ALTER TABLE pgbench_accounts ALTER COLUMN aid TYPE {to}")
            prober = Prober(rows)
            bt.pgbench(cfg, "-c", "2", "-R", "200", "-T", "60", "-n")
            ended = time.monotonic()
            wait_for(lambda: accounts_held() == rows and equal(sampled(cur)), worker, work)
            served, most, asked = time.monotonic() - ended, peak.take(), prober.take()
    finally:
        conn.close()
        peak.stop.set()
    found = MOVED.findall((work / "worker.log").read_text(errors="replace"))
    if not found:
        raise RuntimeError("the worker logged no move")
    records, read, written = found[-1]
    figures = {"records": float(records), "read": float(read), "written": float(written), "served": served,
               "peak": most}  # fmt: skip
    return figures, asked


def truncate(dsn: str, work: Path, worker: Popen[bytes]) -> tuple[float, float, float]:
    """(seconds until the worker holds no account, RSS before, peak RSS)."""
    before, peak = bt.rss_mb(worker.pid), bt.Peak(lambda: worker.pid)
    try:
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        conn.cursor().execute("TRUNCATE pgbench_accounts")
        conn.close()
        took = wait_for(lambda: accounts_held() == 0, worker, work)
        return took, before, peak.take()
    finally:
        peak.stop.set()


def main(scale: int) -> None:
    rows = scale * 100_000
    with capture.seeded_stack() as (cfg, dsn, work):
        print(f"pgbench -i -s {scale} ...", flush=True)
        bt.pgbench(cfg, "-i", "-s", str(scale), "-q")
        cap = bt.start_capture(cfg, dsn, work)
        try:
            capture.wait_confirmed(dsn, "bench_tables", cap)
            worker = spawn_worker(cfg, work, "pgb", bt.PORT)
            try:
                fanned, _, first_peak = bt.load(worker, scale * (100_000 + 10 + 1), work)
                moves = []
                for to in ("bigint", "integer"):
                    moves.append((to, *rekey(cfg, dsn, work, worker, rows, to), topic_keys(cfg)))
                emptied = truncate(dsn, work, worker)
            finally:
                stop(worker)
        finally:
            stop(cap)
    report(scale, rows, fanned, first_peak, moves, emptied)


def stop(process: Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 60 s (before the stack goes away under it)."""
    process.terminate()
    try:
        process.wait(timeout=60)
    except TimeoutExpired:
        process.kill()
        process.wait()


def report(scale: int, rows: int, fanned: float, first_peak: float,
           moves: list[tuple[str, dict[str, float], Counter[int], Counter[bytes]]], emptied: tuple[float, float, float]
           ) -> None:  # fmt: skip
    took, before, peak = emptied
    print(f"\nschema changes: pgbench -s {scale}, {rows} accounts, one worker")
    print(f"  first load (baseline): fan-out {fanned:.1f} s, peak RSS {first_peak:.0f} MB")
    for to, moved, asked, frames in moves:
        print(f"  aid made {to}, then pgbench -R 200 for 60 s: {moved['records']:.0f} records moved, the topic read in "
              f"{moved['read']:.1f} s ({moved['read'] / fanned:.2f}x the first load), written in "
              f"{moved['written']:.1f} s ({moved['written'] / fanned:.2f}x)")  # fmt: skip
        print(f"    every account served, 300 sampled and the last written equal to PostgreSQL {moved['served']:.0f} s "
              f"after the load ended; worker peak RSS {moved['peak']:.0f} MB")  # fmt: skip
        statuses = ", ".join(f"{code}: {n}" for code, n in sorted(asked.items()))
        print(f"    random accounts asked for from the ALTER until then, by status (all exist: 404 is wrong): "
              f"{statuses}")
        by_schema = {int.from_bytes(frame[1:], "big"): n for frame, n in frames.items()}
        print(f"    the table topic's live keys, by key schema id: {by_schema}")
    print(f"  TRUNCATE {ACCOUNTS}: the worker held none {took:.1f} s after ({took / fanned:.2f}x the first load); RSS "
          f"{before:.0f} MB before, peak {peak:.0f} MB")  # fmt: skip
