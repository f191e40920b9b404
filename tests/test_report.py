"""Report file mechanics: atomic writes, the published schema, and verdict recomputation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pytest_dflash.evidence import report as reports
from pytest_dflash.evidence.verdict import gate_status, route_verdict
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes.registry import Route
from pytest_dflash.routes.vocabulary import GATE_KINDS, PROFILES, ROLES

ROUTE = Route("toy.a.fast", "toy.a", "candidate", baseline="toy.a.base",
              gates=("parity", "speed"))
FINGERPRINT = {"git_head": "a" * 40, "git_dirty_sha256": None, "kernel_sources_sha256": "b" * 64,
               "sidecar_sha256": None, "python": "3.11.7", "torch": "2.13.0+cpu", "cuda": None,
               "device": "cpu", "libraries": []}


def _evidence() -> dict:
    return reports.new_report(routes=[ROUTE], fingerprint=FINGERPRINT,
                              device={"type": "cpu", "name": "cpu"}, profile="ci",
                              policy=Policy().as_dict())


def test_failed_write_leaves_the_previous_report_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "r.json"
    reports.write_atomic(_evidence(), path)
    before = path.read_text()

    opened = os.fdopen

    class FullDisk:  # the temporary file exists; writing into it fails
        def __init__(self, handle: int, *args, **kwargs) -> None:
            self.file = opened(handle, *args, **kwargs)

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def write(self, data: bytes) -> int:
            raise OSError("disk full")

    monkeypatch.setattr(os, "fdopen", FullDisk)
    with pytest.raises(OSError, match="disk full"):
        reports.write_atomic(_evidence(), path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize(
    ("outcomes", "status"),
    [([], "pending"), (["passed"], "passed"), (["passed", "skipped"], "pending"),
     (["passed", "failed"], "failed"), (["skipped"], "pending"),
     # an error (the harness raised) is its own status; a proven failure outranks it
     (["skipped", "error"], "error"), (["passed", "error"], "error"),
     (["error", "failed"], "failed")],
)
def test_gate_status_never_counts_a_skip_as_a_pass(outcomes: list[str], status: str) -> None:
    assert gate_status([{"outcome": o} for o in outcomes]) == status


def test_route_verdict_reject_beats_pending_and_names_each_gate() -> None:
    gates = {"parity": {"status": "failed", "tests": [{"nodeid": "n", "outcome": "failed",
                                                        "message": "bad"}]},
             "speed": {"status": "pending", "tests": []}}
    verdict, reasons = route_verdict(["parity", "speed"], gates)
    assert verdict == "reject"
    assert reasons == ["parity failed: bad", "speed pending: did not run in this evidence"]
    assert route_verdict(["parity"], {"parity": {"status": "passed", "tests": []}})[0] == "accept"


def test_a_route_that_requires_no_gate_is_never_accepted() -> None:
    """Vacuous truth: with nothing required, "every required gate passed" holds with no test
    behind it. Such an entry (an old or hand-edited report) stays pending and says why."""
    verdict, reasons = route_verdict([], {})
    assert verdict == "pending"
    assert reasons == ["requires no gate, so nothing ran for it: declare the gates it needs"]


def test_add_test_replaces_by_node_id() -> None:
    data = _evidence()
    for outcome in ("failed", "passed"):
        reports.add_test(data, ROUTE.name, "parity", {"nodeid": "t::p", "outcome": outcome})
    assert [t["outcome"] for t in data["routes"][ROUTE.name]["gates"]["parity"]["tests"]] == [
        "passed"]


def test_gate_figure_shows_failures_first_then_the_worst_margin() -> None:
    from pytest_dflash.evidence.verdict import gate_figure

    def test(outcome: str, figure: str, rel_l2: float) -> dict:
        return {"outcome": outcome, "measurements": {"figure": figure, "rel_l2": rel_l2,
                                                     "rel_l2_limit": 1e-5}}

    tests = [test("passed", "small", 1e-7), test("passed", "worst", 9e-6),
             test("passed", "middle", 1e-6)]
    assert gate_figure(tests, limit=1) == "worst (+2 more)"
    tests.append(test("failed", "broken", 1e-8))
    assert gate_figure(tests) == "broken; worst (+2 more)"


def test_the_published_schema_is_valid_and_shipped_with_the_package() -> None:
    from importlib import resources

    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(reports.schema())
    assert resources.files("pytest_dflash.evidence").joinpath(reports.SCHEMA_FILE).is_file()
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'"evidence/{reports.SCHEMA_FILE}"' in pyproject  # package-data: wheels carry it too


def test_the_schema_vocabulary_is_the_code_vocabulary() -> None:
    """The schema repeats the closed vocabularies: it must never drift from the code's."""
    defs = reports.schema()["$defs"]
    assert tuple(defs["gate_kind"]["enum"]) == GATE_KINDS
    assert tuple(reports.schema()["properties"]["profile"]["enum"]) == PROFILES
    assert tuple(defs["route"]["properties"]["role"]["enum"]) == ROLES
    assert reports.schema()["properties"]["schema"]["const"] == reports.SCHEMA
    fields = set(Policy().as_dict())
    assert set(defs["policy"]["required"]) <= fields
    assert set(defs["policy"]["properties"]) - {"output_contract"} <= fields


