"""From test outcomes to gate statuses to route verdicts (docs/report.md).

This is the only place that decides; the plugin, the merge and the CLI all call it on the
report's data, so a verdict read back from a report is computed exactly like a live one.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeGuard

from pytest_dflash.routes.vocabulary import EXCLUSIVE_KINDS

if TYPE_CHECKING:
    from pytest_dflash.policy.thresholds import Policy

PASSED, FAILED, PENDING = "passed", "failed", "pending"
# a test (and its gate) that raised outside the candidate's own code: the harness failed, which
# proves nothing about the candidate, so the route stays pending (never a reject, never a pass)
ERROR = "error"
# a timing test whose interval straddles the policy's margin at its cap: it claims neither a
# pass nor a regression, so its gate stays pending (docs/gates.md, "Timing protocol")
INCONCLUSIVE = "inconclusive"
# a test whose call phase never reported: the session stopped while it ran
INTERRUPTED = "interrupted"
INTERRUPTED_MESSAGE = "did not finish: the session stopped while it ran"
# a test of a shard plan whose shard's report never reached the merge (evidence.merge)
MISSING = "missing"
ACCEPT, REJECT = "accept", "reject"
FAILING_OUTCOMES = frozenset({FAILED})


def gate_status(tests: Iterable[Mapping[str, Any]]) -> str:
    """failed if any test failed; else error if any test errored; passed only if tests ran and
    every one passed; else pending.

    A skipped, inconclusive or interrupted test keeps its gate pending: none counts as a pass.
    An error (the harness raised, not the candidate) is neither: the gate says ``error``.
    A failure outranks an error: a defect one test proved stays proven.
    """
    outcomes = [t["outcome"] for t in tests]
    if any(o in FAILING_OUTCOMES for o in outcomes):
        return FAILED
    if ERROR in outcomes:
        return ERROR
    if outcomes and all(o == "passed" for o in outcomes):
        return PASSED
    return PENDING


def gate_outcome(gate: Mapping[str, Any]) -> str:
    """The gate's status, or ``inconclusive`` for a pending gate held by an inconclusive timing
    test (the table, Markdown, JSON summary and JUnit show this word)."""
    if gate["status"] == PENDING and any(t["outcome"] == INCONCLUSIVE for t in gate["tests"]):
        return INCONCLUSIVE
    return str(gate["status"])


def margin(measurements: Mapping[str, Any]) -> float:
    """How close a test came to its limit (1.0 = on the limit), from its own measurements.

    Parity tests record ``rel_l2`` and its limit, timing tests ``ci_high`` and the threshold;
    any test may record ``margin`` itself. Unknown shapes rank last.
    """
    pairs = (("margin", None), ("rel_l2", "rel_l2_limit"), ("ci_high", "threshold"))
    for value_key, limit_key in pairs:
        value = measurements.get(value_key)
        limit = measurements.get(limit_key) if limit_key else 1.0
        if isinstance(value, (int, float)) and isinstance(limit, (int, float)) and limit:
            return float(value) / float(limit)
    return float("-inf")


def gate_figure(tests: list[Mapping[str, Any]], limit: int = 2) -> str:
    """The figures that decided the gate: failures first, then the tests closest to their limit
    (so a passed parity gate shows its worst error, not an arbitrary one)."""
    ordered = sorted(tests, key=lambda t: (t["outcome"] not in FAILING_OUTCOMES,
                                           t["outcome"] != ERROR,
                                           -margin(t.get("measurements", {}))))
    figures: list[str] = []
    for test in ordered:
        figure = test.get("measurements", {}).get("figure")
        if figure and figure not in figures:
            figures.append(str(figure))
    text = "; ".join(figures[:limit])
    if len(figures) > limit:
        text += f" (+{len(figures) - limit} more)"
    return text


def route_verdict(
    required: Iterable[str], gates: Mapping[str, Mapping[str, Any]]
) -> tuple[str, list[str]]:
    """accept / reject / pending with one reason per gate that is not passed.

    A failed gate rejects; a gate in ``error`` (the harness raised) leaves the route pending,
    with the exception and where it was raised as the reason.

    A route that requires no gate stays pending: an accept needs tests that ran and passed
    (the registry refuses such candidates; a report can still carry one, e.g. hand-edited).
    """
    required = list(required)
    if not required:
        return PENDING, ["requires no gate, so nothing ran for it: declare the gates it needs"]
    reasons: list[str] = []
    verdict = ACCEPT
    for kind in required:
        gate = gates.get(kind, {"status": PENDING, "tests": []})
        status = gate["status"]
        if status == PASSED:
            continue
        if status == FAILED:
            verdict = REJECT
            failed = [t for t in gate["tests"] if t["outcome"] in FAILING_OUTCOMES]
            detail = failed[0].get("message") or failed[0]["nodeid"] if failed else ""
            reasons.append(f"{kind} failed: {detail}".rstrip(": "))
        elif status == ERROR:
            if verdict == ACCEPT:
                verdict = PENDING
            errored = [t for t in gate["tests"] if t["outcome"] == ERROR]
            detail = (errored[0].get("message") or errored[0]["nodeid"]) if errored else ""
            reasons.append(f"{kind} ERROR: {detail}".rstrip(": "))
        else:
            if verdict == ACCEPT:
                verdict = PENDING
            skipped = [t for t in gate["tests"] if t["outcome"] == "skipped"]
            stopped = [t for t in gate["tests"] if t["outcome"] == INTERRUPTED]
            missing = [t for t in gate["tests"] if t["outcome"] == MISSING]
            undecided = [t for t in gate["tests"] if t["outcome"] == INCONCLUSIVE]
            if undecided:
                what = "timing " if kind in EXCLUSIVE_KINDS else ""  # the timed gates
                reasons.append(f"{kind} pending: inconclusive {what}"
                               f"({undecided[0].get('message') or undecided[0]['nodeid']})")
            elif skipped:
                reasons.append(f"{kind} pending: skipped ({skipped[0].get('message', '')})")
            elif stopped:
                reasons.append(f"{kind} pending: {stopped[0]['nodeid']} {INTERRUPTED_MESSAGE}")
            elif missing:
                shards = sorted({str(t.get("message", "")).partition(" never")[0]
                                 for t in missing})
                reasons.append(f"{kind} pending: {', '.join(shards)} never arrived "
                               f"({len(missing)} of its tests, e.g. {missing[0]['nodeid']})")
            else:
                reasons.append(f"{kind} pending: did not run in this evidence")
    return verdict, reasons


def recompute(routes: dict[str, dict[str, Any]]) -> None:
    """Refresh every gate status, figure and route verdict of a report's ``routes`` in place."""
    for entry in routes.values():
        for gate in entry["gates"].values():
            gate["status"] = gate_status(gate["tests"])
            gate["figure"] = gate_figure(gate["tests"])
        entry["verdict"], entry["reasons"] = route_verdict(entry["required"], entry["gates"])


