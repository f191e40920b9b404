"""The cross-process timing statistic and its three outcomes (docs/gates.md, "Timing protocol").

Simulated processes: each has a bias of its own (a lognormal factor drawn once per process, as
the host path's per-process cost is) and per-round noise. The old protocol's interval, computed
over the rounds of one process, rejects identical code whenever that process's bias exceeds the
noise floor; the interval across processes must not. No wall clock anywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from pytest_dflash.evidence.verdict import gate_status, route_verdict
from pytest_dflash.measure.decision import judge, threshold_for
from pytest_dflash.measure.process_statistics import (
    ProcessSample,
    across_processes,
    decision_chance,
    process_compare,
    process_statistic,
    sample_calls,
    statistic_variance,
    t_quantile,
    variance_components,
)
from pytest_dflash.measure.round_statistics import paired_compare, sides
from pytest_dflash.policy.thresholds import Policy, PolicyError

POLICY = Policy()
BIAS = 0.01  # sigma of the per-process log bias: 1%, well inside what the host path shows
NOISE = 0.03  # sigma of the per-round log noise
ROUNDS = 24  # what a worker's time budget (policy timing_process_s) gives a ~10 ms round


def _simulated(rng: np.random.Generator, true_ratio: float, bias: float | None = None,
               bias_sd: float = BIAS):
    """``sample(n, rounds)`` of simulated processes around ``true_ratio``."""
    made = [0]

    def sample(count: int, rounds: int) -> list[ProcessSample]:
        out = []
        for _ in range(count):
            made[0] += 1
            b = rng.normal(0.0, bias_sd) if bias is None else bias
            base = 1e-3 * rng.lognormal(0.0, NOISE, rounds)
            cand = base * true_ratio * np.exp(b) * rng.lognormal(0.0, NOISE, rounds)
            out.append(
                ProcessSample(
                    worker=made[0],
                    pid=made[0],
                    candidate_s=cand.tolist(),
                    baseline_s=base.tolist(),
                    orders=["cb"] * rounds,
                    setup_s=0.5,
                )
            )
        return out

    return sample


def _decide_across(seed: int, true_ratio: float, rule: str = "no_regression", *,
                   futility: float = POLICY.timing_futility, bias_sd: float = BIAS):
    rng = np.random.default_rng(seed)
    return process_compare(
        _simulated(rng, true_ratio, bias_sd=bias_sd),
        processes=POLICY.timing_processes,
        max_processes=POLICY.timing_max_processes,
        rounds=ROUNDS,
        confidence=POLICY.speed_confidence,
        rule=rule,
        threshold=threshold_for(rule, POLICY),
        max_rounds=POLICY.timing_max_rounds_per_process,
        futility=futility,
    )


@pytest.mark.parametrize(
    ("p", "df", "expected"),
    [
        (0.975, 1, 12.706204736),
        (0.975, 5, 2.570581836),
        (0.975, 17, 2.109815578),
        (0.995, 5, 4.032142984),
        (0.5, 9, 0.0),
        (0.025, 5, -2.570581836),
    ],
)
def test_t_quantile_matches_the_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-7)


def test_t_quantile_refuses_nonsense():
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile(0.975, 0)
    with pytest.raises(ValueError, match="quantile level"):
        t_quantile(1.0, 5)


def test_interval_across_processes_is_the_t_interval_of_their_means():
    stats = [0.01, -0.004, 0.002, 0.007, -0.001, 0.003]
    ratio, lo, hi = across_processes(stats, 0.95)
    mean, sd = np.mean(stats), np.std(stats, ddof=1)
    half = 2.570581836 * sd / np.sqrt(6)
    assert (ratio, lo, hi) == pytest.approx(
        (np.exp(mean), np.exp(mean - half), np.exp(mean + half)), rel=1e-9
    )
    with pytest.raises(ValueError, match="at least 2 processes"):
        across_processes([0.01], 0.95)


def test_one_biased_process_rejects_identical_code_the_old_way_but_not_across_processes():
    """A process whose own bias is +2% (identical code, true ratio 1): the old interval over
    its 1536 rounds lies wholly above the 1% floor and rejects; processes drawn with that spread
    of biases give an interval that does not fail."""
    rng = np.random.default_rng(7)
    one = _simulated(rng, 1.0, bias=0.02)(1, 1536)[0]
    cand, base = iter(one.candidate_s), iter(one.baseline_s)  # one of each per round
    old = paired_compare(
        sides(lambda: next(cand), lambda: next(base)),
        rounds=12,
        max_rounds=1536,
        confidence=0.95,
        resamples=2000,
        seed=1,
        rule="no_regression",
        threshold=threshold_for("no_regression", POLICY),
    )
    assert old.decision == "fail" and old.ci_low > 1.01, old.figure()
    new = _decide_across(7, 1.0)
    assert new.decision != "fail", new.figure()


def test_identical_code_almost_never_fails_across_processes_and_often_did_within_one():
    """200 simulated A/A gates: across processes at most 2.5% fail (the one-sided error the
    95% interval allows); judged within one process, about a third would have failed."""
    fails = sum(_decide_across(seed, 1.0).decision == "fail" for seed in range(200))
    assert fails <= 5
    rng = np.random.default_rng(0)
    biases = rng.normal(0.0, BIAS, 2000)
    # a process's within-process interval is ~+-0.15% at 1536 rounds: it fails when its bias
    # alone exceeds the floor
    assert np.mean(np.exp(biases) > 1.0 + POLICY.validation_noise_floor + 0.0015) > 0.10


def test_planted_slowdowns_are_caught():
    """5% slower fails every time; 2% slower (twice the floor) never passes."""
    five = [_decide_across(seed, 1.05).decision for seed in range(30)]
    two = [_decide_across(seed, 1.02).decision for seed in range(30)]
    assert five == ["fail"] * 30
    assert "pass" not in two


def test_looks_add_processes_and_record_kalibera_jones_rounds():
    result = _decide_across(3, 1.009, futility=0.0)  # right at the floor: needs every look
    assert result.looks == [6, 12, 18]
    assert len(result.processes) == 18
    assert result.rounds_per_process[:6] == [ROUNDS] * 6
    assert result.variance["within"] > 0 and "optimal_rounds" in result.variance
    measured = result.measurements()
    assert measured["unit"] == "process" and len(measured["processes"]) == 18
    assert measured["decision"] in ("pass", "fail", "inconclusive")


def test_variance_components_separate_bias_from_noise():
    rng = np.random.default_rng(11)
    samples = _simulated(rng, 1.0)(40, 200)
    parts = variance_components(samples)
    # the ratio carries one draw; the interquartile mean sees about 1.2x a normal round's
    # variance (its efficiency against the mean there)
    assert NOISE**2 < parts["within"] < 1.4 * NOISE**2
    assert parts["between"] == pytest.approx(BIAS**2, rel=0.5)
    # c_process = 0.5 s, c_round ~ 2 ms: K&J say sqrt(250 * within / between) rounds
    assert parts["optimal_rounds"] == pytest.approx(
        np.sqrt(0.5 / parts["round_s"] * parts["within"] / parts["between"])
    )


def test_kalibera_jones_rounds_count_every_call_of_a_sample():
    """A CPU sample of a short call repeats it (calls_per_sample) and records the calls' mean:
    a round costs that many calls on each side, and the optimum falls with the root of it."""
    rng = np.random.default_rng(11)
    samples = _simulated(rng, 1.0)(12, 100)
    one = variance_components(samples)
    for sample in samples:
        sample.info["calls_per_sample"] = 9
    nine = variance_components(samples)
    assert nine["round_s"] == pytest.approx(9 * one["round_s"])
    assert nine["within"] == one["within"] and nine["between"] == one["between"]
    assert nine["optimal_rounds"] == pytest.approx(one["optimal_rounds"] / 3)
    del samples[0].info["calls_per_sample"]  # a worker that recorded none: one call a sample
    assert sample_calls(samples[0].info, samples[0].worker) == 1
    for bad in (0, "9", True, None):  # not a count: refused, naming the field
        samples[0].info["calls_per_sample"] = bad
        with pytest.raises(ValueError, match="calls_per_sample must be a positive integer"):
            variance_components(samples)


@pytest.mark.parametrize(
    ("rule", "lo", "hi", "decision", "words"),
    [
        ("no_regression", 0.995, 1.008, "pass", "neutral"),
        ("no_regression", 0.990, 0.998, "pass", "faster"),
        ("no_regression", 1.011, 1.02, "fail", "slower"),
        ("no_regression", 1.002, 1.015, "inconclusive", "inconclusive"),
        ("gain", 0.95, 0.98, "pass", "faster"),
        ("gain", 0.995, 1.004, "fail", "neutral"),
        ("gain", 1.01, 1.03, "fail", "slower"),
        ("gain", 0.98, 1.0, "inconclusive", "inconclusive"),
    ],
)
def test_three_outcomes_against_the_margin(rule, lo, hi, decision, words):
    threshold = threshold_for(rule, POLICY)
    assert judge(rule, threshold, lo, hi) == (decision, words)


def _test(outcome: str, message: str = "") -> dict:
    return {"nodeid": f"t::{outcome}", "outcome": outcome, "message": message, "measurements": {}}


def test_inconclusive_never_promotes_and_never_says_slower():
    gates = {
        "parity": {"status": "passed", "tests": [_test("passed")]},
        "validation_cost": {
            "status": gate_status(
                [_test("passed"), _test("inconclusive", "verify M=3: inconclusive")]
            ),
            "tests": [_test("passed"), _test("inconclusive", "verify M=3: inconclusive")],
        },
    }
    assert gates["validation_cost"]["status"] == "pending"
    verdict, reasons = route_verdict(["parity", "validation_cost"], gates)
    assert verdict == "pending"
    assert reasons == ["validation_cost pending: inconclusive timing (verify M=3: inconclusive)"]
    assert "slower" not in reasons[0]
    # a failure elsewhere still rejects: inconclusive does not mask a fail
    failing = {**gates, "parity": {"status": "failed", "tests": [_test("failed", "bad")]}}
    assert route_verdict(["parity", "validation_cost"], failing)[0] == "reject"


def test_futility_stops_only_hopeless_gates_and_only_as_inconclusive():
    """A speed gate whose true gain equals the margin, with a 6% per-process spread (a cold
    prefill on two cores): the cap almost never decides, so most runs stop at an interim look.
    Every run that decides with the futility stop decides the same without it (the same
    processes), and a stopped run is inconclusive, never a pass or a fail."""
    margin = 1.0 - POLICY.speed_min_gain
    stopped, timed_with, timed_without = 0, 0, 0
    for seed in range(40):
        with_stop = _decide_across(seed, margin, "gain", bias_sd=0.06)
        without = _decide_across(seed, margin, "gain", futility=0.0, bias_sd=0.06)
        timed_with += len(with_stop.processes)
        timed_without += len(without.processes)
        if with_stop.stopped_futile is not None:
            stopped += 1
            assert with_stop.decision == "inconclusive"
            assert with_stop.stopped_futile < POLICY.timing_futility
            assert len(with_stop.processes) < POLICY.timing_max_processes
            assert "futility stop" in with_stop.stop_reason()
        else:
            assert with_stop.decision == without.decision
            assert with_stop.looks == without.looks
    assert stopped >= 15
    assert timed_with < 0.9 * timed_without


def test_futility_never_stops_a_gate_heading_for_a_decision():
    """Identical code on the 1% no-regression floor and a clear 5% gain, at the usual spread: a
    clear gain is never stopped early, and identical code only rarely, and then only where the
    cap would have ended inconclusive too (a process bias of 1% sd now and then draws a mean
    near the margin that 18 processes cannot resolve)."""
    stopped = 0
    for seed in range(30):
        if _decide_across(seed, 1.0).stopped_futile is not None:
            stopped += 1
            assert _decide_across(seed, 1.0, futility=0.0).decision == "inconclusive", seed
        assert _decide_across(seed, 0.95, "gain").stopped_futile is None
    assert stopped <= 3


def test_decision_chance_is_high_far_from_the_margin_and_low_on_it():
    rng = np.random.default_rng(7)
    far = np.log(0.90) + rng.normal(0.0, 0.01, 6)
    on = np.log(0.99) + rng.normal(0.0, 0.08, 12)
    kw = {"final_n": 18, "final_confidence": 0.955, "rule": "gain", "threshold": 0.99}
    assert decision_chance(far, **kw) > 0.99
    assert decision_chance(on, **kw) < 0.05
    with pytest.raises(ValueError, match="2 <= n < final_n"):
        decision_chance(far, final_n=6, final_confidence=0.955, rule="gain", threshold=0.99)
    with pytest.raises(PolicyError, match="timing_futility must be a probability"):
        Policy(timing_futility=1.0)


def test_the_policys_fewest_rounds_let_one_stretched_call_not_set_a_process_statistic():
    """A cold prefill's worker times the policy's fewest rounds; one call stretched by 40% (host
    dispatch, a preemption) must not move that process's statistic past the 1% margin. With two
    rounds the median is their mean, and the one call sets it."""
    rounds = POLICY.timing_min_rounds_per_process
    rng = np.random.default_rng(11)
    for stretched in range(rounds):
        ratios = np.exp(rng.normal(0.0, 0.003, rounds))
        ratios[stretched] *= 1.4
        assert abs(np.exp(process_statistic(ratios)) - 1.0) < 0.01
    assert np.exp(process_statistic([1.0, 1.4])) > 1.1


def test_a_process_statistic_keeps_the_tight_middle_of_heavy_tailed_rounds():
    """Rounds on a busy host are mostly tight with a heavy tail (a preemption or a stray cache
    miss stretches one side of a round: recorded verify steps on two CPU cores hold a few
    rounds a hundred times their interquartile range). The median keeps one order statistic of
    the middle and the mean lets the tail in; the process statistic must beat both over many
    simulated processes: a spread under 95% of the median's (0.90 here; 0.75 on recorded
    rounds, benchmarks/results/cpu-process-statistic.json) and under half the mean's. Falls back
    to either and this fails."""
    rng = np.random.default_rng(5)
    medians, means, stats = [], [], []
    for _ in range(400):
        logs = 0.02 * rng.standard_t(4, 200)
        tail = rng.random(200) < 0.04
        logs[tail] += rng.normal(0.0, 0.5, int(tail.sum()))
        medians.append(np.median(logs))
        means.append(np.mean(logs))
        stats.append(process_statistic(np.exp(logs)))
    assert np.std(stats) < 0.95 * np.std(medians)
    assert np.std(stats) < 0.5 * np.std(means)
    # the fewest rounds keep what the median gives there: the middle two of four
    four = np.exp([0.01, -0.02, 0.4, 0.0])
    assert process_statistic(four) == pytest.approx(np.median(np.log(four)))


def test_variance_components_are_those_of_the_statistic_under_heavy_tailed_rounds():
    """5% of rounds stretched by a preemption (sd 0.5 in log ratio): the statistic trims them,
    so the per-round variance it sees stays near the tight rounds' (the rounds' own variance
    is 15 times that, and Kalibera & Jones' rule would ask for about four times the rounds
    it needs), and the process bias is still found."""
    rng = np.random.default_rng(13)
    samples = []
    for i in range(40):
        bias = rng.normal(0.0, BIAS)
        noise = rng.normal(0.0, NOISE, 200)
        stretched = rng.random(200) < 0.05
        noise[stretched] += rng.normal(0.0, 0.5, int(stretched.sum()))
        base = 1e-3 * rng.lognormal(0.0, NOISE, 200)
        samples.append(ProcessSample(worker=i, pid=i, candidate_s=(base * np.exp(bias + noise))
                                     .tolist(), baseline_s=base.tolist(), orders=["cb"] * 200,
                                     setup_s=0.5))
    parts = variance_components(samples)
    assert NOISE**2 < parts["within"] < 2 * NOISE**2
    assert parts["between"] == pytest.approx(BIAS**2, rel=0.5)
    assert statistic_variance(samples[0].ratios) < 2 * NOISE**2 / 200
    with pytest.raises(ValueError, match="positive ratio"):  # a negative time is no round
        statistic_variance([1.0, 1.01, -1.0])
