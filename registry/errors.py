"""Registry errors with Confluent's error codes and HTTP statuses.

Promise: each error renders as Confluent's JSON body ``{"error_code", "message"}``
with the status clients expect, so real clients raise their usual exceptions.
``RegistryError`` refuses a request for good; ``RegistryUnavailable`` (503) says the
same request may succeed in a few seconds, and why it cannot now.
"""

from __future__ import annotations

from tables.errors import FatalError, HeadwaterError, RetryableError


class HttpError(HeadwaterError):
    """An error answered to an HTTP client."""

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code

    def body(self) -> dict[str, object]:
        return {"error_code": self.code, "message": self.message}


class RegistryError(HttpError, FatalError):
    """A request the registry refuses: sent again unchanged, it gets the same answer."""


class RegistryUnavailable(HttpError, RetryableError):
    """The registry cannot take writes right now; the message says why and when to retry."""


def subject_not_found(subject: str) -> RegistryError:
    return RegistryError(404, 40401, f"Subject '{subject}' not found.")


def version_not_found(subject: str, version: object) -> RegistryError:
    return RegistryError(404, 40402, f"Version {version} not found for subject '{subject}'.")


def schema_not_found(detail: str = "Schema not found") -> RegistryError:
    return RegistryError(404, 40403, detail)


def subject_not_soft_deleted(subject: str) -> RegistryError:
    return RegistryError(404, 40405, f"Subject '{subject}' was not deleted first before being permanently deleted")


def version_not_soft_deleted(subject: str, version: int) -> RegistryError:
    return RegistryError(
        404, 40407, f"Subject '{subject}' Version {version} was not deleted first before being permanently deleted"
    )


def subject_config_not_found(subject: str) -> RegistryError:
    return RegistryError(404, 40408, f"Subject '{subject}' does not have subject-level compatibility configured")


def incompatible(messages: list[str]) -> RegistryError:
    detail = "; ".join(messages)
    return RegistryError(
        409, 409, f"Schema being registered is incompatible with an earlier schema for subject: {detail}"
    )


def invalid_schema(detail: str) -> RegistryError:
    return RegistryError(422, 42201, f"Invalid schema: {detail}")


def invalid_version(version: str) -> RegistryError:
    return RegistryError(
        422,
        42202,
        f"The specified version '{version}' is not a valid version id. "
        'Allowed values are between [1, 2^31-1] and the string "latest"',
    )


def invalid_compatibility(level: object) -> RegistryError:
    return RegistryError(422, 42203, f"Invalid compatibility level: {level!r}")


def store_error(detail: str) -> RegistryError:
    return RegistryError(500, 50001, f"Error in the backend data store: {detail}")


def log_unavailable(topic: str, bootstrap: str, problem: str) -> RegistryUnavailable:
    return RegistryUnavailable(
        503,
        50001,
        f"Error in the backend data store: the schema log '{topic}' on {bootstrap} cannot take writes: {problem}. "
        "The registry reconnects by itself and rewrites the log from memory if it was lost; "
        "retry in a few seconds (reads still work).",
    )
