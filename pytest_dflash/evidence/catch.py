"""The catch table: the report's ``selftest`` section, computed from the planted routes' tests.

A route the self-test planted carries a ``planted`` field in the report (the route it was
planted from, the defect's key and description, the planted slowdown), so this module needs
nothing of the self-test itself. Like verdicts, the section is a pure function of the recorded
outcomes and measurements, so the CLI recomputes it from any report and a stored section is
never trusted. Per original route and gate kind:

* ``copy``: the unchanged copy's gate status next to the route's own; ``copy_agrees`` is False
  when both were decided differently (a gate that accepts a route and rejects its copy, or the
  reverse, cannot reproduce its decision here), None when either did not run;
* ``defects``: each planted defect ``caught`` (its gate failed a test), ``missed`` (its gate
  passed it), ``error`` (the gate errored before judging) or ``pending`` (did not run);
* timing gates: ``resolution``, the smallest planted slowdown the gate *resolved*, i.e. rejected
  with a CI wholly on the failing side of its threshold over enough rounds for that CI's level
  to be reachable at all (a distribution-free interval for a median needs
  ``n >= log2(2 / alpha)`` paired rounds: 6 at 95%); a rejection at the round cap with a CI
  still straddling the threshold is fail-closed, not resolved. ``resolves_policy`` says whether
  the policy-sized defect (speed: the min gain; validation_cost: the planted +2% per call) was
  resolved;
* ``evidence``: False when a planted defect was missed: the gate's accept of the route is then
  not evidence (the verdict table marks it; strict mode fails the run).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from pytest_dflash.evidence import timings
from pytest_dflash.evidence.verdict import gate_figure, gate_status
from pytest_dflash.routes.vocabulary import EXCLUSIVE_KINDS as TIMING_KINDS

COPY = "copy"  # the defect key of a planted route's unchanged copy
CAUGHT, MISSED, ERROR, PENDING = "caught", "missed", "error", "pending"


def min_rounds(confidence: float) -> int:
    """Fewest paired rounds for which a distribution-free CI of the median at ``confidence``
    can exclude anything: all n ratios on one side has probability 2 * 2^-n under the null."""
    alpha = 1.0 - float(confidence)
    return math.ceil(math.log2(2.0 / alpha)) if alpha > 0 else 1


def _timings(measurements: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every timing comparison in a test's measurements (top level and per verify width)."""
    for _, series in timings.comparisons(measurements):
        yield series


def resolved(timing: Mapping[str, Any]) -> bool:
    """A rejection the interval established (not the fail-closed default at the cap).

    The count that must reach :func:`min_rounds` is of the interval's independent units: the
    worker processes it was computed across, or the rounds when timed in one process.
    """
    lo, threshold = timing.get("ci_low"), timing.get("threshold")
    if not isinstance(lo, (int, float)) or not isinstance(threshold, (int, float)):
        return False
    if timings.units(timing) < min_rounds(timing.get("confidence", 0.95)):
        return False
    return lo >= threshold if timing.get("rule") == "gain" else lo > threshold


def _defect_status(gate: Mapping[str, Any] | None) -> str:
    if gate is None:
        return PENDING
    outcomes = [t["outcome"] for t in gate.get("tests", [])]
    if "failed" in outcomes:
        return CAUGHT
    if "error" in outcomes:
        return ERROR
    if outcomes and all(o == "passed" for o in outcomes):
        return MISSED
    return PENDING


def summarize(report: Mapping[str, Any]) -> dict[str, Any]:
    """The ``selftest`` section of ``report`` (empty routes when nothing was planted)."""
    routes = report.get("routes", {})
    policy = report.get("policy", {})
    out: dict[str, Any] = {}
    for name, entry in sorted(routes.items()):
        planted = entry.get("planted")
        if planted is None:
            continue
        original, key = planted["from"], planted["defect"]
        own = routes.get(original, {}).get("gates", {})
        for kind in entry.get("required", []):
            gate = entry["gates"].get(kind)
            section = out.setdefault(original, {}).setdefault(kind, {
                "copy": None,
                "route_status": gate_status(own[kind]["tests"]) if kind in own else "not run",
                "defects": [], "caught": 0, "planted": 0, "missed": [], "errors": []})
            if key == COPY:
                section["copy"] = {"route": name,
                                   "status": gate_status(gate["tests"]) if gate else PENDING}
                continue
            if not (gate or {}).get("tests") and not own.get(kind, {}).get("tests"):
                continue  # kind not selected (``-m``, ``--dflash-gate``): nothing planted ran
            status = _defect_status(gate)
            record: dict[str, Any] = {"key": key, "route": name, "status": status,
                                      "what": planted.get("what", ""),
                                      "figure": gate_figure(gate["tests"]) if gate else ""}
            fraction = planted.get("slowdown")
            if kind in TIMING_KINDS and fraction is not None:
                timings = [t for test in (gate or {}).get("tests", [])
                           for t in _timings(test.get("measurements", {}))]
                record["slowdown"] = fraction
                record["resolved"] = status == CAUGHT and any(resolved(t) for t in timings)
            section["defects"].append(record)
            section["planted"] += 1
            section["caught"] += status == CAUGHT
            if status == MISSED:
                section["missed"].append(key)
            elif status == ERROR:
                section["errors"].append(key)
    for kinds in out.values():
        for kind, section in kinds.items():
            _finish(kind, section, policy)
    return {"routes": out}


