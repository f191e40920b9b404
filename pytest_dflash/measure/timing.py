"""Timers and the speed gate (docs/gates.md, "speed" and "validation_cost").

Why this module exists: a speed claim is only evidence if both routes were timed the same way, in
the same process, interleaved, with the cache state each run would see in production. So every
speed and validation-cost gate goes through :func:`speed_gate`, which

* times ONE call per sample on CUDA: events around the call with the L2 cache flushed first (a
  cold L2, as a prefill that streams its weights sees) and a single synchronize after, so no
  host overhead or sync latency is counted. On the CPU (``perf_counter_ns``) a call shorter than
  ``policy.cpu_sample_min_s`` is repeated back to back within a sample, the same number of
  times on both sides (:func:`calls_per_sample`), so OS jitter does not swamp a sub-millisecond
  call;
* runs an untimed ``before_each`` (e.g. a prefix-cache reset) before every timed call;
* warms both sides up, then hands the pair to
:func:`pytest_dflash.measure.statistics.paired_compare`
  with the predeclared policy values, records the figure, CI and raw samples, and fails the test
  with a reviewer-readable message unless the rule passes.
"""

from __future__ import annotations

import functools
import math
import os
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch

from pytest_dflash.measure import progress
from pytest_dflash.measure.statistics import (
    PairedResult,
    max_rounds_for,
    paired_compare,
    threshold_for,
)
from pytest_dflash.session.policy import Policy

# Flush buffers are allocated once per device: allocating inside the timed loop would put
# allocator work and its synchronisation next to every measurement.
_L2_FLUSH: dict[int, torch.Tensor] = {}
_L2_FALLBACK_BYTES = 128 * 1024 * 1024  # above every current L2 when the driver reports none


def cpu_timer(fn: Callable[[], Any]) -> float:
    """Seconds taken by one call of ``fn`` (``perf_counter_ns``: monotonic, integer ns)."""
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e9


def l2_flush_buffer(device: torch.device | str) -> torch.Tensor:
    """The cached int8 buffer of twice the device's L2 size that is overwritten before each call.

    Writing twice the L2 capacity evicts whatever the previous call left cached, so every timed
    call starts cold, and the candidate cannot profit from the baseline's warm cache (or vice
    versa) through the interleaving order.
    """
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _L2_FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0) or 0
        nbytes = 2 * l2 if l2 > 0 else _L2_FALLBACK_BYTES
        _L2_FLUSH[index] = torch.empty(nbytes, dtype=torch.int8, device=f"cuda:{index}")
    return _L2_FLUSH[index]


def cuda_timer(fn: Callable[[], Any], device: torch.device | str, *,
               spin_cycles: int = 0) -> float:
    """Seconds of GPU time for one call of ``fn`` on ``device``, measured with CUDA events.

    The L2 flush is enqueued before the start event, so it is not timed; the host synchronizes
    once, on the end event, after the call. ``spin_cycles`` > 0 adds a spin kernel of that many
    GPU cycles after the flush, so the host enqueues ``fn`` while the GPU is still busy: the
    figure is then the GPU's time alone, without the host's dispatch cost (for benchmarks that
    report both; the gates time calls as the host makes them).
    """
    dev = torch.device(device)
    flush = l2_flush_buffer(dev)
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        flush.fill_(1)
        if spin_cycles > 0:
            torch.cuda._sleep(spin_cycles)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
    return start.elapsed_time(end) / 1e3  # elapsed_time is in milliseconds


def synchronized(fn: Callable[[], Any], device: torch.device | str) -> Callable[[], Any]:
    """``fn`` followed by a device synchronize on CUDA (unchanged on the CPU).

    For wall-clock timers such as pytest-benchmark's: a CUDA call returns once its kernels are
    queued, so timing it unsynchronised measures the launch, not the work.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return fn

    def call() -> Any:
        result = fn()
        torch.cuda.synchronize(dev)
        return result

    return call


def timer_for(device: torch.device | str) -> Callable[[Callable[[], Any]], float]:
    """The timer that measures ``device`` honestly: CUDA events on CUDA, perf_counter on CPU."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return cpu_timer
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"cannot time on {dev}: torch {torch.__version__} sees no CUDA device; "
                "run with --dflash-device cpu or on a CUDA machine"
            )
        return functools.partial(cuda_timer, device=dev)
    raise ValueError(f"no timer for device type {dev.type!r}; supported: cpu, cuda")


