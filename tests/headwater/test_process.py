"""Background processes: a service's log is its owner's alone."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

from headwater import process


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_services_log_and_its_directory_are_readable_by_their_owner_only(tmp_path: Path) -> None:
    log, older = tmp_path / "logs" / "svc.log", tmp_path / "logs" / "old.log"
    older.parent.mkdir(mode=0o755)
    older.write_text("written by an older version\n")
    older.chmod(0o644)
    pid = process.spawn([sys.executable, "-c", "print('a row: (id)=(5)')"], log=log, pidfile=tmp_path / "svc.pid",
                        cwd=tmp_path)  # fmt: skip
    other = process.spawn([sys.executable, "-c", "pass"], log=older, pidfile=tmp_path / "old.pid", cwd=tmp_path)
    deadline = time.monotonic() + 30
    while (process.is_running(pid) or process.is_running(other)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process.is_running(pid) and not process.is_running(other)  # both reaped
    assert "a row: (id)=(5)" in log.read_text()
    assert (_mode(log.parent), _mode(log), _mode(older)) == (0o700, 0o600, 0o600)
    assert older.read_text().startswith("written by an older version")  # appended to, not truncated


def test_tail_tells_a_missing_log_from_one_it_cannot_read(tmp_path: Path) -> None:
    assert process.tail(tmp_path / "none.log") == "(no log written)"
    assert process.tail(tmp_path).startswith("(log not readable: ")  # a directory: read, it fails
