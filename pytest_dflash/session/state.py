"""Session state: what the plugin knows about a run.

``DflashState`` (one per config, stashed) holds the registry, the policy, the selection made
by ``--dflash-route`` / ``--dflash-gate``, the run's timing pool and the plugins its timing
workers register. A gate test's binding (route, kind, measurements) travels in its
``user_properties``; ``session.collector`` folds them into the report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pytest_dflash import settings
from pytest_dflash.measure import timing_pool
from pytest_dflash.policy.profiles import with_profile_timing
from pytest_dflash.policy.thresholds import Policy, PolicyError, load_policy
from pytest_dflash.routes import library, origin, shipped
from pytest_dflash.routes.registry import RegistryError, Route, RouteRegistry
from pytest_dflash.routes.vocabulary import UnknownNameError, check_kind, check_profile
from pytest_dflash.session import shard
from pytest_dflash.session.environment import (
    device_info,
    profile_of,
    torch_device,
)

STATE = pytest.StashKey["DflashState"]()
# the gate context's candidate objects of a test, to tell whose code raised (routes.origin)
CANDIDATE_CODE = pytest.StashKey[origin.CandidateCode]()
PROPERTY = "dflash"  # user_properties key: travels with reports through xdist
# the gate context's candidate objects of a test, to tell whose code raised (routes.origin)
CANDIDATE_CODE = pytest.StashKey[origin.CandidateCode]()


class DflashState:
    """Everything the plugin knows about this session, stashed on the config."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.registry = RouteRegistry()
        # the predeclared policy with the project's overrides; ``policy`` adds the profile's
        # timing size once the profile is known
        self.thresholds = Policy()
        self._sized: Policy | None = None
        self.selected_routes: set[str] = set()
        self.selected_gates: set[tuple[str, str]] = set()
        self.timing_pool: timing_pool.TimingPool | None = None
        # first looks timed for a group of routes, waiting for their own gates (SharedLook)
        self.shared_looks: dict[tuple[str, str], Any] = {}
        # plugins every timing worker registers too (the self-test's): WorkerSpec.worker_plugins
        self.worker_plugins: list[dict[str, Any]] = []
        self.planted: dict[str, dict[str, Any]] = {}  # route -> its report field ``planted``
        self.shard: dict[str, Any] | None = None  # --dflash-shard: the report field ``shard``

    @property
    def policy(self) -> Policy:
        """The policy the gates run with: ``thresholds`` sized by the session profile
        (``profiles.with_profile_timing``: quick and ci take one look of the timing processes).

        Sized at the first read, not at configure: an implicit profile (ci on the CPU, full on
        CUDA) is known only once the device is, and asking the device imports torch, which a
        session that runs no gate never does. Code that runs at configure reads
        ``thresholds``, which no profile changes.
        """
        if self._sized is None:
            self._sized = with_profile_timing(self.thresholds, profile_of(self.config))
        return self._sized

    def candidates(self) -> list[Route]:
        """The candidates this run gates: all registered, narrowed by the selection options."""
        routes = self.registry.candidates()
        if self.selected_routes:
            routes = [r for r in routes if r.name in self.selected_routes]
        if self.selected_gates:
            names = {route for route, _ in self.selected_gates}
            routes = [r for r in routes if r.name in names]
        return routes


def state_of(config: pytest.Config) -> DflashState:
    return config.stash[STATE]


def start(config: pytest.Config) -> DflashState:
    """Set the session up: routes from every plugin, policy, selection, sidecar, timing pool.

    Every mistake here (unknown route or kind, bad override, missing sidecar, CUDA asked for
    without one) is a ``pytest.UsageError`` naming the fix, raised before any test runs.
    """
    asked = settings.of(config)
    if asked.shard is not None:  # --dflash-shard K/N: a malformed one is refused at once
        try:
            shard.parse(asked.shard)
        except shard.ShardError as exc:
            raise pytest.UsageError(str(exc)) from None
    state = DflashState(config)
    config.stash[STATE] = state
    if not config.pluginmanager.is_registered(shipped):
        config.pluginmanager.register(shipped, "dflash-shipped-routes")
    if not config.pluginmanager.is_registered(library):  # the library families' references
        config.pluginmanager.register(library, "dflash-library-families")
    if asked.engine == "hf":  # the transformers engine's own routes, only while it is selected
        from pytest_dflash.engines import transformers as hf_engine

        if not config.pluginmanager.is_registered(hf_engine):
            config.pluginmanager.register(hf_engine, "dflash-hf-routes")
    try:
        state.thresholds = load_policy(config.rootpath)
        if asked.profile:  # an unknown profile is a usage error now, before any test runs
            check_profile(asked.profile)
        config.hook.pytest_dflash_routes(registry=state.registry)
        route_plugins = list(config.hook.pytest_dflash_routes.get_hookimpls())
        state.registry.validate()
        _select(state, asked)
        if asked.selftest:
            from pytest_dflash.selftest.session import start as start_selftest

            start_selftest(config, state)
    except (RegistryError, UnknownNameError, PolicyError) as exc:
        raise pytest.UsageError(f"pytest-dflash: {exc}") from None
    settings.export_to_children(asked)
    if asked.device == "cuda":
        device_info(config)  # an explicit device is checked now, as a usage error
    state.timing_pool = timing_pool.TimingPool(
        lambda: _worker_spec(config, state, route_plugins),
        size=state.thresholds.timing_processes,
        timeout_s=state.thresholds.timing_worker_timeout_s)
    return state