def calls_per_sample(baseline: Callable[[], Any], device: torch.device | str,
                     min_seconds: float) -> int:
    """How many back-to-back calls one sample holds: 1 on CUDA or when ``min_seconds`` is 0,
    else enough calls of ``baseline`` (its fastest of 3 single calls) to last ``min_seconds``."""
    if torch.device(device).type != "cpu" or min_seconds <= 0:
        return 1
    single = min(cpu_timer(baseline) for _ in range(3))
    return max(1, min(10_000, math.ceil(min_seconds / max(single, 1e-9))))


def _repeated(fn: Callable[[], Any], calls: int) -> Callable[[], Any]:
    if calls == 1:
        return fn

    def run() -> None:
        for _ in range(calls):
            fn()

    return run


def speed_gate(
    candidate: Callable[[], Any],
    baseline: Callable[[], Any],
    *,
    policy: Policy,
    device: torch.device | str,
    record: Callable[..., Any],
    label: str,
    before_each: Callable[[], Any] | None = None,
    rule: str = "gain",
) -> PairedResult:
    """Time ``candidate`` against ``baseline`` on ``device`` and fail unless ``rule`` passes.

    ``rule="gain"``: the CI upper bound of candidate/baseline must be < 1 - policy.speed_min_gain.
    ``rule="no_regression"``: it must be <= 1 + policy.validation_noise_floor.
    The order of the two calls is randomized per round from ``policy.seed`` and ``label`` (so
    different gates do not share one order sequence, yet every rerun repeats it). Measurements,
    raw samples included, are passed to ``record`` before the verdict, so a failed gate still
    reports what it measured.
    """
    if not callable(candidate) or not callable(baseline):
        raise TypeError(f"{label}: candidate and baseline must be zero-argument callables")
    if before_each is not None and not callable(before_each):
        raise TypeError(f"{label}: before_each must be a zero-argument callable or None")
    timer = timer_for(device)
    threshold = threshold_for(rule, policy)
    calls = 1 if before_each is not None else calls_per_sample(baseline, device,
                                                               policy.cpu_sample_min_s)

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        sample = _repeated(fn, calls)

        def run() -> float:
            if before_each is not None:
                before_each()
            return timer(sample) / calls

        return run

    load_before = list(os.getloadavg())
    max_rounds = max_rounds_for(rule, policy)
    with progress.gate(label, rule=rule, threshold=threshold, max_rounds=max_rounds,
                       confidence=policy.speed_confidence) as on_round:
        result = paired_compare(
            timed(candidate),
            timed(baseline),
            rounds=policy.speed_rounds,
            max_rounds=max_rounds,
            confidence=policy.speed_confidence,
            resamples=policy.bootstrap_resamples,
            seed=policy.seed + zlib.crc32(label.encode()),
            rule=rule,
            threshold=threshold,
            warmup=policy.speed_warmup,
            on_round=on_round,
        )
    record(
        figure=result.figure(),
        ratio_median=result.median,
        ci_low=result.ci_low,
        ci_high=result.ci_high,
        confidence=result.confidence,
        rounds=result.rounds,
        outcome=result.outcome,
        rule=rule,
        threshold=threshold,
        samples={"candidate": list(result.candidate_s), "baseline": list(result.baseline_s)},
        # a busy machine stalls threads for whole scheduler quanta: keep the load as evidence
        loadavg_before=load_before,
        loadavg_after=list(os.getloadavg()),
        threads=torch.get_num_threads(),
        calls_per_sample=calls,
    )
    if not result.passed:
        raise AssertionError(
            f"{label}: {_verdict_words(result)}: {result.figure()}; {result.requirement()}"
        )
    return result


def _verdict_words(result: PairedResult) -> str:
    """How a pull request would phrase the failure ("neutral, not selected")."""
    if result.rule == "gain":
        return {
            "slower": "slower, rejected on speed",
            "neutral": "neutral, not selected",
            "inconclusive": "inconclusive at the round cap, not selected",
        }[result.outcome]
    return {
        "slower": "slower, regression beyond the noise floor",
        "inconclusive": "inconclusive at the round cap, a regression beyond the noise floor "
        "is not ruled out",
    }[result.outcome]
