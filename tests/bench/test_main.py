"""The benchmarks' command line: what it refuses, naming what to fix."""

from __future__ import annotations

import pytest

from bench.__main__ import parse

pytestmark = pytest.mark.unit


def test_the_drain_phase_is_on_by_default_and_0_turns_it_off() -> None:
    assert parse(["views"]).drain == 20_000
    assert parse(["views", "--drain", "0"]).drain == 0


def test_a_negative_drain_is_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse(["views", "--drain", "-5"])
    assert stopped.value.code == 2
    assert "--drain -5: a number of transactions, 0 or more" in capsys.readouterr().err


def test_a_bootstrap_for_another_benchmark_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["tables", "--bootstrap", "127.0.0.1:9092"])
    assert "--bootstrap is taken by the views benchmark only" in capsys.readouterr().err
