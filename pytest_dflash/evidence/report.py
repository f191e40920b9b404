"""The JSON evidence report: schema, atomic write, validated read, and merge of a rerun.

The report is the unit of evidence: the CLI reads it back, CI jobs merge gate reruns into it,
and the verdict is recomputed from it by ``pytest_dflash.evidence.verdict`` every time. Reading is
defensive: the file is checked against the published JSON Schema (``report.schema.json``), and
a stored decision that its own tests do not support makes the report corrupt. The report is not
signed: these checks catch a decision edited without its evidence, not evidence forged whole.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

from pytest_dflash.evidence import catch, files
from pytest_dflash.evidence import fingerprint as fp
from pytest_dflash.evidence.verdict import disagreements, recompute
from pytest_dflash.policy.thresholds import Policy, PolicyError, policy_from_overrides

SCHEMA = "pytest-dflash/report/3"
SCHEMA_FILE = "report.schema.json"


class ReportError(ValueError):
    """A report file that is missing, corrupt, foreign, or of another schema."""


class MergeRefused(ReportError):
    """The existing report was measured on different code or hardware."""


def route_entry(route: Any, planted: dict[str, Any] | None = None) -> dict[str, Any]:
    """A route's entry; ``planted`` marks a route the self-test planted (``evidence.catch``)."""
    entry: dict[str, Any] = {
        "family": route.family,
        "role": route.role,
        "baseline": route.baseline,
        "switch": route.enable_switch,
        "required": list(route.gates),
        "verdict": "pending",
        "reasons": [],
        "gates": {kind: {"status": "pending", "figure": "", "tests": []} for kind in route.gates},
    }
    if planted is not None:
        entry["planted"] = planted
    return entry


def judged(routes: dict[str, Any]) -> dict[str, Any]:
    """A report's routes without the planted ones: what verdicts, exit statuses and enable
    switches are about (planted routes are judged in the catch table)."""
    return {name: entry for name, entry in routes.items() if "planted" not in entry}


def new_report(*, routes: list[Any], fingerprint: dict[str, Any], device: dict[str, Any],
               profile: str, policy: dict[str, Any],
               planted: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    planted = planted or {}
    return {
        "schema": SCHEMA,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "fingerprint": fingerprint,
        "device": device,
        "profile": profile,
        "policy": policy,
        "routes": {route.name: route_entry(route, planted.get(route.name)) for route in routes},
        "session": {},
    }


def add_test(report: dict[str, Any], route: str, kind: str, test: dict[str, Any]) -> None:
    """Insert or replace (by node id) one test's entry under its route and gate."""
    entry = report["routes"].get(route)
    if entry is None or kind not in entry["gates"]:
        return
    tests = entry["gates"][kind]["tests"]
    tests[:] = [t for t in tests if t["nodeid"] != test["nodeid"]] + [test]


def write_atomic(report: dict[str, Any], path: Path) -> None:
    """Write to a temporary file in the same folder, then rename: never a half-written report.

    Compact JSON (no indentation: a report is read by the CLI, not by eye); gzip-compressed
    when the path ends in ``.json.gz``."""
    recompute(report["routes"])
    files.write_json(report, path, indent=None)


def load(path: Path) -> dict[str, Any]:
    """Read, validate and audit a report; its derived fields come back freshly recomputed.

    Every problem is a :class:`ReportError` naming the file and the offending field or route,
    never another exception: the CLI turns it into exit status 2.
    """
    path = Path(path)
    try:
        text = files.read_text(path)
    except FileNotFoundError:
        raise ReportError(f"{path}: no such report; run `pytest -m sm70` to create one") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ReportError(f"{path}: cannot read report ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(
            f"{path}: corrupt report, not valid JSON ({exc.msg} at line {exc.lineno}); "
            "delete it and rerun the gates"
        ) from None
    except (RecursionError, ValueError) as exc:
        raise ReportError(f"{path}: corrupt report, not usable JSON ({exc})") from None
    validate(data, path)
    return data


def schema() -> dict[str, Any]:
    """The published JSON Schema of a report (``pytest_dflash/evidence/report.schema.json``)."""
    schema_file = resources.files("pytest_dflash.evidence").joinpath(SCHEMA_FILE)
    text = schema_file.read_text(encoding="utf-8")
    return json.loads(text)


def validate(data: Any, path: Path | str = "report") -> None:
    """Schema, policy, registration and verdict checks; refreshes the derived fields in place.

    The stored verdicts and gate statuses are never believed: they are recomputed from the
    recorded tests, the required gates and the recorded policy, and a disagreement makes the
    report corrupt (somebody edited the decision without the evidence).
    """
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ReportError(
            f"{path}: not a pytest-dflash report (schema {found!r}, expected {SCHEMA!r})"
        )
    _check_schema(data, path)
    policy = _policy(data["policy"], path)
    _check_routes(data["routes"], path)
    problems = disagreements(data["routes"], policy)
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ReportError(
            f"{path}: corrupt report: {problems[0]}{more}; the decision was edited without the "
            "evidence: rerun the gates"
        )
    recompute(data["routes"])
    if "selftest" in data:
        fresh = catch.summarize(data)
        if json.loads(json.dumps(data["selftest"])) != json.loads(json.dumps(fresh)):
            raise ReportError(
                f"{path}: corrupt report: field selftest disagrees with the planted routes' "
                "tests; the catch table was edited without the evidence: rerun the gates"
            )
        data["selftest"] = fresh


def field_name(parts: Iterable[str | int]) -> str:
    """``routes["gemm.nvfp4.qpn2"].switch``: a JSON path a reader can find in the file."""
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.isidentifier():
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part)}]"
    return text or "the top level"


