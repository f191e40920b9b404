"""Timers and the speed gate (docs/gates.md, "speed", "validation_cost", "Timing protocol").

Why this module exists: a speed claim is only evidence if both routes were timed the same way,
interleaved, with the cache state each run would see in production, and if the interval covers
the variation that a rerun would see. So every speed and validation-cost gate goes through
:func:`speed_gate`. Given a :class:`~pytest_dflash.measure.timing_pool.TimingJob`, it times the pair
in the run's timing worker processes and decides on an interval across processes
(``process_statistics.process_compare``): pass, fail, or inconclusive (the route stays
pending). Without a job (a gate that can only build its calls in this process) it times rounds
here (``round_statistics.paired_compare``) and decides the same three ways. Either way it

* times ONE call per sample on CUDA: events around the call with the L2 cache flushed first (a
  cold L2, as a prefill that streams its weights sees) and a single synchronize after, so no
  host overhead or sync latency is counted. On the CPU (``perf_counter_ns``) a call shorter than
  ``policy.cpu_sample_min_s`` is repeated back to back within a sample, the same number of
  times on both sides (:func:`calls_per_sample`, :func:`round_timer`), so OS jitter does not
  swamp a sub-millisecond call;
* runs an untimed ``before_each`` (e.g. a prefix-cache reset) before every timed call;
* warms both sides up, then hands the pair to
:func:`pytest_dflash.measure.round_statistics.paired_compare`
  with the predeclared policy values, records the figure, CI and raw samples, and fails the test
  with a reviewer-readable message unless the rule passes.
"""

from __future__ import annotations

import functools
import math
import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pytest_dflash.measure import cuda_graphs, progress, timing_pool
from pytest_dflash.measure.decision import (
    FAIL,
    INCONCLUSIVE,
    NEUTRAL,
    SLOWER,
    max_rounds_for,
    threshold_for,
)
from pytest_dflash.measure.process_statistics import ProcessResult, process_compare
from pytest_dflash.measure.round_statistics import PairedResult, RoundTimer, paired_compare
from pytest_dflash.policy.thresholds import Policy


class TimingInconclusive(pytest.skip.Exception):  # type: ignore[name-defined]
    """A timing gate whose interval straddles the policy's margin at its cap.

    It claims neither a pass nor a regression: the test is reported ``inconclusive`` (a kind
    of skip, so it never counts as a pass), its gate and route stay pending, and
    ``--dflash-strict`` fails the run as for any pending route.
    """

