"""Tests of pytest_dflash.measure.timing on real, cheap workloads with an unmistakable difference.

The workloads are numpy sums of 2e5 vs 2e6 numbers (10x the work); the tests check decisions,
outcomes, records and call counts, never a wall-clock value.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from pytest_dflash.measure.round_statistics import PairedResult
from pytest_dflash.measure.timing import (
    calls_per_sample,
    cpu_timer,
    cuda_timer,
    l2_flush_buffer,
    speed_gate,
    synchronized,
    timer_for,
)
from pytest_dflash.policy.thresholds import Policy, PolicyError

POLICY = Policy()
SMALL = np.random.default_rng(0).random(200_000)
LARGE = np.random.default_rng(1).random(2_000_000)
RECORD_KEYS = {
    "figure",
    "ratio_median",
    "ci_low",
    "ci_high",
    "rounds",
    "outcome",
    "threshold",
    "samples",
}


def small_sum() -> float:
    return float(SMALL.sum())


def large_sum() -> float:
    return float(LARGE.sum())


class Recorder:
    """Stands in for the dflash_record fixture: keeps every call's keyword arguments."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **measurements: Any) -> None:
        self.calls.append(measurements)


def test_cpu_timer_times_exactly_one_call():
    calls = []
    seconds = cpu_timer(lambda: calls.append(large_sum()))
    assert len(calls) == 1 and isinstance(seconds, float) and seconds > 0


def test_timer_for_picks_the_device_timer():
    assert timer_for("cpu") is cpu_timer
    assert timer_for(torch.device("cpu")) is cpu_timer
    with pytest.raises(ValueError, match="no timer for device type 'meta'"):
        timer_for("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_timer_for_cuda_without_cuda_says_how_to_fix():
    with pytest.raises(RuntimeError, match="sees no CUDA device; run with --dflash-device cpu"):
        timer_for("cuda")


def test_synchronized_is_the_call_itself_on_the_cpu():
    calls = []
    fn = lambda: calls.append(1) or 7  # noqa: E731
    assert synchronized(fn, "cpu") is fn
    assert synchronized(fn, "cpu")() == 7 and calls == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")
def test_synchronized_waits_for_the_queued_kernels_on_cuda():
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(4096, 4096, device=device)
    done = torch.cuda.Event()

    def work() -> None:  # milliseconds of queued GPU work, then a marker behind it
        a @ a @ a @ a
        done.record()

    synchronized(work, device)()
    assert done.query(), "the work was still queued when the synchronised call returned"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA events)")
def test_cuda_timer_flushes_l2_and_times_one_call():
    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(2048, 2048, device=device)
    calls = []
    seconds = cuda_timer(lambda: calls.append(a @ a), device)
    assert len(calls) == 1 and seconds > 0
    flush = l2_flush_buffer(device)
    assert flush is l2_flush_buffer(device)  # cached, never allocated inside the timed loop
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    assert flush.numel() * flush.element_size() == 2 * l2
    assert int(flush[0]) == 1 and int(flush[-1]) == 1  # overwritten before the timed call
    assert timer_for(device).func is cuda_timer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA events)")
def test_cuda_timer_spin_runs_before_the_timed_window():
    """The spin that keeps the GPU busy while the host enqueues must not be timed itself: a
    near-empty call behind a 10^7-cycle spin must time far below the spin's own duration."""
    device = torch.device("cuda", torch.cuda.current_device())
    spin = cuda_timer(lambda: torch.cuda._sleep(10**7), device)
    calls = []
    queued = cuda_timer(lambda: calls.append(torch.empty(1, device=device).fill_(1)), device,
                        spin_cycles=10**7)
    assert len(calls) == 1 and 0 < queued < spin / 10, (queued, spin)


def test_speed_gate_passes_a_tenfold_cheaper_candidate():
    record = Recorder()
    result = speed_gate(
        small_sum,
        large_sum,
        policy=POLICY,
        device="cpu",
        record=record,
        label="sum.small vs sum.large",
    )
    assert isinstance(result, PairedResult)
    assert result.passed and result.outcome == "faster"
    assert result.ci_high < 1 - POLICY.speed_min_gain
    assert len(record.calls) == 1
    rec = record.calls[0]
    assert RECORD_KEYS <= set(rec)
    json.dumps(rec, allow_nan=False)
    assert rec["figure"] == result.figure() and rec["rounds"] == result.rounds
    assert len(rec["samples"]["candidate"]) == len(rec["samples"]["baseline"]) == result.rounds
    assert rec["threshold"] == pytest.approx(1 - POLICY.speed_min_gain)


def test_speed_gate_rejects_a_tenfold_slower_candidate_and_still_records():
    record = Recorder()
    with pytest.raises(AssertionError) as info:
        speed_gate(
            large_sum,
            small_sum,
            policy=POLICY,
            device="cpu",
            record=record,
            label="sum.large vs sum.small",
        )
    msg = str(info.value)
    assert msg.startswith("sum.large vs sum.small: slower, rejected on speed: ratio ")
    assert msg.endswith(f"rounds; needs CI upper < {1 - POLICY.speed_min_gain:.3f}")
    assert record.calls and record.calls[0]["outcome"] == "slower"
    assert record.calls[0]["ci_low"] > 1


def test_no_regression_rule_uses_the_noise_floor():
    record = Recorder()
    result = speed_gate(
        small_sum,
        large_sum,
        policy=POLICY,
        device="cpu",
        record=record,
        label="verify.m8",
        rule="no_regression",
    )
    assert result.passed and record.calls[0]["threshold"] == pytest.approx(
        1 + POLICY.validation_noise_floor
    )
    with pytest.raises(
        AssertionError,
        match=r"verify\.m8: slower, regression beyond the noise "
        r"floor: .*needs CI upper <= 1\.010",
    ):
        speed_gate(
            large_sum,
            small_sum,
            policy=POLICY,
            device="cpu",
            record=record,
            label="verify.m8",
            rule="no_regression",
        )


