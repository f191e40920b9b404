"""Build real report files (through ``pytest_dflash.evidence.report``) for the reporting tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pytest_dflash.evidence import report as reports
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes.registry import Route

FAST = Route("toy.add.fast", "toy.add", "candidate", baseline="toy.add.base",
             gates=("parity", "speed"))
SLOW = Route("toy.add.slow", "toy.add", "candidate", baseline="toy.add.base",
             gates=("parity",), switch="TOY_SLOW")


def fingerprint(head: str = "abc") -> dict[str, Any]:
    """A schema-valid fingerprint whose git head starts with ``head`` (hex digits)."""
    return {"git_head": head.ljust(40, "0"), "git_dirty_sha256": None,
            "kernel_sources_sha256": None, "sidecar_sha256": None, "python": "3.11",
            "torch": "2.13.0+cpu", "cuda": None, "device": "cpu (2 cores)", "libraries": []}


def make(path: Path, *, parity: str = "passed", speed: str = "passed", head: str = "abc",
         device: dict[str, Any] | None = None, profile: str = "ci",
         policy: dict[str, Any] | None = None, speed_measurements: dict[str, Any] | None = None,
         ) -> Path:
    """A two-route report; ``speed=""`` leaves the speed gate without tests (pending)."""
    data = reports.new_report(routes=[FAST, SLOW], fingerprint=fingerprint(head),
                              device=device or {"name": "cpu (2 cores)", "type": "cpu"},
                              profile=profile, policy={**Policy().as_dict(), **(policy or {})})
    for kind, outcome in (("parity", parity), ("speed", speed)):
        if outcome:
            measurements = {"figure": f"{kind} {outcome}"}
            if kind == "speed" and speed_measurements:
                measurements = speed_measurements
            reports.add_test(data, FAST.name, kind, {
                "nodeid": f"t.py::test_{kind}[toy.add.fast]", "outcome": outcome,
                "duration_s": 0.1, "message": f"{kind} said {outcome} | details",
                "measurements": measurements})
    reports.add_test(data, SLOW.name, "parity", {
        "nodeid": "t.py::test_parity[toy.add.slow]", "outcome": "passed", "duration_s": 0.1,
        "message": "", "measurements": {"figure": "rel L2 1e-7 | max abs 2e-7"}})
    reports.write_atomic(data, path)
    return path