def _check_schema(data: dict[str, Any], path: Path | str) -> None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    error = best_match(Draft202012Validator(schema()).iter_errors(data))
    if error is None:
        return
    where = list(error.absolute_path)
    if error.validator == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        problem = "is missing"
        where.append(missing[0])
    elif error.validator == "additionalProperties":
        known = error.schema.get("properties", {})
        where.append(next(k for k in error.instance if k not in known))
        problem = "is not a field of a report"
    elif "propertyNames" in error.schema_path:
        problem = f"has a key that is not allowed: {error.message}"
    elif error.validator == "type":
        expected = error.validator_value
        problem = f"must be of type {expected}, got {type(error.instance).__name__}"
    else:
        problem = f"is invalid: {error.message}"
    if len(problem) > 300:
        problem = problem[:297] + "..."
    raise ReportError(
        f"{path}: malformed report: field {field_name(where)} {problem}; the file was truncated "
        "or edited: rerun the gates"
    )


def _policy(recorded: dict[str, Any], path: Path | str) -> Policy:
    """The recorded thresholds as a Policy: unknown names or wrong types make the report bad."""
    thresholds = {k: v for k, v in recorded.items() if k != "output_contract"}
    known = {f.name for f in dataclasses.fields(Policy)}
    for name in thresholds:
        if name not in known:
            raise ReportError(f"{path}: malformed report: field policy.{name} names no "
                              "threshold of pytest_dflash.policy.thresholds; known: "
                              f"{', '.join(sorted(known))}")
    try:
        return policy_from_overrides(thresholds)
    except PolicyError as exc:
        message = str(exc).replace("[tool.pytest-dflash] ", "field policy.")
        raise ReportError(f"{path}: malformed report: {message}") from None


def _check_routes(routes: dict[str, Any], path: Path | str) -> None:
    """Route metadata the report cannot change: a shipped route's registration, unique switches.

    Without this an edited ``switch`` would make ``enable`` print another route's switch, and an
    edited ``required`` list would drop a failed gate from the decision.
    """
    from pytest_dflash.routes.shipped import SHIPPED_ROUTES

    shipped = {route.name: route for route in SHIPPED_ROUTES}
    owners: dict[str, str] = {}
    for name, entry in routes.items():
        if not name.startswith(entry["family"] + "."):
            raise ReportError(
                f"{path}: malformed report: field {field_name(['routes', name, 'family'])}: "
                f"route {name!r} is not of family {entry['family']!r}"
            )
        other = owners.setdefault(entry["switch"], name)
        if other != name:
            raise ReportError(
                f"{path}: corrupt report: routes {other!r} and {name!r} share the switch "
                f"{entry['switch']!r}"
            )
        route = shipped.get(name)
        if route is None:
            continue
        expected = route_entry(route)
        for key in ("family", "role", "baseline", "switch", "required"):
            if entry[key] != expected[key]:
                raise ReportError(
                    f"{path}: corrupt report: field {field_name(['routes', name, key])} is "
                    f"{entry[key]!r}, but the shipped route {name!r} is registered with "
                    f"{expected[key]!r}: the report was edited or made by another version of "
                    "pytest-dflash; rerun the gates"
                )


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Old report updated with the new run's tests; refused if the evidence differs."""
    old_key, new_key = fp.key(old["fingerprint"]), fp.key(new["fingerprint"])
    if old_key != new_key:
        changed = sorted(k for k in old_key if old_key[k] != new_key[k])
        raise MergeRefused(
            "merge refused: the existing report was measured on different evidence "
            f"(changed: {', '.join(changed)}); rerun every gate without --dflash-merge"
        )
    merged = json.loads(json.dumps(old))
    merged["created"] = new["created"]
    merged["policy"] = new["policy"]
    libs = {lib["path"]: lib for lib in merged["fingerprint"].get("libraries", [])}
    for lib in new["fingerprint"].get("libraries", []):
        seen = libs.get(lib["path"])
        if seen is not None and seen.get("sha256") != lib.get("sha256"):
            raise MergeRefused(
                f"merge refused: native library {lib['path']} changed "
                f"({seen.get('sha256')} -> {lib.get('sha256')}); rerun every gate"
            )
        libs[lib["path"]] = lib
    merged["fingerprint"]["libraries"] = list(libs.values())
    for name, entry in new["routes"].items():
        if name not in merged["routes"]:
            merged["routes"][name] = entry
            continue
        target = merged["routes"][name]
        target["required"] = entry["required"]
        for kind, gate in entry["gates"].items():
            target["gates"].setdefault(kind, {"status": "pending", "figure": "", "tests": []})
            for test in gate["tests"]:
                add_test(merged, name, kind, test)
    merged["session"] = new.get("session", {})
    recompute(merged["routes"])
    return merged
