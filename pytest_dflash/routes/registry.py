"""Route records and the registry they are declared into.

A route is data, not code: its implementation is named by a ``"module:attribute"`` string and
only imported when a gate runs it, so registering the whole shipped stack costs no torch import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pytest_dflash.routes.families import Family
from pytest_dflash.routes.vocabulary import (
    DTYPES,
    GATE_KINDS,
    ROLES,
    UnknownNameError,
    check_kind,
)


class RegistryError(ValueError):
    """A route declaration that contradicts the registry (duplicate, dangling baseline, ...)."""


def resolve(target: object) -> Any:
    """Import ``"package.module:attr"`` lazily; anything else (a callable, an implementation
    object, None) passes through."""
    if target is None or not isinstance(target, str):
        return target
    module_name, sep, attr = target.partition(":")
    if not sep:
        raise RegistryError(f"implementation {target!r} must look like 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def selection_key(selection: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The hashable key of an engine selection (family -> route name), the same for any order
    of its items: every cache of engines per selection keys on it."""
    return tuple(sorted(selection.items()))


@dataclass(frozen=True)
class Route:
    """One implementation or setting of a family.

    ``impl`` is what op-level gates call (family-specific contract); ``engine`` maps
    family -> route name and is what model-level gates switch in the engine. ``probe`` returns
    None when the route can run here, otherwise the human reason it cannot (e.g. "needs SM70").
    ``verify_route``, like ``baseline``, overrides the family's for this candidate: the route
    its validation-cost gates compare it with (what serves verification while it is off). The
    gate self-test uses it to compare a wrapped route with the verify route wrapped the same
    way, so the wrapper's own per-call cost is paid on both sides.

    ``server_env`` is what a server started by ``--dflash-serve`` gets in its environment while
    the route is switched on, besides ``NAME=1``: the settings of a server that reads them from
    its environment (llama_cpp.server reads ``FLASH_ATTN``, ``N_UBATCH``, ``TYPE_K``, ...), so
    a route of a stack nobody here wrote is switched by that stack's own settings.
    """

    name: str
    family: str
    role: str
    baseline: str | None = None
    gates: tuple[str, ...] = ()
    default_enabled: bool = False
    impl: object = None  # "module:attribute", or the implementation object itself
    engine: Mapping[str, str] = field(default_factory=dict)
    probe: str | Callable[[], str | None] | None = None
    switch: str | None = None
    description: str = ""
    verify_route: str | None = None
    # the route whose code this one runs unchanged: its hits count as this route's, booked per
    # gate test (``hits.attributed``), so proving what ran costs the timed calls nothing
    hit_source: str | None = None
    server_env: Mapping[str, str] = field(default_factory=dict)
    # the compute dtypes the route's kernels take ("float16", "bfloat16", ...); empty: every
    # one. A gate test parametrized over ``dtype`` runs only these for the route (collection
    # deselects the rest), so a backend with no float32 kernel is judged on what it serves
    # instead of pending forever on what it never claimed
    dtypes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise RegistryError(f"route {self.name!r}: role {self.role!r} is not one of {ROLES}")
        if not self.name.startswith(self.family + "."):
            raise RegistryError(
                f"route {self.name!r} must be named '<family>.<route>' with family {self.family!r}"
            )
        object.__setattr__(self, "gates", tuple(self.gates))
        object.__setattr__(self, "engine", MappingProxyType(dict(self.engine)))
        bad = {k: v for k, v in dict(self.server_env).items()
               if not (isinstance(k, str) and k and isinstance(v, str))}
        if bad:
            raise RegistryError(f"route {self.name!r}: server_env must map non-empty variable "
                                f"names to string values, got {bad!r}; e.g. "
                                "server_env={'N_UBATCH': '128'}")
        object.__setattr__(self, "server_env", MappingProxyType(dict(self.server_env)))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        unknown = [d for d in self.dtypes if d not in DTYPES]
        if unknown:
            raise RegistryError(f"route {self.name!r}: dtypes {unknown} are not torch compute "
                                f"dtypes; use some of {', '.join(DTYPES)}")
        try:
            for kind in self.gates:
                check_kind(kind)
        except UnknownNameError as exc:
            raise RegistryError(f"route {self.name!r}: {exc}") from None
        if self.role == "candidate" and not self.baseline:
            raise RegistryError(f"candidate route {self.name!r} must name its baseline")
        if self.role == "candidate" and not self.gates:
            # with nothing required, every gate it needs would have "run and passed": an accept
            # that no test stands behind
            raise RegistryError(
                f"candidate route {self.name!r} declares no gates, so it could never be judged; "
                f"name the gates it needs, e.g. gates=('parity', 'speed') (kinds: "
                f"{', '.join(GATE_KINDS)})")
        if self.role == "candidate" and self.default_enabled:
            raise RegistryError(f"candidate route {self.name!r} must be default-off until accepted")

    @property
    def short(self) -> str:
        return self.name[len(self.family) + 1 :]

    @property
    def enable_switch(self) -> str:
        """Environment-style switch printed by ``pytest-dflash enable`` for an accepted route."""
        if self.switch:
            return self.switch
        return "DFLASH_" + self.name.upper().replace(".", "_")

    def implementation(self) -> Any:
        return resolve(self.impl)

    def unavailable_reason(self) -> str | None:
        probe = resolve(self.probe)
        return probe() if probe is not None else None


