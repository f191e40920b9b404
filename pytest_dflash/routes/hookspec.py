"""Hooks other projects implement to extend pytest-dflash (docs/extending.md).

Implement them in a ``conftest.py`` or an installed plugin, as with any pytest hook. The shipped
stack uses the very same hooks (``pytest_dflash/routes/shipped.py``, the reference engine in
``pytest_dflash/plugin.py``), so nothing shipped is privileged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_dflash.routes.registry import RouteRegistry


def pytest_dflash_routes(registry: RouteRegistry) -> None:
    """Register routes (and declare families) into the session's ``RouteRegistry``.

    Called once per session, in every conftest and installed plugin, before collection; the
    registry is checked as a whole afterwards (a dangling baseline is a usage error). A route's
    ``impl`` follows its family's contract (``pytest_dflash.routes.families``).

    Example, an engine repository adding an attention candidate to the shipped family:

    ```python
    from pytest_dflash import Route
    def pytest_dflash_routes(registry):
        registry.register(Route(
            "attn.d256.mine", family="attn.d256", role="candidate",
            baseline="attn.d256.sdpa", gates=("parity", "speed"),
            impl="my_engine.attention:MINE"))
    ```

    A new family is declared the same way, with its contract and the routes its gates need:

    ```python
    from pytest_dflash import Family, Route
    def pytest_dflash_routes(registry):
        registry.declare(Family("rope.yarn", contract=MyRopeProtocol,
                                baseline="rope.yarn.torch", oracle="rope.yarn.fp64"))
        registry.register(Route("rope.yarn.fp64", "rope.yarn", "oracle", impl=...))
        ...
    ```
    """


@pytest.hookspec(firstresult=True)
def pytest_dflash_engine(config: pytest.Config, selection: dict[str, str], profile: str) -> Any:
    """Build the engine for model-level gates (ppl, quality, prefill speed, engine validation
    cost) from a family -> route ``selection`` and the session ``profile``.

    Return an object implementing ``pytest_dflash.engines.Engine``, or None to let the next
    implementation (ultimately the embedded reference engine) build it. Called once per distinct
    selection and session (``dflash_gate.engines()`` / the ``dflash_engine`` factory cache it).

    Example, a serving engine of your own:

    ```python
    def pytest_dflash_engine(config, selection, profile):
        if config.option.my_engine:
            return MyEngine(attention=selection["attn.d256"],
                            linear=selection["gemm.nvfp4"],
                            geometry=selection["prefill.geometry"])
        return None  # let the reference engine answer
    ```
    """
