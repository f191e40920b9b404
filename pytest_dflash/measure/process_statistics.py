"""The cross-process timing protocol: one statistic per worker process, an interval across them.

Why: a process carries a bias of its own (memory placement, the host path's dispatch cost, the
thread pool's state) that hits every round it times, so rounds of one process are not
independent draws of the ratio, and an interval over them covers only within-process noise:
more rounds make one process's bias look more certain. Following Kalibera & Jones (ISMM 2013),
the unit of repetition is the level that varies most, the process: each worker process yields
one statistic, and the interval is computed across processes.

Each look adds processes until the interval decides or the cap is reached; the error rate is
spent across the looks (``decision.look_confidence``), the rounds each later process times
follow Kalibera & Jones' optimum from the variances measured so far, and a look whose chance
of deciding at the cap is small can stop early, inconclusive (a futility stop). The decision
and its words are ``decision.judge``'s; the in-process protocol is ``round_statistics``.
numpy only (no torch, no scipy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytest_dflash.measure.decision import (
    INTERIM_SHARE,
    PASS,
    RULES,
    check_confidence,
    finite_1d,
    judge,
    look_confidence,
)


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (numpy only).

    Bisection on the CDF, which is the regularized incomplete beta function evaluated by its
    continued fraction: accurate to ~1e-10, enough for an interval whose other parts are
    measurements.
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {p!r}")
    if not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be an integer >= 1, got {df!r}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def _t_cdf(t: float, df: int) -> float:
    x = df / (df + t * t)
    tail = 0.5 * _betainc(0.5 * df, 0.5, x)
    return 1.0 - tail if t >= 0 else tail


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) (Lentz's continued fraction)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                 + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    frac = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            frac *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * frac / a


def process_statistic(ratios: Sequence[float] | np.ndarray) -> float:
    """One process's statistic: the interquartile mean of its per-round log ratios.

    The mean of the middle half of the sorted log ratios (a quarter of the rounds trimmed from
    each end, at least one each once there are three): with four rounds, the policy's fewest,
    the mean of the middle two, i.e. their median. Not the mean: a round that a preemption or a
    stray cache miss stretched on one side is an outlier of that round, not a property of the
    process, and on a GPU a few such rounds per process widen the interval across processes
    by more than the margin (on an H200, graph replays of identical code with a median of 26 us
    on both sides gave one process a mean ratio of 1.06 from a few stretched rounds). Not the
    median either: a process's rounds are mostly tight with a heavy tail (identical verify
    steps on two CPU cores: a per-round sd of 15% in log ratio), and there the median throws
    away most of the tight middle. Replayed on recorded workers, the interquartile mean's
    spread across processes is about three quarters of the median's, the precision the median
    reaches only with about 1.6 times the rounds (benchmarks/results/cpu-process-statistic.json).
    The statistics of different processes are still independent draws, so the t interval
    across them holds; logs make a 2% slowdown and a 2% speed-up symmetric.
    """
    logs = _sorted_logs(ratios)
    trim = _trimmed(logs.size)
    return float(np.mean(logs[trim: logs.size - trim]))


def _sorted_logs(ratios: Sequence[float] | np.ndarray) -> np.ndarray:
    """A process's per-round log ratios, sorted (the trimmed statistic and its variance)."""
    data = finite_1d(ratios, "ratios")
    if data.size < 1 or (data <= 0).any():
        raise ValueError("a process statistic needs at least one positive ratio")
    return np.sort(np.log(data))


