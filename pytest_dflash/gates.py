"""Former name of :mod:`pytest_dflash.vocabulary` (gate kinds, profiles, roles).

The module held the vocabulary, not gates, and was renamed; this name keeps imports written
against it working. New code imports ``pytest_dflash.vocabulary``.
"""

from pytest_dflash.vocabulary import (
    EXCLUSIVE_KINDS,
    GATE_KINDS,
    PROFILES,
    ROLES,
    UnknownNameError,
    check_kind,
    check_profile,
)

__all__ = ["EXCLUSIVE_KINDS", "GATE_KINDS", "PROFILES", "ROLES", "UnknownNameError",
           "check_kind", "check_profile"]
