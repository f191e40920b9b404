"""Quality scoring: the per-completion output contract and the paired quality verdict
(docs/gates.md, "quality").

A route that changes numerics (a new reduction order, an fp16 SSM state) can keep pass@1 about
level while its generations degrade in ways a few unit tests miss: loops of one token, walls of
digits, repeated paragraphs, mojibake, runaway generations that never stop, unclosed code fences.
The output contract catches those per completion, rule by rule, so a report can say *which* rule
broke. The quality verdict then compares candidate and baseline on the same tasks: McNemar on the
paired pass/fail outcomes (only discordant tasks carry information), plus the contract-failure
count and the natural-stop rate, each against the predeclared policy.

The contract's numbers (docs/gates.md, "Output contract") are collected in :data:`CONTRACT`
(printed with the results): they define what a well-formed completion is, and never change
inside a test.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from itertools import groupby
from typing import Any

from pytest_dflash.policy.thresholds import Policy


@dataclasses.dataclass(frozen=True)
class ContractLimits:
    """The output contract (docs/gates.md). A rule is violated when the measure is *greater*
    than the limit (a run of exactly ``max_same_token_run`` tokens is fine, one more is not).

    Where the documented rule leaves a detail open, this is the reading (and why):

    - whitespace normalisation maps every whitespace character to one space, keeping the length,
      so the "windows less than half non-space are ignored" exclusion has something to exclude
      (indentation); a window with exactly half non-space characters counts;
    - a window's repeats are its non-overlapping occurrences (``str.count`` semantics): a run of
      one character is the run rules' business, not twenty overlapping window hits per char;
    - identical lines compare with trailing whitespace removed; a blank line ends a run;
    - a doubled token is a word of two or more characters, a hyphen, the same word (``UTF-UTF``);
    - a code fence is a line starting with three backticks; an odd count is an unclosed fence.
    """

    max_same_token_run: int = 48
    max_digit_run: int = 80
    max_same_char_run: int = 120
    # whitespace-normalised window length -> max occurrences; the 20-char limit grows with the text
    window_limits: tuple[tuple[int, int], ...] = ((20, 80), (50, 40), (100, 20))
    window_20_per_chars: int = 200  # 20-char limit is max(80, len / 200)
    max_identical_lines: int = 12
    corruption_run: int = 20  # twenty 0s or twenty 5s in a row

    def window_limit(self, width: int, normalised_len: int) -> float:
        base = dict(self.window_limits)[width]
        if width == 20:
            return max(base, normalised_len / self.window_20_per_chars)
        return base

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CONTRACT = ContractLimits()

RULES: tuple[str, ...] = (
    "min_tokens",
    "same_token_run",
    "digit_run",
    "same_char_run",
    "window_repeat_20",
    "window_repeat_50",
    "window_repeat_100",
    "identical_lines",
    "corruption_markers",
    "natural_stop",
    "code_fence",
)


@dataclasses.dataclass(frozen=True)
class ContractResult:
    """Per-rule outcome of one completion. ``rules[name] = {"ok": bool, "detail": str}`` for every
    name in :data:`RULES`; ``violations`` lists the broken ones in that order."""

    rules: dict[str, dict[str, Any]]

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def violations(self) -> list[str]:
        return [name for name in RULES if not self.rules[name]["ok"]]

    def message(self) -> str:
        if self.ok:
            return "output contract: all rules hold"
        broken = "; ".join(f"{name}: {self.rules[name]['detail']}" for name in self.violations)
        return f"output contract: {len(self.violations)} violation(s): {broken}"


def _longest_run(items: Sequence[Any]) -> tuple[int, Any]:
    """Length and value of the longest run of equal consecutive items (0, None when empty)."""
    best, best_value, run = 0, None, 0
    for i, item in enumerate(items):
        run = run + 1 if i and item == items[i - 1] else 1
        if run > best:
            best, best_value = run, item
    return best, best_value


_DIGIT_RUNS = re.compile(r"[0-9]+")
_DOUBLED_TOKEN = re.compile(r"\b([A-Za-z][A-Za-z0-9_]+)-\1\b")
_FENCE = re.compile(r"^\s*```")
_WHITESPACE = re.compile(r"\s")


def _rule(ok: bool, detail: str) -> dict[str, Any]:
    return {"ok": ok, "detail": detail}


def _window_rule(normalised: str, width: int, limits: ContractLimits) -> dict[str, Any]:
    """Most frequent ``width``-char window, counted as non-overlapping occurrences scanning left to
    right (``str.count`` semantics), so a run of one character is judged by the run rules and a
    loop of any period p by how often its text really recurs."""
    limit = limits.window_limit(width, len(normalised))
    seen: dict[str, tuple[int, int]] = {}  # window -> (occurrences, end of the last one counted)
    for i in range(len(normalised) - width + 1):
        window = normalised[i : i + width]
        count, end = seen.get(window, (0, 0))
        if i >= end:
            seen[window] = (count + 1, i + width)
    best_window, best = "", 0
    for window, (count, _) in seen.items():
        # a window that is less than half non-space is indentation or layout, not content
        if count > best and 2 * (width - window.count(" ")) >= width:
            best_window, best = window, count
    limit_text = f"{limit:g}"
    if best > limit:
        return _rule(
            False, f"{width}-char window {best_window!r} occurs {best} times > {limit_text}"
        )
    return _rule(True, f"most frequent {width}-char window occurs {best} times <= {limit_text}")


def check_output_contract(
    text: str,
    token_ids: Sequence[int] | None = None,
    *,
    finish_reason: str,
    min_tokens: int = 1,
) -> ContractResult:
    """Check one completion against every rule of the output contract (docs/gates.md).

    ``token_ids`` are the generated ids; without them the token rules count UTF-8 bytes, which
    is exact for byte-level models such as the reference engine (and said so in the detail).
    ``finish_reason`` is the engine's: ``"stop"`` means it stopped naturally (EOS or a stop
    string); anything else (``"length"``) is a runaway generation.
    """
    # the documented numbers; deliberately not a parameter, so no test can loosen them
    limits = CONTRACT
    if not isinstance(text, str):
        raise TypeError(f"text must be the decoded completion (str), got {type(text).__name__}")
    if not isinstance(finish_reason, str):
        raise TypeError(
            f"finish_reason must be the engine's string ('stop' or 'length'), got {finish_reason!r}"
        )
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be a non-negative integer, got {min_tokens!r}")
    if token_ids is None:
        tokens: Sequence[int] = text.encode("utf-8")
        unit = "bytes (no token ids given)"
    else:
        tokens = list(token_ids)
        unit = "tokens"

    rules: dict[str, dict[str, Any]] = {}
    rules["min_tokens"] = _rule(
        len(tokens) >= min_tokens, f"{len(tokens)} {unit}, at least {min_tokens} required"
    )
    run, value = _longest_run(tokens)
    rules["same_token_run"] = _rule(
        run <= limits.max_same_token_run,
        f"longest run of one token: {run} x {value!r} in {unit} "
        f"({'<=' if run <= limits.max_same_token_run else '>'} {limits.max_same_token_run})",
    )
    digits = max((len(m) for m in _DIGIT_RUNS.findall(text)), default=0)
    rules["digit_run"] = _rule(
        digits <= limits.max_digit_run,
        f"longest digit run {digits} ({'<=' if digits <= limits.max_digit_run else '>'} "
        f"{limits.max_digit_run})",
    )
    run, char = _longest_run(text)
    rules["same_char_run"] = _rule(
        run <= limits.max_same_char_run,
        f"longest run of one character: {run} x {char!r} "
        f"({'<=' if run <= limits.max_same_char_run else '>'} {limits.max_same_char_run})",
    )
    # every whitespace character becomes one space (length kept, so indentation stays visible to
    # the half-non-space exclusion and len / 200 is the completion's own length)
    normalised = _WHITESPACE.sub(" ", text)
    for width, _ in limits.window_limits:
        rules[f"window_repeat_{width}"] = _window_rule(normalised, width, limits)

    lines = [line.rstrip() for line in text.splitlines()]
    run = max((len(list(group)) for key, group in groupby(lines) if key.strip()), default=0)
    rules["identical_lines"] = _rule(
        run <= limits.max_identical_lines,
        f"longest run of one identical non-empty line: {run} "
        f"({'<=' if run <= limits.max_identical_lines else '>'} {limits.max_identical_lines})",
    )

    markers = []
    if "\ufffd" in text:
        markers.append(f"{text.count(chr(0xFFFD))} x U+FFFD replacement character")
    for digit in "05":
        if digit * limits.corruption_run in text:
            markers.append(f"run of {limits.corruption_run} {digit}s")
    doubled = _DOUBLED_TOKEN.search(text)
    if doubled:
        markers.append(f"doubled token {doubled.group(0)!r}")
    rules["corruption_markers"] = _rule(not markers, "; ".join(markers) or "none")

    rules["natural_stop"] = _rule(
        finish_reason == "stop", f"finish_reason {finish_reason!r} ('stop' required)"
    )
    fences = sum(1 for ln in lines if _FENCE.match(ln))
    rules["code_fence"] = _rule(
        fences % 2 == 0,
        f"{fences} code fence line(s)" + (": the last one is never closed" if fences % 2 else ""),
    )
    return ContractResult(rules)


# ---------------------------------------------------------------------------------------------
# Paired quality verdict


@dataclasses.dataclass(frozen=True)
class QualitySummary:
    """Candidate vs baseline on the same tasks. ``reasons`` names every failed rule."""

    ok: bool
    reasons: list[str]
    measurements: dict[str, Any]
    # why the gate cannot decide (no power to show a regression), None where it can
    inconclusive: str | None = None

    @property
    def figure(self) -> str:
        return self.measurements["figure"]


_RECORD_KEYS = ("task_id", "passed", "contract_ok", "natural_stop")


def _records(results: Sequence[Mapping[str, Any]], route: str) -> list[Mapping[str, Any]]:
    if isinstance(results, (str, bytes, Mapping)) or not isinstance(results, Sequence):
        raise TypeError(
            f"{route} results must be a list of per-task records {{{', '.join(_RECORD_KEYS)}}}, "
            f"got {type(results).__name__}"
        )
    for i, record in enumerate(results):
        if not isinstance(record, Mapping):
            raise TypeError(f"{route} result {i} must be a mapping, got {type(record).__name__}")
        missing = [key for key in _RECORD_KEYS if key not in record]
        if missing:
            raise ValueError(
                f"{route} result {i} ({record.get('task_id', '?')}) lacks {missing}; every record "
                f"needs {list(_RECORD_KEYS)}"
            )
        for key in _RECORD_KEYS[1:]:
            if not isinstance(record[key], bool):
                raise TypeError(
                    f"{route} result {i} ({record['task_id']}): {key} must be a bool, "
                    f"got {record[key]!r}"
                )
    return list(results)


COMPLETION_CHARS = 240  # of each completion kept in the report's per-task records


def _task_entry(record: Mapping[str, Any]) -> dict[str, Any]:
    entry = {k: record[k] for k in ("passed", "contract_ok", "natural_stop")}
    for key in ("status", "violations", "finish_reason"):
        if key in record:
            entry[key] = record[key]
    if "completion" in record:
        text, cut = str(record["completion"]), COMPLETION_CHARS
        entry["completion"] = text if len(text) <= cut else \
            f"{text[:cut]}... (+{len(text) - cut} chars)"
    return entry


def summarize_quality(
    baseline_results: Sequence[Mapping[str, Any]],
    candidate_results: Sequence[Mapping[str, Any]],
    policy: Policy,
) -> QualitySummary:
    """The quality verdict (docs/gates.md) from per-task records of both routes (same tasks,
    same order).

    Fails when (1) the one-sided exact McNemar test finds a regression: p <= policy.quality_alpha,
    with b = tasks only the baseline passes and c = tasks only the candidate passes; (2) the
    candidate has more than policy.quality_contract_margin extra output-contract failures; (3) its
    natural-stop rate is lower by more than policy.quality_stop_rate_margin.
    """
    from pytest_dflash.measure.round_statistics import mcnemar_exact, mcnemar_regression

    base = _records(baseline_results, "baseline")
    cand = _records(candidate_results, "candidate")
    if not base:
        raise ValueError("no tasks: the quality gate needs at least one scored task per route")
    if len(base) != len(cand):
        raise ValueError(
            f"baseline scored {len(base)} tasks but candidate {len(cand)}: both routes must run "
            "the same task list"
        )
    for i, (b_rec, c_rec) in enumerate(zip(base, cand, strict=True)):
        if b_rec["task_id"] != c_rec["task_id"]:
            raise ValueError(
                f"task order differs at position {i}: baseline {b_rec['task_id']!r} vs candidate "
                f"{c_rec['task_id']!r}; pass both routes' records in the same task order"
            )
    ids = [rec["task_id"] for rec in base]
    duplicates = sorted({t for t in ids if ids.count(t) > 1}, key=str)
    if duplicates:
        raise ValueError(f"task ids repeat: {duplicates}; each task must be scored once per route")

    n = len(base)
    b = sum(1 for x, y in zip(base, cand, strict=True) if x["passed"] and not y["passed"])
    c = sum(1 for x, y in zip(base, cand, strict=True) if y["passed"] and not x["passed"])
    p_regression = mcnemar_regression(b, c)
    pass_base = sum(rec["passed"] for rec in base) / n
    pass_cand = sum(rec["passed"] for rec in cand) / n
    contract_base = sum(not rec["contract_ok"] for rec in base)
    contract_cand = sum(not rec["contract_ok"] for rec in cand)
    stops_base = sum(rec["natural_stop"] for rec in base)
    stops_cand = sum(rec["natural_stop"] for rec in cand)

    reasons = []
    if p_regression <= policy.quality_alpha:
        reasons.append(
            f"significant pass@1 regression: {b} task(s) pass only on the baseline, {c} only on "
            f"the candidate, one-sided McNemar p={p_regression:.3g} <= alpha "
            f"{policy.quality_alpha}"
        )
    if contract_cand - contract_base > policy.quality_contract_margin:
        reasons.append(
            f"output-contract failures {contract_base} -> {contract_cand} of {n}: more than "
            f"{policy.quality_contract_margin} extra"
        )
    # exact rational comparison: a drop of exactly the margin is allowed
    stop_drop = Fraction(stops_base - stops_cand, n)
    if stop_drop > Fraction(str(policy.quality_stop_rate_margin)):
        reasons.append(
            f"natural-stop rate {stops_base / n:.3f} -> {stops_cand / n:.3f}: drop greater than "
            f"{policy.quality_stop_rate_margin}"
        )

    # Power: the most a candidate could lose is every task the baseline passes (b = those, c =
    # 0). Where even that is not significant, no candidate could be shown worse: an accept
    # would be no evidence, so the gate is inconclusive (pending), never a pass.
    passes = sum(rec["passed"] for rec in base)
    least_p = mcnemar_regression(passes, 0)
    inconclusive = None
    if not reasons and least_p > policy.quality_alpha:
        inconclusive = (
            f"no power: the baseline passes {passes} of {n} tasks, so even a candidate failing "
            f"all of them would reach only McNemar p={least_p:.3g} > alpha "
            f"{policy.quality_alpha}; a model or task set the baseline passes more of can decide"
        )
    figure = f"pass@1 {pass_base:.2f} -> {pass_cand:.2f}, McNemar p={p_regression:.2g}"
    if inconclusive:
        figure += f" (no power: least possible p={least_p:.2g})"
    measurements = {
        "figure": figure,
        "decision": "fail" if reasons else "inconclusive" if inconclusive else "pass",
        "mcnemar_least_p": least_p,
        "tasks": n,
        "pass_at_1_baseline": pass_base,
        "pass_at_1_candidate": pass_cand,
        "discordant_baseline_only": b,
        "discordant_candidate_only": c,
        "mcnemar_p_regression": p_regression,
        "mcnemar_p_two_sided": mcnemar_exact(b, c),
        "contract_failures_baseline": contract_base,
        "contract_failures_candidate": contract_cand,
        "natural_stop_rate_baseline": stops_base / n,
        "natural_stop_rate_candidate": stops_cand / n,
        # per task, both routes: what the outcome grid of `pytest-dflash plot` draws
        # plus, where the records carry them, what a reject is diagnosed from: the sandbox
        # status, the contract violations and the completion (truncated)
        "per_task": [
            {"task_id": x["task_id"], "baseline": _task_entry(x), "candidate": _task_entry(y)}
            for x, y in zip(base, cand, strict=True)
        ],
    }
    return QualitySummary(ok=not reasons, reasons=reasons, measurements=measurements,
                          inconclusive=inconclusive)
