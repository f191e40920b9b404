"""Gate kinds and profiles: the closed vocabulary every other module validates against."""

from __future__ import annotations

GATE_KINDS: tuple[str, ...] = ("loader", "parity", "speed", "validation_cost", "ppl", "quality")
PROFILES: tuple[str, ...] = ("quick", "ci", "full")
ROLES: tuple[str, ...] = ("oracle", "baseline", "candidate")
# Timing gates share the device with nothing else: they refuse to run inside xdist workers.
EXCLUSIVE_KINDS: frozenset[str] = frozenset({"speed", "validation_cost"})


class UnknownNameError(ValueError):
    """A route, gate kind or profile name that does not exist; the message lists what does."""


def check_kind(kind: str) -> str:
    if kind not in GATE_KINDS:
        raise UnknownNameError(
            f"unknown gate kind {kind!r}; known kinds: {', '.join(GATE_KINDS)}"
        )
    return kind
