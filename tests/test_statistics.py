"""Calibration and unit tests of the in-process protocol (pytest_dflash.measure.round_statistics)
and the decision it asks, with deterministic synthetic timers.

A "timer" here is a zero-argument callable returning a synthetic duration drawn from a seeded
generator (5% multiplicative lognormal noise around a true mean): no sleeping, no wall clock.
The calibration tests run the real ``paired_compare`` hundreds of times with the DEFAULT policy
and check its error rates against the targets the gates promise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pytest

from pytest_dflash.measure.decision import max_rounds_for, threshold_for
from pytest_dflash.measure.round_statistics import (
    PairedResult,
    bootstrap_ci,
    mcnemar_exact,
    mcnemar_regression,
    paired_bootstrap,
    paired_compare,
    sides,
)
from pytest_dflash.policy.thresholds import Policy

POLICY = Policy()
NOISE = 0.05  # sigma of the log of each timed run: 5% multiplicative lognormal noise
SIMS = 500
# The no-regression gate must prove "at most 1% slower" from runs with 5% noise each: the CI
# half-width has to shrink below ~0.5%, which takes ~1000 rounds: policy.validation_max_rounds.


def _timer(rng: np.random.Generator, mean_s: float, sigma: float = NOISE) -> Callable[[], float]:
    return lambda: mean_s * float(rng.lognormal(0.0, sigma))


def _compare(true_ratio: float, rule: str, sim: int) -> PairedResult:
    policy = POLICY
    noise = np.random.default_rng([20261129, sim])
    return paired_compare(
        sides(_timer(noise, 1e-3 * true_ratio), _timer(noise, 1e-3)),
        rounds=policy.speed_rounds,
        max_rounds=max_rounds_for(rule, policy),
        confidence=policy.speed_confidence,
        resamples=policy.bootstrap_resamples,
        seed=policy.seed + sim,
        rule=rule,
        threshold=threshold_for(rule, policy),
    )


def _pass_rate(true_ratio: float, rule: str) -> tuple[float, dict[str, int]]:
    outcomes: dict[str, int] = {}
    passes = 0
    for sim in range(SIMS):
        result = _compare(true_ratio, rule, sim)
        passes += result.passed
        outcomes[result.outcome] = outcomes.get(result.outcome, 0) + 1
    return passes / SIMS, outcomes


def test_no_regression_aa_false_fail_rate_at_most_2_percent():
    rate, outcomes = _pass_rate(1.0, "no_regression")
    print(f"no_regression A/A: false-fail {1 - rate:.1%} over {SIMS} runs, outcomes {outcomes}")
    assert 1 - rate <= 0.02


def test_no_regression_detects_a_10_percent_slowdown():
    rate, outcomes = _pass_rate(1.10, "no_regression")
    print(f"no_regression 10% slower: detected {1 - rate:.1%} over {SIMS} runs, {outcomes}")
    assert 1 - rate >= 0.95
    assert outcomes.get("slower", 0) >= 0.95 * SIMS


def test_gain_aa_false_pass_rate_at_most_2_percent():
    rate, outcomes = _pass_rate(1.0, "gain")
    print(f"gain A/A: false-pass {rate:.1%} over {SIMS} runs, outcomes {outcomes}")
    assert rate <= 0.02


def test_gain_passes_a_10_percent_speedup():
    rate, outcomes = _pass_rate(0.90, "gain")
    print(f"gain 10% faster: passed {rate:.1%} over {SIMS} runs, outcomes {outcomes}")
    assert rate >= 0.95
    assert outcomes.get("faster", 0) == round(rate * SIMS)


def test_interleaving_follows_the_recorded_seeded_order():
    calls: list[str] = []
    noise = np.random.default_rng(3)

    def run(tag: str, mean: float) -> Callable[[], float]:
        def timed() -> float:
            calls.append(tag)
            return mean * float(noise.lognormal(0, NOISE))

        return timed

    result = paired_compare(
        sides(run("c", 1e-3), run("b", 1e-3)),
        rounds=12,
        max_rounds=12,
        confidence=0.95,
        resamples=2000,
        seed=11,
        rule="gain",
        threshold=0.99,
        warmup=2,
    )
    assert calls[:4] == ["c", "b", "c", "b"]  # warmup: untimed calls of each side first
    timed = calls[4:]
    assert ["".join(timed[i : i + 2]) for i in range(0, len(timed), 2)] == result.orders
    assert {"cb", "bc"} <= set(result.orders)
    again = paired_compare(
        sides(run("c", 1e-3), run("b", 1e-3)),
        rounds=12,
        max_rounds=12,
        confidence=0.95,
        resamples=2000,
        seed=11,
        rule="gain",
        threshold=0.99,
    )
    assert again.orders == result.orders  # seeded
    other = paired_compare(
        sides(run("c", 1e-3), run("b", 1e-3)),
        rounds=12,
        max_rounds=12,
        confidence=0.95,
        resamples=2000,
        seed=12,
        rule="gain",
        threshold=0.99,
    )
    assert other.orders != result.orders
    assert result.ratios == pytest.approx(
        [c / b for c, b in zip(result.candidate_s, result.baseline_s, strict=True)]
    )


def test_a_clear_effect_stops_at_the_first_look():
    result = _compare(0.7, "gain", sim=0)
    assert result.passed and result.outcome == "faster"
    assert result.rounds == POLICY.speed_rounds and result.looks == [POLICY.speed_rounds]
    assert result.ci_high < threshold_for("gain", POLICY)


def test_undecided_run_doubles_rounds_then_fails_closed():
    """A true 1.5% gain under 5% noise cannot be shown to beat the 1% bar within 48 rounds."""
    runs = [_compare(0.985, "gain", sim=s) for s in range(40)]
    plan = [12, 24, 48]
    assert all(r.looks == plan[: len(r.looks)] and r.rounds == r.looks[-1] for r in runs)
    at_cap = [r for r in runs if r.rounds == POLICY.speed_max_rounds]
    assert len(at_cap) >= 20
    # still straddling the threshold at the cap: inconclusive, and failed (fail closed)
    straddling = [r for r in at_cap if r.ci_low < r.threshold <= r.ci_high < 1.0]
    assert straddling and all(r.outcome == "inconclusive" and not r.passed for r in straddling)
    # stopped early: only on a decision the CI supports
    early = [r for r in runs if r.rounds < POLICY.speed_max_rounds]
    assert all(r.passed == (r.ci_high < r.threshold) for r in early)
    assert all(r.ci_high < r.threshold or r.ci_low >= r.threshold for r in early)


def test_outcome_names():
    assert _compare(1.3, "gain", sim=2).outcome == "slower"
    aa = _compare(1.0, "gain", sim=3)
    # A/A against a gain margin: the interval holds 1 and 0.99 at the cap, so it proves neither
    # a gain nor its lack, and its words say so as its decision does (tests/test_decision.py)
    assert aa.ci_low < aa.threshold < 1.0 <= aa.ci_high and not aa.passed
    assert (aa.decision, aa.outcome) == ("inconclusive", "inconclusive")
    quick = _compare(0.8, "no_regression", sim=4)
    assert quick.passed and quick.outcome == "faster"
    slow = _compare(1.3, "no_regression", sim=5)
    assert not slow.passed and slow.outcome == "slower" and slow.ci_low > slow.threshold


def test_result_figure_and_measurements_are_json_able():
    result = _compare(0.9, "gain", sim=6)
    assert result.figure() == (
        f"ratio {result.median:.3f} [{result.ci_low:.3f}, {result.ci_high:.3f}] "
        f"over {result.rounds} rounds"
    )
    record = json.loads(json.dumps(result.measurements(), allow_nan=False))
    assert record["samples"]["candidate"] == result.candidate_s
    assert len(record["samples"]["baseline"]) == record["rounds"] == len(record["orders"])
    assert record["threshold"] == pytest.approx(1 - POLICY.speed_min_gain)
    assert "needs CI upper < 0.990" == result.requirement()


def test_bad_arguments_are_refused_with_the_fix():
    ok = dict(rounds=12, max_rounds=48, confidence=0.95, resamples=2000, seed=1, threshold=0.99)
    one = lambda: 1e-3  # noqa: E731
    with pytest.raises(ValueError, match="unknown rule 'faster'; known rules: gain, no_regression"):
        paired_compare(sides(one, one), rule="faster", **ok)
    with pytest.raises(ValueError, match="max_rounds"):
        paired_compare(sides(one, one), rule="gain", **{**ok, "max_rounds": 6})
    with pytest.raises(ValueError, match="rounds must be an integer >= 2"):
        paired_compare(sides(one, one), rule="gain", **{**ok, "rounds": 1})
    with pytest.raises(ValueError, match="resamples must be an integer >= 100"):
        paired_compare(sides(one, one), rule="gain", **{**ok, "resamples": 10})
    with pytest.raises(ValueError, match="confidence must be"):
        paired_compare(sides(one, one), rule="gain", **{**ok, "confidence": 95})
    with pytest.raises(ValueError, match="below the timer's resolution"):
        paired_compare(sides(lambda: 0.0, one), rule="gain", **ok)
    with pytest.raises(ValueError, match="run_baseline returned -1.0"):
        paired_compare(sides(one, lambda: -1.0), rule="gain", **ok)
    with pytest.raises(TypeError, match="must return elapsed seconds as a number"):
        paired_compare(sides(lambda: None, one), rule="gain", **ok)
    with pytest.raises(ValueError, match="at least 2 values"):
        bootstrap_ci([1.0], confidence=0.95, resamples=2000, seed=0)
    with pytest.raises(ValueError, match="NaN/Inf"):
        bootstrap_ci([1.0, math.nan], confidence=0.95, resamples=2000, seed=0)


@pytest.mark.parametrize(
    ("b", "c", "two_sided", "worse"),
    [
        (0, 0, 1.0, 1.0),
        (0, 5, 2 / 32, 1.0),  # tail C(5,0) = 1 of 2^5, doubled
        (1, 9, 2 * 11 / 1024, 1023 / 1024),  # C(10,0)+C(10,1) = 11; P(X>=1) = 1 - 1/1024
        (2, 8, 2 * 56 / 1024, 1013 / 1024),  # 1+10+45 = 56; P(X>=2) = 1 - 11/1024
        (8, 2, 2 * 56 / 1024, 56 / 1024),  # P(X>=8) = (45+10+1)/1024
        (3, 3, 1.0, 42 / 64),  # doubled tail 84/64 capped at 1; P(X>=3) = (20+15+6+1)/64
        (12, 1, 2 * 14 / 8192, 14 / 8192),  # C(13,0)+C(13,1) = 14 of 2^13
    ],
)
def test_mcnemar_matches_hand_computed_binomials(b, c, two_sided, worse):
    assert mcnemar_exact(b, c) == pytest.approx(two_sided, rel=1e-12)
    assert mcnemar_regression(b, c) == pytest.approx(worse, rel=1e-12)


def test_mcnemar_refuses_bad_counts():
    with pytest.raises(ValueError, match="non-negative integer"):
        mcnemar_exact(-1, 3)
    with pytest.raises(ValueError, match="non-negative integer"):
        mcnemar_regression(2.5, 3)


def test_median_fast_path_matches_explicit_resampling():
    """The O(resamples) median draw has the distribution of explicit index resampling."""
    data = np.random.default_rng(8).lognormal(0, 0.07, 47)
    fast = bootstrap_ci(data, confidence=0.9, resamples=100_000, seed=1)
    slow = bootstrap_ci(
        data,
        confidence=0.9,
        resamples=100_000,
        seed=1,
        stat=lambda x, axis=None: np.median(x, axis=axis),
    )
    assert fast[0] == slow[0] == float(np.median(data))
    assert fast[1:] == pytest.approx(slow[1:], abs=2e-3)
    even = np.arange(1.0, 7.0)  # median of an even count averages the two middle values
    point, lo, hi = bootstrap_ci(even, confidence=0.95, resamples=4000, seed=2)
    assert point == 3.5 and 1.0 <= lo < 3.5 < hi <= 6.0


@pytest.mark.parametrize("stat", ["median", "mean"])
def test_bootstrap_ci_covers_the_true_value(stat):
    rng = np.random.default_rng(77)
    trials, covered = 400, 0
    for trial in range(trials):
        sample = rng.lognormal(0.0, 0.3, 41)  # true median 1, true mean exp(0.045)
        if stat == "median":
            _, lo, hi = bootstrap_ci(sample, confidence=0.95, resamples=2000, seed=trial)
            truth = 1.0
        else:
            _, lo, hi = paired_bootstrap(sample, confidence=0.95, resamples=2000, seed=trial)
            truth = math.exp(0.3**2 / 2)
        covered += lo <= truth <= hi
    print(f"bootstrap {stat} CI coverage {covered / trials:.1%} (nominal 95%)")
    assert 0.90 <= covered / trials <= 0.985


def test_paired_bootstrap_of_a_shift():
    diffs = np.random.default_rng(5).normal(0.3, 0.1, 30)
    mean, lo, hi = paired_bootstrap(diffs, confidence=0.95, resamples=2000, seed=0)
    assert mean == pytest.approx(float(diffs.mean()))
    assert 0.2 < lo < mean < hi < 0.4
