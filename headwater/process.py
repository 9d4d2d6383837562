"""Background processes of the local stack: spawn, find again by pid file, stop.

Promise: a service spawned here runs in its own session with its output in a log
file (readable by its owner only, in a directory only its owner opens: a log may quote rows,
as PostgreSQL's errors do) and its pid in a pid file, so a later ``headwater`` process can tell whether it
still runs and stop it. Stopping sends the service's own shutdown signal, waits,
then kills; it never signals a pid that no longer runs the expected program.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

# Popen objects of the children this process spawned, so they can be reaped on stop.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def spawn(
    argv: list[str], *, log: Path, pidfile: Path, cwd: Path, user: str | None = None, env: dict[str, str] | None = None
) -> int:
    """Start ``argv`` detached, output appended to ``log``; record and return its pid."""
    with open_log(log) as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,
            user=user,
            group=user,
            extra_groups=[] if user else None,
        )
    _CHILDREN[proc.pid] = proc
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    pidfile.write_text(f"{proc.pid}\n{argv[0]}\n", encoding="utf-8")
    return proc.pid


def open_log(log: Path) -> IO[bytes]:
    """``log`` opened to append, owner-only (an older log or logs directory of ours, made readable by others, is
    closed to them too; one another user owns keeps its mode)."""
    log.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if log.parent.stat().st_uid == os.geteuid():
        log.parent.chmod(0o700)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # never a link planted there
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def arguments(pid: int) -> list[str]:
    """A live process's command line, one argument each (empty when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def command_line(pid: int) -> str:
    """A live process's command line as one string, its arguments joined by spaces ("" when it is gone)."""
    return " ".join(arguments(pid))


def is_running(pid: int) -> bool:
    """True if ``pid`` is a live (not zombie) process."""
    child = _CHILDREN.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def recorded_pid(pidfile: Path) -> int | None:
    """The pid in ``pidfile`` if that process still runs the program recorded there."""
    try:
        pid_text, program = pidfile.read_text(encoding="utf-8").splitlines()[:2]
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    if is_running(pid) and os.path.basename(program) in command_line(pid):
        return pid
    return None


def stop(pidfile: Path, *, sig: int = signal.SIGTERM, timeout: float = 15.0) -> bool:
    """Stop the process recorded in ``pidfile``; True if one was running."""
    pid = recorded_pid(pidfile)
    if pid is None:
        pidfile.unlink(missing_ok=True)
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if is_running(pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        child.wait(timeout=10)
    pidfile.unlink(missing_ok=True)
    return True


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file (or a note that there is none)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    except OSError as exc:
        return f"(log not readable: {exc})"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"
