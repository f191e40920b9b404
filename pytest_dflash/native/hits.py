"""Route hit counters: every op wrapper records which route and path served each call.

Gates assert on these counts to prove what really ran: a silent fallback shows up as hits on
the fallback route instead of the candidate. Native ops count their own hits (no Python on their
call path); a *source* registered with :func:`add_source` reports those counters, and every
snapshot includes them.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_hits: Counter[tuple[str, str]] = Counter()
# monotonic counters kept elsewhere (a native library), and their values at the last reset
_sources: list[Callable[[], dict[tuple[str, str], int]]] = []
_source_offsets: Counter[tuple[str, str]] = Counter()
_local = threading.local()  # per-thread route renames of the enclosing ``renamed`` blocks
# (source, target) -> sequence number of its latest ``renamed`` block (for native counts)
_claims: dict[tuple[str, str], int] = {}
_claim_seq = 0


def record(route: str, op: str, count: int = 1) -> None:
    """Count ``count`` calls of ``op`` served by ``route`` (route is a full route name)."""
    aliases = getattr(_local, "aliases", None)
    if aliases:
        route = aliases.get(route, route)
    with _lock:
        _hits[(route, op)] += count


class renamed:  # noqa: N801 - used like a function: ``with hits.renamed(a, b):``
    """Hits of route ``source`` made inside the block count under ``target`` instead.

    For a route that serves its calls through another route's code (the self-test's copies and
    planted defects wrap a route): the gates then see the wrapper as the route that ran, while
    hits of shared kernels the wrapped code calls keep their own names. Hits recorded from
    Python are renamed as they are recorded; hits a native op counts itself are renamed in the
    delta of every ``counting()`` block during which such a ``renamed`` block ran (a gate never
    runs a planted copy and its source route inside one counting block). A class, not a
    generator: it wraps every call of a timed route, so it must cost next to nothing.
    """

    __slots__ = ("source", "target", "previous")

    def __init__(self, source: str, target: str) -> None:
        self.source, self.target = source, target

    def __enter__(self) -> None:
        global _claim_seq
        self.previous = getattr(_local, "aliases", None)
        _local.aliases = {**(self.previous or {}), self.source: self.target}
        _claim_seq += 1
        _claims[(self.source, self.target)] = _claim_seq

    def __exit__(self, *exc: object) -> None:
        _local.aliases = self.previous


def add_source(read: Callable[[], dict[tuple[str, str], int]]) -> None:
    """Include ``read()`` (monotonic counts per (route, op)) in every snapshot from now on."""
    with _lock:
        if read not in _sources:
            _sources.append(read)
            _source_offsets.update(read())  # counts before registration are not this session's


def _source_counts() -> Counter[tuple[str, str]]:
    total: Counter[tuple[str, str]] = Counter()
    for read in _sources:
        total.update(read())
    return total


def snapshot() -> dict[tuple[str, str], int]:
    with _lock:
        merged = Counter(_hits)
        for key, n in _source_counts().items():
            if n - _source_offsets.get(key, 0):
                merged[key] += n - _source_offsets.get(key, 0)
        return dict(merged)


def reset() -> None:
    with _lock:
        _hits.clear()
        _source_offsets.clear()
        _source_offsets.update(_source_counts())


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
    start = _claim_seq
    with _lock:
        native_before = _source_counts()
    before = snapshot()
    delta = HitDelta()
    try:
        yield delta
    finally:
        after = snapshot()
        counts = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
        claimed = {source: target for (source, target), seq in _claims.items() if seq > start}
        if claimed:
            with _lock:
                native = _source_counts() - native_before
            for (route, op), n in native.items():
                if route in claimed and n > 0:
                    counts[(route, op)] -= n
                    counts[(claimed[route], op)] = counts.get((claimed[route], op), 0) + n
            counts = {k: n for k, n in counts.items() if n}
        delta.counts = counts
