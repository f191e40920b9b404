"""Collection: gate markers become tests bound to routes, sizes and the run's selection.

``@pytest.mark.gate(kind, family=... | route=..., per_size=...)`` is the only thing a gate test
declares (``family=`` names one family or a tuple of them). From it this module parametrizes
``dflash_route`` over the family's candidates that require the gate (and are selected),
parametrizes ``size`` over the profile's sizes (``pytest_dflash.policy.profiles``), binds every
item to its route and kind for the report, drops what ``--dflash-gate`` did not ask for, and at
setup refuses timing gates inside xdist workers that own no GPU and skips SM70-only tests
elsewhere (a skip leaves the gate pending, never passed).
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_dflash import settings
from pytest_dflash.policy.profiles import per_size_values
from pytest_dflash.routes.registry import Route
from pytest_dflash.routes.vocabulary import (
    EXCLUSIVE_KINDS,
    GATE_KINDS,
    UnknownNameError,
    check_kind,
)
from pytest_dflash.session import saved_runs as reporting
from pytest_dflash.session import settled, shard
from pytest_dflash.session.environment import device_info, profile_of
from pytest_dflash.session.state import bind, binding, state_of
from pytest_dflash.xdist import plugin as xdist_gpus

GATE_KEYWORDS = frozenset({"family", "route", "per_size"})


def gate_marker(definition: Any) -> tuple[str, str | None, str | None, Any] | None:
    """(kind, family, route, per_size) of a test's gate marker, None for other tests."""
    marker = definition.get_closest_marker("gate")
    if marker is None:
        return None
    if len(marker.args) != 1:
        raise ValueError("@pytest.mark.gate takes exactly one gate kind, e.g. gate('parity', "
                         f"family='attn.d256'); known kinds: {', '.join(GATE_KINDS)}")
    kind = check_kind(marker.args[0])
    unknown = set(marker.kwargs) - GATE_KEYWORDS
    if unknown:
        raise ValueError(f"@pytest.mark.gate({kind!r}) got unknown keywords {sorted(unknown)}; "
                         f"known: {', '.join(sorted(GATE_KEYWORDS))}")
    family, route = marker.kwargs.get("family"), marker.kwargs.get("route")
    if (family is None) == (route is None):
        raise ValueError(f"@pytest.mark.gate({kind!r}) needs exactly one of family= or route=")
    return kind, family, route, marker.kwargs.get("per_size")


def generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize a gate test over its routes (and its profile sizes, with ``per_size=``)."""
    gate = gate_marker(metafunc.definition)
    if gate is None:
        return
    kind, family, route_name, per_size = gate
    if "dflash_route" not in metafunc.fixturenames:
        raise ValueError(f"{metafunc.definition.nodeid}: a gate test must take the "
                         "`dflash_route` fixture (or `dflash_gate`, which includes it) so its "
                         "outcome is bound to a route")
    state = state_of(metafunc.config)
    if route_name is not None:
        routes = [state.registry.get(route_name)]
    else:
        # one family, or a tuple of them: a model-level gate serves every family an engine applies
        families = (family,) if isinstance(family, str) else tuple(family or ())
        for name in families:
            if name not in state.registry.families():
                raise UnknownNameError(f"unknown family {name!r}; known families: "
                                       f"{', '.join(state.registry.families())}")
        routes = [r for name in families for r in state.registry.candidates(name, kind)]
    selected = {r.name for r in state.candidates()}
    routes = [r for r in routes if r.name in selected and kind in r.gates]
    metafunc.parametrize("dflash_route", routes, ids=[r.name for r in routes], indirect=True)
    if per_size is not None:
        if "size" not in metafunc.fixturenames:
            raise ValueError(f"{metafunc.definition.nodeid}: gate(per_size=...) parametrizes "
                             "the `size` argument; add it to the test's signature")
        values = per_size_values(per_size, profile_of(metafunc.config))
        metafunc.parametrize("size", values, ids=[f"T{v}" for v in values])


def modify_items(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Bind gate items to route and kind, add the kind as a marker, apply ``--dflash-gate``."""
    state = state_of(config)
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        callspec = getattr(item, "callspec", None)
        route = callspec.params.get("dflash_route") if callspec else None
        if not isinstance(route, Route):  # pytest's empty parameter set (NOTSET): no route
            route = None
        marker = item.get_closest_marker("gate")
        if route is None or marker is None:
            (drop if state.selected_gates else keep).append(item)
            continue
        kind = marker.args[0]
        item.add_marker(kind)
        bind(item, route, kind)
        if callspec is not None and not serves_dtype(route, callspec.params.get("dtype")):
            drop.append(item)
        elif state.selected_gates and (route.name, kind) not in state.selected_gates:
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    reporting.deselect_skipped_benchmarks(config, items, lambda item: binding(item) is not None)


