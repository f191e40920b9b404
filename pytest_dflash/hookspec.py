"""Hooks other projects implement to extend pytest-dflash (pluggy, like pytest-benchmark's)."""

from __future__ import annotations

from typing import Any

import pytest


def pytest_dflash_routes(registry: Any) -> None:
    """Register routes: ``registry.register(Route(...))``. Called once per session, in every
    conftest and installed plugin; the shipped stack registers its own routes the same way."""


@pytest.hookspec(firstresult=True)
def pytest_dflash_engine(config: pytest.Config, selection: dict[str, str], profile: str) -> Any:
    """Build the engine for model-level gates from a family -> route selection.

    Return an object implementing ``pytest_dflash.engines.Engine`` or None to let the next
    implementation (ultimately the embedded reference engine) build it."""
