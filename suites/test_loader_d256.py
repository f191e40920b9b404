"""Loader gate of family attn.d256 (docs/gates.md, "loader").

Every loader state is exercised for real, each scenario in its own process, with real library
files: the full and dense-only builds of ``kernels/csrc``, copies of the full build at other paths
(sidecar and clash), a file of random bytes, a text file and a path that does not exist. A route
that claims the native ops must run them where they are real (hits on the route itself) and must
refuse, never fall back silently, where they are not.

The clash scenario is checked against a control: the very same two files loaded without the
loader must abort the child (SIGABRT), so the refusal is proven to have prevented a real abort.
"""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path

import pytest

from dflash_suites.support.loader import Outcome, Scenario, library_files, run_scenarios
from pytest_dflash.native.loader import file_sha256

pytestmark = pytest.mark.sm70

FAMILY = "attn.d256"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return library_files(tmp_path_factory.mktemp("d256_libraries"))


def scenarios_for(impl: str, files: dict[str, Path], device: str) -> list[Scenario]:
    """Every scenario on the gate's device: the loader verifies the ops there and the route
    runs there, so this gate cannot pass on a device where the parity gate finds no kernel."""
    f = {name: str(path) for name, path in files.items()}
    scenarios = [
        Scenario("bundled", route_impl=impl),
        Scenario("missing", bundled=None, route_impl=impl),
        Scenario("partial", bundled=f["dense_only"], route_impl=impl),
        Scenario("sidecar", bundled=None, sidecar=f["sidecar_copy"], route_impl=impl),
        Scenario("sidecar_env", bundled=None, sidecar_env=f["sidecar_copy"], route_impl=impl),
        Scenario("corrupt", bundled=None, sidecar=f["random"], route_impl=impl),
        Scenario("not_a_library", bundled=None, sidecar=f["text"], route_impl=impl),
        Scenario("nonexistent", bundled=None, sidecar=f["nonexistent"], route_impl=impl),
        Scenario("partial_with_sidecar", bundled=f["dense_only"], sidecar=f["sidecar_copy"],
                 route_impl=impl),
        Scenario("clash", bundled=None, first_sidecar=f["sidecar_copy"],
                 sidecar=f["clash_copy"], route_impl=impl),
        Scenario("clash_foreign", bundled=None, preload=f["sidecar_copy"],
                 sidecar=f["clash_copy"], route_impl=impl),
        Scenario("clash_control", raw_load=f["sidecar_copy"], preload=f["clash_copy"]),
        Scenario("sidecar_while_bundled", sidecar=f["sidecar_copy"], route_impl=impl),
    ]
    return [dataclasses.replace(s, device=device) for s in scenarios]


_RESULTS: dict[str, dict[str, Outcome]] = {}


@pytest.fixture
def outcomes(dflash_gate, files) -> dict[str, Outcome]:
    """All scenarios of this route, run once (concurrently, one process each)."""
    route = dflash_gate.route
    if not isinstance(route.impl, str):
        pytest.fail(f"{route.name}: the loader gate runs the route in child processes "
                    "and needs its impl as a 'module:attribute' string, got "
                    f"{type(route.impl).__name__}")
    key = f"{route.name}@{dflash_gate.device}"
    if key not in _RESULTS:
        _RESULTS[key] = run_scenarios(scenarios_for(route.impl, files, str(dflash_gate.device)))
    return _RESULTS[key]


def ran_natively(o: Outcome, route: str) -> None:
    assert o.call is not None and o.call["ok"], f"route call failed: {o.describe()}"
    assert o.call["hits"] == {f"{route}/dense": 1}, (
        f"the route did not run its own op exactly once (hits {o.call['hits']}): {o.describe()}")


def refused_to_run(o: Outcome, route: str) -> None:
    """No silent fallback: the call raises and records no hit on any route."""
    assert o.call is not None and not o.call["ok"], (
        f"{route} ran although its ops are not real (silent fallback?): {o.describe()}")
    assert o.call["hits"] == {}, o.describe()


def fallback_warnings(o: Outcome) -> list[str]:
    return [w["message"] for w in o.warnings if w["category"] == "DflashFallbackWarning"]


def clean_exit(o: Outcome) -> dict:
    assert o.returncode == 0, f"child did not exit cleanly: {o.describe()}"
    assert o.status is not None, o.describe()
    return o.status


@pytest.mark.gate("loader", family=FAMILY)
def test_bundled_ops_are_real(dflash_gate, outcomes, files):
    o = outcomes["bundled"]
    st = clean_exit(o)
    assert st["state"] == "bundled", o.describe()
    assert st["device"] == str(dflash_gate.device), o.describe()
    assert all(op["present"] and op["verified"] for op in st["ops"].values()), o.describe()
    assert Path(st["realpath"]) == files["full"].resolve(), o.describe()
    assert st["sha256"] == file_sha256(files["full"])
    assert st["cached"], "a second load_d256 call must return the cached status"
    assert fallback_warnings(o) == []
    ran_natively(o, dflash_gate.route.name)
    dflash_gate.record(figure=f"bundled {st['sha256'][:12]} on {st['device']}, ops verified: "
                              f"{', '.join(st['ops'])}",
                       scenario_seconds={n: round(s.seconds, 2) for n, s in outcomes.items()})


