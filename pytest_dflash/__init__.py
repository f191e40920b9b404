"""pytest-dflash: promote a candidate kernel route only on test evidence.

The public API is deliberately tiny and import-light (no torch here): a route record, a family
declaration, and the registry all go into the ``pytest_dflash_routes`` hook
(docs/extending.md); ``hits`` is where a route records which code path served a call. Gate tests
use the ``dflash_gate`` fixture (``pytest_dflash.session.gate``); suites ask
``pytest_dflash.session.environment`` for the device and profile.
"""

from pytest_dflash.native import hits
from pytest_dflash.routes.families import Family
from pytest_dflash.routes.registry import RegistryError, Route, RouteRegistry

__all__ = ["Family", "Route", "RouteRegistry", "RegistryError", "hits"]
