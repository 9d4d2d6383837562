"""Bad input to ``headwater capture``: each a clear message, a non-zero exit, no secret printed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest

from headwater import stack
from tables.config import StackConfig
from tests.plugins.stack import free_port, free_ports, stack_dir


def capture(dsn: str, cfg: StackConfig, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable, "-m", "headwater.cli", "capture", "--on-error", "exit", "--state-dir", str(tmp_path / "st"),
        "--bootstrap", cfg.bootstrap, "--registry-url", cfg.registry_url, "--slot", "bad_input",
        "--publication", "bad_input", "--metrics-port", str(free_port()), *extra,
    ]  # fmt: skip (a free metrics port: the default, 9188, may be a running capture's)
    env = {**os.environ, "HEADWATER_CAPTURE_DSN": dsn}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_wrong_password_is_named_and_never_printed(local_stack: StackConfig, tmp_path: Path) -> None:
    dsn = local_stack.dsn().replace("password=headwater", "password=Wr0ngSecret")
    result = capture(dsn, local_stack, tmp_path)
    assert result.returncode == 1
    assert "cannot connect to PostgreSQL" in result.stderr and "password authentication failed" in result.stderr
    assert "Wr0ngSecret" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_role_without_replication(local_stack: StackConfig, pg_database: str, tmp_path: Path) -> None:
    admin = psycopg2.connect(pg_database)
    admin.autocommit = True
    role = "reader_" + os.urandom(3).hex()
    with admin.cursor() as cur:
        cur.execute("CREATE TABLE t (id int PRIMARY KEY)")
        cur.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw' NOREPLICATION; GRANT SELECT ON t TO {role}")
    dsn = pg_database.replace(f"user={local_stack.postgres_user}", f"user={role}").replace(
        "password=headwater", "password=pw"
    )
    try:
        result = capture(dsn, local_stack, tmp_path)
    finally:
        with admin.cursor() as cur:
            cur.execute(f"REVOKE ALL ON t FROM {role}; DROP ROLE {role}")
        admin.close()
    assert result.returncode == 1
    assert f"role '{role}' may not replicate" in result.stderr and "WITH REPLICATION" in result.stderr


def test_unknown_table_pattern(local_stack: StackConfig, pg_database: str, tmp_path: Path) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE t (id int PRIMARY KEY)")
    conn.close()
    result = capture(pg_database, local_stack, tmp_path, "--include", "public.t,public.no_such_table")
    assert result.returncode == 1
    assert "include pattern 'public.no_such_table' matches no table" in result.stderr


def test_registry_unreachable(local_stack: StackConfig, pg_database: str, tmp_path: Path) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE t (id int PRIMARY KEY)")
    conn.close()
    nowhere = f"http://127.0.0.1:{free_port()}"
    argv_cfg = stack.StackConfig(registry_port=free_port(), kafka_port=local_stack.kafka_port)
    result = capture(pg_database, argv_cfg, tmp_path, "--registry-url", nowhere, "--bootstrap", local_stack.bootstrap)
    assert result.returncode == 1
    assert f"schema registry at {nowhere} is unreachable" in result.stderr
    assert leftovers(pg_database) == (0, 0), "a failed first start leaves no publication behind"


def leftovers(dsn: str) -> tuple[int, int]:
    """(slots, publications) named ``bad_input`` in the database."""
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT (SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'bad_input'),"
                    " (SELECT count(*) FROM pg_publication WHERE pubname = 'bad_input')")  # fmt: skip
        found = cur.fetchone()
    conn.close()
    return found  # type: ignore[return-value]


def test_a_value_refused_in_the_snapshot_leaves_no_slot_or_publication(
    local_stack: StackConfig, pg_database: str, tmp_path: Path
) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE t (id int PRIMARY KEY, d date)")
        cur.execute("INSERT INTO t VALUES (1, '2024-01-01'), (2, '0044-03-15 BC')")
    conn.close()
    result = capture(pg_database, local_stack, tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "public.t.d" in result.stderr and "dates outside years 1 to 9999" in result.stderr
    assert "removed slot bad_input and publication bad_input" in result.stderr
    assert leftovers(pg_database) == (0, 0), "the slot would hold WAL forever"


class ReplicaOnly(stack.Postgres):
    """A cluster running with wal_level = replica."""

    def argv(self) -> list[str]:
        return [a.replace("wal_level=logical", "wal_level=replica") for a in super().argv()]


@pytest.fixture(scope="module")
def replica_cluster() -> Iterator[StackConfig]:
    with stack_dir() as path:
        pg, kafka, registry, redis = free_ports(4)
        cfg = StackConfig(data_dir=path, postgres_port=pg, kafka_port=kafka, registry_port=registry, redis_port=redis)
        server = ReplicaOnly(cfg)
        server.start()
        try:
            yield cfg
        finally:
            server.stop()


@pytest.mark.slow
def test_wal_level_not_logical_names_the_setting(
    replica_cluster: StackConfig, local_stack: StackConfig, tmp_path: Path
) -> None:
    result = capture(replica_cluster.dsn(), local_stack, tmp_path)
    assert result.returncode == 1
    assert "wal_level = replica" in result.stderr and "ALTER SYSTEM SET wal_level = logical" in result.stderr
