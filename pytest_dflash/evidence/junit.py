"""Flat JUnit XML properties for gate tests and verdicts.

Why: CI systems show JUnit ``<property>`` elements as name/value pairs. The plugin carries each
gate test's route, kind and measurements in one ``user_properties`` entry (that is how they
travel through xdist), which JUnit would print as the repr of a whole dict. Just before the
junitxml plugin reads a test's teardown report, :func:`flatten` replaces that entry with a few
flat properties; :func:`add_verdicts` adds one suite-level property per candidate's verdict.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

from pytest_dflash.evidence import timings

PREFIX = "dflash"


def _number(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return f"{value:.6g}"


def _ci(measurements: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """(low, high, units) of a timing test's interval; for a test with several comparisons
    (validation_cost per M), the one with the highest upper bound: the one closest to failing.
    ``units`` is how many processes (or rounds, timed in one process) it rests on."""
    worst = timings.worst(measurements)
    if worst is None:
        return None, None, None
    low, high = timings.interval(worst) or (None, None)
    counted = timings.units(worst) if timings.protocol(worst) else None
    return _number(low), _number(high), None if counted is None else str(counted)


def properties(binding: dict[str, Any]) -> list[tuple[str, str]]:
    """``dflash_route``, ``dflash_kind``, and when recorded ``dflash_figure``,
    ``dflash_decision``, ``dflash_ci_low``, ``dflash_ci_high`` and ``dflash_ci_units`` (the
    processes, or rounds, the interval rests on) for one gate test."""
    measurements = binding.get("measurements") or {}
    props = [(f"{PREFIX}_route", str(binding["route"])), (f"{PREFIX}_kind", str(binding["kind"]))]
    if measurements.get("figure"):
        props.append((f"{PREFIX}_figure", str(measurements["figure"])))
    if measurements.get("decision"):  # timing tests: pass / fail / inconclusive
        props.append((f"{PREFIX}_decision", str(measurements["decision"])))
    low, high, units = _ci(measurements)
    if low is not None:
        props.append((f"{PREFIX}_ci_low", low))
    if high is not None:
        props.append((f"{PREFIX}_ci_high", high))
    if units is not None:
        props.append((f"{PREFIX}_ci_units", units))
    return props


def flatten(report: Any, key: str, binding: dict[str, Any]) -> None:
    """Replace the ``key`` entry of a teardown report's user_properties by flat properties.

    Only the teardown report is changed: junitxml writes properties from it, and the evidence
    collector has read the measurements from this and the earlier reports already.
    """
    if getattr(report, "when", None) != "teardown":
        return
    kept = [(name, value) for name, value in report.user_properties if name != key]
    report.user_properties = kept + properties(binding)


def add_verdicts(config: pytest.Config, evidence: dict[str, Any]) -> None:
    """One suite-level ``dflash_verdict.<route>`` property per candidate, when --junitxml is on."""
    from _pytest.junitxml import xml_key

    xml = config.stash.get(xml_key, None)
    if xml is None:
        return
    for name, entry in sorted(evidence["routes"].items()):
        xml.add_global_property(f"{PREFIX}_verdict.{name}", entry["verdict"])