def timing_disagreement(test: Mapping[str, Any], policy: Policy) -> str | None:
    """Why a timing test's recorded decision contradicts the policy or its outcome, else None.

    Timing gates record ``rule``, ``threshold`` and the CI of the ratio
    (``pytest_dflash.measure.timing``).
    The threshold must be the one the recorded policy implies, and a passed test must have a CI
    that passes it. A failed test may carry a passing record: a gate that times several widths
    keeps only the last record and fails on another.
    """
    from pytest_dflash.measure.decision import RULES, judge, threshold_for

    measured = test.get("measurements") or {}
    if "rule" not in measured:
        return None
    rule, threshold = measured.get("rule"), measured.get("threshold")
    low, high = measured.get("ci_low"), measured.get("ci_high")
    if rule not in RULES:
        return f"unknown timing rule {rule!r} (known: {', '.join(RULES)})"
    if not (_real(threshold) and _real(low) and _real(high)):
        return "timing record lacks a numeric threshold, ci_low or ci_high"
    expected = threshold_for(rule, policy)
    if not math.isclose(threshold, expected, rel_tol=1e-12, abs_tol=1e-12):
        return f"recorded threshold {threshold!r} is not the policy's {expected!r} for {rule}"
    if test["outcome"] == PASSED and not judge(rule, threshold, low, high).passed:
        return f"outcome passed, but its CI upper bound {high!r} fails the {rule} threshold"
    return None


def _real(value: Any) -> TypeGuard[int | float]:
    """A JSON number (a bool is not one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def disagreements(routes: Mapping[str, Mapping[str, Any]], policy: Policy) -> list[str]:
    """Every stored decision of a report's ``routes`` that its recorded tests do not support."""
    fresh: dict[str, dict[str, Any]] = copy.deepcopy({k: dict(v) for k, v in routes.items()})
    recompute(fresh)
    problems: list[str] = []
    for name, entry in routes.items():
        for kind, gate in entry["gates"].items():
            for test in gate["tests"]:
                why = timing_disagreement(test, policy)
                if why:
                    problems.append(f"route {name!r} gate {kind} test {test['nodeid']}: {why}")
            computed = fresh[name]["gates"][kind]["status"]
            if gate["status"] != computed:
                problems.append(f"route {name!r}: gate {kind} is stored as {gate['status']!r}, "
                                f"its recorded tests make it {computed!r}")
        verdict, reasons = fresh[name]["verdict"], fresh[name]["reasons"]
        if entry["verdict"] != verdict:
            why = f" ({'; '.join(reasons)})" if reasons else ""
            problems.append(f"route {name!r}: stored verdict {entry['verdict']!r}, but its "
                            f"recorded tests and required gates give {verdict!r}{why}")
    return problems
