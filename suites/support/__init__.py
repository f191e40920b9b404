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