def _trimmed(n: int) -> int:
    """Rounds trimmed from each end for the interquartile mean of ``n`` rounds."""
    return max(1, n // 4) if n >= 3 else 0


def statistic_variance(ratios: Sequence[float] | np.ndarray) -> float:
    """The sampling variance of :func:`process_statistic` from one process's own rounds.

    Tukey and McLaughlin's estimate for a trimmed mean: the winsorized variance (the trimmed
    rounds set to the nearest kept one) over ``(1 - 2 g / n)**2 n``, with ``g`` rounds trimmed
    from each end. The plain variance of the rounds would count the heavy tail that the
    statistic discards: on two CPU cores a per-round sd of 15% for a statistic whose spread
    across processes is 0.3%.
    """
    logs = _sorted_logs(ratios)
    n = logs.size
    if n < 2:
        raise ValueError("a statistic's variance needs at least two rounds")
    g = _trimmed(n)
    winsorized = np.clip(logs, logs[g], logs[n - 1 - g])
    return float(np.var(winsorized, ddof=1) / ((1.0 - 2.0 * g / n) ** 2 * n))


def across_processes(statistics: Sequence[float], confidence: float) -> tuple[float, float, float]:
    """(ratio, low, high): the geometric-mean ratio over processes and its t interval.

    ``statistics`` holds one log-ratio statistic per process; the interval is
    ``exp(mean +- t_{n-1} * sd / sqrt(n))``, two-sided at ``confidence``.
    """
    data = finite_1d(statistics, "statistics")
    if data.size < 2:
        raise ValueError(f"an interval across processes needs at least 2 processes, got "
                         f"{data.size}: one process has no between-process spread")
    check_confidence(confidence)
    mean = float(np.mean(data))
    half = t_quantile(0.5 + confidence / 2, data.size - 1) * float(np.std(data, ddof=1)) \
        / math.sqrt(data.size)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


@dataclass
class ProcessSample:
    """What one worker process timed for one gate: its rounds and its one statistic."""

    worker: int
    pid: int
    candidate_s: list[float]
    baseline_s: list[float]
    orders: list[str]
    setup_s: float = 0.0  # building the pair and warming it up in that process
    info: dict[str, Any] = field(default_factory=dict)  # how it timed (e.g. graph or eager)

    @property
    def ratios(self) -> list[float]:
        return [c / b for c, b in zip(self.candidate_s, self.baseline_s, strict=True)]

    @property
    def statistic(self) -> float:
        return process_statistic(self.ratios)

    def as_json(self) -> dict[str, Any]:
        return {"worker": self.worker, "pid": self.pid, "statistic": self.statistic,
                "ratio": math.exp(self.statistic), "rounds": len(self.candidate_s),
                "setup_s": self.setup_s, "info": dict(self.info), "orders": list(self.orders),
                "samples": {"candidate": list(self.candidate_s),
                            "baseline": list(self.baseline_s)}}


@dataclass
class ProcessResult:
    """A timing comparison decided across processes (one statistic per process)."""

    processes: list[ProcessSample]
    ratio: float  # geometric mean of the per-process ratios
    ci_low: float
    ci_high: float
    decision: str  # one of decision.DECISIONS
    outcome: str  # in words, one of decision.OUTCOMES (decision.judge)
    rule: str
    threshold: float
    confidence: float
    looks: list[int]  # processes at each look
    rounds_per_process: list[int]  # rounds each look's processes timed
    variance: dict[str, float] = field(default_factory=dict)
    # an inconclusive result stopped before the cap: the predictive probability that the cap
    # would have decided (futility_stop); None when the looks ran to a decision or the cap
    stopped_futile: float | None = None
    max_processes: int | None = None

    @property
    def passed(self) -> bool:
        return self.decision == PASS

    @property
    def median(self) -> float:  # the name the per-round protocol's readers use
        return self.ratio

    @property
    def rounds(self) -> int:
        return sum(len(p.candidate_s) for p in self.processes)

    def figure(self) -> str:
        """e.g. ``ratio 1.002 [0.996, 1.008] over 6 processes x 24 rounds``."""
        per = sorted(set(self.rounds_per_process))
        rounds = "/".join(str(r) for r in per)
        return (f"ratio {self.ratio:.3f} [{self.ci_low:.3f}, {self.ci_high:.3f}] over "
                f"{len(self.processes)} processes x {rounds} rounds")

    def requirement(self) -> str:
        op = "<" if self.rule == "gain" else "<="
        return f"needs CI upper {op} {self.threshold:.3f}"

    def stop_reason(self) -> str:
        """Why an inconclusive result stopped where it did, in words."""
        if self.stopped_futile is None:
            return "at the process cap"
        return (f"stopped at {len(self.processes)} of {self.max_processes} processes: the cap "
                f"would have decided with a predictive probability of "
                f"{self.stopped_futile:.1%} (futility stop)")

    def measurements(self) -> dict[str, Any]:
        return {
            "stopped_futile": self.stopped_futile,
            "figure": self.figure(), "ratio_median": self.ratio, "ci_low": self.ci_low,
            "ci_high": self.ci_high, "confidence": self.confidence, "decision": self.decision,
            "outcome": self.outcome, "passed": self.passed, "rule": self.rule,
            "threshold": self.threshold, "unit": "process", "looks": list(self.looks),
            "rounds": self.rounds, "rounds_per_process": list(self.rounds_per_process),
            "variance": dict(self.variance),
            "processes": [p.as_json() for p in self.processes],
        }


def sample_calls(info: Mapping[str, Any], worker: object) -> int:
    """How many calls each sample of worker ``worker``'s process timed back to back, from the
    process's ``info`` (1 where the worker recorded none). A recorded value that is no positive
    count is refused: costing its rounds as one call would misjudge Kalibera & Jones' rounds,
    or a replay's seconds, without a word."""
    calls = info.get("calls_per_sample", 1)
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"process {worker}: calls_per_sample must be a positive integer "
                         f"(the calls each sample timed), got {calls!r}: the timing worker "
                         "recorded it wrongly")
    return calls


