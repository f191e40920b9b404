"""Family declarations, the gate context built on them, and profile sizes (docs/extending.md)."""

from __future__ import annotations

import pytest

from pytest_dflash import Family, RegistryError, Route, RouteRegistry
from pytest_dflash.measure.gate import GateContext, case_seed
from pytest_dflash.policy.profiles import SIZES, per_size_values
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes.families import AttnD256, GemmNvfp4, contract_calls
from pytest_dflash.routes.shipped import pytest_dflash_routes as shipped_routes


def _toy(verify_route: str | None = None) -> RouteRegistry:
    registry = RouteRegistry()
    registry.declare(Family("toy.mul", AttnD256, baseline="toy.mul.base", oracle="toy.mul.exact",
                            verify_route=verify_route, gates=("parity", "validation_cost")))
    registry.register(Route("toy.mul.exact", "toy.mul", "oracle"))
    registry.register(Route("toy.mul.base", "toy.mul", "baseline"))
    registry.register(Route("toy.mul.fast", "toy.mul", "candidate", baseline="toy.mul.base",
                            gates=("parity",)))
    return registry


def test_contract_calls_are_the_protocol_methods() -> None:
    assert contract_calls(AttnD256) == ("dense", "paged")
    assert contract_calls(GemmNvfp4) == ("prepare", "linear", "gate_up")


def test_shipped_families_validate_and_name_their_routes() -> None:
    registry = RouteRegistry()
    shipped_routes(registry)
    registry.validate()
    gemm = registry.family_of("gemm.nvfp4")
    assert gemm.verify_route == "gemm.nvfp4.qpn2"
    assert registry.role("gemm.nvfp4", "oracle").name == "gemm.nvfp4.oracle"
    assert registry.family_of("attn.d256").verify_route is None


@pytest.mark.parametrize(
    ("family", "message"),
    [
        (Family("toy.mul", None, baseline="toy.mul.gone"), "declares baseline 'toy.mul.gone'"),
        (Family("toy.mul", None, baseline="toy.mul.exact"), "registered with role 'oracle'"),
        (Family("toy.mul", None, baseline="toy.mul.base", verify_route="other.fam.x"),
         "declares verify_route 'other.fam.x', which is not a registered route of that family"),
    ],
)
def test_family_declarations_are_checked_against_the_routes(family: Family, message: str) -> None:
    registry = RouteRegistry()
    registry.declare(family)
    registry.register(Route("toy.mul.exact", "toy.mul", "oracle"))
    registry.register(Route("toy.mul.base", "toy.mul", "baseline"))
    with pytest.raises(RegistryError, match=message):
        registry.validate()


def test_a_family_is_declared_once() -> None:
    registry = _toy()
    with pytest.raises(RegistryError, match="declared twice"):
        registry.declare(Family("toy.mul", None, baseline="toy.mul.base"))


def test_undeclared_family_is_derived_from_roles() -> None:
    registry = RouteRegistry()
    registry.register(Route("toy.add.base", "toy.add", "baseline"))
    family = registry.family_of("toy.add")
    assert (family.contract, family.baseline, family.oracle) == (None, "toy.add.base", None)


def test_contract_check_names_the_missing_calls() -> None:
    class DenseOnly:
        def dense(self, *args):
            return None

    family = _toy().family_of("toy.mul")
    with pytest.raises(TypeError, match=r"lacks paged; a toy.mul route must implement "
                                        r"pytest_dflash.routes.families.AttnD256 \(dense, paged\)"):
        family.check(DenseOnly(), "toy.mul.fast")


def _context(registry: RouteRegistry, recorded: dict) -> GateContext:
    return GateContext(route=registry.get("toy.mul.fast"), kind="parity", registry=registry,
                       policy=Policy(), profile="quick", device="cpu",
                       record=recorded.update, engine=lambda selection: dict(selection))


