"""``pytest-dflash merge OUT REPORT...``: one report from the reports of several hosts' shards.

Why: evidence is per host, verdicts are per code (DESIGN section 11). Shards of one gate job
(``--dflash-shard K/N``) run wherever cards are free; joining their reports gives the report
``verdict``, ``enable``, ``diff``, ``plot`` and ``--dflash-compare`` read like any other, every
verdict recomputed from the joined tests. A join is refused (``MergeError``, exit 2) where it
would mix experiments:

* code: the fingerprints' git head, dirty diff, kernel sources, sidecar, native libraries or
  torch/CUDA differ (the field is named);
* cards: one gate's tests were measured on two device models (the same model on different
  hosts is fine), or CPU evidence would join GPU evidence;
* setup: profile or policy differ, or the shards were cut from different plans;
* outcomes: one test appears in two reports with different outcomes (both files named).

A shard of the plan whose report is not among the inputs leaves its tests ``missing``: their
gates stay pending, and the reason names the shard.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pytest_dflash.evidence import catch
from pytest_dflash.evidence import report as reports
from pytest_dflash.evidence.verdict import MISSING, recompute

# fingerprint fields that say which code was measured, as the refusal names them
CODE_FIELDS: tuple[tuple[str, str], ...] = (
    ("git_head", "git head"), ("git_dirty_sha256", "dirty diff"),
    ("kernel_sources_sha256", "kernel sources"), ("sidecar_sha256", "sidecar library"),
    ("torch", "torch version"), ("cuda", "CUDA version"))
ROUTE_FIELDS = ("family", "role", "baseline", "switch", "required", "planted")


class MergeError(reports.ReportError):
    """Reports that must not be joined: other code, other cards for one gate, clashing tests."""


def _differs(what: str, field: str, seen: Mapping[str, list[str]]) -> MergeError:
    """The refusal naming the field and which file holds which value (as JSON)."""
    values = "; ".join(f"{value[:80]} in {', '.join(files)}" for value, files in seen.items())
    return MergeError(f"merge refused: the reports differ in {what} (field {field}): {values}; "
                      "merge only shards of one gate job, run on the same code and settings")


def _same(loaded: Sequence[tuple[str, dict[str, Any]]], what: str, field: str,
          value: Any) -> None:
    """Refuse unless ``value(report)`` is equal (as JSON) in every report."""
    seen: dict[str, list[str]] = {}
    for name, data in loaded:
        seen.setdefault(json.dumps(value(data), sort_keys=True, default=str), []).append(name)
    if len(seen) > 1:
        raise _differs(what, field, seen)


def check_code(loaded: Sequence[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Refuse other code; the union of the native libraries the shards loaded.

    Libraries are matched by file name: the cache folder differs from host to host, the bytes
    of a library of one name must not.
    """
    for key, what in CODE_FIELDS:
        _same(loaded, what, f"fingerprint.{key}", lambda d, k=key: d["fingerprint"].get(k))
    libraries: dict[str, tuple[dict[str, Any], str]] = {}
    for name, data in loaded:
        for lib in data["fingerprint"].get("libraries", []):
            base = Path(lib["path"]).name
            seen = libraries.get(base)
            if seen is None:
                libraries[base] = (lib, name)
            elif seen[0].get("sha256") != lib.get("sha256"):
                raise _differs(f"the native library {base}", "fingerprint.libraries",
                               {json.dumps(seen[0].get("sha256")): [seen[1]],
                                json.dumps(lib.get("sha256")): [name]})
    return [lib for lib, _ in libraries.values()]


def _plan(loaded: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any] | None:
    """The shards' common plan, None for reports of unsharded runs; refused when they differ."""
    sharded = [(name, data) for name, data in loaded if "shard" in data]
    if not sharded:
        return None
    if len(sharded) != len(loaded):
        plain = [name for name, data in loaded if "shard" not in data]
        raise MergeError(f"merge refused: {', '.join(plain)} did not run with --dflash-shard, "
                         f"the others did (field shard); merge the shards of one job")
    _same(sharded, "shard count", "shard.count", lambda d: d["shard"]["count"])
    _same(sharded, "the plan the shards were cut from (selection or costs)",
          "shard.plan_sha256", lambda d: d["shard"]["plan_sha256"])
    return sharded[0][1]["shard"]


def _device_model(test: Mapping[str, Any], device: Mapping[str, Any]) -> str:
    gpu = test.get("gpu")
    if isinstance(gpu, Mapping) and gpu.get("name"):
        return str(gpu["name"])
    return str(device.get("name"))


