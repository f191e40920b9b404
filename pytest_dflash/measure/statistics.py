"""Paired statistics for the speed, validation_cost and quality gates (docs/gates.md).

Why paired and interleaved: a candidate and its baseline are timed in the same process, one
right after the other, in an order drawn per round from a seeded generator, so slow drift of the
machine (clocks, thermals, other tenants) hits both sides of a round alike and cancels in the
per-round ratio ``candidate / baseline``. The decision uses the median ratio (robust to a stray
slow run) and its percentile-bootstrap confidence interval; everything is seeded, so a rerun on
the same samples gives the same verdict.

Decision rules (the thresholds come from the predeclared policy, never from a test):

* ``"gain"``: pass iff the CI upper bound < ``threshold`` (``1 - policy.speed_min_gain``).
* ``"no_regression"``: pass iff the CI upper bound <= ``threshold``
  (``1 + policy.validation_noise_floor``).

A CI that still straddles the threshold is not a decision: more rounds are taken (doubling) up to
``max_rounds``; a run that is still undecided there fails ("inconclusive": fail closed). Because
every look is a chance to stop on a fluke, the error rate is spent across the looks (interim
looks use a much stricter CI than the final one), so the whole adaptive run keeps the
predeclared confidence instead of inflating it with each extra look.

numpy only (no torch, no scipy), so the gate arithmetic is importable anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytest_dflash.policy.thresholds import Policy

RULES: tuple[str, ...] = ("gain", "no_regression")
OUTCOMES: tuple[str, ...] = ("faster", "neutral", "slower", "inconclusive")


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    *,
    confidence: float,
    resamples: int,
    seed: int | Sequence[int],
    stat: Callable[..., Any] = np.median,
) -> tuple[float, float, float]:
    """Percentile bootstrap: ``(stat(values), lo, hi)`` at two-sided ``confidence``.

    All resamples are drawn as one ``(resamples, n)`` index matrix and reduced with
    ``stat(matrix, axis=1)``, so ``stat`` must accept ``axis`` (numpy reductions do). Vectorized
    because the gates and their calibration tests call this thousands of times.
    """
    data = _finite_1d(values, "values")
    if data.size < 2:
        raise ValueError(
            f"bootstrap_ci needs at least 2 values, got {data.size}: one sample has no spread"
        )
    _check_confidence(confidence)
    _check_resamples(resamples)
    rng = np.random.default_rng(seed)
    if stat is np.median:
        stats = _bootstrap_medians(np.sort(data), resamples, rng)
    else:
        idx = rng.integers(0, data.size, size=(resamples, data.size))
        stats = np.asarray(stat(data[idx], axis=1), dtype=np.float64)
    alpha = 1.0 - confidence
    lo, hi = np.quantile(stats, [alpha / 2, 1.0 - alpha / 2])
    return float(stat(data)), float(lo), float(hi)


def _bootstrap_medians(ordered: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Medians of ``resamples`` bootstrap resamples of sorted data, in O(resamples), not O(n each).

    A resample is n iid uniform picks of a sorted position, i.e. ``floor(n * U)`` for iid uniform
    U, and floor is monotone, so the resample's k-th smallest value is
    ``ordered[floor(n * U_(k))]`` with ``U_(k) ~ Beta(k, n - k + 1)``, and the next order
    statistic is ``U_(k) + (1 - U_(k)) * Beta(1, n - k)``. This draws exactly the distribution of
    ``np.median(data[rng.integers(0, n, (resamples, n))], axis=1)`` without the index matrix,
    which keeps hundreds of rounds and the calibration tests cheap.
    """
    n = ordered.size
    k = (n + 1) // 2  # 1-based rank of the (lower) middle order statistic
    u_k = rng.beta(k, n - k + 1, size=resamples)
    lower = ordered[np.minimum((n * u_k).astype(np.int64), n - 1)]
    if n % 2:
        return lower
    u_next = u_k + (1.0 - u_k) * rng.beta(1, n - k, size=resamples)
    upper = ordered[np.minimum((n * u_next).astype(np.int64), n - 1)]
    return 0.5 * (lower + upper)


def paired_bootstrap(
    diffs: Sequence[float] | np.ndarray,
    *,
    confidence: float,
    resamples: int,
    seed: int | Sequence[int],
) -> tuple[float, float, float]:
    """Mean of paired differences (e.g. per-segment PPL deltas) and its bootstrap CI."""
    return bootstrap_ci(diffs, confidence=confidence, resamples=resamples, seed=seed, stat=np.mean)