def upcoming_tests(item: pytest.Item) -> list[tuple[Route, dict[str, Any]]]:
    """The route and parameters of every later test of ``item``'s test function in this
    session whose gate has not failed (``settled``): the tests whose first look a gate may
    time with its own (``GateContext.peers``). Empty in an xdist worker, which runs a share
    of the items it collected."""
    items = item.session.items
    if hasattr(item.config, "workerinput") or item not in items:
        return []
    found = []
    for later in items[items.index(item) + 1:]:
        bound = binding(later)
        callspec = getattr(later, "callspec", None)
        if (bound is None or callspec is None or later.path != item.path
                or getattr(later, "originalname", None) != getattr(item, "originalname", None)
                or settled.failed_at(item.config, bound["route"], bound["kind"])):
            continue
        route = callspec.params.get("dflash_route")
        if isinstance(route, Route):
            found.append((route, {k: v for k, v in callspec.params.items()
                                  if k != "dflash_route"}))
    return found


def serves_dtype(route: Route, dtype: Any) -> bool:
    """Whether a gate test parametrized with ``dtype`` (a torch dtype or its name; None: not
    parametrized) applies to ``route``: every dtype does unless the route declares the ones
    its kernels take (``Route.dtypes``)."""
    if dtype is None or not route.dtypes:
        return True
    return str(dtype).removeprefix("torch.") in route.dtypes


def check_setup(item: pytest.Item) -> None:
    """Skip, with the reason, what must not run here: a test of a gate that has already failed
    for its route (``settled``), timing gates in an xdist worker that does not own a GPU (they
    never share the device; docs/multi-gpu.md) and ``requires_sm70`` tests off SM70 hardware.
    A gate test that runs records the GPU that measures it."""
    settled.check(item)
    bound = binding(item)
    if bound and bound["kind"] in EXCLUSIVE_KINDS:
        refusal = xdist_gpus.timing_refusal(item.config, device_info)
        if refusal:
            pytest.skip(f"refused: {bound['kind']} gates {refusal}")
    if item.get_closest_marker("requires_sm70"):
        reason = sm70_missing(item.config)
        if reason:
            pytest.skip(f"requires SM70 hardware: {reason}")
    if bound:
        bound["gpu"] = xdist_gpus.gpu_record(item.config, device_info)


def sm70_missing(config: pytest.Config) -> str | None:
    """Why this session is not on an SM70 (compute capability 7.0) device, None if it is."""
    info = device_info(config)
    if info["type"] != "cuda":
        return f"running on {info['name']}"
    if info.get("capability") != "7.0":
        return f"{info['name']} has capability {info.get('capability')}, not 7.0"
    return None


def select_shard(config: pytest.Config, items: list[pytest.Item]) -> dict[str, Any] | None:
    """Keep this shard's share of ``items`` (after every other selection), deselect the rest;
    the plan's record, or None without ``--dflash-shard``."""
    asked = settings.of(config)
    if asked.shard is None:
        return None
    spec = shard.parse(asked.shard)
    try:
        costs, source = shard.load_costs(asked.shard_costs, config.rootpath)
    except shard.ShardError as exc:
        raise pytest.UsageError(str(exc)) from None
    tests = []
    for item in items:
        bound = binding(item) or {}
        tests.append((item.nodeid, bound.get("route"), bound.get("kind")))
    where = shard.plan(tests, costs, spec.count)
    keep = [item for item in items if where[item.nodeid] == spec.index]
    drop = [item for item in items if where[item.nodeid] != spec.index]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    return shard.record(spec, tests, where, source)