@pytest.mark.gate("loader", family=FAMILY)
def test_missing_library_falls_back_with_one_warning(dflash_gate, outcomes):
    o = outcomes["missing"]
    st = clean_exit(o)
    assert st["state"] == "missing" and st["path"] is None, o.describe()
    assert len(fallback_warnings(o)) == 1, o.warnings
    assert "falling back to the family baseline" in fallback_warnings(o)[0]
    refused_to_run(o, dflash_gate.route.name)


@pytest.mark.gate("loader", family=FAMILY)
def test_partial_library_names_the_missing_op(dflash_gate, outcomes, files):
    o = outcomes["partial"]
    st = clean_exit(o)
    assert st["state"] == "partial", o.describe()
    assert st["ops"]["dense"]["verified"] and not st["ops"]["paged"]["present"], o.describe()
    assert st["sha256"] == file_sha256(files["dense_only"])
    (warning,) = fallback_warnings(o)
    assert "paged" in warning and "dense," not in warning, warning
    refused_to_run(o, dflash_gate.route.name)


@pytest.mark.gate("loader", family=FAMILY)
@pytest.mark.parametrize("how", ["sidecar", "sidecar_env"])
def test_explicit_sidecar_ops_are_real(dflash_gate, outcomes, files, how):
    o = outcomes[how]
    st = clean_exit(o)
    assert st["state"] == "sidecar", o.describe()
    assert st["path"] == str(files["sidecar_copy"]), o.describe()
    assert st["sha256"] == file_sha256(files["sidecar_copy"])
    assert all(op["verified"] for op in st["ops"].values()), o.describe()
    assert [lib["realpath"] for lib in o.loaded] == [str(files["sidecar_copy"].resolve())]
    ran_natively(o, dflash_gate.route.name)


@pytest.mark.gate("loader", family=FAMILY)
@pytest.mark.parametrize("case,expected", [
    ("corrupt", "not a loadable op library"),
    ("not_a_library", "not a loadable op library"),
    ("nonexistent", "does not exist"),
])
def test_bad_sidecar_gives_clear_error_and_fallback(dflash_gate, outcomes, case, expected):
    o = outcomes[case]
    st = clean_exit(o)
    assert st["state"] == "missing", o.describe()
    assert expected in (st["error"] or ""), o.describe()
    assert o.loaded == [], "a bad file must never be loaded into the process"
    assert len(fallback_warnings(o)) == 1 and expected in fallback_warnings(o)[0], o.warnings
    refused_to_run(o, dflash_gate.route.name)


@pytest.mark.gate("loader", family=FAMILY)
def test_partial_bundled_library_makes_way_for_the_sidecar(dflash_gate, outcomes, files):
    """A partial bundled build would claim the namespace and shut the sidecar out; the loader
    probes it first, keeps it unloaded and serves the complete sidecar."""
    o = outcomes["partial_with_sidecar"]
    st = clean_exit(o)
    assert st["state"] == "sidecar" and st["path"] == str(files["sidecar_copy"]), o.describe()
    assert [lib["realpath"] for lib in o.loaded] == [str(files["sidecar_copy"].resolve())]
    ran_natively(o, dflash_gate.route.name)


@pytest.mark.gate("loader", family=FAMILY)
def test_clashing_namespace_is_refused_without_abort(dflash_gate, outcomes, files):
    control = outcomes["clash_control"]
    assert control.returncode == -signal.SIGABRT, (
        "control: loading both files without the loader should abort the child, so the clash "
        f"scenario is real; got {control.describe()}")
    clash_copy = str(files["clash_copy"].resolve())
    # a second library after the loader's own first one: refused, the first keeps serving
    o = outcomes["clash"]
    st = clean_exit(o)
    assert "already registered" in (st["error"] or ""), o.describe()
    assert st["state"] == "sidecar" and st["path"] == str(files["sidecar_copy"]), o.describe()
    assert clash_copy not in [lib["realpath"] for lib in o.loaded]
    assert any("already registered" in w["message"] for w in o.warnings), o.warnings
    ran_natively(o, dflash_gate.route.name)
    # a namespace registered behind the loader's back: refused, and those ops are not used
    o = outcomes["clash_foreign"]
    st = clean_exit(o)
    assert "already registered" in (st["error"] or ""), o.describe()
    assert st["state"] == "missing" and o.loaded == [], o.describe()
    refused_to_run(o, dflash_gate.route.name)


@pytest.mark.gate("loader", family=FAMILY)
def test_sidecar_not_loaded_while_bundled_is_complete(dflash_gate, outcomes, files):
    o = outcomes["sidecar_while_bundled"]
    st = clean_exit(o)
    assert st["state"] == "bundled", o.describe()
    assert Path(st["realpath"]) == files["full"].resolve()
    loaded = [lib["realpath"] for lib in o.loaded]
    assert str(files["sidecar_copy"].resolve()) not in loaded, loaded
    assert any("not loaded" in w for w in st["warnings"]), st["warnings"]
    ran_natively(o, dflash_gate.route.name)