def _join_routes(loaded: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Every route of every report with the tests of all; a route's registration must agree,
    one test's outcome must agree, and one gate's tests must share a device model."""
    routes: dict[str, Any] = {}
    origin: dict[tuple[str, str, str], tuple[str, dict[str, Any]]] = {}
    models: dict[tuple[str, str], dict[str, list[str]]] = {}
    for name, data in loaded:
        shard = data.get("shard", {}).get("index")
        for route, entry in data["routes"].items():
            target = routes.get(route)
            if target is None:
                target = routes[route] = {**{k: v for k, v in entry.items() if k != "gates"},
                                          "gates": {}}
            for key in ROUTE_FIELDS:
                if json.dumps(target.get(key)) != json.dumps(entry.get(key)):
                    raise _differs(f"route {route}'s registration",
                                   reports.field_name(["routes", route, key]),
                                   {json.dumps(target.get(key)): ["an earlier report"],
                                    json.dumps(entry.get(key)): [name]})
            for kind, gate in entry["gates"].items():
                tests = target["gates"].setdefault(
                    kind, {"status": "pending", "figure": "", "tests": []})["tests"]
                for test in gate["tests"]:
                    key3 = (route, kind, test["nodeid"])
                    if key3 in origin:
                        first_file, first = origin[key3]
                        if first["outcome"] != test["outcome"]:
                            raise MergeError(
                                f"merge refused: test {test['nodeid']} is {first['outcome']} "
                                f"in {first_file} and {test['outcome']} in {name}; one test "
                                "must come from one run: rerun it and merge one of the two")
                        continue
                    joined = {**test, **({"shard": shard} if shard else {})}
                    origin[key3] = (name, joined)
                    tests.append(joined)
                    model = _device_model(test, data["device"])
                    models.setdefault((route, kind), {}).setdefault(model, []).append(name)
    for (route, kind), seen in sorted(models.items()):
        if len(seen) > 1:
            where = "; ".join(f"{model} in {', '.join(sorted(set(files)))}"
                              for model, files in seen.items())
            raise MergeError(f"merge refused: the {kind} gate of {route} was measured on "
                             f"different device models ({where}); a gate's tests must come "
                             "from one card model: rerun that gate on one (docs/multi-gpu.md)")
    return routes


def _missing(routes: dict[str, Any], plan: Mapping[str, Any], arrived: set[int]) -> list[int]:
    """Mark every planned test of a shard that never arrived ``missing``, naming the shard."""
    count = int(plan["count"])
    absent = sorted(set(range(1, count + 1)) - arrived)
    for planned in plan["plan"]:
        route, kind = planned.get("route"), planned.get("kind")
        if planned["shard"] not in absent or route not in routes:
            continue
        gate = routes[route]["gates"].get(kind)
        if gate is None or any(t["nodeid"] == planned["nodeid"] for t in gate["tests"]):
            continue
        gate["tests"].append({
            "nodeid": planned["nodeid"], "outcome": MISSING, "duration_s": 0.0,
            "message": f"shard {planned['shard']}/{count} never arrived: its report was not "
                       "among the merged ones", "measurements": {}, "gpu": None,
            "shard": planned["shard"]})
    return absent


def _in_plan_order(routes: dict[str, Any], plan: Mapping[str, Any]) -> None:
    """Each gate's tests in the order one run would have run them (the plan keeps the
    collection order): a gate's figure breaks ties by that order, so it reads as one run's."""
    position = {p["nodeid"]: i for i, p in enumerate(plan["plan"])}
    for entry in routes.values():
        for gate in entry["gates"].values():
            gate["tests"].sort(key=lambda t: position.get(t["nodeid"], len(position)))


def _device(loaded: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The shards' device when they agree; else its type with every model named."""
    _same(loaded, "device type (CPU and GPU evidence)", "device.type",
          lambda d: d["device"]["type"])
    first = loaded[0][1]["device"]
    keys = ("name", "capability")
    if all(all(d["device"].get(k) == first.get(k) for k in keys) for _, d in loaded):
        return dict(first)
    names: dict[str, list[str]] = {}
    for name, data in loaded:
        names.setdefault(str(data["device"].get("name")), []).append(name)
    return {**first, "capability": None,
            "name": "mixed: " + "; ".join(f"{n} ({', '.join(f)})" for n, f in names.items())}


def merge(loaded: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One report from ``(name, report)`` pairs already read by ``report.load``."""
    if not loaded:
        raise MergeError("merge needs at least one report")
    libraries = check_code(loaded)
    _same(loaded, "profile", "profile", lambda d: d["profile"])
    policy = {key for _, d in loaded for key in d["policy"]}
    for key in sorted(policy):  # named threshold by threshold
        _same(loaded, f"the policy's {key}", f"policy.{key}", lambda d, k=key: d["policy"].get(k))
    plan = _plan(loaded)
    device = _device(loaded)
    routes = _join_routes(loaded)
    arrived = {int(d["shard"]["index"]) for _, d in loaded if "shard" in d}
    absent = _missing(routes, plan, arrived) if plan is not None else []
    if plan is not None:
        _in_plan_order(routes, plan)
    first = loaded[0][1]
    fingerprint = {**first["fingerprint"], "libraries": libraries,
                   "device": device["name"] if not device["name"].startswith("mixed: ")
                   else None}
    merged: dict[str, Any] = {
        "schema": reports.SCHEMA,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "fingerprint": fingerprint, "device": device, "profile": first["profile"],
        "policy": first["policy"], "routes": routes,
        "shards": {
            "count": plan["count"] if plan else None,
            "plan_sha256": plan["plan_sha256"] if plan else None,
            "merged": [{"file": name, "shard": data.get("shard", {}).get("index"),
                        "host": data.get("shard", {}).get("host"),
                        "device": data["device"].get("name")} for name, data in loaded],
            "missing": absent},
        "session": {"exitstatus": max(int(d.get("session", {}).get("exitstatus", 0))
                                      for _, d in loaded)},
    }
    recompute(merged["routes"])
    if any("planted" in entry for entry in routes.values()):
        merged["selftest"] = catch.summarize(merged)
    return merged


def merge_files(out: Path, paths: Sequence[Path]) -> dict[str, Any]:
    """Read, check and join ``paths``, write the result atomically to ``out``, and return it.

    Each input is read as ``verdict`` reads it (a malformed or tampered shard is a
    ``ReportError``), and the result is validated as any report is before it is written.
    """
    loaded = [(str(path), reports.load(Path(path))) for path in paths]
    merged = merge(loaded)
    reports.validate(json.loads(json.dumps(merged)), out)
    reports.write_atomic(merged, Path(out))
    return merged