def _worker_spec(config: pytest.Config, state: DflashState,
                 route_plugins: list[Any]) -> timing_pool.WorkerSpec:
    """The gate's environment as the timing workers rebuild it: its device, thread count,
    profile and policy, the plugins that registered routes, the session's worker plugins."""
    import torch

    return timing_pool.WorkerSpec(
        device=str(torch_device(config)), threads=torch.get_num_threads(),
        profile=profile_of(config), policy=state.policy.as_dict(),
        plugins=timing_pool.plugin_references(route_plugins),
        worker_plugins=list(state.worker_plugins), hf_model=_hf_model(config),
        hf_dtype=settings.of(config).hf_dtype)


def _hf_model(config: pytest.Config) -> str | None:
    model = settings.of(config).hf_model
    return None if model is None else str(model)


def stop(config: pytest.Config) -> None:
    """Stop the run's timing workers (also on an aborted run)."""
    state = config.stash.get(STATE, None)
    pool = getattr(state, "timing_pool", None)
    if pool is not None:
        pool.close()


def _select(state: DflashState, asked: settings.Settings) -> None:
    for name in asked.routes:
        route = state.registry.get(name)
        if route.role != "candidate":
            raise UnknownNameError(f"--dflash-route {name}: only candidate routes are gated "
                                   f"({name} is the {route.role})")
        state.selected_routes.add(name)
    for spec in asked.gates:
        name, sep, kind = spec.rpartition(":")
        if not sep or not name:
            raise UnknownNameError(f"--dflash-gate {spec!r} must look like ROUTE:KIND, "
                                   f"e.g. attn.d256.fa2:speed")
        route = state.registry.get(name)
        check_kind(kind)
        if kind not in route.gates:
            raise UnknownNameError(f"--dflash-gate {spec}: route {name} does not require a "
                                   f"{kind} gate; its gates: {', '.join(route.gates) or 'none'}")
        state.selected_gates.add((name, kind))


def bind(item: pytest.Item, route: Route, kind: str) -> None:
    """Bind a gate test to its route and kind; the binding carries its measurements."""
    item.user_properties.append((PROPERTY, {"route": route.name, "kind": kind,
                                            "measurements": {}}))


def binding(item_or_report: Any) -> dict[str, Any] | None:
    """The route/kind/measurements binding of a gate test item or report, None for others."""
    for key, value in item_or_report.user_properties:
        if key == PROPERTY:
            return value
    return None


def record_raised(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """Record in a gate test's binding what it raised, if it raised anything but a decision
    (an assertion, ``pytest.fail``), a skip or an expected failure: the exception, where it
    was raised and whose code raised it (``routes.origin``). A decision in setup or teardown
    is a fixture's, so the harness's. The first exception of a test is kept."""
    bound = binding(item)
    excinfo = call.excinfo
    if bound is None or excinfo is None or "raised" in bound:
        return
    if excinfo.errisinstance((pytest.skip.Exception, pytest.xfail.Exception)):
        return
    if item.get_closest_marker("xfail") is not None:
        return  # the self-test's planted defects: judged by their own expected-failure rule
    exc = excinfo.value
    if call.when == "call" and origin.is_decision(exc):
        return
    raised = origin.describe(exc, item.stash.get(CANDIDATE_CODE, None),
                             root=str(item.config.rootpath))
    if origin.is_decision(exc):  # past the return above only in setup or teardown: a fixture's
        raised = dataclasses.replace(raised, origin=origin.HARNESS)
    bound["raised"] = raised.as_dict()