# Flush buffers are allocated once per device: allocating inside the timed loop would put
# allocator work and its synchronisation next to every measurement.
_L2_FLUSH: dict[int, torch.Tensor] = {}
_L2_FALLBACK_BYTES = 128 * 1024 * 1024  # above every current L2 when the driver reports none
# calls_per_sample: a first call this many times the sample's minimum length is one call a sample
LONG_CALL_FACTOR = 10.0


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
    else enough calls of ``baseline`` (its fastest of 3 single calls) to last ``min_seconds``.

    Two first calls that each last ``LONG_CALL_FACTOR`` times ``min_seconds`` settle it at 1
    without a third: one call already fills a sample, and the call saved is a quarter second of
    every timing worker's setup for a 0.24 s attention prefill on the CPU. Not the first call
    alone: in a fresh worker it pays the first-call costs (a 0.4 ms verify step's first call can
    take 20 ms), and a sample sized by it would hold one call where warm ones need five.
    """
    if torch.device(device).type != "cpu" or min_seconds <= 0:
        return 1
    first, second = cpu_timer(baseline), cpu_timer(baseline)
    if min(first, second) >= LONG_CALL_FACTOR * min_seconds:
        return 1
    single = min(first, second, cpu_timer(baseline))
    return max(1, min(10_000, math.ceil(min_seconds / max(single, 1e-9))))


def arms_timer(arms: dict[str, Callable[[], Any]], *, device: torch.device | str,
               calls: int = 1, before_each: Callable[[], Any] | None = None,
               ) -> Callable[[Sequence[str]], dict[str, float]]:
    """One timed round of every named arm, in the order asked for: seconds per call by name.

    Each arm is one sample: ``calls`` calls back to back (short CPU calls,
    :func:`calls_per_sample`; one call on CUDA), timed together, the figure their mean.
    ``before_each`` runs, untimed, before each sample (it forces one call a sample: each call
    must see its reset)."""
    if calls > 1 and before_each is not None:
        raise ValueError(f"a before_each reset needs one call a sample, got calls={calls}")
    timer = timer_for(device)

    def sample(fn: Callable[[], Any]) -> float:
        if before_each is not None:
            before_each()
        if calls == 1:
            return timer(fn)

        def repeated() -> None:
            for _ in range(calls):
                fn()

        return timer(repeated) / calls

    def run_round(order: Sequence[str]) -> dict[str, float]:
        return {name: sample(arms[name]) for name in order}

    return run_round


def round_timer(candidate: Callable[[], Any], baseline: Callable[[], Any], *,
                device: torch.device | str, calls: int = 1,
                before_each: Callable[[], Any] | None = None) -> RoundTimer:
    """One timed round of the pair, in the order asked for (``"cb"`` or ``"bc"``): (candidate,
    baseline) seconds per call (:func:`arms_timer` of the two). Calls alternated side by side
    within a round were measured and not kept (docs/gates.md, "What was tried and not kept"):
    they did not narrow the spread of identical code's per-process statistic.
    """
    run = arms_timer({"c": candidate, "b": baseline}, device=device, calls=calls,
                     before_each=before_each)

    def run_round(order: str) -> tuple[float, float]:
        spent = run(order)
        return spent["c"], spent["b"]

    return run_round


@dataclass(frozen=True)
class SharedLook:
    """A gate's first look timed together with the same gate's first look of other routes, all
    against one baseline (docs/gates.md, "Shared looks").

    A route's samples may already wait in ``store`` (the session's), under ``group``, which
    names what the routes share (the builder, the baseline's engine, the input): an earlier
    gate of the group timed them. Otherwise ``job`` builds
    :class:`~pytest_dflash.measure.timing_pool.TimedArms` of every route still to be judged,
    ``route`` (this gate's) among them, and the others' samples wait in ``store`` for their
    own gates; without a ``job`` (no other route to share with) the route is timed alone. The
    rounds are a pair's: each route's ratio is paired with the baseline run of its own round;
    the baseline just runs once a round for all of them.
    """

    group: str
    route: str
    store: dict[tuple[str, str], Any]
    job: timing_pool.TimingJob | None = None


def speed_gate(
    candidate: Callable[[], Any] | None,
    baseline: Callable[[], Any] | None,
    *,
    policy: Policy,
    device: torch.device | str,
    record: Callable[..., Any],
    label: str,
    before_each: Callable[[], Any] | None = None,
    rule: str = "gain",
    job: timing_pool.TimingJob | None = None,
    timing: timing_pool.TimingSetup | None = None,
    shared: SharedLook | None = None,
) -> PairedResult | ProcessResult:
    """Time ``candidate`` against ``baseline`` and pass, fail or leave the gate inconclusive.

    ``rule="gain"``: the CI upper bound of candidate/baseline must be < 1 - policy.speed_min_gain.
    ``rule="no_regression"``: it must be <= 1 + policy.validation_noise_floor. A CI wholly on the
    other side fails (AssertionError); one that straddles the margin at the cap raises
    :class:`TimingInconclusive`. With ``job`` and a timing pool in ``timing`` (the session's:
    ``dflash_gate.timing``, which also names where progress goes), the pair is built and timed
    in the worker processes (``candidate``/``baseline`` may then be None); otherwise in this
    process, in a seeded random order per round. With ``shared`` the first look in the workers
    is the one timed for the whole group (:class:`SharedLook`); a group look that fails (a
    worker error) is said in the record (``shared_look``) and the route is timed alone.
    Measurements, raw samples included, are passed to ``record`` before the verdict, so a
    failed gate still reports what it measured.
    """
    load_before = list(os.getloadavg())
    if job is not None and timing is None:
        raise TypeError(f"{label}: a timing job needs timing=dflash_gate.timing, the session's "
                        "pool of timing workers (outside a pytest session, timing=TimingSetup() "
                        "times the pair in this process)")
    timing = timing or timing_pool.TimingSetup()
    pool = timing.pool
    if job is not None and pool is not None:
        extra: dict[str, Any] = {"pool_workers": pool.size}
        result: PairedResult | ProcessResult = _across_processes(
            pool, job, policy=policy, label=label, rule=rule,
            budget_s=process_budget(rule, device, policy), sinks=timing.sinks,
            shared=shared, notes=extra)
    else:
        if not callable(candidate) or not callable(baseline):
            raise TypeError(f"{label}: candidate and baseline must be zero-argument callables")
        result, extra = _in_process(candidate, baseline, policy=policy, device=device,
                                    label=label, before_each=before_each, rule=rule,
                                    sinks=timing.sinks)
    record(
        **result.measurements(),
        **extra,
        # a busy machine stalls threads for whole scheduler quanta: keep the load as evidence
        loadavg_before=load_before,
        loadavg_after=list(os.getloadavg()),
        threads=torch.get_num_threads(),
    )
    decision = result.decision
    if decision == FAIL:
        raise AssertionError(
            f"{label}: {_verdict_words(result)}: {result.figure()}; {result.requirement()}"
        )
    if decision == INCONCLUSIVE:
        where = f" ({result.stop_reason()})" if isinstance(result, ProcessResult) else ""
        raise TimingInconclusive(
            f"{label}: inconclusive, route left pending: {result.figure()} straddles the "
            f"margin ({result.requirement()}){where}; it shows neither a pass nor a regression")
    return result


def process_budget(rule: str, device: torch.device | str, policy: Policy) -> float:
    """Seconds of timed rounds each worker spends per look: ``timing_process_s``, or on the CPU
    ``cpu_validation_process_s`` for a no_regression gate, whose identical-cost candidate must
    be bounded within one noise floor of its true ratio."""
    if rule == "no_regression" and torch.device(device).type == "cpu":
        return policy.cpu_validation_process_s
    return policy.timing_process_s


def _across_processes(pool: timing_pool.TimingPool, job: timing_pool.TimingJob, *, policy: Policy,
                      label: str, rule: str, budget_s: float,
                      sinks: Sequence[Any] = (), shared: SharedLook | None = None,
                      notes: dict[str, Any] | None = None) -> ProcessResult:
    """The pool's first workers give the first look, each later look the next ones."""
    threshold = threshold_for(rule, policy)
    seed = policy.seed + zlib.crc32(label.encode())
    used = [0]
    modes: dict[str, str] = {}
    sizes: dict[str, Any] = {"warmup": policy.speed_warmup,
                             "max_rounds": policy.timing_max_rounds_per_process,
                             "budget_s": budget_s}

    def sample(count: int, rounds: int) -> list[Any]:
        samples = None
        if shared is not None and used[0] == 0:
            samples = _shared_first_look(pool, shared, count, rounds=rounds, label=label,
                                         seed=policy.seed, notes=notes, **sizes)
        if samples is None:
            samples = pool.sample(job, count, rounds=rounds, seed=seed, label=label,
                                  first=used[0], **sizes)
        used[0] += count
        for s in samples:
            modes.setdefault(timing_mode(s.info), str(s.info.get("graph")))
        if len(modes) > 1:
            raise timing_pool.TimingWorkerError(
                f"{label}: its processes were timed in different ways ({'; '.join(modes.values())}"
                "): graph replays and eager calls measure different things, and one interval "
                "cannot hold both. A capture that failed in some workers only is usually device "
                "memory: run fewer timing gates at once on the device, or free its memory")
        return samples

    with progress.gate(label, rule=rule, threshold=threshold,
                       max_rounds=policy.timing_max_processes,
                       confidence=policy.speed_confidence, sinks=sinks):
        return process_compare(
            sample, processes=policy.timing_processes,
            max_processes=policy.timing_max_processes,
            rounds=policy.timing_min_rounds_per_process, confidence=policy.speed_confidence,
            rule=rule, threshold=threshold, max_rounds=policy.timing_max_rounds_per_process,
            futility=policy.timing_futility)


def _shared_first_look(pool: timing_pool.TimingPool, shared: SharedLook, count: int, *,
                       rounds: int, label: str, seed: int, warmup: int, max_rounds: int,
                       budget_s: float, notes: dict[str, Any] | None) -> list[Any] | None:
    """This route's first look from the group's (timed now if no other route of the group
    timed it), or None: nothing to share (the route is then timed alone) or the group's look
    failed (timed alone, and ``notes["shared_look"]`` says why)."""
    waiting = shared.store.pop((shared.group, shared.route), None)
    if waiting is not None or shared.job is None:
        return waiting
    try:
        by_route = pool.sample_arms(shared.job, count, rounds=rounds, warmup=warmup,
                                    seed=seed + zlib.crc32(shared.group.encode()),
                                    label=f"{label} (first look shared: {shared.group})",
                                    max_rounds=max_rounds, budget_s=budget_s)
    except timing_pool.TimingWorkerError as exc:
        if notes is not None:
            notes["shared_look"] = (f"not shared, timed alone: the group's look failed: "
                                    f"{str(exc).splitlines()[0]}")
        return None
    for route, samples in by_route.items():
        if route != shared.route:
            shared.store[(shared.group, route)] = samples
    return by_route[shared.route]


def timing_mode(info: dict[str, Any]) -> str:
    """How a process timed its calls: ``graph`` (replays of captured CUDA graphs) or ``eager``."""
    return "graph" if str(info.get("graph") or "").startswith("captured") else "eager"


def _in_process(candidate: Callable[[], Any], baseline: Callable[[], Any], *, policy: Policy,
                device: torch.device | str, label: str, before_each: Callable[[], Any] | None,
                rule: str, sinks: Sequence[Any] = ()) -> tuple[PairedResult, dict[str, Any]]:
    if before_each is not None and not callable(before_each):
        raise TypeError(f"{label}: before_each must be a zero-argument callable or None")
    threshold = threshold_for(rule, policy)
    calls = 1 if before_each is not None else calls_per_sample(baseline, device,
                                                               policy.cpu_sample_min_s)
    max_rounds = max_rounds_for(rule, policy)
    with progress.gate(label, rule=rule, threshold=threshold, max_rounds=max_rounds,
                       confidence=policy.speed_confidence, sinks=sinks) as on_round:
        result = paired_compare(
            round_timer(candidate, baseline, device=device, calls=calls, before_each=before_each),
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
    return result, {"calls_per_sample": calls}


def pair_timers(pair: timing_pool.TimedPair, device: torch.device,
                policy: Policy) -> tuple[RoundTimer, dict[str, Any]]:
    """The round timer of a worker's pair (:func:`round_timer`), and how it times (for the
    report).

    CUDA with ``pair.graph``: both calls are captured once in CUDA graphs and each timed
    replay is one graph launch between events (the L2 flushed before), as a deployment runs its
    M <= 8 verification steps; the eager time of each side is measured beside it. A call that
    cannot be captured is timed eagerly and ``info["graph"]`` says why. CPU: calls shorter than
    ``policy.cpu_sample_min_s`` are repeated within a sample, the same count on both sides.
    """
    dev = torch.device(device)
    before = pair.before_each
    info: dict[str, Any] = {"graph": None, **pair.info}
    cand, base = pair.candidate, pair.baseline
    if dev.type == "cuda" and pair.graph and before is None:
        try:
            captured = cuda_graphs.capture((cand, base), dev, warmup=3)
        except cuda_graphs.CaptureRefused as why:
            info["graph"] = f"not captured, timed eagerly: {why}"
        else:
            eager = (cand, base)
            cand, base = captured.replays
            timer = timer_for(dev)
            info["graph"] = "captured"
            info["eager_s"] = {"candidate": min(timer(eager[0]) for _ in range(5)),
                               "baseline": min(timer(eager[1]) for _ in range(5))}
    calls = 1 if before is not None else calls_per_sample(base, dev, policy.cpu_sample_min_s)
    info["calls_per_sample"] = calls
    return round_timer(cand, base, device=dev, calls=calls, before_each=before), info


def arms_timers(arms: timing_pool.TimedArms, device: torch.device,
                policy: Policy) -> tuple[Callable[[Sequence[str]], dict[str, float]],
                                         dict[str, Any]]:
    """The round timer of a worker's arms (:func:`arms_timer`, the baseline named
    ``timing_pool.BASELINE_ARM``) and how it times, for the report. A builder that captures
    CUDA graphs does so itself (``TimedArms.info``); on the CPU calls shorter than
    ``policy.cpu_sample_min_s`` are repeated within a sample, the same count for every arm."""
    dev = torch.device(device)
    before = arms.before_each
    calls = 1 if before is not None else calls_per_sample(arms.baseline, dev,
                                                          policy.cpu_sample_min_s)
    info: dict[str, Any] = {"graph": None, **arms.info, "calls_per_sample": calls}
    named = {**arms.candidates, timing_pool.BASELINE_ARM: arms.baseline}
    return arms_timer(named, device=dev, calls=calls, before_each=before), info


def _verdict_words(result: PairedResult | ProcessResult) -> str:
    """How a pull request would phrase the failure ("neutral, not selected")."""
    if result.rule == "gain":
        return {
            SLOWER: "slower, rejected on speed",
            NEUTRAL: "neutral, not selected",
        }[result.outcome]
    return "slower, regression beyond the noise floor"