def test_a_written_report_reads_back_with_recomputed_decisions(tmp_path: Path) -> None:
    data = _evidence()
    reports.add_test(data, ROUTE.name, "parity", {"nodeid": "t::p", "outcome": "passed",
                                                  "duration_s": 0.5, "message": "",
                                                  "measurements": {"figure": "rel L2 1e-7"}})
    path = tmp_path / "r.json"
    reports.write_atomic(data, path)
    loaded = reports.load(path)
    entry = loaded["routes"][ROUTE.name]
    assert entry["verdict"] == "pending"
    assert entry["gates"]["parity"] == {"status": "passed", "figure": "rel L2 1e-7",
                                        "tests": data["routes"][ROUTE.name]["gates"]["parity"][
                                            "tests"]}
    assert entry["reasons"] == ["speed pending: did not run in this evidence"]


def test_stale_derived_text_is_recomputed_not_trusted(tmp_path: Path) -> None:
    """Figures and reasons are derived text: an edited one is replaced, not shown."""
    path = tmp_path / "r.json"
    reports.write_atomic(_evidence(), path)
    data = json.loads(path.read_text())
    data["routes"][ROUTE.name]["reasons"] = ["all good, ship it"]
    data["routes"][ROUTE.name]["gates"]["speed"]["figure"] = "10x faster"
    path.write_text(json.dumps(data))
    entry = reports.load(path)["routes"][ROUTE.name]
    assert entry["reasons"] == ["parity pending: did not run in this evidence",
                                "speed pending: did not run in this evidence"]
    assert entry["gates"]["speed"]["figure"] == ""


def test_an_accept_with_no_tests_behind_it_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    reports.write_atomic(_evidence(), path)
    data = json.loads(path.read_text())
    data["routes"][ROUTE.name]["verdict"] = "accept"
    for gate in data["routes"][ROUTE.name]["gates"].values():
        gate["status"] = "passed"
    path.write_text(json.dumps(data))
    with pytest.raises(reports.ReportError, match="gate parity is stored as 'passed', its "
                       "recorded tests make it 'pending'"):
        reports.load(path)


def test_two_routes_sharing_a_switch_are_corrupt(tmp_path: Path) -> None:
    other = Route("toy.a.other", "toy.a", "candidate", baseline="toy.a.base", gates=("parity",),
                  switch=ROUTE.enable_switch)
    data = _evidence()
    data["routes"][other.name] = reports.route_entry(other)
    path = tmp_path / "r.json"
    reports.write_atomic(data, path)
    with pytest.raises(reports.ReportError, match="routes 'toy.a.fast' and 'toy.a.other' share "
                       "the switch 'DFLASH_TOY_A_FAST'"):
        reports.load(path)


def test_merge_refuses_to_build_on_a_tampered_report(tmp_path: Path) -> None:
    """The plugin's --dflash-merge loads the old report through the same checks."""
    path = tmp_path / "r.json"
    data = _evidence()
    reports.add_test(data, ROUTE.name, "parity", {"nodeid": "t::p", "outcome": "failed",
                                                  "message": "bad"})
    reports.write_atomic(data, path)
    tampered = json.loads(path.read_text())
    tampered["routes"][ROUTE.name]["gates"]["parity"]["status"] = "passed"
    path.write_text(json.dumps(tampered))
    with pytest.raises(reports.ReportError, match="corrupt report"):
        reports.merge(reports.load(path), _evidence())
