"""The decision of a timing comparison, and its words: the one place that names them.

A timing gate's interval of candidate/baseline is judged against the policy's margin by one
function, :func:`judge`, which gives both the decision (``pass`` / ``fail`` / ``inconclusive``)
and the finding in words (``faster`` / ``neutral`` / ``slower`` / ``inconclusive``). Both
protocols (``round_statistics``: rounds of one process; ``process_statistics``: one statistic
per process) and the report's readers ask it, so a result's words cannot disagree with its
decision: an interval that straddles the margin is "inconclusive" in both.

Decision rules (the thresholds come from the predeclared policy, never from a test):

* ``"gain"``: pass iff the interval's upper bound < ``threshold`` (``1 - policy.speed_min_gain``);
  fail iff its lower bound >= the threshold (not the required gain).
* ``"no_regression"``: pass iff the upper bound <= ``threshold``
  (``1 + policy.validation_noise_floor``); fail iff the lower bound > it (a proven regression).

Every look of a sequential comparison is a chance to stop on a fluke, so the error rate is
spent across the looks (:func:`look_confidence`). numpy only (no torch, no scipy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pytest_dflash.policy.thresholds import Policy

RULES: tuple[str, ...] = ("gain", "no_regression")
PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
DECISIONS: tuple[str, ...] = (PASS, FAIL, INCONCLUSIVE)
FASTER, NEUTRAL, SLOWER = "faster", "neutral", "slower"
OUTCOMES: tuple[str, ...] = (FASTER, NEUTRAL, SLOWER, INCONCLUSIVE)


class Judgement(NamedTuple):
    """What an interval says against the margin: the decision and the finding in words."""

    decision: str  # one of DECISIONS
    outcome: str  # one of OUTCOMES; "inconclusive" exactly when the decision is

    @property
    def passed(self) -> bool:
        return self.decision == PASS

    @property
    def decided(self) -> bool:
        """The interval lies wholly on one side of the margin: no more looks are needed."""
        return self.decision != INCONCLUSIVE


def judge(rule: str, threshold: float, lo: float, hi: float) -> Judgement:
    """Judge the interval [``lo``, ``hi``] of candidate/baseline by ``rule`` at ``threshold``.

    Decision: see the module docstring; an interval that straddles the margin claims neither a
    pass nor a fail. Words: a pass is "faster" (gain, or no_regression with the interval wholly
    below 1) or "neutral" (no_regression, the interval reaching 1 or above); a fail is "slower"
    (the interval wholly above 1, or no_regression's proven regression) or "neutral" (gain: the
    interval holds 1, or sits between the margin and 1: faster by less than the required gain);
    an undecided interval is "inconclusive", whatever side of 1 it leans to.

    Ratios or log ratios: only comparisons with ``threshold`` decide, so a log interval with a
    log threshold gets the same decision (its words then compare with 0, not 1: ask them of
    ratios).
    """
    if rule == "gain":
        passed, failed = hi < threshold, lo >= threshold
    elif rule == "no_regression":
        passed, failed = hi <= threshold, lo > threshold
    else:
        raise ValueError(f"unknown rule {rule!r}; known rules: {', '.join(RULES)}")
    if passed:
        return Judgement(PASS, FASTER if rule == "gain" or hi < 1.0 else NEUTRAL)
    if failed:
        return Judgement(FAIL, SLOWER if rule == "no_regression" or lo > 1.0 else NEUTRAL)
    return Judgement(INCONCLUSIVE, INCONCLUSIVE)


def threshold_for(rule: str, policy: Policy) -> float:
    """The predeclared decision threshold of ``rule``: where the policy says the line is."""
    if rule == "gain":
        return 1.0 - policy.speed_min_gain
    if rule == "no_regression":
        return 1.0 + policy.validation_noise_floor
    raise ValueError(f"unknown rule {rule!r}; known rules: {', '.join(RULES)}")


def max_rounds_for(rule: str, policy: Policy) -> int:
    """Round cap of ``rule``: proving "at most 1% slower" under 5% per-run noise needs the CI
    half-width below ~0.5%, i.e. ~1000 rounds, far more than a gain gate needs to decide."""
    threshold_for(rule, policy)  # validates the rule name
    return policy.validation_max_rounds if rule == "no_regression" else policy.speed_max_rounds


# the share of the error rate the interim looks spend together (Haybittle-Peto style); what a
# larger share would cost is replayed by benchmarks/spending_replay.py
INTERIM_SHARE = 0.1


def look_confidence(confidence: float, looks: int, final: bool,
                     interim_share: float = INTERIM_SHARE) -> float:
    """Per-look CI level so that the whole adaptive run keeps ``confidence`` (alpha spending).

    Every look is a chance to stop on a wrong decision, so the error rate ``1 - confidence`` is
    split (Bonferroni, Haybittle-Peto style): the interim looks share ``interim_share`` of it (a
    tenth) and the final look at the cap gets the rest. Early stops then need overwhelming
    evidence, and the final look stays close to the nominal level, where most of the precision
    is: near-margin gates that need the cap pass there (an equal split passed them less often,
    benchmarks/results/not-kept-timing-looks.json).
    """
    if looks == 1:
        return confidence
    alpha = 1.0 - confidence
    spent = alpha * interim_share / (looks - 1) if not final else alpha * (1.0 - interim_share)
    return 1.0 - spent


def finite_1d(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    """``values`` as a one-dimensional float array, refused where it holds NaN or Inf."""
    data = np.asarray(values, dtype=np.float64)
    if data.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {data.shape}")
    if not np.isfinite(data).all():
        raise ValueError(f"{name} contains NaN/Inf at {np.flatnonzero(~np.isfinite(data))[:5]}")
    return data


def check_confidence(confidence: float) -> None:
    """Refuse a confidence level outside [0.5, 1), naming the range."""
    if not (isinstance(confidence, float) and 0.5 <= confidence < 1.0):
        raise ValueError(f"confidence must be a float in [0.5, 1), got {confidence!r}")
