"""docker-compose.yml is a valid Compose file (checked by Docker's own tooling)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def compose_command() -> list[str]:
    """`docker compose` when the plugin is there, else Debian's docker-compose (./dev installs it)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    binary = shutil.which("docker-compose")
    assert binary, "neither 'docker compose' nor 'docker-compose' is installed; run ./dev setup"
    return [binary]


def test_compose_file_validates() -> None:
    result = subprocess.run(
        [*compose_command(), "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


def test_compose_runs_the_four_services_with_logical_wal() -> None:
    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert set(spec["services"]) == {"kafka", "registry", "postgres", "redis", "prometheus", "grafana"}
    monitoring = {name for name, s in spec["services"].items() if s.get("profiles") == ["monitoring"]}
    assert monitoring == {"prometheus", "grafana"}, "monitoring starts only with --profile monitoring"
    assert "--web.listen-address=127.0.0.1:9090" in spec["services"]["prometheus"]["command"]
    assert spec["services"]["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert "wal_level=logical" in spec["services"]["postgres"]["command"]
    assert spec["services"]["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    for service in spec["services"].values():
        assert all(str(port).startswith("127.0.0.1:") for port in service.get("ports", []))
