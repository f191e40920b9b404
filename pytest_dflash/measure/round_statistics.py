"""The in-process timing protocol: paired rounds of one process, and their bootstrap interval.

Why paired and interleaved: a candidate and its baseline are timed in the same process, one
right after the other, in an order drawn per round from a seeded generator, so slow drift of the
machine (clocks, thermals, other tenants) hits both sides of a round alike and cancels in the
per-round ratio ``candidate / baseline``. The decision uses the median ratio (robust to a stray
slow run) and its percentile-bootstrap confidence interval; everything is seeded, so a rerun on
the same samples gives the same verdict. A timing gate falls back to this protocol only where
no timing worker can rebuild the pair (``timing.speed_gate``); the cross-process protocol is
``process_statistics``, the decision and its words ``decision``.

A CI that still straddles the threshold is not a decision: more rounds are taken (doubling) up to
``max_rounds``; a run that is still undecided there is "inconclusive" (the route stays pending).
The error rate is spent across the looks (``decision.look_confidence``), so the whole adaptive
run keeps the predeclared confidence instead of inflating it with each extra look.

Also here: McNemar's exact tests, the paired test of the quality gate's pass/fail per task.
numpy only (no torch, no scipy), so the gate arithmetic is importable anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytest_dflash.measure.decision import (
    RULES,
    check_confidence,
    finite_1d,
    judge,
    look_confidence,
)


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
    data = finite_1d(values, "values")
    if data.size < 2:
        raise ValueError(
            f"bootstrap_ci needs at least 2 values, got {data.size}: one sample has no spread"
        )
    check_confidence(confidence)
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
    outcome: str  # one of decision.OUTCOMES, as decision.judge words it
    passed: bool
    rule: str
    threshold: float
    confidence: float
    looks: list[int] = field(default_factory=list)  # rounds at each interim decision

    @property
    def decision(self) -> str:
        """pass / fail / inconclusive (an interval that still straddles the margin)."""
        return judge(self.rule, self.threshold, self.ci_low, self.ci_high).decision

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
    check_confidence(confidence)
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
        look_conf = look_confidence(confidence, len(plan), final)
        median, lo, hi = bootstrap_ci(
            ratios, confidence=look_conf, resamples=resamples, seed=[seed, 1, len(looks)]
        )
        judged = judge(rule, threshold, lo, hi)
        if judged.decided or final:
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
        outcome=judged.outcome,
        passed=judged.passed,
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


def _check_resamples(resamples: int) -> None:
    if not isinstance(resamples, int) or resamples < 100:
        raise ValueError(
            f"resamples must be an integer >= 100, got {resamples!r}: fewer makes the CI's own "
            "Monte Carlo error comparable to the thresholds"
        )
