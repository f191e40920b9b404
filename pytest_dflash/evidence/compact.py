"""The report's form of a timing comparison: every process's summary and a bounded sample of its
rounds, not every round.

Why: a verdict, a plot, a diff and a merge need each process's statistic and a picture of its
rounds, not all of them. Kept whole, the rounds made a report grow with the rounds a gate timed:
a validation_cost test on a GPU times about a thousand rounds in each of 6 processes at 8 verify
widths, 3 MB a test, and one calibration run of one gate wrote over 30 MB. Here each process keeps

- its statistic and ratio (what the interval across processes was computed from), unchanged;
- ``summary``: count, interquartile mean and quartiles of its per-round ratios, and the quartiles
  and total of each side's timed seconds, computed over *every* round;
- ``samples``/``orders``: at most ``keep`` rounds, evenly spaced over the process's rounds, the
  first and last included, paired (a kept round keeps both sides), with ``sampled`` saying which
  rounds they are and of how many.

A comparison timed in the test's own process (the round protocol) is kept the same way at its top.
The summary is computed before the sample is drawn, so every figure a reader shows that is not a
round's own comes from all the rounds. ``keep=None`` keeps every round (``--dflash-report-rounds
all``: for studies that replay the rounds, ``benchmarks/*_replay.py``).

Compaction runs once, where a gate test records its measurements (``session.fixture``), so the
workers under xdist send, and JUnit and the report hold, the compact form. It is idempotent: an
entry that is already a sample is left as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from pytest_dflash.evidence import timings

DEFAULT_KEEP = 32  # rounds kept per process (and per in-process comparison)


def parse_keep(value: str | int | None) -> int | None:
    """``--dflash-report-rounds``: a whole number >= 2 of rounds kept, or ``all`` (None).

    Raises ValueError naming the value and the fix."""
    if value is None or value == "":
        return DEFAULT_KEEP
    if isinstance(value, str) and value.strip().lower() == "all":
        return None
    try:
        keep = int(value)
    except (TypeError, ValueError):
        keep = -1
    if keep < 2:
        raise ValueError(f"dflash_report_rounds = {value!r}: give a whole number of rounds to "
                         f"keep per process, at least 2 (default {DEFAULT_KEEP}), or 'all'")
    return keep


def measurements(measured: Mapping[str, Any], keep: int | None = DEFAULT_KEEP) -> dict[str, Any]:
    """A copy of a test's measurements with every timing comparison in it compacted.

    Comparisons are found where ``evidence.timings`` finds them (at the top, or nested as a
    validation_cost test's ``per_m``); everything else is kept as it is."""
    out = dict(measured)
    protocol = timings.protocol(out)
    if protocol == timings.PROCESS:
        out["processes"] = [_process(p, keep) if isinstance(p, Mapping) else p
                            for p in out["processes"]]
    elif protocol == timings.ROUND:
        out.update(_rounds(out, keep, statistic=None))
    for key, value in out.items():
        if isinstance(value, Mapping) and key not in ("samples", "variance", "summary"):
            out[key] = measurements(value, keep)
    return out


def _process(proc: Mapping[str, Any], keep: int | None) -> dict[str, Any]:
    out = dict(proc)
    out.update(_rounds(out, keep, statistic=proc.get("statistic")))
    return out


def _rounds(entry: Mapping[str, Any], keep: int | None, statistic: Any) -> dict[str, Any]:
    """``summary``, ``samples``, ``orders`` and ``sampled`` of one set of paired rounds."""
    samples = entry.get("samples")
    if "sampled" in entry or not isinstance(samples, Mapping):
        return {}  # compacted already, or no rounds to keep
    cand = list(samples.get("candidate") or [])
    base = list(samples.get("baseline") or [])
    count = min(len(cand), len(base))
    orders = entry.get("orders")
    update: dict[str, Any] = {"summary": summary(cand[:count], base[:count], statistic)}
    if keep is None or count <= keep:
        return update
    index = kept_rounds(count, keep)
    update["samples"] = {"candidate": [cand[i] for i in index],
                         "baseline": [base[i] for i in index]}
    if isinstance(orders, list) and len(orders) >= count:
        update["orders"] = [orders[i] for i in index]
    update["sampled"] = {"rounds": index, "of": count}
    return update


def kept_rounds(count: int, keep: int) -> list[int]:
    """``keep`` round indices evenly spaced over ``count`` rounds, the first and last included
    (deterministic: the same rounds give the same sample on every run and every host)."""
    if count <= keep:
        return list(range(count))
    step = (count - 1) / (keep - 1)
    return sorted({round(i * step) for i in range(keep)})


def summary(candidate_s: Sequence[Any], baseline_s: Sequence[Any],
            statistic: Any = None) -> dict[str, Any]:
    """Count, interquartile mean and quartiles of the per-round ratios, and each side's
    quartiles and total seconds, over every round given.

    The interquartile mean is the process statistic's (``process_statistics.process_statistic``:
    the mean of the middle half of the log ratios), exponentiated; ``statistic`` is used as it
    is when the gate recorded one, so the summary and the interval's input cannot disagree."""
    pairs = [(float(c), float(b)) for c, b in zip(candidate_s, baseline_s, strict=False)
             if _finite(c) and _finite(b) and b > 0 and c > 0]
    ratios = sorted(c / b for c, b in pairs)
    out: dict[str, Any] = {"count": len(ratios)}
    if not ratios:
        return out
    if not _finite(statistic):
        from pytest_dflash.measure.process_statistics import process_statistic

        statistic = process_statistic(ratios)
    iqm = math.exp(float(statistic))
    out["ratio"] = {"iqm": iqm, **quartiles(ratios)}
    for side, values in (("candidate", [c for c, _ in pairs]), ("baseline", [b for _, b in pairs])):
        out[f"{side}_s"] = {**quartiles(sorted(values)), "total": sum(values)}
    return out


def quartiles(ordered: Sequence[float]) -> dict[str, float]:
    """q1, median, q3 of sorted values (linear interpolation, numpy's default)."""
    return {"q1": _quantile(ordered, 0.25), "median": _quantile(ordered, 0.5),
            "q3": _quantile(ordered, 0.75)}


def _quantile(ordered: Sequence[float], q: float) -> float:
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(
        value)


def every_round(proc: Mapping[str, Any]) -> tuple[list[float], list[float], list[str]]:
    """(candidate seconds, baseline seconds, orders) of every round a process timed.

    For studies that replay rounds (``benchmarks/*_replay.py``). Raises ValueError naming the
    fix when the report kept only a sample of them."""
    sampled = proc.get("sampled")
    if isinstance(sampled, Mapping):
        raise ValueError(f"this report keeps {len(sampled.get('rounds') or [])} of "
                         f"{sampled.get('of')} rounds of a process; rerun the gates with "
                         "--dflash-report-rounds all to keep every round")
    samples = proc.get("samples") or {}
    return (list(samples.get("candidate") or []), list(samples.get("baseline") or []),
            list(proc.get("orders") or []))


def timed_seconds(proc: Mapping[str, Any]) -> float:
    """Seconds a process spent in its timed rounds, both sides: from the summary of every round
    when the report has one, else from the rounds kept whole. A CPU sample of a short call is
    the mean of ``calls_per_sample`` calls timed back to back, so each sample cost that many
    times its seconds."""
    from pytest_dflash.measure.process_statistics import sample_calls

    calls = sample_calls(proc.get("info") or {}, proc.get("worker"))
    summary_ = proc.get("summary") or {}
    if "candidate_s" in summary_ and "baseline_s" in summary_:
        return calls * float(summary_["candidate_s"]["total"] + summary_["baseline_s"]["total"])
    cand, base, _ = every_round(proc)
    return calls * float(sum(cand) + sum(base))
