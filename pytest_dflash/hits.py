"""Route hit counters: every op wrapper records which route and path served each call.

Gates assert on these counts to prove what really ran: a silent fallback shows up as hits on
the fallback route instead of the candidate.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_hits: Counter[tuple[str, str]] = Counter()


def record(route: str, op: str, count: int = 1) -> None:
    """Count ``count`` calls of ``op`` served by ``route`` (route is a full route name)."""
    with _lock:
        _hits[(route, op)] += count


def snapshot() -> dict[tuple[str, str], int]:
    with _lock:
        return dict(_hits)


def reset() -> None:
    with _lock:
        _hits.clear()


class HitDelta:
    """Hits recorded inside a ``counting()`` block, filled in when the block exits."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def by_route(self) -> dict[str, int]:
        totals: Counter[str] = Counter()
        for (route, _op), n in self.counts.items():
            totals[route] += n
        return dict(totals)

    def route(self, route: str) -> int:
        return self.by_route().get(route, 0)

    def as_json(self) -> dict[str, int]:
        return {f"{route}/{op}": n for (route, op), n in sorted(self.counts.items())}


@contextmanager
def counting() -> Iterator[HitDelta]:
    """Yield a delta holding only the hits recorded while the block ran."""
    before = snapshot()
    delta = HitDelta()
    try:
        yield delta
    finally:
        after = snapshot()
        delta.counts = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
