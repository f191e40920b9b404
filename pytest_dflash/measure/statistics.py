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

from pytest_dflash.session.policy import Policy

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


def paired_compare(
    run_candidate: Callable[[], float],
    run_baseline: Callable[[], float],
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

    ``run_*`` each perform ONE timed run and return its elapsed seconds. Starts with ``rounds``
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
        _timed(run_candidate, "run_candidate")
        _timed(run_baseline, "run_baseline")

    plan = _planned_looks(rounds, max_rounds)
    order_rng = np.random.default_rng([seed, 0])
    cand: list[float] = []
    base: list[float] = []
    orders: list[str] = []
    looks: list[int] = []
    target = rounds
    while True:
        while len(cand) < target:
            if order_rng.random() < 0.5:
                orders.append("cb")
                c = _timed(run_candidate, "run_candidate")
                b = _timed(run_baseline, "run_baseline")
            else:
                orders.append("bc")
                b = _timed(run_baseline, "run_baseline")
                c = _timed(run_candidate, "run_candidate")
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


def _look_confidence(confidence: float, looks: int, final: bool) -> float:
    """Per-look CI level so that the whole adaptive run keeps ``confidence`` (alpha spending).

    Every look is a chance to stop on a wrong decision, so the error rate ``1 - confidence`` is
    split (Bonferroni, Haybittle-Peto style): the interim looks share a tenth of it and the final
    look at the cap gets the rest. Early stops then need overwhelming evidence, and the final look
    stays close to the nominal level, where most of the precision is.
    """
    if looks == 1:
        return confidence
    alpha = 1.0 - confidence
    spent = alpha / 10 / (looks - 1) if not final else alpha * 9 / 10
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


def _timed(fn: Callable[[], float], name: str) -> float:
    value = fn()
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