class RouteRegistry:
    """All routes and family declarations of a session, checked as a whole once every plugin
    had its say."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}
        self._families: dict[str, Family] = {}

    def declare(self, family: Family) -> Family:
        """Declare a family's contract and the routes its gates need (``families.Family``)."""
        if not isinstance(family, Family):
            raise RegistryError(f"declare() takes a Family, got {type(family).__name__}")
        if family.name in self._families:
            raise RegistryError(f"family {family.name!r} is declared twice")
        self._families[family.name] = family
        return family

    def register(self, route: Route) -> Route:
        if not isinstance(route, Route):
            raise RegistryError(f"register() takes a Route, got {type(route).__name__}")
        if route.name in self._routes:
            raise RegistryError(f"route {route.name!r} is registered twice")
        self._routes[route.name] = route
        return route

    def validate(self) -> None:
        """Dangling names can only be judged after every plugin registered its routes."""
        for family in self._families.values():
            self._validate_family(family)
        for route in self._routes.values():
            self.check_gates(route)
        for route in self._routes.values():
            if route.baseline is None:
                continue
            base = self._routes.get(route.baseline)
            if base is None:
                raise RegistryError(
                    f"route {route.name!r} names baseline {route.baseline!r}, which is not "
                    f"registered; known routes of family {route.family!r}: "
                    f"{', '.join(r.name for r in self.family(route.family)) or 'none'}"
                )
            if base.family != route.family:
                raise RegistryError(
                    f"route {route.name!r} and its baseline {base.name!r} are of different families"
                )
        for route in self._routes.values():
            source = self._routes.get(route.hit_source) if route.hit_source else None
            if route.hit_source and (source is None or source.family != route.family):
                raise RegistryError(
                    f"route {route.name!r} names hit_source {route.hit_source!r}, which is not "
                    f"a registered route of family {route.family!r}")
            if route.verify_route is None:
                continue
            verify = self._routes.get(route.verify_route)
            if verify is None or verify.family != route.family:
                raise RegistryError(
                    f"route {route.name!r} names verify_route {route.verify_route!r}, which is "
                    f"not a registered route of family {route.family!r}")

    def offered(self, family: str) -> tuple[str, ...]:
        """The gate kinds the gate tests of ``family`` offer: its declaration's ``gates``; a
        family nobody declared offers none (its routes can be oracles and baselines only)."""
        declared = self._families.get(family)
        return declared.gates if declared is not None else ()

    def check_gates(self, route: Route) -> None:
        """Refuse ``route`` if it declares a gate kind no test of its family measures: that gate
        could never run, so the route would stay pending whatever its code does."""
        offered = sorted(self.offered(route.family), key=GATE_KINDS.index)
        unknown = [kind for kind in route.gates if kind not in offered]
        if not unknown:
            return
        if route.family not in self._families:
            raise RegistryError(
                f"route {route.name!r} declares gates {', '.join(unknown)}, but family "
                f"{route.family!r} is not declared, so no gate test is known to measure it; a "
                f"family that brings its own gate tests declares the kinds they offer: "
                f"registry.declare(Family({route.family!r}, contract, baseline=..., "
                f"gates={tuple(route.gates)!r}))")
        raise RegistryError(
            f"route {route.name!r} declares gate {', '.join(map(repr, unknown))}, which no test "
            f"of family {route.family!r} measures (the gate would stay pending forever); the "
            f"family offers: {', '.join(offered) or 'no gate kinds'}. Drop it from the route's "
            f"gates, or bring a gate test of that kind and add it to the family's "
            f"Family(gates=...)")

    def _validate_family(self, family: Family) -> None:
        wanted = {"baseline": family.baseline, "oracle": family.oracle,
                  "verify_route": family.verify_route}
        for part, name in wanted.items():
            if name is None:
                continue
            route = self._routes.get(name)
            if route is None or route.family != family.name:
                raise RegistryError(
                    f"family {family.name!r} declares {part} {name!r}, which is not a registered "
                    f"route of that family; its routes: "
                    f"{', '.join(r.name for r in self.family(family.name)) or 'none'}")
            if part in ("baseline", "oracle") and route.role != part:
                raise RegistryError(f"family {family.name!r} declares {part} {name!r}, but that "
                                    f"route is registered with role {route.role!r}")

    def __contains__(self, name: object) -> bool:
        return name in self._routes

    def __iter__(self):
        return iter(sorted(self._routes.values(), key=lambda r: r.name))

    def __len__(self) -> int:
        return len(self._routes)

    def get(self, name: str) -> Route:
        try:
            return self._routes[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown route {name!r}; known routes: {', '.join(sorted(self._routes))}"
            ) from None

    def family(self, family: str) -> list[Route]:
        return [r for r in self if r.family == family]

    def families(self) -> list[str]:
        return sorted({r.family for r in self._routes.values()})

    def candidates(self, family: str | None = None, kind: str | None = None) -> list[Route]:
        return [
            r
            for r in self
            if r.role == "candidate"
            and (family is None or r.family == family)
            and (kind is None or kind in r.gates)
        ]

    def family_of(self, name: str) -> Family:
        """The declaration of family ``name``; for an undeclared family one derived from its
        registered roles (no contract check, no verify route)."""
        declared = self._families.get(name)
        if declared is not None:
            return declared
        if name not in self.families():
            raise UnknownNameError(f"unknown family {name!r}; known families: "
                                   f"{', '.join(self.families())}")
        return Family(name, contract=None, baseline=self.role(name, "baseline").name,
                      oracle=next((r.name for r in self.family(name) if r.role == "oracle"), None))

    def role(self, family: str, role: str) -> Route:
        """The family's oracle or baseline: the declared one, else the first with that role."""
        declared = self._families.get(family)
        name = getattr(declared, role, None) if declared is not None else None
        if name is not None:
            return self.get(name)
        matches = [r for r in self.family(family) if r.role == role]
        if not matches:
            raise UnknownNameError(f"family {family!r} has no {role} route registered")
        return matches[0]

    def engine_selection(self, names: Iterable[str] = ()) -> dict[str, str]:
        """Family -> route for an engine: every family's baseline, then the named overrides.

        A family may register more than one route of role baseline: the family's own (declared,
        else its first) runs in every engine; another is the ground a candidate names as its
        ``baseline`` when it must be compared on something else (norm_mlp.torch_mlp)."""
        selection = {family: self.role(family, "baseline").name for family in self.families()
                     if any(r.role == "baseline" for r in self.family(family))}
        for name in names:
            route = self.get(name)
            selection[route.family] = route.name
            selection.update(route.engine)
        return selection
