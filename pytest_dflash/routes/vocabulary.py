"""The closed vocabulary of pytest-dflash: gate kinds, profiles, roles, compute dtypes.

Every other module validates names against these tuples, so a typo in a marker, an option or a
route declaration is an error that lists what exists (docs/vocabulary.md explains each word).
"""

from __future__ import annotations

# ``speed`` times one op of a family (op level); ``prefill`` times an engine's cold prefill of a
# whole prompt with the route switched in (model level): two kinds, so a report never mixes them.
GATE_KINDS: tuple[str, ...] = ("loader", "parity", "speed", "prefill", "validation_cost", "ppl",
                               "quality")
PROFILES: tuple[str, ...] = ("quick", "ci", "full")
ROLES: tuple[str, ...] = ("oracle", "baseline", "candidate")
# compute dtypes, as torch names them: a route's ``dtypes``, the transformers engine's
# ``--dflash-dtype``
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# Timing gates share the device with nothing else: they refuse to run inside xdist workers.
EXCLUSIVE_KINDS: frozenset[str] = frozenset({"speed", "prefill", "validation_cost"})


class UnknownNameError(ValueError):
    """A route, gate kind or profile name that does not exist; the message lists what does."""


def check_kind(kind: str) -> str:
    """Return ``kind`` if it is a gate kind, else raise UnknownNameError listing the kinds."""
    if kind not in GATE_KINDS:
        raise UnknownNameError(
            f"unknown gate kind {kind!r}; known kinds: {', '.join(GATE_KINDS)}"
        )
    return kind


def check_profile(profile: str) -> str:
    """Return ``profile`` if it is a profile name, else raise UnknownNameError listing them."""
    if profile not in PROFILES:
        raise UnknownNameError(f"unknown profile {profile!r}; known: {', '.join(PROFILES)}")
    return profile