def variance_components(processes: Sequence[ProcessSample]) -> dict[str, float]:
    """Within- and between-process variance of the process statistic, and Kalibera & Jones'
    rounds.

    within: the sampling variance of a process's statistic from its own rounds
    (:func:`statistic_variance`), times its rounds: the per-round variance the statistic sees,
    pooled over processes. between: the variance of the process statistics across processes less
    what that within-process part explains (clamped at 0). Both on the statistic the gate
    decides on, so a heavy tail of rounds that the statistic trims neither inflates the within
    part nor hides a real process bias. ``optimal_rounds`` = sqrt(c_process / c_round * within
    / between): the rounds per process that minimise the interval's width for a given time,
    where c_process is what starting a process's measurement costs (its setup) and c_round what
    one round costs: both of its samples, each of which repeats a short call
    ``info["calls_per_sample"]`` times (``timing.calls_per_sample``) and records their mean. A
    round cost taken from the per-call means alone would count a 2 ms sample of nine 0.25 ms
    GEMVs as 0.25 ms, and ask every process of the next look for three times the rounds that
    the optimum is (sqrt(9)), each costing its full sample.
    """
    own = [statistic_variance(p.ratios) for p in processes]
    sizes = np.asarray([len(p.candidate_s) for p in processes], dtype=np.float64)
    within = float(np.mean(np.asarray(own) * sizes))
    stats = np.asarray([p.statistic for p in processes])
    raw_between = float(np.var(stats, ddof=1)) if stats.size > 1 else 0.0
    between = max(0.0, raw_between - float(np.mean(own)))
    round_cost = float(np.mean([(np.mean(p.candidate_s) + np.mean(p.baseline_s))
                                * sample_calls(p.info, p.worker) for p in processes]))
    setup = float(np.mean([p.setup_s for p in processes]))
    if between > 0 and round_cost > 0:
        optimal = math.sqrt(max(setup, round_cost) / round_cost * within / between)
    else:
        optimal = float("inf")  # no measurable process bias: rounds are as good as processes
    return {"within": within, "between": between, "setup_s": setup, "round_s": round_cost,
            "optimal_rounds": optimal}


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def decision_chance(statistics: Sequence[float], *, final_n: int, final_confidence: float,
                    rule: str, threshold: float) -> float:
    """Predictive probability that the look at ``final_n`` processes decides (pass or fail).

    Given the process statistics so far (n of them, mean m, sd s), the mean over ``final_n``
    processes is predicted as normal around m with sd ``s * sqrt((N - n) / (N n))`` (the
    predictive distribution under a flat prior: the future processes' mean is uncertain both
    through their own noise and through the unknown true mean), and the final interval's
    half-width as ``t * s / sqrt(N)``. A route whose interval sits on the margin with a spread
    that the remaining processes cannot narrow enough has a small chance: timing them is work
    that almost surely ends inconclusive anyway (stochastic curtailment for futility).
    """
    data = finite_1d(statistics, "statistics")
    n = data.size
    if n < 2 or final_n <= n:
        raise ValueError(f"a prediction needs 2 <= n < final_n processes, got n={n}, "
                         f"final_n={final_n}")
    mean, sd = float(np.mean(data)), float(np.std(data, ddof=1))
    log_threshold = math.log(threshold)
    half = t_quantile(0.5 + final_confidence / 2, final_n - 1) * sd / math.sqrt(final_n)
    spread = sd * math.sqrt((final_n - n) / (final_n * n))
    if spread == 0.0:  # identical statistics: the prediction is the current interval's
        lo, hi = mean - half, mean + half
        return 1.0 if judge(rule, log_threshold, lo, hi).decided else 0.0
    chance_pass = _normal_cdf((log_threshold - half - mean) / spread)
    chance_fail = _normal_cdf((mean - half - log_threshold) / spread)
    return min(1.0, chance_pass + chance_fail)


