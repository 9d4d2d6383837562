"""The local stack's services: what each says about itself, without starting anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from headwater import stack


@pytest.mark.unit
@pytest.mark.parametrize("bootstrap", ["", "127.0.0.1:39092,127.0.0.2:39093"])
def test_every_service_names_its_port_and_the_setting_that_moves_it(tmp_path: Path, bootstrap: str) -> None:
    cfg = stack.StackConfig(data_dir=tmp_path, kafka_port=29092, kafka_bootstrap=bootstrap)
    for service in stack.services(cfg):
        assert f":{service.port}" in service.address, service.name
        assert "[stack]" in service.setting_hint, service.name
    kafka = next(s for s in stack.services(cfg) if s.name == "kafka")
    assert (kafka.port, "kafka_bootstrap" in kafka.setting_hint) == ((39092, True) if bootstrap else (29092, False))