def test_before_each_runs_untimed_before_every_call():
    """A heavy reset before every call must not dilute the measured ratio."""
    resets = []

    def reset() -> None:
        resets.append(float(LARGE.sum() + LARGE.sum()))  # 4e6 numbers: 20x the candidate

    calls = {"candidate": 0, "baseline": 0}

    def candidate() -> float:
        calls["candidate"] += 1
        return small_sum()

    def baseline() -> float:
        calls["baseline"] += 1
        return large_sum()

    result = speed_gate(
        candidate,
        baseline,
        policy=POLICY,
        device="cpu",
        record=Recorder(),
        label="reset",
        before_each=reset,
    )
    assert calls["candidate"] == calls["baseline"] == result.rounds + POLICY.speed_warmup
    assert len(resets) == 2 * (result.rounds + POLICY.speed_warmup)
    # timed with the reset the ratio would be ~(4.2e6 / 6e6) = 0.7; untimed it is ~0.1
    assert result.median < 0.5


def test_speed_gate_refuses_bad_arguments():
    with pytest.raises(ValueError, match="unknown rule 'fast'"):
        speed_gate(
            small_sum,
            small_sum,
            policy=POLICY,
            device="cpu",
            record=Recorder(),
            label="x",
            rule="fast",
        )
    with pytest.raises(TypeError, match="zero-argument callables"):
        speed_gate(small_sum, 3, policy=POLICY, device="cpu", record=Recorder(), label="x")


def test_a_round_times_each_side_as_one_sample_in_the_order_asked():
    """A round of k calls a side: k calls of the side named first, then k of the other, each
    side's figure the mean of its k; before_each (one call a sample) runs before every call."""
    from pytest_dflash.measure.timing import round_timer

    log: list[str] = []

    def side(name: str):
        return lambda: log.append(name)

    run_round = round_timer(side("c"), side("b"), device="cpu", calls=3)
    c, b = run_round("cb")
    assert log == list("cccbbb") and c > 0 and b > 0
    log.clear()
    run_round("bc")
    assert log == list("bbbccc")
    log.clear()
    reset = round_timer(side("c"), side("b"), device="cpu",
                        before_each=lambda: log.append("reset"))
    reset("bc")
    assert log == ["reset", "b", "reset", "c"]
    with pytest.raises(ValueError, match="before_each reset needs one call a sample"):
        round_timer(side("c"), side("b"), device="cpu", calls=2, before_each=lambda: None)


def test_short_cpu_calls_are_repeated_within_a_sample_alike_on_both_sides():
    """A call far shorter than cpu_sample_min_s is repeated k times per sample (k from the
    baseline, the same for both sides); CUDA, a zero minimum or a before_each keep one call."""
    calls = {"candidate": 0, "baseline": 0}

    def side(name: str):
        def call() -> float:
            calls[name] += 1
            return float(SMALL[:1000].sum())
        return call

    record = Recorder()
    result = speed_gate(side("candidate"), side("baseline"), policy=POLICY, device="cpu",
                        record=record, label="repeat", rule="no_regression")
    k = record.calls[0]["calls_per_sample"]
    assert k > 1
    assert calls["candidate"] == k * (result.rounds + POLICY.speed_warmup)
    assert calls["baseline"] == calls["candidate"] + 3  # 3 single calls size k
    assert calls_per_sample(large_sum, "cpu", 0.0) == 1
    assert calls_per_sample(small_sum, "cuda", 1.0) == 1  # one cold-L2 call per CUDA sample
    assert calls_per_sample(small_sum, "cpu", 1.0) > 1


def test_a_call_far_longer_than_the_sample_minimum_is_sized_by_one_call():
    """Two calls that each last LONG_CALL_FACTOR times the minimum settle one call a sample
    without a third; a short one is sized by its fastest of three, and so is a short call whose
    first call alone was long (a fresh worker's first call pays its first-call costs)."""
    import time

    from pytest_dflash.measure.timing import LONG_CALL_FACTOR

    made = {"long": 0, "short": 0, "cold": 0}

    def long_call() -> None:
        made["long"] += 1
        time.sleep(0.02)

    def short_call() -> None:
        made["short"] += 1

    def cold_first_call() -> None:
        made["cold"] += 1
        if made["cold"] == 1:
            time.sleep(0.02)

    minimum = 0.02 / (2 * LONG_CALL_FACTOR)
    assert calls_per_sample(long_call, "cpu", minimum) == 1
    assert made["long"] == 2
    assert calls_per_sample(short_call, "cpu", 0.001) > 1
    assert made["short"] == 3
    assert calls_per_sample(cold_first_call, "cpu", minimum) > 1
    assert made["cold"] == 3


def test_cpu_sample_minimum_must_not_be_negative():
    with pytest.raises(PolicyError, match="cpu_sample_min_s must be >= 0"):
        Policy(cpu_sample_min_s=-1.0)


def test_a_cpu_no_regression_gate_gets_the_longer_worker_budget_and_nothing_else_does():
    from pytest_dflash.measure.timing import process_budget

    policy = Policy(timing_process_s=0.25, cpu_validation_process_s=1.0)
    assert process_budget("no_regression", "cpu", policy) == 1.0
    assert process_budget("gain", "cpu", policy) == 0.25
    assert process_budget("no_regression", "cuda", policy) == 0.25
    assert process_budget("gain", torch.device("cuda", 0), policy) == 0.25
    with pytest.raises(PolicyError, match="cpu_validation_process_s must be >= 0"):
        Policy(cpu_validation_process_s=-0.5)
