"""The ``headwater`` command as a user runs it: a second stack in its own directory and ports.

Each test runs the real console command in a subprocess and checks what it leaves
behind: healthy services, or nothing at all.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.plugins.stack import free_ports, stack_dir


def headwater(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "headwater.cli", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
    )


def processes_in(directory: Path) -> list[str]:
    """Command lines of live processes whose command line or working directory is under ``directory``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(proc / "cwd")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (str(directory) in cmdline or cwd.startswith(str(directory))):
            found.append(cmdline)
    return found


@pytest.fixture
def project(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    """A directory with a headwater.toml choosing free ports and a reachable data dir."""
    with stack_dir() as data:
        pg, kafka, registry, redis, web = free_ports(5)
        (tmp_path / "headwater.toml").write_text(
            f'[stack]\ndata_dir = "{data}"\npostgres_port = {pg}\nkafka_port = {kafka}\n'
            f"registry_port = {registry}\nredis_port = {redis}\nstart_timeout = 30\n"
            f"[streams]\nweb_port = {web}\n",
            encoding="utf-8",
        )
        ports = {"postgres": str(pg), "kafka": str(kafka), "registry": str(registry), "redis": str(redis)}
        try:
            yield tmp_path, ports
        finally:
            headwater("stack", "down", cwd=tmp_path)
            assert processes_in(data) == []


@pytest.mark.slow
def test_up_twice_status_seed_down_leaves_nothing(project: tuple[Path, dict[str, str]]) -> None:
    cwd, ports = project
    first = headwater("stack", "up", cwd=cwd)
    assert first.returncode == 0, first.stderr
    assert "started: postgres, kafka, redis, registry" in first.stdout
    assert first.stdout.count("healthy") == 4
    second = headwater("stack", "up", cwd=cwd)
    assert second.returncode == 0 and "already running" in second.stdout

    status = headwater("stack", "status", cwd=cwd)
    assert status.returncode == 0
    for port in ports.values():
        assert f":{port}" in status.stdout
    assert "***" in status.stdout and "password" not in status.stdout

    seeded = headwater("demo", "seed", "--customers", "5", "--products", "3", "--orders", "4", cwd=cwd)
    assert seeded.returncode == 0, seeded.stderr
    assert "customers 5, products 3, orders 4" in seeded.stdout

    down = headwater("stack", "down", cwd=cwd)
    assert down.returncode == 0 and "stopped: registry, redis, kafka, postgres" in down.stdout
    data_dir = Path(cwd.joinpath("headwater.toml").read_text().split('"')[1])
    assert processes_in(data_dir) == []
    after = headwater("stack", "status", cwd=cwd)
    assert after.returncode == 3 and after.stdout.count("stopped") == 4


@pytest.mark.slow
def test_taken_port_fails_clearly_and_leaves_nothing_running(project: tuple[Path, dict[str, str]]) -> None:
    cwd, ports = project
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", int(ports["kafka"])))
        squatter.listen()
        result = headwater("stack", "up", cwd=cwd)
    assert result.returncode != 0
    assert f"port {ports['kafka']}" in result.stderr and "kafka" in result.stderr
    assert "--kafka-port" in result.stderr  # says how to choose another
    assert "Traceback" not in result.stderr
    data_dir = Path(cwd.joinpath("headwater.toml").read_text().split('"')[1])
    assert processes_in(data_dir) == []  # postgres, started first, was stopped again


@pytest.mark.slow
def test_service_dying_on_start_shows_its_log(project: tuple[Path, dict[str, str]]) -> None:
    cwd, _ = project
    data_dir = Path(cwd.joinpath("headwater.toml").read_text().split('"')[1])
    pgdata = data_dir / "postgres"
    pgdata.mkdir()
    (pgdata / "PG_VERSION").write_text("9\n")  # looks initialised, but is not a cluster
    result = headwater("stack", "up", cwd=cwd)
    assert result.returncode != 0
    assert "postgres failed to start: the process exited" in result.stderr
    assert "last lines of" in result.stderr and "postgres.log" in result.stderr
    assert processes_in(data_dir) == []


def test_broken_config_file_names_line_and_key(tmp_path: Path) -> None:
    (tmp_path / "headwater.toml").write_text("[stack]\nkafka_port = 19092\nregistry_port = 'x'\n")
    result = headwater("stack", "status", cwd=tmp_path)
    assert result.returncode == 2
    assert "line 3" in result.stderr and "registry_port" in result.stderr and "integer" in result.stderr
    (tmp_path / "headwater.toml").write_text("[stack\nkafka_port = 1\n")
    result = headwater("stack", "up", cwd=tmp_path)
    assert result.returncode == 2 and "line 1" in result.stderr and "not valid TOML" in result.stderr


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    result = headwater("stack", "status", "--config", str(tmp_path / "nope.toml"), cwd=tmp_path)
    assert result.returncode == 2 and "does not exist" in result.stderr


def test_unknown_command_exits_non_zero(tmp_path: Path) -> None:
    result = headwater("stak", "up", cwd=tmp_path)
    assert result.returncode == 2 and "invalid choice: 'stak'" in result.stderr
    result = headwater("stack", "sideways", cwd=tmp_path)
    assert result.returncode == 2 and "invalid choice: 'sideways'" in result.stderr


@pytest.mark.slow
def test_demo_runs_the_pipeline_and_reconciles(project: tuple[Path, dict[str, str]]) -> None:
    cwd, _ = project
    result = headwater("demo", "run", "--duration", "2", "--rate", "40", cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "started headwater capture" in out and "SNAPSHOT_END 1" in out
    for table in ("customers", "products", "orders", "order_items"):
        assert any(line.strip().startswith(table) and line.endswith(": equal") for line in out.splitlines()), table
    assert "snapshot: done" in out and "lag:" in out
    for table in ("customers", "products", "orders", "order_items"):  # the table topics and the endpoint
        assert re.search(rf"headwater\.{table} +\d+ rows in PostgreSQL: equal", out), table
        assert re.search(rf"endpoint /tables/{table} +\d+ rows in PostgreSQL: equal", out), table
    assert '"table":"public.orders"' in out
    views = ("headwater.views.orders_enriched", "endpoint /views/orders_enriched", "Redis headwater:orders_enriched:*")
    for where in views:
        assert re.search(rf"{re.escape(where)} +\d+ rows in PostgreSQL: equal", out), where
    assert re.search(r"shop-report +\d+ groups in PostgreSQL: equal", out)  # Spark's report against PostgreSQL's
    assert (cwd / "analytics-output" / "shop-report").is_dir()
    down = headwater("stack", "down", cwd=cwd)
    assert down.stdout.startswith("stopped: streams, capture, registry")
