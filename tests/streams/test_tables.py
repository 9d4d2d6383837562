"""Table state at a size a test affords: 200,000 rows loaded into the worker's store on disk, served
without a 404 for a row that exists while loading, and restarts that read only what came after."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from tables.kafka import read_topic
from tests.plugins.capture import Capture
from tests.plugins.streams import Worker
from tests.streams.test_workers import Watch, wait_for

ROWS = 200_000


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def progress(worker: Worker) -> dict[str, Any]:
    return dict(worker.get("/tables/").json()["tables"][0])


def loaded(worker: Worker) -> bool:
    try:
        table = progress(worker)
    except Exception:
        return False
    return bool(table["partitions_here"]) and table["loaded"] and table["rows_here"] == ROWS


def sample_matches(conn: Any, worker: Worker, keys: list[int]) -> list[str]:
    with conn.cursor() as cur:
        cur.execute("SELECT id, v FROM big WHERE id = ANY(%s)", (keys,))
        expected = dict(cur.fetchall())
    conn.commit()
    wrong = []
    for key in keys:
        answer = worker.get(f"/tables/big/{key}")
        if answer.status_code != 200 or answer.json()["row"] != {"id": key, "v": expected[key]}:
            wrong.append(f"{key}: {answer.status_code} {answer.text[:200]}")
    return wrong


@pytest.mark.slow
def test_200k_rows_load_restart_and_kill_without_a_404_for_a_row_that_exists(
    pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE big (id int PRIMARY KEY, v text NOT NULL)")
        cur.execute("INSERT INTO big SELECT g, 'row ' || g FROM generate_series(1, %s) g", (ROWS,))
    capture = capture_factory(pg_database, include="public.big")
    capture.spawn()
    capture.wait_caught_up(pg_database, timeout=300)
    rng = random.Random(5)
    keys = rng.sample(range(1, ROWS + 1), 200)

    worker = worker_factory(capture.cfg.topic_prefix).start()  # the fan-out and the table load run together
    watches = [Watch(f"{worker.url}/tables/big/{key}") for key in keys[:4]]
    peak = 0.0
    deadline = time.monotonic() + 300
    while not loaded(worker) and time.monotonic() < deadline:
        assert worker.process is not None
        peak = max(peak, rss_mb(worker.process.pid))
        time.sleep(0.5)
    answers = [a for w in watches for a in w.stop()]
    assert loaded(worker), worker.tail()
    assert {status for status, _ in answers} <= {200, 503}, "a row that exists was answered 404 while loading"
    assert all(retry for status, retry in answers if status == 503), "a 503 without Retry-After"
    assert peak < 400, f"worker RSS {peak:.0f} MB while loading {ROWS} rows"
    assert not sample_matches(conn, worker, keys)

    with conn, conn.cursor() as cur:  # changes while the worker is away come after its stored offsets
        cur.execute("UPDATE big SET v = 'changed' WHERE id <= 1000")
    capture.wait_caught_up(pg_database)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        worker.kill(sig)
        started = time.monotonic()
        worker.start()
        assert wait_for(lambda: loaded(worker), 30, every=0.2), worker.tail()
        took = time.monotonic() - started
        assert took < 30, f"serving every key again took {took:.0f} s after {sig.name}"
        parts = progress(worker)["progress"].values()
        assert all(p["resumed_at"] > 0 for p in parts), "the store's offsets were not reused"
        assert not sample_matches(conn, worker, [*keys, *range(1, 1001, 37)])

    worker.kill(signal.SIGKILL)  # kill -9 in the middle of a fresh load, then start again
    fresh = worker_factory(capture.cfg.topic_prefix).start()
    assert wait_for(lambda: 0 < progress(fresh)["rows_here"] < ROWS, 60, every=0.05), fresh.tail()
    fresh.kill(signal.SIGKILL)
    fresh.start()
    assert wait_for(lambda: loaded(fresh), 120, every=0.5), fresh.tail()
    assert any(p["resumed_at"] > 0 for p in progress(fresh)["progress"].values()), "a killed load starts over"
    assert not sample_matches(conn, fresh, keys)
    capture.stop()
    conn.close()


def live_records(bootstrap: str, topic: str) -> dict[bytes, bytes]:
    """A table topic's live records by key bytes, as compaction leaves them."""
    latest: dict[bytes, bytes | None] = {}
    for msg in read_topic(bootstrap, topic):
        latest[msg.key] = msg.value
    return {k: v for k, v in latest.items() if v is not None}