def test_gate_context_resolves_routes_through_the_family() -> None:
    recorded: dict = {}
    gate = _context(_toy(verify_route="toy.mul.base"), recorded)
    assert gate.baseline_route.name == "toy.mul.base"
    assert gate.oracle_route.name == "toy.mul.exact"
    assert gate.verify_route.name == "toy.mul.base"
    assert gate.seed("a", 1) == case_seed(Policy(), "a", 1) != gate.seed("a", 2)
    assert gate.sizes is SIZES["quick"]
    gate.record(figure="f", x=1)
    assert recorded == {"figure": "f", "x": 1}
    baseline, candidate = gate.engines()
    assert baseline["toy.mul"] == "toy.mul.base" and candidate["toy.mul"] == "toy.mul.fast"


def test_gate_context_without_verify_route_says_how_to_declare_it() -> None:
    gate = _context(_toy(), {})
    with pytest.raises(LookupError, match="declares no verify_route"):
        gate.verify_route  # noqa: B018


def test_a_route_can_name_its_own_verify_route() -> None:
    """Like ``Route.baseline``, ``Route.verify_route`` overrides the family's for that route
    (the self-test compares a wrapped route with the verify route wrapped the same way)."""
    registry = _toy(verify_route="toy.mul.base")
    registry.register(Route("toy.mul.other", "toy.mul", "baseline"))
    registry.register(Route("toy.mul.mine", "toy.mul", "candidate", baseline="toy.mul.base",
                            gates=("validation_cost",), verify_route="toy.mul.other"))
    registry.validate()
    mine = GateContext(route=registry.get("toy.mul.mine"), kind="validation_cost",
                       registry=registry, policy=Policy(), profile="quick", device="cpu",
                       record=lambda **_: None, engine=lambda selection: dict(selection))
    assert mine.verify_route.name == "toy.mul.other"
    assert _context(registry, {}).verify_route.name == "toy.mul.base"  # the family's


@pytest.mark.parametrize("name", ["toy.mul.gone", "toy.add.base"])
def test_a_routes_verify_route_must_be_a_route_of_its_family(name: str) -> None:
    registry = _toy(verify_route="toy.mul.base")
    registry.register(Route("toy.add.base", "toy.add", "baseline"))
    registry.register(Route("toy.mul.mine", "toy.mul", "candidate", baseline="toy.mul.base",
                            gates=("validation_cost",), verify_route=name))
    with pytest.raises(RegistryError, match=f"names verify_route '{name}', which is not a "
                                            "registered route of family 'toy.mul'"):
        registry.validate()


def test_per_size_values() -> None:
    assert per_size_values("attn_speed_t", "ci") == SIZES["ci"].attn_speed_t
    assert per_size_values({"quick": 3, "ci": (1, 2), "full": [4]}, "quick") == (3,)
    with pytest.raises(ValueError, match="names no profile size; known: ppl_segments"):
        per_size_values("attn_speedt", "ci")
    with pytest.raises(ValueError, match="no entry for profile 'full'"):
        per_size_values({"quick": (1,)}, "full")


TOY = """
from pytest_dflash import Family, Route
def pytest_dflash_routes(registry):
    registry.declare(Family("toy.mul", None, baseline="toy.mul.base", gates=("parity",)))
    registry.register(Route("toy.mul.base", "toy.mul", "baseline"))
    registry.register(Route("toy.mul.fast", "toy.mul", "candidate", baseline="toy.mul.base",
                            gates=("parity",)))
"""


def test_per_size_marker_parametrizes_size_for_the_profile(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_sizes="""
        import pytest

        @pytest.mark.gate("parity", family="toy.mul",
                          per_size={"quick": (8,), "ci": (16, 32), "full": (64,)})
        def test_sized(dflash_gate, size):
            dflash_gate.record(figure=f"size {size}")
            assert dflash_gate.profile in ("quick", "ci")
    """)
    result = pytester.runpytest("--dflash-profile", "ci", "-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_sized?toy.mul.fast-T16? PASSED*",
                                 "*test_sized?toy.mul.fast-T32? PASSED*"])


def test_unknown_gate_marker_keyword_is_a_collection_error(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(TOY)
    pytester.makepyfile(test_bad="""
        import pytest

        @pytest.mark.gate("parity", family="toy.mul", sizes="attn_speed_t")
        def test_bad(dflash_gate):
            pass
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*got unknown keywords ?'sizes'?; known: family, per_size, "
                                 "route*"])
