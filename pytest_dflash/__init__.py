"""pytest-dflash: promote a candidate kernel route only on test evidence.

The public API is deliberately tiny and import-light (no torch here): a route record, a family
declaration, and the registry all go into the ``pytest_dflash_routes`` hook
(docs/extending.md); ``hits`` is where a route records which code path served a call;
:func:`default_engine` is the engine pytest-dflash itself would build, for an outside
``pytest_dflash_engine`` hook to wrap. Gate tests use the ``dflash_gate`` fixture
(``pytest_dflash.measure.gate``); suites ask ``pytest_dflash.session.environment`` for the
device and profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from pytest_dflash.native import hits
from pytest_dflash.routes.families import Family
from pytest_dflash.routes.registry import RegistryError, Route, RouteRegistry

if TYPE_CHECKING:
    import pytest

    from pytest_dflash.engines import Engine

__all__ = ["Family", "Route", "RouteRegistry", "RegistryError", "hits", "default_engine"]


def default_engine(config: pytest.Config, selection: Mapping[str, str]) -> Engine:
    """The engine pytest-dflash builds for ``selection`` (family -> route name; families left
    out run their baselines) when no plugin answers ``pytest_dflash_engine``: the reference
    engine on the gate device, the transformers engine under ``--dflash-engine hf:PATH``, or
    a server engine under ``--dflash-serve`` / ``--dflash-engine-url``.

    Why: an outside plugin that wraps the default engine (to count calls, add a capability,
    log requests) needs it without importing internal modules, whose paths change. The engine
    belongs to the pytest session and is closed when the session ends, so a wrapper need not
    close it. A route name that is not registered, or not of the family it is given for,
    raises ValueError naming the known routes.
    """
    from pytest_dflash.session.engine_factory import factory_of

    return factory_of(config).build(dict(selection))
