"""Settled gates: once a test of a route's gate has failed, the gate's remaining tests are skipped.

Why: a route is promoted only if every gate it needs passed, and a failed test decides its gate
(``verdict.gate_status``: a failure outranks every other outcome) and so the route (REJECT).
The gate's later tests cannot change either verdict, and on a GPU they are often the dearest
ones: a cold prefill of 65536 tokens that sits on the 1% margin takes every timing process
(148 s on one H100) after the 32768-token prefill of the same gate has already failed.

Each skip names the test that failed, so the report and the terminal say why the test did not
run, and the gate keeps the failing test's figure. ``--dflash-every-test`` (ini
``dflash_every_test``) runs every test anyway, for a figure at every size; the self-test's
calibration always does, since what it measures is which slowdown each size resolves.

The failures are those the evidence collector records (``session.collector``), in the process
that runs the tests. Under xdist the collector sits in the controller and the tests run in the
workers, which see no failure: there every test runs, as before.
"""

from __future__ import annotations

import pytest

from pytest_dflash import settings
from pytest_dflash.session.state import binding

_FIRST_FAILURE = pytest.StashKey[dict[tuple[str, str], str]]()


def record_failure(config: pytest.Config, route: str, kind: str, nodeid: str) -> None:
    """Remember the first test that failed ``route``'s ``kind`` gate in this session."""
    config.stash.setdefault(_FIRST_FAILURE, {}).setdefault((route, kind), nodeid)


def failed_at(config: pytest.Config, route: str, kind: str) -> str | None:
    """The node id of the test that failed ``route``'s ``kind`` gate, None while none has."""
    return config.stash.get(_FIRST_FAILURE, {}).get((route, kind))


def check(item: pytest.Item) -> None:
    """Skip a gate test whose gate has already failed for its route, naming that test."""
    bound = binding(item)
    if bound is None or settings.of(item.config).every_test:
        return
    first = failed_at(item.config, bound["route"], bound["kind"])
    if first is not None:
        pytest.skip(f"settled: {bound['route']}'s {bound['kind']} gate already failed at "
                    f"{first}, so this test cannot change its verdict (--dflash-every-test "
                    f"runs it)")
