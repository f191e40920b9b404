"""Whose exception it was: the candidate's own code, or the harness around it (docs/report.md).

A gate test that raises is one of two things. An exception raised inside the candidate's own
code (its implementation's calls, its engine's build, its engine or server answering a valid
request with an error) is the candidate's failure: the test fails and the gate rejects, naming
the exception. Anything else (the plugin, the suites, the baseline, fixtures, the gate's own
contract checks) is an error of the harness: it proves nothing about the candidate, so the test
is an ``error``, its gate ``error`` and the route pending.

The origin is read from the exception itself, never from where the test happened to stop:

- an explicit tag (:func:`mark`) wins: the gate context tags what the candidate's
  implementation import and engine build raise; an engine tags a request it refused as
  invalid (an HTTP 4xx) as the harness's;
- else the traceback: a frame that runs a method of one of the test's candidate objects (the
  candidate's implementation, the engines built for its selection), or a contract call of the
  implementation when it is a plain function, makes it the candidate's. Frames are matched by
  object identity, so the baseline's engine, another instance of the same class, never counts.

Exceptions chained with ``raise ... from`` are followed, so a harness wrapper around a
candidate's exception keeps the candidate's origin.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

CANDIDATE, HARNESS = "candidate", "harness"
_TAG = "__dflash_origin__"
# exceptions that are a gate's decision (an assertion, pytest.fail), not a crash
_DECISIONS = ("AssertionError", "Failed")


def mark(exc: BaseException, origin: str) -> BaseException:
    """Tag ``exc`` as raised by the candidate's code or by the harness; returns it."""
    if origin not in (CANDIDATE, HARNESS):
        raise ValueError(f"origin must be {CANDIDATE!r} or {HARNESS!r}, got {origin!r}")
    try:
        setattr(exc, _TAG, origin)
    except (AttributeError, TypeError):  # an exception type without a __dict__: left untagged
        pass
    return exc


@contextmanager
def candidate_code() -> Iterator[None]:
    """Everything raised inside is the candidate's (unless already tagged otherwise)."""
    try:
        yield
    except Exception as exc:
        if getattr(exc, _TAG, None) is None:
            mark(exc, CANDIDATE)
        raise


@dataclass(frozen=True)
class Raised:
    """One exception as the report records it (a test's ``raised`` field)."""

    exception: str
    message: str
    where: str
    origin: str

    def as_dict(self) -> dict[str, str]:
        return {"exception": self.exception, "message": self.message, "where": self.where,
                "origin": self.origin}


def is_decision(exc: BaseException) -> bool:
    """True for a gate's own verdict: an AssertionError or pytest's ``Failed`` (pytest.fail)."""
    return any(cls.__name__ in _DECISIONS for cls in type(exc).__mro__)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (None if current.__suppress_context__
                                        else current.__context__)


def _frames(exc: BaseException) -> Iterator[types.FrameType]:
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


class CandidateCode:
    """The candidate objects of one gate test, filled as the gate context resolves them: the
    implementation, the engines built for the candidate's selection, and the code objects of
    the implementation's contract calls that are plain functions (no ``self`` to match)."""

    def __init__(self) -> None:
        self.objects: list[Any] = []
        self.codes: set[types.CodeType] = set()

    def add(self, obj: Any, calls: Iterable[str] = ()) -> Any:
        """Count ``obj`` as candidate code, and its named ``calls`` where they are functions;
        returns ``obj``."""
        if obj is None:
            return obj
        if all(o is not obj for o in self.objects):
            self.objects.append(obj)
        if isinstance(obj, types.FunctionType):  # an implementation that is one function
            self.codes.add(obj.__code__)
        for name in calls:
            value = getattr(obj, name, None)
            if isinstance(value, types.FunctionType):
                self.codes.add(value.__code__)
        return obj


def origin_of(exc: BaseException, candidates: CandidateCode | None) -> str:
    """``candidate`` if ``exc`` (or an exception it was raised from) is tagged so or passed
    through a frame of a candidate object; ``harness`` otherwise."""
    ids = {id(obj) for obj in candidates.objects} if candidates else set()
    codes = candidates.codes if candidates else set()
    chain = list(_chain(exc))
    for link in chain:
        tag = getattr(link, _TAG, None)
        if tag in (CANDIDATE, HARNESS):
            return str(tag)
    for link in chain:
        for frame in _frames(link):
            if frame.f_code in codes:
                return CANDIDATE
            try:
                owner = frame.f_locals.get("self")
            except Exception:  # noqa: BLE001 - an unreadable frame proves nothing
                continue
            if owner is not None and id(owner) in ids:
                return CANDIDATE
    return HARNESS


def where(exc: BaseException, root: str | None = None) -> str:
    """``path:line in function`` of the innermost frame that raised ``exc``, relative to
    ``root`` where it lies below it."""
    last = None
    for frame_tb in _tracebacks(exc):
        last = frame_tb
    if last is None:
        return "unknown"
    path = last.tb_frame.f_code.co_filename
    if root:
        try:
            rel = os.path.relpath(path, root)
            path = rel if not rel.startswith("..") else path
        except ValueError:
            pass
    return f"{path}:{last.tb_lineno} in {last.tb_frame.f_code.co_name}"


def _tracebacks(exc: BaseException) -> Iterator[types.TracebackType]:
    tb = exc.__traceback__
    while tb is not None:
        yield tb
        tb = tb.tb_next


def describe(exc: BaseException, candidates: CandidateCode | None, root: str | None = None,
             limit: int = 300) -> Raised:
    """The report's record of ``exc``: its class, first line, where it was raised, origin."""
    text = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return Raised(exception=type(exc).__name__, message=text, where=where(exc, root),
                  origin=origin_of(exc, candidates))
