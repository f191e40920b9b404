"""The shipped families (and the kernel libraries') offer exactly the gate kinds the shipped
suites measure, the shipped routes declare the seed's plan (docs/gates.md, "The seed's test
plan"), and the registry refuses a kind a family cannot run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pytest_dflash import Family, RegistryError, Route, RouteRegistry
from pytest_dflash.routes.library import FAMILIES as LIBRARY_FAMILIES
from pytest_dflash.routes.shipped import SHIPPED_FAMILIES, SHIPPED_ROUTES, pytest_dflash_routes

SUITE_KINDS = """
import importlib, json, pkgutil
import dflash_suites
from pytest_dflash.routes.shipped import SHIPPED_ROUTES
routes = {route.name: route for route in SHIPPED_ROUTES}
found = {}
for info in pkgutil.iter_modules(dflash_suites.__path__):
    if not info.name.startswith("test_"):
        continue
    module = importlib.import_module(f"dflash_suites.{info.name}")
    for test in vars(module).values():
        for mark in getattr(test, "pytestmark", []):
            if mark.name != "gate":
                continue
            families = mark.kwargs.get("family") or routes[mark.kwargs["route"]].family
            for family in (families,) if isinstance(families, str) else families:
                found.setdefault(family, set()).add(mark.args[0])
print(json.dumps({family: sorted(kinds) for family, kinds in found.items()}))
"""


def suite_kinds() -> dict[str, set[str]]:
    """family -> the kinds the gate markers of the shipped suites (dflash_suites) measure, read
    in a child interpreter (importing every suite module here would leave them in this one)."""
    done = subprocess.run([sys.executable, "-c", SUITE_KINDS], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {family: set(kinds) for family, kinds in json.loads(done.stdout).items()}


def test_shipped_families_offer_what_the_suites_measure() -> None:
    measured = suite_kinds()
    families = (*SHIPPED_FAMILIES, *LIBRARY_FAMILIES)  # the kernel libraries' too
    assert {f.name: set(f.gates) for f in families} == measured
    # the model-level gates serve every family the engine applies
    for family in families:
        assert {"prefill", "ppl", "quality"} <= set(family.gates), family.name


def test_shipped_routes_declare_the_seeds_plan() -> None:
    gates = {route.name: route.gates for route in SHIPPED_ROUTES}
    assert gates["gemm.nvfp4.qpn2_packed"] == ("parity", "prefill", "validation_cost", "ppl",
                                               "quality")
    assert gates["attn.d256.fa2"] == ("loader", "parity", "speed", "prefill")
    assert gates["gemm.nvfp4.qpn4_bounded"] == ("parity", "speed")  # the microbenchmark
    assert all("speed" not in gates[name] for name in gates if name.startswith("prefill."))
    registry = RouteRegistry()
    pytest_dflash_routes(registry)
    registry.validate()  # every shipped declaration is one its family can run


def _registry(route: Route) -> RouteRegistry:
    registry = RouteRegistry()
    pytest_dflash_routes(registry)
    registry.register(route)
    return registry


def test_a_kind_the_family_does_not_offer_is_refused_with_the_kinds_it_does() -> None:
    registry = _registry(Route("gemm.nvfp4.mine", "gemm.nvfp4", "candidate",
                               baseline="gemm.nvfp4.turbomind", gates=("ppl", "loader")))
    with pytest.raises(RegistryError, match=(
            r"route 'gemm.nvfp4.mine' declares gate 'loader', which no test of family "
            r"'gemm.nvfp4' measures .*the family offers: parity, speed, prefill, "
            r"validation_cost, ppl, quality\.")):
        registry.validate()


def test_a_model_level_kind_of_an_attention_or_gemm_route_is_accepted() -> None:
    for route in (Route("gemm.nvfp4.mine", "gemm.nvfp4", "candidate",
                        baseline="gemm.nvfp4.turbomind", gates=("ppl", "quality", "prefill")),
                  Route("attn.d256.mine", "attn.d256", "candidate", baseline="attn.d256.sdpa",
                        gates=("prefill", "ppl"))):
        _registry(route).validate()


def test_an_undeclared_family_offers_no_kinds_and_says_how_to_declare_them() -> None:
    registry = RouteRegistry()
    registry.register(Route("toy.add.base", "toy.add", "baseline"))
    registry.register(Route("toy.add.fast", "toy.add", "candidate", baseline="toy.add.base",
                            gates=("parity",)))
    with pytest.raises(RegistryError, match=r"family 'toy.add' is not declared.*"
                                            r"registry.declare\(Family\('toy.add'"):
        registry.validate()
    registry.declare(Family("toy.add", None, baseline="toy.add.base", gates=("parity",)))
    registry.validate()


def test_a_family_declares_only_known_kinds() -> None:
    from pytest_dflash.routes.vocabulary import UnknownNameError

    with pytest.raises(UnknownNameError, match="unknown gate kind 'perplexity'"):
        Family("toy.add", None, baseline="toy.add.base", gates=("perplexity",))
