"""The error hierarchy every Headwater component raises.

Promise: every error a user can cause is a ``HeadwaterError`` whose message says
what went wrong and what to do; the facts (service, port, key, line) ride along as
attributes. ``RetryableError`` marks faults that may pass by themselves (a broker
restarting); ``FatalError`` marks faults that need a person (bad config, a taken port).
"""

from __future__ import annotations


class HeadwaterError(Exception):
    """Base of every error Headwater raises on purpose."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): drivers such as
    libpq add hint lines that do not belong in a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class RetryableError(HeadwaterError):
    """A fault that may clear by itself; callers may retry with backoff."""


class FatalError(HeadwaterError):
    """A fault that retrying will not fix; a person has to change something."""


class ConfigError(FatalError):
    """The configuration (file, environment or flags) is malformed or inconsistent."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        key: str | None = None,
        hint: str | None = None,
    ) -> None:
        where = ", ".join(
            part for part in (path, f"line {line}" if line else None, f"key '{key}'" if key else None) if part
        )
        super().__init__(f"{where}: {message}" if where else message, hint=hint)
        self.path = path
        self.line = line
        self.key = key


class PortInUseError(FatalError):
    """A service of the local stack cannot bind its port because something else holds it."""

    def __init__(self, service: str, host: str, port: int, setting: str) -> None:
        super().__init__(
            f"port {port} on {host} for {service} is already in use by another process",
            hint=f"stop that process or choose another port with {setting}",
        )
        self.service = service
        self.host = host
        self.port = port


class MissingBinaryError(FatalError):
    """A program the local stack needs is not installed."""

    def __init__(self, program: str, install: str) -> None:
        super().__init__(f"{program} was not found", hint=install)
        self.program = program


class ServiceStartError(FatalError):
    """A service of the local stack died or never became healthy while starting."""

    def __init__(self, service: str, reason: str, log_path: str, log_tail: str) -> None:
        super().__init__(
            f"{service} failed to start: {reason}\n--- last lines of {log_path} ---\n{log_tail}",
            hint=f"read {log_path}; fix the cause, then run 'headwater stack up' again",
        )
        self.service = service
        self.log_path = log_path


class RegistryUnavailableError(RetryableError):
    """The schema registry cannot be reached."""


class SchemaChangeError(FatalError):
    """A table changed in a way its topic's compatibility rules refuse."""

    def __init__(self, table: str, subject: str, detail: str) -> None:
        super().__init__(
            f"table {table} changed incompatibly: the registry refused the new schema for '{subject}': {detail}",
            hint=(
                "give the new column a DEFAULT and make it nullable, or change the type to one that widens; "
                f"or relax the subject's compatibility (PUT /config/{subject}) and restart capture"
            ),
        )
        self.table = table
        self.subject = subject
