"""The fixtures pytest-dflash offers to gate tests (registered by the plugin at configure).

A gate test takes ``dflash_gate`` and little else; the narrower fixtures remain for tests that
need one thing only (and for suites written against them before ``dflash_gate`` existed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_dflash import settings
from pytest_dflash.evidence import compact
from pytest_dflash.measure import progress
from pytest_dflash.measure.gate import GateContext
from pytest_dflash.measure.timing_pool import TimingSetup
from pytest_dflash.native import hits
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes.registry import Route, RouteRegistry
from pytest_dflash.session import engine_factory
from pytest_dflash.session.collection import upcoming_tests
from pytest_dflash.session.environment import profile_of, sidecar_path, torch_device
from pytest_dflash.session.state import CANDIDATE_CODE, binding, state_of


@pytest.fixture
def dflash_route(request: pytest.FixtureRequest) -> Route:
    """The candidate route this gate test measures (parametrized by the plugin from the gate
    marker). A route whose probe says it cannot run here is skipped with that reason, which
    leaves its gate pending."""
    if not hasattr(request, "param"):
        raise pytest.UsageError(f"{request.node.nodeid}: `dflash_route` is only available to "
                                "tests marked @pytest.mark.gate(kind, family=...)")
    reason = request.param.unavailable_reason()
    if reason:
        pytest.skip(f"{request.param.name} unavailable here: {reason}")
    return request.param


@pytest.fixture(scope="session")
def dflash_registry(pytestconfig: pytest.Config) -> RouteRegistry:
    """Every route and family registered this session (shipped, conftests, plugins)."""
    return state_of(pytestconfig).registry


@pytest.fixture(scope="session")
def dflash_policy(pytestconfig: pytest.Config) -> Policy:
    """The predeclared thresholds, with the project's ``[tool.pytest-dflash]`` overrides."""
    return state_of(pytestconfig).policy


@pytest.fixture(scope="session")
def dflash_profile(pytestconfig: pytest.Config) -> str:
    """The session profile: ``quick``, ``ci`` or ``full``."""
    return profile_of(pytestconfig)


@pytest.fixture(scope="session")
def dflash_device(pytestconfig: pytest.Config) -> Any:
    """The gate device as a ``torch.device`` (``--dflash-device``; auto: CUDA if present)."""
    return torch_device(pytestconfig)


@pytest.fixture(scope="session")
def dflash_sidecar(pytestconfig: pytest.Config) -> Path | None:
    """The explicit D256 op library (``--dflash-sidecar`` or its environment variable)."""
    return sidecar_path(pytestconfig)


@pytest.fixture
def dflash_record(request: pytest.FixtureRequest) -> Callable[..., None]:
    """Attach measurements to this gate test: ``dflash_record(figure="...", key=value, ...)``.

    ``figure`` is the one-line figure shown in the verdict table; ``samples`` holds raw timing
    samples. Values must be JSON-serialisable (they travel through xdist and into the report).
    Timing comparisons are kept in the report's compact form (``evidence.compact``): each
    process's summary of all its rounds and a bounded sample of them.
    """
    bound = binding(request.node)
    keep = settings.of(request.config).report_rounds

    def record(**measurements: Any) -> None:
        if bound is None:
            raise RuntimeError(f"{request.node.nodeid} is not a gate test; mark it "
                               "@pytest.mark.gate(kind, family=...) to record measurements")
        merged = compact.measurements({**bound["measurements"], **measurements}, keep)
        bound["measurements"].clear()
        bound["measurements"].update(merged)

    return record


@pytest.fixture(scope="session")
def dflash_engine(pytestconfig: pytest.Config) -> Callable[[dict[str, str]], Any]:
    """Factory: ``dflash_engine(selection)`` builds (once per selection, in the session's one
    engine cache, ``EngineFactory.engine``) an engine via the ``pytest_dflash_engine`` hook;
    the embedded reference engine answers last. An engine that cannot run a selection at all
    (``EngineUnsupported``: a route it cannot switch, a server nobody named) skips the test
    with the engine's reason: the gate stays pending."""
    from pytest_dflash.engines import EngineUnsupported

    def hook(selection: dict[str, str]) -> Any:
        return pytestconfig.hook.pytest_dflash_engine(
            config=pytestconfig, selection=selection, profile=profile_of(pytestconfig))

    def build(selection: dict[str, str]) -> Any:
        try:
            return engine_factory.factory_of(pytestconfig).engine(selection, hook)
        except EngineUnsupported as exc:
            pytest.skip(f"the engine cannot run this selection: {exc}")

    return build


@pytest.fixture
def dflash_gate(request: pytest.FixtureRequest, dflash_route: Route,
                dflash_registry: RouteRegistry, dflash_policy: Policy, dflash_profile: str,
                dflash_device: Any, dflash_record: Callable[..., None],
                dflash_engine: Callable[[dict[str, str]], Any]) -> Iterator[GateContext]:
    """The gate context of this test (``pytest_dflash.measure.gate.GateContext``): the candidate,
    its
    family's baseline, oracle and verify route, policy, profile and sizes, device and dtype,
    case seeds, ``record(...)`` and the baseline/candidate engines. For a route that runs
    another route's code (``Route.hit_source``) that route's hits count as its own for the
    whole test, booked outside the timed calls (``hits.attributed``)."""
    from pytest_dflash.selftest import engine as selftest_engine

    bound = binding(request.node)
    kind = bound["kind"] if bound else request.node.get_closest_marker("gate").args[0]
    config = request.config
    gate = GateContext(route=dflash_route, kind=kind, registry=dflash_registry,
                       policy=dflash_policy, profile=dflash_profile, device=dflash_device,
                       record=dflash_record, engine=dflash_engine,
                       data_dir=settings.of(config).data,
                       servers=lambda: engine_factory.factory_of(config).servers(),
                       rebuildable=lambda engine: engine_factory.factory_of(config).rebuildable(
                           selftest_engine.unwrapped(engine)),
                       timing=TimingSetup(pool=state_of(config).timing_pool,
                                          sinks=progress.sinks_of(config),
                                          looks=state_of(config).shared_looks),
                       upcoming=lambda: upcoming_tests(request.node))
    request.node.stash[CANDIDATE_CODE] = gate.candidate_code  # read if the test raises
    if dflash_route.hit_source is None:
        yield gate
        return
    with hits.attributed(dflash_route.hit_source, dflash_route.name):
        yield gate