@dataclass
class PairedResult:
    """Everything a paired timing comparison measured, raw samples included."""

    ratios: list[float]  # candidate_s[i] / baseline_s[i], one per round
    candidate_s: list[float]  # raw timed durations, seconds
    baseline_s: list[float]
    orders: list[str]  # per round: "cb" (candidate ran first) or "bc"
    rounds: int
    median: float
    ci_low: float
    ci_high: float
    outcome: str  # one of OUTCOMES
    passed: bool
    rule: str
    threshold: float
    confidence: float
    looks: list[int] = field(default_factory=list)  # rounds at each interim decision

    @property
    def decision(self) -> str:
        """pass / fail / inconclusive (an interval that still straddles the margin)."""
        return decide(self.rule, self.threshold, self.ci_low, self.ci_high)

    def figure(self) -> str:
        """e.g. ``ratio 0.932 [0.901, 0.960] over 24 rounds`` (3 decimals: thresholds are 1%)."""
        return (
            f"ratio {self.median:.3f} [{self.ci_low:.3f}, {self.ci_high:.3f}] "
            f"over {self.rounds} rounds"
        )

    def requirement(self) -> str:
        """What passing needs, in words, for failure messages."""
        op = "<" if self.rule == "gain" else "<="
        return f"needs CI upper {op} {self.threshold:.3f}"

    def measurements(self) -> dict[str, Any]:
        """JSON-able record for the report: the figure, the decision and the raw samples."""
        return {
            "figure": self.figure(),
            "ratio_median": self.median,
            "ci_low": self.ci_low,
            "ci_high": self.ci_high,
            "rounds": self.rounds,
            "outcome": self.outcome,
            "decision": self.decision,
            "unit": "round (one process)",
            "passed": self.passed,
            "rule": self.rule,
            "threshold": self.threshold,
            "confidence": self.confidence,
            "looks": list(self.looks),
            "orders": list(self.orders),
            "samples": {"candidate": list(self.candidate_s), "baseline": list(self.baseline_s)},
        }


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


RoundTimer = Callable[[str], tuple[float, float]]


def sides(run_candidate: Callable[[], float], run_baseline: Callable[[], float]) -> RoundTimer:
    """A round of one timed run of each side, in the order asked for (``"cb"``: candidate
    first), for :func:`paired_compare`: ``run_*`` each perform ONE timed run and return its
    elapsed seconds."""

    def run_round(order: str) -> tuple[float, float]:
        if order == "cb":
            c = run_candidate()
            return c, run_baseline()
        b = run_baseline()
        return run_candidate(), b

    return run_round


