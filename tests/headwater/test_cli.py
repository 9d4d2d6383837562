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
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg2
import psycopg2.extensions
import pytest
from confluent_kafka.admin import AdminClient

from capture.state import State
from headwater import stack
from tests.plugins.stack import free_ports, stack_dir


def headwater(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 180
              ) -> subprocess.CompletedProcess[str]:  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "headwater.cli", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
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
        pg, kafka, registry, redis, web, metrics = free_ports(6)
        (tmp_path / "headwater.toml").write_text(
            f'[stack]\ndata_dir = "{data}"\npostgres_port = {pg}\nkafka_port = {kafka}\n'
            f"registry_port = {registry}\nredis_port = {redis}\nstart_timeout = 30\n"
            f"[streams]\nweb_port = {web}\n[capture]\nmetrics_port = {metrics}\n",
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
def test_a_stack_on_a_kafka_of_your_own_starts_no_broker_and_keeps_its_schemas_there(
    project: tuple[Path, dict[str, str]],
) -> None:
    """``kafka_bootstrap``: the stack starts PostgreSQL, Redis and the registry, whose schemas go to a topic of its
    own on that Kafka (not a Confluent registry's ``_schemas``); ``status`` tells whether that Kafka answers, ``up``
    refuses one that does not, or while the stack's Tansu still runs; ``down`` leaves that Kafka running."""
    cwd, ports = project
    data_dir = Path(cwd.joinpath("headwater.toml").read_text().split('"')[1])
    assert headwater("stack", "up", cwd=cwd).returncode == 0  # on Tansu first
    with stack_dir() as elsewhere:
        own = stack.Broker(stack.StackConfig(data_dir=elsewhere, kafka_port=free_ports(1)[0], start_timeout=30))
        own.start()
        try:
            config = cwd / "headwater.toml"
            config.write_text(config.read_text().replace("[stack]\n", f'[stack]\nkafka_bootstrap = "{own.address}"\n'))
            refused = headwater("stack", "up", cwd=cwd)
            assert refused.returncode == 2 and "Tansu) still runs" in refused.stderr, refused.stderr
            assert "kafka_bootstrap" in refused.stderr and "headwater stack down" in refused.stderr
            mixed = headwater("stack", "status", cwd=cwd)  # yours answers, and the stack's Tansu is left over
            assert mixed.returncode == 3 and f"kafka://{own.address} (yours)" in mixed.stdout, mixed.stdout
            assert re.search(r"tansu +left over +kafka://\S+ \(Tansu, in-memory\): 'headwater stack down' stops it +"
                             r"pid \d+", mixed.stdout), mixed.stdout  # fmt: skip
            assert "stopped: registry, redis, postgres, kafka" in headwater("stack", "down", cwd=cwd).stdout
            up = headwater("stack", "up", cwd=cwd)
            assert up.returncode == 0, up.stderr
            assert "started: postgres, redis, registry" in up.stdout and up.stdout.count("healthy") == 4
            assert f"kafka://{own.address} (yours)" in up.stdout
            subject = f"http://127.0.0.1:{ports['registry']}/subjects/t-value/versions"
            answer = httpx.post(subject, json={"schema": '"string"'}, timeout=10)
            assert answer.status_code == 200, answer.text
            topics = AdminClient({"bootstrap.servers": own.address}).list_topics(timeout=10).topics
            assert stack.OWN_KAFKA_SCHEMAS in topics and "_schemas" not in topics
            mine = config.read_text()
            config.write_text(mine.replace(f'kafka_bootstrap = "{own.address}"\n', ""))  # back to Tansu, still up
            moved = headwater("stack", "up", cwd=cwd)
            assert moved.returncode == 2 and f"the registry runs with --host 127.0.0.1 --port {ports['registry']} " \
                f"--bootstrap {own.address} --topic {stack.OWN_KAFKA_SCHEMAS}, the settings now say" in moved.stderr
            assert "headwater stack down" in moved.stderr
            assert not any("--listener-url" in line for line in processes_in(data_dir))  # the Tansu it started: gone
            config.write_text(mine)
        finally:
            own.stop()
    status = headwater("stack", "status", cwd=cwd)
    assert status.returncode == 3 and "unreachable" in status.stdout
    assert "stopped: registry, redis, postgres\n" in headwater("stack", "down", cwd=cwd).stdout
    unanswered = headwater("stack", "up", cwd=cwd)
    assert unanswered.returncode == 2 and "does not answer" in unanswered.stderr, unanswered.stderr
    assert "docker compose up -d kafka" in unanswered.stderr and "Traceback" not in unanswered.stderr
    assert processes_in(data_dir) == []


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


def log_tail(cwd: Path, service: str, lines: int = 80) -> list[str]:
    """The last ``lines`` of a stack service's log in the project at ``cwd`` (for a failure's message: the data
    directory goes with the test; a CI leg's demo showed no streamed change counted, with no log left to read)."""
    data = Path(tomllib.loads((cwd / "headwater.toml").read_text(encoding="utf-8"))["stack"]["data_dir"])
    log = data / "logs" / f"{service}.log"
    return [f"== {log}", *log.read_text(errors="replace").splitlines()[-lines:]] if log.exists() else [f"no {log}"]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_demo_runs_the_pipeline_and_reconciles(project: tuple[Path, dict[str, str]]) -> None:
    cwd, _ = project
    # the whole pipeline and a Spark job: 82 s alone here, ~170 s beside another test's worker (Spark ~100 s of it)
    result = headwater("demo", "run", "--duration", "2", "--rate", "40", cwd=cwd, timeout=420)
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
    for shown in ('headwater_capture_events_total{op="INSERT",table="public.orders"}',
                  "headwater_streams_fanout_changes_total", "/ready: ready"):  # fmt: skip
        assert shown in out, f"{shown} not shown:\n" + "\n".join(
            [line for line in out.splitlines() if "metrics" in line or "headwater_" in line] + log_tail(cwd, "capture"))
    assert (cwd / "analytics-output" / "shop-report").is_dir()
    down = headwater("stack", "down", cwd=cwd)
    assert down.stdout.startswith("stopped: streams, capture, registry")


def stack_flags(cfg: stack.StackConfig, database: str) -> list[str]:
    """Flags that point a command at the session's stack (``local_stack``) and one database."""
    return [
        "--data-dir", str(cfg.data_dir), "--postgres-port", str(cfg.postgres_port),
        "--kafka-port", str(cfg.kafka_port), "--registry-port", str(cfg.registry_port),
        "--redis-port", str(cfg.redis_port), "--database", database,
    ]  # fmt: skip


def wait_for(query: str, params: tuple[object, ...], admin: psycopg2.extensions.connection, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with admin.cursor() as cur:
        while time.monotonic() < deadline:
            cur.execute(query, params)
            if cur.fetchone()[0]:  # type: ignore[index]
                return
            time.sleep(0.02)
    raise AssertionError(f"not true after {timeout} s: {query}")


@pytest.mark.slow
def test_killed_seed_leaves_nothing_and_the_next_seed_starts_clean(
    local_stack: stack.StackConfig, pg_database: str, unique_name: str, tmp_path: Path
) -> None:
    flags = stack_flags(local_stack, unique_name)
    argv = [sys.executable, "-m", "headwater.cli", "demo", "seed", *flags, "--customers", "20000", "--orders", "200000"]
    seeding = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    admin = psycopg2.connect(local_stack.dsn("postgres"))
    admin.autocommit = True
    try:
        copying = "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND query LIKE 'COPY orders%%'"
        wait_for(copying, (unique_name,), admin, timeout=60)  # the seed is well under way
        seeding.kill()
        seeding.wait(timeout=10)
        gone = "SELECT count(*) = 0 FROM pg_stat_activity WHERE datname = %s"
        wait_for(gone, (unique_name,), admin, timeout=30)  # the server rolled the seed back
    finally:
        admin.close()
        if seeding.poll() is None:
            seeding.kill()
            seeding.wait()
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT to_regclass('customers'), to_regclass('order_items'), to_regtype('order_status')")
        assert cur.fetchone() == (None, None, None)
    conn.close()
    again = headwater("demo", "seed", *flags, "--customers", "7", "--products", "3", "--orders", "11", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "created and seeded" in again.stdout and "customers 7, products 3, orders 11" in again.stdout


@pytest.mark.slow
def test_postgres_restarted_by_pg_ctl_is_still_the_stacks(project: tuple[Path, dict[str, str]]) -> None:
    cwd, _ = project
    assert headwater("stack", "up", cwd=cwd).returncode == 0
    pgdata = Path(cwd.joinpath("headwater.toml").read_text().split('"')[1]) / "postgres"
    before = int((pgdata / "postmaster.pid").read_text().split()[0])
    owner = "postgres" if os.geteuid() == 0 else None  # PostgreSQL refuses root
    pg_ctl = [str(stack.Postgres.bindir() / "pg_ctl"), "restart", "-m", "fast", "-w", "-D", str(pgdata)]
    subprocess.run(
        pg_ctl, cwd=pgdata, user=owner, group=owner, extra_groups=[] if owner else None,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=60,
    )  # fmt: skip
    after = int((pgdata / "postmaster.pid").read_text().split()[0])
    assert after != before

    status = headwater("stack", "status", cwd=cwd)
    assert status.returncode == 0, status.stdout
    assert re.search(rf"^postgres +healthy .* pid {after}$", status.stdout, re.MULTILINE), status.stdout
    up = headwater("stack", "up", cwd=cwd)
    assert up.returncode == 0, up.stderr
    assert "already running" in up.stdout and f"pid {after}" in up.stdout
    down = headwater("stack", "down", cwd=cwd)
    assert down.returncode == 0 and "postgres" in down.stdout  # the fixture checks no process is left


def test_nonsensical_numbers_are_refused_in_one_line(tmp_path: Path) -> None:
    for prog, value, flag in (
        ("demo load", "0", "--rate"),
        ("demo load", "-5", "--rate"),
        ("demo load", "-1", "--duration"),
        ("demo run", "nan", "--rate"),
        ("demo seed", "-1", "--orders"),
        ("demo seed", "0", "--customers"),
        ("demo seed", "many", "--products"),
        ("analytics", "-2", "--rows"),
    ):
        result = headwater(*prog.split(), flag, value, cwd=tmp_path)
        assert result.returncode == 2, (prog, flag, value)
        first, hint = result.stderr.splitlines()
        assert first.startswith(f"headwater {prog}: error: argument {flag}: expected ") and repr(value) in first
        assert hint == f"  hint: see 'headwater {prog} --help'"
    result = headwater("stack", "up", "--start-timeout", "-3", cwd=tmp_path)
    assert result.returncode == 2 and "start_timeout" in result.stderr and "Traceback" not in result.stderr
    assert headwater("demo", "load", "--help", cwd=tmp_path).returncode == 0


@pytest.mark.parametrize(
    ("dsn", "says"),
    [
        ("postgresql://x:hunter2@host:notaport/db", "port must be a number between 1 and 65535, got 'notaport'"),
        ("garbage==", 'invalid connection option "garbage"'),
        ("postgresql://x:hunter2@[host/db", "IPv6 host address"),
        ("postgresql://x:hunter2%zz@host/db", "invalid percent-encoded token"),
        ("host=h password=hunter2 sslmode=sure", "sslmode must be one of"),
    ],
)
def test_malformed_dsn_is_one_line_naming_the_setting(tmp_path: Path, dsn: str, says: str) -> None:
    for where, args, env in (
        ("flag", ["--dsn", dsn], {}),
        ("environment", [], {"HEADWATER_CAPTURE_DSN": dsn}),
        ("file", [], {}),
    ):
        if where == "file":
            escaped = dsn.replace("\\", "\\\\").replace('"', '\\"')
            (tmp_path / "headwater.toml").write_text(f'[capture]\nslot = "s"\ndsn = "{escaped}"\n')
        for command in ("capture", "status"):
            result = headwater(command, *args, cwd=tmp_path, env=env)
            assert result.returncode == 2, (where, command, result.stderr)
            assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
            assert "'dsn'" in result.stderr and says in result.stderr
            assert "hunter2" not in result.stderr
            if where == "file":
                assert "headwater.toml, line 3" in result.stderr


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any HEADWATER_ setting of the caller's, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("HEADWATER_")}, **extra}


def test_config_show_names_every_source_and_masks_secrets(tmp_path: Path) -> None:
    (tmp_path / "headwater.toml").write_text(
        '[stack]\nkafka_port = 29092\n\n[pipeline]\nbootstrap = "kafka.example.com:9093"\n'
        'registry_url = "https://svc:RegistrySecret1@registry.example.com"\n'
        'kafka = { "security.protocol" = "SASL_SSL", "sasl.password" = "KafkaSecret2" }\n'
        '\n[capture]\nslot = "orders"\n',
        encoding="utf-8",
    )
    env = clean_env(HEADWATER_PIPELINE_TOPIC_PREFIX="pgb", HEADWATER_CAPTURE_DSN="host=db password=DsnSecret3")
    result = subprocess.run(
        [sys.executable, "-m", "headwater.cli", "config", "show"], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for secret in ("RegistrySecret1", "KafkaSecret2", "DsnSecret3", "password=headwater"):
        assert secret not in out
    sections = {s.split("]", 1)[0]: s for s in out.split("\n[")[1:]}
    assert set(sections) == {"stack", "pipeline", "capture", "streams", "analytics"}

    def line(section: str, key: str) -> str:
        found = [x for x in sections[section].splitlines() if x.startswith(f"{key} = ")]
        assert len(found) == 1, (section, key, sections[section])
        return re.sub(r"\s+#", "  #", found[0])

    assert line("stack", "kafka_port") == "kafka_port = 29092  # headwater.toml:2"
    assert line("stack", "postgres_password") == 'postgres_password = "***"  # default'
    for section in ("capture", "streams", "analytics"):
        assert line(section, "bootstrap") == 'bootstrap = "kafka.example.com:9093"  # headwater.toml:5'
        assert (
            line(section, "registry_url") == 'registry_url = "https://svc:***@registry.example.com"  # headwater.toml:6'
        )
        assert line(section, "topic_prefix") == 'topic_prefix = "pgb"  # HEADWATER_PIPELINE_TOPIC_PREFIX'
    assert '"sasl.password" = "***"' in line("capture", "producer") and "SASL_SSL" in line("capture", "producer")
    assert line("capture", "slot") == 'slot = "orders"  # headwater.toml:10'
    assert line("capture", "dsn") == 'dsn = "***"  # HEADWATER_CAPTURE_DSN'
    assert line("capture", "include") == 'include = "public.*"  # default'
    assert (
        line("streams", "redis_url")
        == 'redis_url = "redis://127.0.0.1:16379/0"  # local stack ([stack] host, redis_port)'
    )
    assert line("streams", "broker_profile").endswith("# default, auto: the broker is not the local stack's")

    flag = headwater("config", "show", "--component", "capture", "--config", "headwater.toml", cwd=tmp_path, env=env)
    assert flag.returncode == 0 and flag.stdout.count("\n[") == 1 and "\n[capture]\n" in flag.stdout


def test_config_show_refuses_a_bad_pipeline_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "headwater.toml").write_text('[pipeline]\nregistry_url = "registry:8081"\n', encoding="utf-8")
    result = headwater("config", "show", cwd=tmp_path, env=clean_env())
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "headwater.toml, line 2, key 'registry_url'" in result.stderr and "http/https URL" in result.stderr


def test_a_bad_log_level_or_format_is_refused_before_anything_runs(tmp_path: Path) -> None:
    result = headwater("stack", "status", "--log-level", "loud", cwd=tmp_path)
    assert result.returncode == 2 and "--log-level" in result.stderr
    env = {**clean_env(), "HEADWATER_LOG_FORMAT": "xml"}
    result = headwater("stack", "status", cwd=tmp_path, env=env)
    assert result.returncode == 2 and "HEADWATER_LOG_FORMAT" in result.stderr and "text or json" in result.stderr


@pytest.mark.parametrize(
    ("command", "own", "foreign"),
    [
        ("status", ["--config", "--dsn", "--slot", "--state-dir", "--log-level", "--log-format"],
         ["--kafka-port", "--bootstrap", "--producer", "--include", "--snapshot-workers", "--data-dir"]),
        ("capture", ["--config", "--dsn", "--bootstrap", "--producer", "--state-dir"],
         ["--kafka-port", "--redis-port", "--start-timeout", "--master"]),
        ("analytics", ["--config", "--rows", "--master", "--bootstrap", "--kafka"],
         ["--kafka-port", "--postgres-password", "--dsn"]),
        ("config show", ["--config", "--component"], ["--kafka-port", "--bootstrap", "--dsn"]),
        ("snapshot", ["--config", "--dsn", "--slot", "--state-dir", "--where", "--status", "--pause", "--resume",
                      "--cancel", "--wait"], ["--bootstrap", "--include", "--kafka-port", "--producer"]),
    ],
)  # fmt: skip
def test_help_lists_only_the_commands_own_flags(
    tmp_path: Path, command: str, own: list[str], foreign: list[str]
) -> None:
    result = headwater(*command.split(), "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", result.stdout))
    assert set(own) <= flags and not flags & set(foreign), sorted(flags)
    if command == "status":
        assert flags == {"--help", *own}


def test_snapshot_leaves_requests_in_captures_state_and_refuses_what_it_cannot_ask(tmp_path: Path) -> None:
    """``headwater snapshot`` needs capture's state; a request capture is not running to take waits there and
    is listed by --status; a bad command line is refused in one line before anything is asked."""
    where = ["--state-dir", str(tmp_path / "state"), "--slot", "s"]
    missing = headwater("snapshot", "orders", *where, cwd=tmp_path, env=clean_env())
    assert missing.returncode == 1 and "no capture state for slot s in" in missing.stderr
    State(tmp_path / "state", "s").close()
    for args, says in ((["--where", "x > 1"], "name at least one table"),
                       (["--pause", "--where", "x > 1", "orders"], "goes with a snapshot only")):  # fmt: skip
        refused = headwater("snapshot", *args, *where, cwd=tmp_path, env=clean_env())
        assert refused.returncode == 2 and says in refused.stderr and "Traceback" not in refused.stderr, refused
    both = headwater("snapshot", "--pause", "--cancel", *where, cwd=tmp_path, env=clean_env())
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
    waiting = headwater("snapshot", "orders", "--where", "id > 3", "--wait", "0.3", *where, cwd=tmp_path,
                        env=clean_env())  # fmt: skip
    assert waiting.returncode == 0 and "request 1 is waiting for capture (slot s)" in waiting.stdout
    status = headwater("snapshot", "--status", *where, cwd=tmp_path, env=clean_env())
    assert "no backfills yet" in status.stdout
    assert "1 (cli) snapshot orders where id > 3: waiting for capture" in status.stdout, status.stdout
