"""Unique names per test: databases, slots, topics and prefixes never collide."""

from __future__ import annotations

import re
import uuid

import pytest


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> str:
    """A short identifier unique to this test run, safe for SQL, Kafka and Redis."""
    stem = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower()).strip("_")[:24]
    return f"t_{stem}_{uuid.uuid4().hex[:8]}"