@pytest.mark.slow
def test_a_key_column_widened_to_bigint_leaves_each_row_once_on_the_table_topic_and_in_the_faust_table(
    pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:  # fmt: skip
    """``int`` made ``bigint`` gives the table a new key schema: the fan-out moves the topic's rows to it (one
    record per row, so a later delete reaches it), and a worker killed and started again writes nothing twice.
    Made ``int`` again, the rows move back, and the endpoint finds them under the key schema they are written with
    (the registry's newest key version is still ``bigint``'s), before and after a restart."""
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE rk (id int PRIMARY KEY, v text NOT NULL)")
        cur.execute("INSERT INTO rk SELECT g, 'row ' || g FROM generate_series(1, 300) g")
    capture = capture_factory(pg_database, include="public.rk").start()
    capture.wait_caught_up(pg_database)
    worker = worker_factory(capture.cfg.topic_prefix).start()
    topic = f"{capture.cfg.topic_prefix}.rk"

    def settled(rows: int, deleted: list[int]) -> bool:
        table = progress(worker)
        answers = {k: worker.get(f"/tables/rk/{k}").status_code for k in range(1, 6)}
        return table["loaded"] and table["rows_here"] == rows and answers == {
            k: 404 if k in deleted else 200 for k in range(1, 6)}  # fmt: skip

    assert wait_for(lambda: settled(300, []), 60, every=0.2), worker.tail()
    first = {k[:5] for k in live_records(capture.cfg.bootstrap, topic)}
    with conn, conn.cursor() as cur:
        cur.execute("ALTER TABLE rk ALTER COLUMN id TYPE bigint")
    with conn, conn.cursor() as cur:
        cur.execute("UPDATE rk SET v = 'new' WHERE id = 1")
    with conn, conn.cursor() as cur:
        cur.execute("DELETE FROM rk WHERE id = 2")
    capture.wait_caught_up(pg_database)
    moved = time.monotonic()
    assert wait_for(lambda: settled(299, [2]), 120, every=0.5), f"{progress(worker)}\n{worker.tail()}"
    took = [time.monotonic() - moved]
    assert worker.get("/tables/rk/1").json()["row"] == {"id": 1, "v": "new"}
    assert worker.get("/tables/rk/3").json()["row"] == {"id": 3, "v": "row 3"}
    live = live_records(capture.cfg.bootstrap, topic)
    assert len(live) == 299 and len({k[:5] for k in live}) == 1, "every live record under the new key schema"
    assert "is keyed with key schema" in worker.log.read_text()

    worker.kill(signal.SIGKILL)
    with conn, conn.cursor() as cur:
        cur.execute("DELETE FROM rk WHERE id = 3")
    capture.wait_caught_up(pg_database)
    worker.start()
    assert wait_for(lambda: settled(298, [2, 3]), 60, every=0.2), f"{progress(worker)}\n{worker.tail()}"
    assert len(live_records(capture.cfg.bootstrap, topic)) == 298

    with conn, conn.cursor() as cur:  # back to int: the registry's newest key version stays bigint's
        cur.execute("ALTER TABLE rk ALTER COLUMN id TYPE int")
    with conn, conn.cursor() as cur:
        cur.execute("UPDATE rk SET v = 'back' WHERE id = 4")
    capture.wait_caught_up(pg_database)
    moved = time.monotonic()

    def back() -> bool:  # 1: the row the bigint key's first change wrote
        return settled(298, [2, 3]) and [worker.get(f"/tables/rk/{k}").json()["row"]["v"] for k in (1, 4)] == [
            "new", "back"]  # fmt: skip

    assert wait_for(back, 120, every=0.5), f"{progress(worker)}\n{worker.tail()}"
    took.append(time.monotonic() - moved)  # the worker running the fan-out reads keys anew at its next look (5 s)
    assert max(took) < 25, f"the endpoint found the moved rows {took} s after they were captured"
    live = live_records(capture.cfg.bootstrap, topic)
    assert len(live) == 298 and {k[:5] for k in live} == first, "every live record under the first key schema again"
    worker.kill(signal.SIGKILL)
    worker.start()
    assert wait_for(back, 60, every=0.2), f"a restarted worker reads keys as written\n{worker.tail()}"
