"""The self-test's part of a pytest session: plant the routes, wrap engines, judge the gates.

``--dflash-selftest`` registers, for every selected candidate, its unchanged copy and its
catalogue defects as ordinary candidate routes (``catalogue.plan``) and selects them next to it,
so the shipped suites parametrize over them like over any route. Engines for planted
prefill.geometry routes are wrapped here (``engine.build``). After the run the report gains the
``selftest`` section (``pytest_dflash.evidence.catch``), built from each planted route's
``planted`` field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from pytest_dflash import settings
from pytest_dflash.selftest import catalogue, engine, wrappers
from pytest_dflash.selftest.timing_worker import worker_plugin

if TYPE_CHECKING:
    from pytest_dflash.routes.registry import Route, RouteRegistry


class SelftestSession:
    """Registered as a pytest plugin for the session when the self-test is on."""

    def __init__(self, config: pytest.Config, policy: Any) -> None:
        self.config = config
        self.policy = policy
        self.planted: dict[str, catalogue.Planted] = {}
        self.records: dict[str, dict[str, Any]] = {}  # the report's ``planted`` field per route

    def install(self, registry: RouteRegistry, candidates: list[Route],
                selected_routes: set[str],
                selected_gates: set[tuple[str, str]]) -> list[str]:
        """Register the planted routes of ``candidates`` and extend the selection to them.

        Returns the planted route names. A selection by route or by ``ROUTE:KIND`` carries over
        to the planted routes of the selected routes (and only the selected kinds)."""
        calibrate = settings.of(self.config).selftest_calibrate
        for planted in catalogue.plan(candidates, registry, self.policy, calibrate=calibrate):
            registry.register(wrappers.as_route(planted, registry, self.policy))
            self.planted[planted.name] = planted
            self.records[planted.name] = planted.record()
            original = planted.original.name
            if selected_routes:
                selected_routes.add(planted.name)
            for name, kind in list(selected_gates):
                if name == original and kind in planted.gates:
                    selected_gates.add((planted.name, kind))
        return list(self.planted)

    @pytest.hookimpl(trylast=True)  # after the plugin bound each gate test to its route
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """A gate test of a planted defect is expected to fail with the gate's AssertionError:
        caught defects show as xfailed and do not fail the run; any other exception (the
        planted route broke the test instead of being judged) stays a real error."""
        for item in items:
            bound: Any = next((value for key, value in item.user_properties
                               if key == "dflash"), None)
            planted = self.planted.get(bound["route"]) if bound else None
            if planted is None or planted.defect is None:
                continue
            item.add_marker(pytest.mark.xfail(
                raises=AssertionError, strict=False,
                reason=f"planted defect {planted.key} ({planted.what}): the {bound['kind']} gate "
                       "must catch it"))

    @pytest.hookimpl(tryfirst=True)
    def pytest_dflash_engine(self, config: pytest.Config, selection: dict[str, str],
                             profile: str) -> Any:
        """Engines of planted prefill.geometry routes: the served engine, wrapped."""
        return engine.build(config, selection, profile, self.planted, self.policy)


def start(config: pytest.Config, state: Any) -> SelftestSession:
    """Plant the self-test routes of the session's selected candidates and register the
    self-test's hooks (``state`` is the session's ``pytest_dflash.session.state.DflashState``),
    here and in every timing worker (``timing_worker``)."""
    originals = [route.name for route in state.candidates()]
    selftest = SelftestSession(config, state.thresholds)
    selftest.install(state.registry, state.candidates(), state.selected_routes,
                     state.selected_gates)
    state.planted.update(selftest.records)
    state.worker_plugins.append(
        worker_plugin(originals, settings.of(config).selftest_calibrate))
    config.pluginmanager.register(selftest, "dflash-selftest")
    return selftest
