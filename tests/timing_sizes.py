"""The declared timing size of the own tests whose gate sessions run a real timing gate but do
not assert its decision (a seam test asserts the agreement check that runs before the timing).

It is a ``[tool.pytest-dflash]`` override of the run's size, never of a threshold: the margins,
the confidence and the noise floor stay the policy's, so the gate judges as always, on fewer
worker processes and rounds; its decision is then often inconclusive, which these tests accept.
The tests that assert a timing decision keep the policy's sizes (or declare their own).
"""

from __future__ import annotations

# two worker processes (the fewest an interval across processes allows) of two rounds each,
# no time budget a process must fill, no further looks; two in-process rounds, no warm-up
TWO_PROCESSES = {
    "timing_processes": 2,
    "timing_max_processes": 2,
    "timing_min_rounds_per_process": 2,
    "timing_max_rounds_per_process": 2,
    "timing_process_s": 0.0,
    "cpu_validation_process_s": 0.0,
    "speed_rounds": 2,
    "speed_max_rounds": 2,
    "speed_warmup": 0,
}


def pyproject(**more: object) -> str:
    """A pyproject.toml with TWO_PROCESSES (and ``more``) in ``[tool.pytest-dflash]``."""
    lines = [f"{key} = {value!r}".replace("'", '"') for key, value in {**TWO_PROCESSES,
                                                                        **more}.items()]
    return "[tool.pytest-dflash]\n" + "\n".join(lines) + "\n"
