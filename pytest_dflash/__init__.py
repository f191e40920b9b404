"""pytest-dflash: promote a candidate kernel route only on test evidence.

The public API is deliberately tiny and import-light (no torch here): a route record and the
registry it is registered into from the ``pytest_dflash_routes`` hook.
"""

from pytest_dflash.registry import RegistryError, Route, RouteRegistry

__all__ = ["Route", "RouteRegistry", "RegistryError"]
