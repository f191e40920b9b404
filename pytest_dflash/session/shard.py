"""``--dflash-shard K/N``: the K-th of N shares of the selected gates, for a job over many hosts.

Why: a team with several GPU hosts runs the gates where cards are free, each host one share,
and joins the evidence afterwards (``pytest-dflash merge``, ``evidence.merge``). That needs:

* a split every host computes alike from the same selection: units in a fixed order, ties
  broken by name, no randomness, no host facts;
* every test of one timing gate (route and kind) in one unit, so its baseline/candidate pairs
  are all timed on one card of one host (``docs/multi-gpu.md``); other gate tests are units of
  their own;
* shares balanced by what the units cost: the durations recorded in a report
  (``--dflash-shard-costs REF``, else the newest kept run under ``.dflash/``), by count when
  nothing is recorded. Units are dealt longest first to the share with the least cost so far
  (the greedy rule of pytest-split's ``least_duration`` algorithm). pytest-split itself does
  not fit: it deals single tests, so it could part a timing gate's tests across hosts, it reads
  durations only from its own ``.test_durations`` file, and its plugin brings its own
  ``--splits``/``--group`` options; its algorithms module is not a public API to build on;
* a record of the plan in each shard's report (its K/N, every planned test's share and a digest
  of the plan), so the merge can tell shards of one plan from another plan's and name the shard
  whose report never arrived.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_dflash.routes.vocabulary import EXCLUSIVE_KINDS

FORM = "K/N with whole numbers 1 <= K <= N, e.g. --dflash-shard 2/3"
_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
COUNT = "count"  # the costs' source when nothing is recorded: every test costs the same


class ShardError(ValueError):
    """A malformed or out-of-range ``K/N``, or a costs reference that names no report."""


@dataclass(frozen=True)
class Shard:
    """The K-th (1-based) of ``count`` shares."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass(frozen=True)
class Unit:
    """Tests that go to one share together: one timing gate's tests, or one other test."""

    key: str
    nodeids: tuple[str, ...]
    cost: float


def parse(text: str) -> Shard:
    """``"2/3"`` -> Shard(2, 3); anything else is a :class:`ShardError` naming the form."""
    match = _SPEC.match(str(text))
    if not match:
        raise ShardError(f"--dflash-shard {text!r}: not of the form {FORM}")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1 or not 1 <= index <= count:
        raise ShardError(f"--dflash-shard {text}: K must lie in 1..N and N must be at least 1; "
                         f"use {FORM}")
    return Shard(index, count)


def unit_key(nodeid: str, route: str | None, kind: str | None) -> str:
    """The unit a test belongs to: ``ROUTE:KIND`` for a timing gate, else its own node id."""
    if route is not None and kind in EXCLUSIVE_KINDS:
        return f"{route}:{kind}"
    return nodeid


def units(tests: Iterable[tuple[str, str | None, str | None]],
          costs: Mapping[str, float]) -> list[Unit]:
    """The units of ``(nodeid, route, kind)`` tests, each costed by its tests' recorded seconds.

    A test without a recorded duration costs the mean of those recorded among these tests (as
    pytest-split prices a test it has not seen), and every test costs 1 when none is recorded.
    """
    tests = list(tests)
    known = [costs[n] for n, _, _ in tests if n in costs]
    default = sum(known) / len(known) if known else 1.0
    grouped: dict[str, list[str]] = {}
    for nodeid, route, kind in tests:
        grouped.setdefault(unit_key(nodeid, route, kind), []).append(nodeid)
    return [Unit(key, tuple(ids), round(sum(costs.get(n, default) for n in ids), 6))
            for key, ids in grouped.items()]


def split(all_units: Iterable[Unit], count: int) -> list[list[Unit]]:
    """Deal units, costliest first (ties by key), each to the share with the least cost so far
    (ties to the lower share): the same units give the same shares on every host."""
    shares: list[list[Unit]] = [[] for _ in range(count)]
    heap = [(0.0, i) for i in range(count)]
    for unit in sorted(all_units, key=lambda u: (-u.cost, u.key)):
        spent, index = heapq.heappop(heap)
        shares[index].append(unit)
        heapq.heappush(heap, (round(spent + unit.cost, 6), index))
    return shares


def costs_from(report: Mapping[str, Any]) -> dict[str, float]:
    """Each recorded test's duration in seconds, by node id, from a report's routes."""
    found: dict[str, float] = {}
    for entry in report.get("routes", {}).values():
        for gate in entry.get("gates", {}).values():
            for test in gate.get("tests", []):
                duration = test.get("duration_s")
                if isinstance(duration, (int, float)) and duration >= 0:
                    found[test["nodeid"]] = float(duration)
    return found


def load_costs(ref: str | None, root: Path) -> tuple[dict[str, float], str]:
    """(durations by node id, where they came from): the report ``ref`` names (a file, or a
    kept run's number or name), else the newest kept run, else nothing (split by count)."""
    from pytest_dflash.evidence import history
    from pytest_dflash.evidence import report as reports

    if ref is None and not history.entries(root):
        return {}, COUNT
    try:
        path = history.resolve(ref, root)
        data = reports.load(path)
    except reports.ReportError as exc:
        raise ShardError(f"--dflash-shard-costs: {exc}") from None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return costs_from(data), f"{path.name} ({digest})"


def plan(tests: list[tuple[str, str | None, str | None]], costs: Mapping[str, float],
         count: int) -> dict[str, int]:
    """Node id -> its share (1-based) for every selected test."""
    where: dict[str, int] = {}
    for index, share in enumerate(split(units(tests, costs), count), start=1):
        for unit in share:
            for nodeid in unit.nodeids:
                where[nodeid] = index
    return where


def record(shard: Shard, tests: list[tuple[str, str | None, str | None]],
           where: Mapping[str, int], source: str) -> dict[str, Any]:
    """The report's ``shard`` field: K/N, the costs' source, every planned test and its share
    in collection order (the merge puts each gate's tests back in that order, so its figures
    read as one run's), and a digest of that plan that equal selections and costs give on
    every host."""
    planned = [{"nodeid": nodeid, "route": route, "kind": kind, "shard": where[nodeid]}
               for nodeid, route, kind in tests]
    digest = hashlib.sha256(json.dumps([shard.count, planned], sort_keys=True).encode())
    return {"index": shard.index, "count": shard.count, "costs": source,
            "plan_sha256": digest.hexdigest(), "host": socket.gethostname(),
            "selected": len(planned),
            "assigned": sum(1 for p in planned if p["shard"] == shard.index), "plan": planned}


def empty_note(shard: Mapping[str, Any]) -> str:
    """What an empty shard says instead of failing: nothing of the selection fell to it."""
    return (f"shard {shard['index']}/{shard['count']} got no test of the {shard['selected']} "
            "selected: nothing to run here (exit 0; its report still counts for the merge)")