def _finish(kind: str, section: dict[str, Any], policy: Mapping[str, Any]) -> None:
    copy = section["copy"]
    decided = ("passed", "failed")
    section["copy_agrees"] = (copy["status"] == section["route_status"]
                              if copy is not None and copy["status"] in decided
                              and section["route_status"] in decided else None)
    section["evidence"] = not section["missed"]
    if kind not in TIMING_KINDS:
        return
    rungs = sorted((d["slowdown"], d["resolved"]) for d in section["defects"] if "slowdown" in d)
    resolved_rungs = [fraction for fraction, ok in rungs if ok]
    section["resolution"] = resolved_rungs[0] if resolved_rungs else None
    policy_size = (policy.get("speed_min_gain") if kind == "speed"
                   else min((f for f, _ in rungs), default=None))
    section["policy_size"] = policy_size
    section["resolves_policy"] = any(ok and policy_size is not None
                                     and fraction <= policy_size + 1e-12
                                     for fraction, ok in rungs)


def marks(section: Mapping[str, Any]) -> dict[tuple[str, str], str]:
    """(route, kind) -> the reason a gate's accept is not evidence, for the verdict table."""
    found = {}
    for route, kinds in section.get("routes", {}).items():
        for kind, gate in kinds.items():
            if not gate["evidence"]:
                found[(route, kind)] = (f"{kind} self-test missed {', '.join(gate['missed'])}: "
                                        "its accept is not evidence")
    return found


def resolution_text(kind: str, gate: Mapping[str, Any]) -> str:
    """A timing gate's resolution as the catch table prints it ("-" for other kinds)."""
    if kind not in TIMING_KINDS:
        return "-"
    res, size = gate.get("resolution"), gate.get("policy_size")
    text = f"{res:.0%}" if res is not None else "none resolved"
    if size is not None and not gate.get("resolves_policy"):
        text += f" (cannot resolve the policy's {size:.0%} here)"
    return text


def render(section: Mapping[str, Any]) -> list[str]:
    """The catch table: one row per route and gate, then what was missed and the resolution."""
    routes = section.get("routes", {})
    if not routes:
        return ["no self-test routes were planted (no selected candidate has a catalogued gate)"]
    rows = [(route, kind, gate) for route, kinds in sorted(routes.items())
            for kind, gate in kinds.items()]
    name_w = max(len("route"), *(len(r) for r, _, _ in rows))
    header = (f"{'route'.ljust(name_w)}  {'gate'.ljust(15)}  {'copy'.ljust(7)}  "
              f"{'caught'.ljust(7)}  resolution")
    lines = [header, "-" * len(header)]
    for route, kind, gate in rows:
        copy = gate["copy"]["status"] if gate["copy"] else "-"
        copy = {"passed": "pass", "failed": "FAIL"}.get(copy, copy)
        caught = f"{gate['caught']}/{gate['planted']}"
        lines.append(f"{route.ljust(name_w)}  {kind.ljust(15)}  {copy.ljust(7)}  "
                     f"{caught.ljust(7)}  {resolution_text(kind, gate)}")
        for defect in gate["defects"]:
            if defect["status"] != CAUGHT:
                lines.append(f"    {defect['status'].upper()}: {defect['key']} "
                             f"({defect['what']})")
        if gate["copy_agrees"] is False:
            lines.append(f"    copy {gate['copy']['status']} but the route {gate['route_status']}:"
                         " the gate does not reproduce its own decision here")
        if not gate["evidence"]:
            lines.append(f"    -> the accept of this {kind} gate is not evidence")
    return lines
