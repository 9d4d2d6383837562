"""Optional parts of an installation: a command that needs a missing extra names it (pure)."""

from __future__ import annotations

import pytest

from headwater.cli import main
from tables import extras
from tables.errors import FatalError

pytestmark = pytest.mark.unit


def test_every_extra_is_installed_here_and_a_missing_one_is_named_with_its_pip_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert extras.missing("analytics") == [] and extras.missing("local") == []  # ./dev installs everything
    monkeypatch.setitem(extras.EXTRAS, "analytics", ("pyspark", "no_such_module_of_headwater"))
    with pytest.raises(FatalError, match=r"needs no_such_module_of_headwater") as caught:
        extras.require("analytics", "the jobs")
    assert caught.value.hint == "pip install 'headwater[analytics]' (or 'headwater[all]')"
    assert main(["analytics", "tables"]) == 1
    err = capsys.readouterr().err
    assert "headwater analytics tables needs no_such_module_of_headwater" in err
    assert "pip install 'headwater[analytics]'" in err
    monkeypatch.setitem(extras.EXTRAS, "local", ("no_such_broker_of_headwater",))
    assert main(["stack", "up"]) == 1
    assert "pip install 'headwater[local]'" in capsys.readouterr().err