def process_compare(
    sample: Callable[[int, int], Sequence[ProcessSample]],
    *,
    processes: int,
    max_processes: int,
    rounds: int,
    confidence: float,
    rule: str,
    threshold: float,
    max_rounds: int | None = None,
    futility: float = 0.0,
    interim_share: float = INTERIM_SHARE,
) -> ProcessResult:
    """Decide ``rule`` on an interval across processes, adding processes at each look.

    ``sample(n, rounds)`` returns ``n`` new ProcessSamples, each from a process that timed at
    least ``rounds`` interleaved rounds (a worker may time more to fill its time budget; the
    result records what each did). The first look uses ``processes`` processes; while the
    interval straddles ``threshold``, another ``processes`` are added, up to ``max_processes``.
    The error rate is spent across the looks as in :func:`paired_compare`. Later looks ask for
    at least the rounds per process that Kalibera & Jones' rule gives from the variances
    measured so far (up to max_rounds). At the cap a straddling interval is "inconclusive".
    An interim look whose chance of a decision at the cap (:func:`decision_chance`) is below
    ``futility`` stops there, inconclusive too (0: never): it can only end a gate early as
    pending, never turn it into a pass or a fail. ``interim_share`` is the error rate's share
    the interim looks spend (``decision.look_confidence``).
    """
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known rules: {', '.join(RULES)}")
    if not isinstance(processes, int) or processes < 2:
        raise ValueError(f"processes must be an integer >= 2 (got {processes!r}): an interval "
                         "across processes needs at least two")
    if not isinstance(max_processes, int) or max_processes < processes:
        raise ValueError(f"max_processes ({max_processes!r}) must be an integer >= processes "
                         f"({processes})")
    if not isinstance(rounds, int) or rounds < 2:
        raise ValueError(f"rounds must be an integer >= 2, got {rounds!r}")
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be a positive ratio, got {threshold!r}")
    check_confidence(confidence)
    if not 0.0 <= futility < 1.0:
        raise ValueError(f"futility must be a probability in [0, 1) (0: never stop early), "
                         f"got {futility!r}")
    cap = max_rounds if max_rounds is not None else 4 * rounds
    plan = list(range(processes, max_processes + 1, processes))
    if plan[-1] != max_processes:
        plan.append(max_processes)
    taken: list[ProcessSample] = []
    looks: list[int] = []
    per_look: list[int] = []
    per = rounds
    stopped: float | None = None
    while True:
        new = list(sample(plan[len(looks)] - len(taken), per))
        if len(new) != plan[len(looks)] - len(taken):
            raise RuntimeError(f"asked for {plan[len(looks)] - len(taken)} processes, got "
                               f"{len(new)}")
        taken.extend(new)
        per_look.extend(len(p.candidate_s) for p in new)
        looks.append(len(taken))
        final = len(looks) == len(plan)
        look_conf = look_confidence(confidence, len(plan), final, interim_share)
        ratio, lo, hi = across_processes([p.statistic for p in taken], look_conf)
        judged = judge(rule, threshold, lo, hi)
        if judged.decided or final:
            break
        if futility > 0:
            chance = decision_chance(
                [p.statistic for p in taken], final_n=plan[-1], rule=rule, threshold=threshold,
                final_confidence=look_confidence(confidence, len(plan), True, interim_share))
            if chance < futility:
                stopped = chance
                break
        # Kalibera & Jones' optimum, as the next look's minimum (a worker times more when its
        # time budget holds more); with no measurable process bias, rounds are as good as
        # processes. Not the earlier looks' counts: a process whose warm-up round happened to
        # be short timed many rounds, and asking every later process for as many would time
        # the budget many times over.
        optimal = variance_components(taken)["optimal_rounds"]
        per = int(min(cap, max(rounds, math.ceil(optimal)))) if math.isfinite(optimal) else rounds
    return ProcessResult(
        processes=taken, ratio=ratio, ci_low=lo, ci_high=hi, decision=judged.decision,
        outcome=judged.outcome, rule=rule, threshold=float(threshold),
        confidence=look_conf, looks=looks, rounds_per_process=per_look,
        variance=variance_components(taken), stopped_futile=stopped,
        max_processes=plan[-1],
    )
