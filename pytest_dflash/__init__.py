"""pytest-dflash: promote a candidate kernel route only on test evidence.

The public API is deliberately tiny and import-light (no torch here): a route record, a family
declaration, and the registry both go into from the ``pytest_dflash_routes`` hook
(docs/extending.md). Gate tests use the ``dflash_gate`` fixture (``pytest_dflash.gate``); suites
ask ``pytest_dflash.environment`` for the device and profile.
"""

from pytest_dflash.families import Family
from pytest_dflash.registry import RegistryError, Route, RouteRegistry

__all__ = ["Family", "Route", "RouteRegistry", "RegistryError"]
