"""Shared test settings; fixtures live in tests/plugins (loaded from setup.cfg)."""
