"""Registering schemas with the real registry: ids, reuse, and what a refusal says."""

from __future__ import annotations

import httpx
import pytest

from tables.config import StackConfig
from tables.errors import FatalError, RegistryUnavailableError
from tables.registry import Registry, shown
from tables.wire import UndecodableMessage, avro_body, frame
from tests.plugins.stack import free_port

RECORD = {"type": "record", "name": "r", "fields": [{"name": "a", "type": "long"}]}


@pytest.mark.unit
def test_a_password_in_the_url_is_never_shown() -> None:
    assert shown("https://user:s3cret@registry.example:8081/base") == "https://user:***@registry.example:8081/base"
    assert shown("http://[::1]:8081") == "http://[::1]:8081" and shown("http://u:p@[::1]:1") == "http://u:***@[::1]:1"


def test_ids_come_from_the_registry_and_are_asked_once(local_stack: StackConfig, unique_name: str) -> None:
    registrar = Registry(local_stack.registry_url + "/")
    first = registrar.register(f"{unique_name}-value", RECORD)
    again = registrar.register(f"{unique_name}-value", RECORD)
    other = registrar.register(f"{unique_name}-key", {"type": "string"})
    registrar.close()
    answer = httpx.get(f"{local_stack.registry_url}/subjects/{unique_name}-value/versions/latest", timeout=10).json()
    assert first == again == answer["id"] and other != first


def test_what_is_registered_reads_back_and_decodes(local_stack: StackConfig, unique_name: str) -> None:
    registry = Registry(local_stack.registry_url)
    schema_id = registry.register(f"{unique_name}-value", RECORD)
    assert registry.schema(schema_id) == RECORD
    assert registry.latest(f"{unique_name}-value") == (schema_id, RECORD)
    assert registry.latest(f"{unique_name}-nothing") is None
    assert f"{unique_name}-value" in registry.subjects()
    framed = frame(schema_id) + avro_body(registry.parsed(schema_id), {"a": -7})
    assert registry.decode(framed) == {"a": -7} and registry(None) is None
    with pytest.raises(UndecodableMessage, match="Confluent wire format"):
        registry.decode(b"{}")
    with pytest.raises(UndecodableMessage, match="is not in the registry"):
        registry.decode(frame(2**31 - 1) + b"\x02")
    with pytest.raises(UndecodableMessage, match=f"does not match schema {schema_id}"):
        registry.decode(frame(schema_id))


def test_a_refused_schema_names_the_subject_and_the_registry_reason(local_stack: StackConfig, unique_name: str) -> None:
    registrar = Registry(local_stack.registry_url)
    with pytest.raises(FatalError, match=f"refused '{unique_name}-value'"):
        registrar.register(f"{unique_name}-value", {"type": "record", "name": "r"})  # no fields: not Avro
    registrar.close()


def test_an_unreachable_registry_is_retryable_and_hides_the_password() -> None:
    registrar = Registry(f"http://user:s3cret@127.0.0.1:{free_port()}")
    with pytest.raises(RegistryUnavailableError, match="is unreachable") as failed:
        registrar.register("s-value", RECORD)
    registrar.close()
    assert "s3cret" not in str(failed.value) and "user:***@127.0.0.1" in str(failed.value)


def test_basic_auth_comes_from_the_url_and_is_sent(local_stack: StackConfig, unique_name: str) -> None:
    """A registry that wants a user and password gets them from the URL (the local one accepts any)."""
    port = local_stack.registry_url.rpartition(":")[2]
    registrar = Registry(f"http://me:p%40ss@127.0.0.1:{port}")
    assert registrar._headers["Authorization"] == "Basic bWU6cEBzcw=="  # me:p@ss
    assert registrar.register(f"{unique_name}-value", RECORD) > 0


def test_a_url_that_is_not_http_is_named() -> None:
    for url in ("nowhere", "file:///etc/passwd", "http://"):
        with pytest.raises(FatalError, match=r"registry_url = '.*' is not an http\(s\) URL"):
            Registry(url)
