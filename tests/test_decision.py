"""The one decision of a timing interval and its words (``pytest_dflash.measure.decision``).

Both timing protocols word their results through ``judge``, so a result can no longer carry
an outcome that contradicts its decision: before, a paired result whose interval straddled the
gain margin and held 1 said "neutral" while its decision said "inconclusive".
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pytest_dflash.measure.decision import (
    DECISIONS,
    FAIL,
    INCONCLUSIVE,
    OUTCOMES,
    PASS,
    RULES,
    Judgement,
    judge,
)
from pytest_dflash.measure.process_statistics import ProcessSample, process_compare
from pytest_dflash.measure.round_statistics import paired_compare, sides


def test_a_gain_interval_that_straddles_the_margin_is_inconclusive_in_words_too() -> None:
    """gain, threshold 0.99, interval [0.95, 1.02]: neither a proven gain nor a proven lack of
    one, so the decision and the words both say "inconclusive" (not "neutral")."""
    assert judge("gain", 0.99, 0.95, 1.02) == Judgement(INCONCLUSIVE, INCONCLUSIVE)


@pytest.mark.parametrize(("rule", "threshold", "lo", "hi", "expected"), [
    ("gain", 0.99, 0.90, 0.98, (PASS, "faster")),
    ("gain", 0.99, 0.992, 0.999, (FAIL, "neutral")),  # faster by less than the required gain
    ("gain", 0.99, 0.98, 1.01, (INCONCLUSIVE, INCONCLUSIVE)),
    ("gain", 0.99, 1.01, 1.05, (FAIL, "slower")),
    ("no_regression", 1.01, 0.95, 0.99, (PASS, "faster")),
    ("no_regression", 1.01, 0.998, 1.004, (PASS, "neutral")),
    ("no_regression", 1.01, 1.002, 1.02, (INCONCLUSIVE, INCONCLUSIVE)),
    ("no_regression", 1.01, 1.02, 1.05, (FAIL, "slower")),
])
def test_each_side_of_the_margin_gets_its_decision_and_words(rule, threshold, lo, hi,
                                                             expected) -> None:
    assert tuple(judge(rule, threshold, lo, hi)) == expected


def test_words_and_decision_agree_on_every_interval() -> None:
    """Over a grid of intervals round both margins and 1: "inconclusive" in words exactly when
    the decision is, a pass is never "slower" and a fail never "faster"."""
    edges = [0.9, 0.98, 0.99, 0.995, 1.0, 1.005, 1.01, 1.02, 1.1]
    for rule, threshold in (("gain", 0.99), ("no_regression", 1.01)):
        for lo, hi in itertools.combinations_with_replacement(edges, 2):
            decision, outcome = judge(rule, threshold, lo, hi)
            assert decision in DECISIONS and outcome in OUTCOMES
            assert (decision == INCONCLUSIVE) == (outcome == INCONCLUSIVE), (rule, lo, hi)
            assert not (decision == PASS and outcome == "slower"), (rule, lo, hi)
            assert not (decision == FAIL and outcome == "faster"), (rule, lo, hi)


def test_an_unknown_rule_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown rule 'faster'; known rules: gain, no_regression"):
        judge("faster", 0.99, 0.9, 1.0)
    assert RULES == ("gain", "no_regression")


def test_a_paired_result_that_ends_undecided_says_so_in_its_words() -> None:
    """The in-process protocol, A/A at one look: its interval holds 1 and the gain margin, so
    the result is inconclusive, and its record's words say the same."""
    rng = np.random.default_rng(5)

    def timer() -> float:
        return 1e-3 * float(rng.lognormal(0.0, 0.05))

    result = paired_compare(sides(timer, timer), rounds=12, max_rounds=12, confidence=0.95,
                            resamples=2000, seed=3, rule="gain", threshold=0.99)
    assert result.ci_low < 0.99 < 1.0 < result.ci_high  # the case the old words got wrong
    record = result.measurements()
    assert (record["decision"], record["outcome"]) == (INCONCLUSIVE, INCONCLUSIVE)
    assert not result.passed


def test_a_process_result_words_its_interval_as_the_paired_one_would() -> None:
    """The cross-process protocol at its cap with an interval across the gain margin."""
    rng = np.random.default_rng(11)

    def sample(count: int, rounds: int) -> list[ProcessSample]:
        out = []
        for i in range(count):
            bias = float(rng.normal(0.0, 0.03))
            base = [1e-3] * rounds
            cand = [1e-3 * float(np.exp(bias + rng.normal(0.0, 0.01))) for _ in range(rounds)]
            out.append(ProcessSample(i, 1000 + i, cand, base, ["cb", "bc"] * (rounds // 2)))
        return out

    result = process_compare(sample, processes=4, max_processes=4, rounds=4, confidence=0.95,
                             rule="gain", threshold=0.99)
    assert result.ci_low < 0.99 < 1.0 < result.ci_high
    assert (result.decision, result.outcome) == tuple(
        judge("gain", 0.99, result.ci_low, result.ci_high)) == (INCONCLUSIVE, INCONCLUSIVE)
