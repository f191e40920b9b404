"""The self-test inside a timing worker: the same planted routes, the same wrapped engines.

A timing worker rebuilds the session's route registry through the ``pytest_dflash_routes``
hook. When the self-test is on, the session names this plugin in the workers' spec
(:func:`worker_plugin`), so each worker plants the routes the session planted (after every
other plugin registered its own) and builds a planted prefill.geometry route's engine the way
the gate's process does: the served engine, wrapped (``engine.wrap``). The timing code never
names the self-test: it only registers the plugins the session hands it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pytest

from pytest_dflash.selftest import catalogue, engine, wrappers

if TYPE_CHECKING:
    from pytest_dflash.engines import Engine
    from pytest_dflash.measure.timing_child import WorkerContext
    from pytest_dflash.routes.registry import RouteRegistry


class WorkerPlanting:
    """The self-test's hooks in a timing worker (built there as ``WorkerPlanting(policy=...,
    candidates=..., calibrate=...)``)."""

    def __init__(self, policy: Any, candidates: Sequence[str], calibrate: bool = False) -> None:
        self.policy = policy
        self.candidates = list(candidates)
        self.calibrate = calibrate
        self.planted: dict[str, catalogue.Planted] = {}

    @pytest.hookimpl(trylast=True)  # after every plugin registered the originals
    def pytest_dflash_routes(self, registry: RouteRegistry) -> None:
        """Register the planted routes of the session's selected candidates."""
        originals = [registry.get(name) for name in self.candidates]
        for planted in catalogue.plan(originals, registry, self.policy, calibrate=self.calibrate):
            registry.register(wrappers.as_route(planted, registry, self.policy))
            self.planted[planted.name] = planted

    @pytest.hookimpl(tryfirst=True)
    def pytest_dflash_engine(self, config: WorkerContext, selection: dict[str, str],
                             profile: str) -> Engine | None:
        """A planted prefill.geometry route's engine: the worker's served engine, wrapped."""
        return engine.build(config, selection, profile, self.planted, self.policy)


def worker_plugin(candidates: Sequence[str], calibrate: bool) -> dict[str, Any]:
    """The entry of a timing worker spec's ``worker_plugins`` that plants the routes of
    ``candidates`` in every worker (``calibrate``: the timing calibration set)."""
    return {"factory": f"{__name__}:WorkerPlanting",
            "kwargs": {"candidates": list(candidates), "calibrate": bool(calibrate)}}
