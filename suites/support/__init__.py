"""Support for the gate suites: what several gate tests share, kept out of the test modules.

No test module imports another test module; they import from here. Generic pieces live in this
module (the parity log, route-hit checks, seeded inputs without zeros); each family has its own
module (``gemm``, ``attn``), the loader gate's child-interpreter scenarios live in ``loader``.
Everything takes what it needs as arguments (most often a ``dflash_gate``), so an engine
repository can build its own gates from the same pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pytest_dflash.native import hits

if TYPE_CHECKING:
    import torch

    from pytest_dflash.measure.numerics import ParityResult


def no_zeros(x: torch.Tensor) -> torch.Tensor:
    """``x`` with exact zeros replaced by 0.5: a zero input hides a wrong weight or index."""
    import torch

    return torch.where(x == 0, torch.full_like(x, 0.5), x)


class ParityLog:
    """Collects the cases of one gate test; fails with every failing case's message and records
    the worst case (largest rel L2 relative to its limit) as the test's figure."""

    def __init__(self, record: Callable[..., None]) -> None:
        self.record = record
        self.results: list[ParityResult] = []
        self.extra: dict[str, Any] = {}

    def add(self, result: ParityResult) -> None:
        self.results.append(result)

    def finish(self) -> None:
        worst = max(self.results, key=lambda r: r.rel_l2 / r.rel_l2_limit)
        self.record(figure=f"worst {worst.label}: {worst.figure()}", worst=worst.measurements(),
                    cases=[r.measurements() for r in self.results], **self.extra)
        failed = [r.message() for r in self.results if not r.ok]
        if failed:
            raise AssertionError(
                f"{len(failed)}/{len(self.results)} parity cases failed:\n" + "\n".join(failed))


def assert_route_ran(delta: hits.HitDelta, route: str, label: str, what: str = "the call") -> None:
    """Fail unless ``route`` recorded hits in ``delta``: a candidate that silently fell back to
    another route must fail rather than pass with someone else's numbers."""
    if delta.route(route) == 0:
        raise AssertionError(f"{label}: {route} recorded no route hits (got {delta.as_json()}): "
                             f"{what} did not run the candidate (silent fallback?)")


def check_same_kernels(candidate: str, enabled: hits.HitDelta, disabled: hits.HitDelta,
                       label: str) -> dict[str, int]:
    """Hits of a verify step with the candidate on must equal those with it off, apart from
    the candidate's own dispatch records (which must exist: it has to have run)."""
    if enabled.route(candidate) == 0:
        raise AssertionError(f"{label}: {candidate} recorded no route hits: it did not run "
                             f"(hits {enabled.as_json()})")
    kernels_on = {key: n for key, n in enabled.counts.items() if key[0] != candidate}
    if kernels_on != disabled.counts:
        on = {f"{r}/{p}": n for (r, p), n in sorted(kernels_on.items())}
        raise AssertionError(
            f"{label}: route hits differ with {candidate} enabled: the verify path changed. "
            f"enabled (own dispatch records aside) {on} vs disabled {disabled.as_json()}"
        )
    return enabled.as_json()


def _served(delta: hits.HitDelta, op: str | None) -> dict[Any, int]:
    """Calls per route (``op`` None) or per (route, op) pair, as the gate counts them."""
    return delta.by_route() if op is None else dict(delta.counts)


def check_one_call_each(pair: Any, dflash_gate: Any, op: str | None = None) -> None:
    """Before a speed gate times anything: one call of each side, in this process, must compute
    the baseline's result (``pair.check_output``), and its hits must show the candidate served
    the candidate's call and nothing but the two routes ran. A silent fallback is named by its
    hits before its output is judged; a route that cannot run the shape skips before any worker
    times it."""
    name, base = dflash_gate.route.name, dflash_gate.baseline_route.name
    cand, allowed = (name, {name, base}) if op is None else ((name, op), {(name, op), (base, op)})
    with hits.counting() as checked:
        try:
            pair.check_output(dflash_gate.policy)
            wrong = None
        except AssertionError as exc:
            wrong = exc
    served = _served(checked, op)
    if not served.get(cand) or set(served) - allowed:
        raise AssertionError(
            f"{pair.label}: route hits {checked.as_json()} do not match the timed calls (one "
            "call of each side, before timing): the candidate must have served every candidate "
            "call, and nothing else may have run")
    if wrong is not None:
        raise wrong


def timed_with_hits(pair: Any, dflash_gate: Any, job: Any, op: str | None = None) -> dict:
    """``speed_gate`` of ``pair`` (its ``candidate``, ``baseline`` and ``label``) through
    ``job`` in the run's timing workers; the measurements and hits go in the report, and the
    hits must equal the timed calls, both sides: exactly the candidate's and the baseline's
    ``op`` (every op when None), nothing else. Returns the measurements."""
    from pytest_dflash.measure.timing import speed_gate

    name, base = dflash_gate.route.name, dflash_gate.baseline_route.name
    cand, other = (name, base) if op is None else ((name, op), (base, op))
    measured: dict = {}
    try:
        with hits.counting() as delta:
            speed_gate(pair.candidate, pair.baseline, policy=dflash_gate.policy,
                       device=dflash_gate.device, record=measured.update, label=pair.label,
                       job=job, timing=dflash_gate.timing)
    finally:  # the hits are known once the block has exited
        dflash_gate.record(**measured, route_hits=delta.as_json(), shape=pair.label)
    ran = _served(delta, op)
    if "processes" in measured:  # timed in workers: exactly the timed calls, both sides
        timed = sum(p["info"]["timed_calls"] for p in measured["processes"])
        expected = {cand: timed, other: timed}
    else:  # timed here (no timing pool): warm-up and calibration calls are counted too
        expected = {cand: ran.get(cand, 0), other: ran.get(other, 0)}
    if ran != expected or not ran.get(cand):
        raise AssertionError(
            f"{pair.label}: route hits {delta.as_json()} do not match the timed calls "
            f"{expected}: the candidate must have served every candidate call, and nothing "
            "else may have run")
    return measured
