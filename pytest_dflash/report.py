"""The JSON evidence report: schema, atomic write, validated read, and merge of a rerun.

The report is the unit of evidence: the CLI reads it back, CI jobs merge gate reruns into it,
and the verdict is recomputed from it by ``pytest_dflash.verdict`` every time.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_dflash import fingerprint as fp
from pytest_dflash.verdict import recompute

SCHEMA = "pytest-dflash/report/1"
TOP_KEYS = ("schema", "created", "fingerprint", "device", "profile", "policy", "routes")


class ReportError(ValueError):
    """A report file that is missing, corrupt, foreign, or of another schema."""


class MergeRefused(ReportError):
    """The existing report was measured on different code or hardware."""


def route_entry(route: Any) -> dict[str, Any]:
    return {
        "family": route.family,
        "role": route.role,
        "baseline": route.baseline,
        "switch": route.enable_switch,
        "required": list(route.gates),
        "verdict": "pending",
        "reasons": [],
        "gates": {kind: {"status": "pending", "figure": "", "tests": []} for kind in route.gates},
    }


def new_report(*, routes: list[Any], fingerprint: dict[str, Any], device: dict[str, Any],
               profile: str, policy: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "fingerprint": fingerprint,
        "device": device,
        "profile": profile,
        "policy": policy,
        "routes": {route.name: route_entry(route) for route in routes},
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
    """Write to a temporary file in the same folder, then rename: never a half-written report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recompute(report["routes"])
    handle, tmp = tempfile.mkstemp(prefix=".dflash-report-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2, sort_keys=False, default=str)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ReportError(f"{path}: no such report; run `pytest -m sm70` to create one") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path}: cannot read report ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReportError(
            f"{path}: corrupt report, not valid JSON ({exc.msg} at line {exc.lineno}); "
            "delete it and rerun the gates"
        ) from None
    validate(data, path)
    return data


def validate(data: Any, path: Path | str = "report") -> None:
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ReportError(
            f"{path}: not a pytest-dflash report (schema {found!r}, expected {SCHEMA!r})"
        )
    missing = [key for key in TOP_KEYS if key not in data]
    if missing:
        raise ReportError(f"{path}: report lacks {', '.join(missing)}; it is truncated or edited")
    if not isinstance(data["routes"], dict):
        raise ReportError(f"{path}: 'routes' must be an object")
    for name, entry in data["routes"].items():
        try:
            for gate in entry["gates"].values():
                for test in gate["tests"]:
                    test["nodeid"], test["outcome"]  # noqa: B018 - presence check
            entry["required"], entry["verdict"]  # noqa: B018
        except (KeyError, TypeError, AttributeError):
            raise ReportError(f"{path}: route {name!r} is malformed; rerun the gates") from None


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