def paired_compare(
    run_round: RoundTimer,
    *,
    rounds: int,
    max_rounds: int,
    confidence: float,
    resamples: int,
    seed: int,
    rule: str,
    threshold: float,
    warmup: int = 0,
    on_round: Callable[[int, int, Sequence[float], Sequence[float]], None] | None = None,
) -> PairedResult:
    """Time both sides interleaved, in a seeded random order per round, and decide by ``rule``.

    ``run_round(order)`` times one round, candidate first for ``"cb"`` and baseline first for
    ``"bc"``, and returns (candidate, baseline) elapsed seconds (:func:`sides` makes one from
    two single-run timers; ``timing.round_timer`` alternates short calls). Starts with ``rounds``
    rounds; while the CI straddles ``threshold`` the number of rounds doubles, up to
    ``max_rounds``. Interim looks stop only on a decision their (stricter, alpha-spending) CI
    supports, and an undecided run at the cap fails (fail closed). ``PairedResult.confidence`` is
    the level of the CI that made the decision. ``on_round(done, target, candidate_s,
    baseline_s)``, if given, is called after every round (progress display; it must not time).
    """
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; known rules: {', '.join(RULES)}")
    if not isinstance(rounds, int) or rounds < 2:
        raise ValueError(f"rounds must be an integer >= 2 (got {rounds!r}): a CI needs spread")
    if not isinstance(max_rounds, int) or max_rounds < rounds:
        raise ValueError(f"max_rounds ({max_rounds!r}) must be an integer >= rounds ({rounds})")
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be a positive ratio, got {threshold!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    _check_confidence(confidence)
    _check_resamples(resamples)

    for _ in range(warmup):
        _round(run_round, "cb")

    plan = _planned_looks(rounds, max_rounds)
    order_rng = np.random.default_rng([seed, 0])
    cand: list[float] = []
    base: list[float] = []
    orders: list[str] = []
    looks: list[int] = []
    target = rounds
    while True:
        while len(cand) < target:
            orders.append("cb" if order_rng.random() < 0.5 else "bc")
            c, b = _round(run_round, orders[-1])
            cand.append(c)
            base.append(b)
            if on_round is not None:
                on_round(len(cand), target, cand, base)
        ratios = np.asarray(cand) / np.asarray(base)
        looks.append(len(cand))
        final = len(looks) == len(plan)
        look_conf = _look_confidence(confidence, len(plan), final)
        median, lo, hi = bootstrap_ci(
            ratios, confidence=look_conf, resamples=resamples, seed=[seed, 1, len(looks)]
        )
        passed, decided = _decide(rule, threshold, lo, hi)
        if decided or final:
            break
        target = plan[len(looks)]

    return PairedResult(
        ratios=ratios.tolist(),
        candidate_s=cand,
        baseline_s=base,
        orders=orders,
        rounds=len(cand),
        median=median,
        ci_low=lo,
        ci_high=hi,
        outcome=_outcome(rule, threshold, lo, hi, passed, decided),
        passed=passed,
        rule=rule,
        threshold=float(threshold),
        confidence=look_conf,
        looks=looks,
    )


def _planned_looks(rounds: int, max_rounds: int) -> list[int]:
    """Round counts at which the CI is examined: rounds, 2 x rounds, ... and max_rounds last."""
    plan = [rounds]
    while plan[-1] < max_rounds:
        plan.append(min(2 * plan[-1], max_rounds))
    return plan


# the share of the error rate the interim looks spend together (Haybittle-Peto style); what a
# larger share would cost is replayed by benchmarks/spending_replay.py
INTERIM_SHARE = 0.1


def _look_confidence(confidence: float, looks: int, final: bool,
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


def _decide(rule: str, threshold: float, lo: float, hi: float) -> tuple[bool, bool]:
    """(passed, decided): decided once the CI lies wholly on one side of the threshold."""
    if rule == "gain":
        passed = hi < threshold
        return passed, passed or lo >= threshold
    passed = hi <= threshold
    return passed, passed or lo > threshold


def _outcome(rule: str, threshold: float, lo: float, hi: float, passed: bool, decided: bool) -> str:
    """Name the finding: what the CI says about candidate vs baseline, given the decision.

    gain: "faster" = passed; "slower" = CI wholly above 1; "neutral" = CI contains 1, or it lies
    decisively between the threshold and 1 (faster, but by less than the required gain);
    "inconclusive" = still straddling the threshold below 1 at the cap.
    no_regression: passed is "faster" (CI below 1) or "neutral"; "slower" = CI wholly above the
    threshold (a proven regression); "inconclusive" = still straddling the threshold at the cap.
    """
    if passed:
        if rule == "gain" or hi < 1.0:
            return "faster"
        return "neutral"
    if rule == "gain":
        if lo > 1.0:
            return "slower"
        if hi >= 1.0 or decided:
            return "neutral"
        return "inconclusive"
    if lo > threshold:
        return "slower"
    return "inconclusive"


def mcnemar_exact(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value on the discordant pairs.

    ``b``: tasks the candidate fails where the baseline passes; ``c``: the reverse. Under "no
    difference" each discordant pair is a fair coin, so ``min(b, c)`` is Binomial(b + c, 1/2);
    the p-value doubles the smaller tail (capped at 1). No discordant pairs: p = 1.
    """
    n = _discordant(b, c)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


def mcnemar_regression(b: int, c: int) -> float:
    """One-sided exact p-value for "the candidate is worse": P(X >= b), X ~ Bin(b + c, 1/2).

    The quality gate fails on a significant *regression* only, so it asks this one-sided question.
    """
    n = _discordant(b, c)
    if n == 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(b, n + 1)) / 2**n


def _discordant(b: int, c: int) -> int:
    for name, value in (("b", b), ("c", c)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"McNemar count {name} must be a non-negative integer, got {value!r}")
    return int(b) + int(c)


def _round(run_round: RoundTimer, order: str) -> tuple[float, float]:
    c, b = run_round(order)
    return _seconds(c, "run_candidate"), _seconds(b, "run_baseline")


def _seconds(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must return elapsed seconds as a number, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{name} returned {seconds!r}; a timer returns elapsed seconds >= 0")
    if seconds == 0:
        raise ValueError(
            f"{name} returned 0 seconds: the timed call is below the timer's resolution; "
            "time a larger workload"
        )
    return seconds


def _finite_1d(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
    data = np.asarray(values, dtype=np.float64)
    if data.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {data.shape}")
    if not np.isfinite(data).all():
        raise ValueError(f"{name} contains NaN/Inf at {np.flatnonzero(~np.isfinite(data))[:5]}")
    return data


def _check_confidence(confidence: float) -> None:
    if not (isinstance(confidence, float) and 0.5 <= confidence < 1.0):
        raise ValueError(f"confidence must be a float in [0.5, 1), got {confidence!r}")


def _check_resamples(resamples: int) -> None:
    if not isinstance(resamples, int) or resamples < 100:
        raise ValueError(
            f"resamples must be an integer >= 100, got {resamples!r}: fewer makes the CI's own "
            "Monte Carlo error comparable to the thresholds"
        )


# --- Cross-process statistics (docs/gates.md, "Timing protocol") -------------------------------
#
# Why: a process carries a bias of its own (memory placement, the host path's dispatch cost, the
# thread pool's state) that hits every round it times, so rounds of one process are not
# independent draws of the ratio, and an interval over them covers only within-process noise:
# more rounds make one process's bias look more certain. Following Kalibera & Jones (ISMM 2013),
# the unit of repetition is the level that varies most, the process: each worker process yields
# one statistic, and the interval is computed across processes.

DECISIONS: tuple[str, ...] = ("pass", "fail", "inconclusive")


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
    data = _finite_1d(ratios, "ratios")
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
    data = _finite_1d(statistics, "statistics")
    if data.size < 2:
        raise ValueError(f"an interval across processes needs at least 2 processes, got "
                         f"{data.size}: one process has no between-process spread")
    _check_confidence(confidence)
    mean = float(np.mean(data))
    half = t_quantile(0.5 + confidence / 2, data.size - 1) * float(np.std(data, ddof=1)) \
        / math.sqrt(data.size)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def decide(rule: str, threshold: float, lo: float, hi: float) -> str:
    """pass / fail / inconclusive: where the interval lies relative to the policy's margin.

    gain (threshold ``1 - speed_min_gain``): pass when the upper bound is below it, fail when
    the lower bound is at or above it (not the required gain). no_regression (threshold
    ``1 + validation_noise_floor``): pass when the upper bound is at or below it, fail when the
    lower bound is above it (a proven regression). An interval that straddles the margin is
    inconclusive: it claims neither.
    """
    passed, decided = _decide(rule, threshold, lo, hi)
    return "pass" if passed else "fail" if decided else "inconclusive"


def finding(rule: str, threshold: float, lo: float, hi: float) -> str:
    """What the interval says in words: faster / neutral / slower / inconclusive."""
    decision = decide(rule, threshold, lo, hi)
    if decision == "inconclusive":
        return "inconclusive"
    if decision == "pass":
        return "faster" if rule == "gain" or hi < 1.0 else "neutral"
    if rule == "gain":
        return "slower" if lo > 1.0 else "neutral"
    return "slower"


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
    decision: str  # one of DECISIONS
    outcome: str  # finding in words, one of OUTCOMES
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
        return self.decision == "pass"

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
    one round costs.
    """
    own = [statistic_variance(p.ratios) for p in processes]
    sizes = np.asarray([len(p.candidate_s) for p in processes], dtype=np.float64)
    within = float(np.mean(np.asarray(own) * sizes))
    stats = np.asarray([p.statistic for p in processes])
    raw_between = float(np.var(stats, ddof=1)) if stats.size > 1 else 0.0
    between = max(0.0, raw_between - float(np.mean(own)))
    round_cost = float(np.mean([np.mean(p.candidate_s) + np.mean(p.baseline_s)
                                for p in processes]))
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
    data = _finite_1d(statistics, "statistics")
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
        _, decided = _decide(rule, log_threshold, lo, hi)
        return 1.0 if decided else 0.0
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
    the interim looks spend (:func:`_look_confidence`).
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
    _check_confidence(confidence)
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
        look_conf = _look_confidence(confidence, len(plan), final, interim_share)
        ratio, lo, hi = across_processes([p.statistic for p in taken], look_conf)
        decision = decide(rule, threshold, lo, hi)
        if decision != "inconclusive" or final:
            break
        if futility > 0:
            chance = decision_chance(
                [p.statistic for p in taken], final_n=plan[-1], rule=rule, threshold=threshold,
                final_confidence=_look_confidence(confidence, len(plan), True, interim_share))
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
        processes=taken, ratio=ratio, ci_low=lo, ci_high=hi, decision=decision,
        outcome=finding(rule, threshold, lo, hi), rule=rule, threshold=float(threshold),
        confidence=look_conf, looks=looks, rounds_per_process=per_look,
        variance=variance_components(taken), stopped_futile=stopped,
        max_processes=plan[-1],
    )
