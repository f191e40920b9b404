"""The output contract (docs/gates.md), rule by rule at each boundary, and the paired quality
verdict."""

from __future__ import annotations

import math
import random
import string

import pytest

from pytest_dflash.metrics.quality import RULES, check_output_contract, summarize_quality
from pytest_dflash.policy.thresholds import Policy

CLEAN = 'def add(a, b):\n    """Sum."""\n    return a + b\n'
IDS = (11, 12, 13)  # explicit token ids keep the token rules out of text-only cases


def violations(text: str, token_ids=IDS, finish_reason: str = "stop", **kw) -> list[str]:
    return check_output_contract(text, token_ids, finish_reason=finish_reason, **kw).violations


def unique_letters(n: int, seed: int) -> str:
    """A letter string whose 20-char windows never repeat (checked), as neutral filler."""
    text = "".join(random.Random(seed).choices(string.ascii_letters, k=n))
    windows = [text[i : i + 20] for i in range(n - 19)]
    assert len(set(windows)) == len(windows)
    return text


def test_clean_completion_passes_every_rule():
    result = check_output_contract(CLEAN, None, finish_reason="stop")
    assert result.ok and result.violations == []
    assert list(result.rules) == list(RULES)
    assert all(rule["ok"] and rule["detail"] for rule in result.rules.values())
    assert result.message() == "output contract: all rules hold"


def test_min_tokens():
    assert violations("abc", [1, 2, 3], min_tokens=3) == []
    assert violations("abc", [1, 2, 3], min_tokens=4) == ["min_tokens"]
    assert violations("", [], min_tokens=1) == ["min_tokens"]


def test_same_token_run_boundary():
    assert violations("x", [1, 2, *[7] * 48, 3]) == []
    result = check_output_contract("x", [1, 2, *[7] * 49, 3], finish_reason="stop")
    assert result.violations == ["same_token_run"]
    assert "49 x 7" in result.rules["same_token_run"]["detail"]


def test_same_token_run_counts_bytes_without_token_ids():
    assert violations("=" * 48, None) == []
    result = check_output_contract("=" * 49, None, finish_reason="stop")
    assert result.violations == ["same_token_run"]
    assert "bytes (no token ids given)" in result.rules["same_token_run"]["detail"]


def test_digit_run_boundary():
    digits = "1234567890" * 8
    assert violations(f"x = {digits}\n") == []
    assert violations(f"x = {digits}1\n") == ["digit_run"]


def test_same_char_run_boundary():
    assert violations("#" + "-" * 120 + "\n") == []
    assert violations("#" + "-" * 121 + "\n") == ["same_char_run"]
    assert violations("x" + " " * 121 + "y") == ["same_char_run"]  # raw text: spaces count


def test_window_20_boundary():
    unit = string.ascii_letters[:20]
    assert violations(unit * 80) == []
    result = check_output_contract(unit * 81, IDS, finish_reason="stop")
    assert result.violations == ["window_repeat_20"]
    assert "occurs 81 times > 80" in result.rules["window_repeat_20"]["detail"]


def test_window_20_limit_grows_with_length():
    unit = string.ascii_letters[:20]
    filler = unique_letters(17_000, seed=1)
    text = unit * 90 + filler  # len 18_800 -> limit 94
    assert len(text) / 200 == pytest.approx(94.0)
    assert violations(text) == []
    assert violations(unit * 95 + filler) == ["window_repeat_20"]  # len 18_900: 95 > 94.5
    assert violations(unit * 90) == ["window_repeat_20"]  # without the filler: 90 > 80


def test_window_less_than_half_non_space_is_ignored():
    assert violations(("x" * 9 + " " * 11) * 81) == []
    assert violations(("x" * 10 + " " * 10) * 81) == ["window_repeat_20"]


def test_window_whitespace_is_normalised():
    # a tab or newline in place of a space is the same window
    base = "ab cd ef gh ij kl mn"  # 20 chars
    variants = [base, base.replace(" ", "\t"), base.replace(" ", "\n")]
    text = "".join(variants[i % 3] for i in range(81))
    result = check_output_contract(text, IDS, finish_reason="stop")
    assert "window_repeat_20" in result.violations


def test_window_50_boundary():
    unit = string.ascii_letters[:50]
    assert violations(unit * 40) == []
    assert violations(unit * 41) == ["window_repeat_50"]


def test_window_100_boundary():
    unit = unique_letters(100, seed=2)
    assert violations(unit * 20) == []
    assert violations(unit * 21) == ["window_repeat_100"]


def test_identical_lines_boundary():
    assert violations("print(1)\n" * 12) == []
    assert violations("print(1)\n" * 13) == ["identical_lines"]
    assert violations("print(1)  \n" * 6 + "print(1)\n" * 7) == ["identical_lines"]
    assert violations("x = 1\n\n" * 20) == []  # a blank line ends the run


@pytest.mark.parametrize(
    ("text", "broken"),
    [
        ("name = 'caf\ufffd'\n", True),
        ("n = " + "0" * 19 + "\n", False),
        ("n = " + "0" * 20 + "\n", True),
        ("n = " + "5" * 19 + "\n", False),
        ("n = " + "5" * 20 + "\n", True),
        ("encoding = 'UTF-UTF-8'\n", True),
        ("encoding = 'UTF-8'\n", False),
        ("x = a-b - a\n", False),
    ],
)
def test_corruption_markers(text, broken):
    assert violations(text) == (["corruption_markers"] if broken else [])


def test_natural_stop():
    assert violations(CLEAN, finish_reason="stop") == []
    assert violations(CLEAN, finish_reason="length") == ["natural_stop"]


def test_code_fence():
    assert violations("```python\nx = 1\n```\n") == []
    result = check_output_contract("```python\nx = 1\n", IDS, finish_reason="stop")
    assert result.violations == ["code_fence"]
    assert "never closed" in result.message()


def test_bad_arguments_are_clear_errors():
    with pytest.raises(TypeError, match="finish_reason must be"):
        check_output_contract(CLEAN, None, finish_reason=None)
    with pytest.raises(TypeError, match="text must be the decoded completion"):
        check_output_contract(b"bytes", None, finish_reason="stop")
    with pytest.raises(ValueError, match="min_tokens must be"):
        check_output_contract(CLEAN, None, finish_reason="stop", min_tokens=-1)


# --- paired quality verdict ------------------------------------------------------------------


def records(passed, contract_ok=None, natural_stop=None):
    n = len(passed)
    contract_ok = contract_ok if contract_ok is not None else [True] * n
    natural_stop = natural_stop if natural_stop is not None else [True] * n
    return [
        {"task_id": f"t{i}", "passed": p, "contract_ok": c, "natural_stop": s}
        for i, (p, c, s) in enumerate(zip(passed, contract_ok, natural_stop, strict=True))
    ]


def one_sided_p(b: int, c: int) -> float:
    n = b + c
    return sum(math.comb(n, i) for i in range(b, n + 1)) / 2**n if n else 1.0


def test_identical_routes_pass():
    runs = records([True, False] * 5)
    summary = summarize_quality(runs, runs, Policy())
    assert summary.ok and summary.reasons == []
    assert summary.measurements["mcnemar_p_regression"] == 1.0
    assert summary.figure == "pass@1 0.50 -> 0.50, McNemar p=1"


def test_figure_and_discordant_counts():
    # 50 tasks: baseline passes 31, candidate 30; 3 only-baseline, 2 only-candidate
    base = [True] * 31 + [False] * 19
    cand = [False] * 3 + [True] * 28 + [True] * 2 + [False] * 17
    summary = summarize_quality(records(base), records(cand), Policy())
    m = summary.measurements
    assert (m["discordant_baseline_only"], m["discordant_candidate_only"]) == (3, 2)
    assert m["mcnemar_p_regression"] == pytest.approx(one_sided_p(3, 2))
    assert summary.figure == "pass@1 0.62 -> 0.60, McNemar p=0.5"
    assert summary.ok


@pytest.mark.parametrize(("b", "ok"), [(4, True), (5, False)])
def test_significant_regression_fails(b, ok):
    # b tasks pass only on the baseline, none only on the candidate: p = 2**-b
    base = [True] * 10
    cand = [False] * b + [True] * (10 - b)
    summary = summarize_quality(records(base), records(cand), Policy())
    assert summary.measurements["mcnemar_p_regression"] == pytest.approx(one_sided_p(b, 0))
    assert summary.ok is ok
    if not ok:
        assert "McNemar p=0.0312 <= alpha 0.05" in summary.reasons[0]


def test_improvement_never_fails():
    summary = summarize_quality(records([False] * 10), records([True] * 10), Policy())
    assert summary.ok


def test_contract_failures_beyond_margin_fail():
    passed = [True] * 10
    base = records(passed, contract_ok=[True] * 9 + [False])
    same = records(passed, contract_ok=[False] + [True] * 9)
    worse = records(passed, contract_ok=[False, False] + [True] * 8)
    assert summarize_quality(base, same, Policy()).ok
    summary = summarize_quality(base, worse, Policy())
    assert not summary.ok and "output-contract failures 1 -> 2" in summary.reasons[0]
    assert summarize_quality(base, worse, Policy(quality_contract_margin=1)).ok


def test_natural_stop_rate_drop_beyond_margin_fails():
    passed = [True] * 20
    base = records(passed, natural_stop=[True] * 20)
    drop_one = records(passed, natural_stop=[False] + [True] * 19)  # 0.05: equal to the margin
    drop_two = records(passed, natural_stop=[False] * 2 + [True] * 18)
    assert summarize_quality(base, drop_one, Policy()).ok
    summary = summarize_quality(base, drop_two, Policy())
    assert not summary.ok and "natural-stop rate 1.000 -> 0.900" in summary.reasons[0]


def test_mismatched_inputs_are_clear_errors():
    runs = records([True, False])
    with pytest.raises(ValueError, match="same task list"):
        summarize_quality(runs, runs[:1], Policy())
    with pytest.raises(ValueError, match="task order differs at position 0"):
        summarize_quality(runs, list(reversed(runs)), Policy())
    with pytest.raises(ValueError, match="no tasks"):
        summarize_quality([], [], Policy())
    with pytest.raises(ValueError, match="lacks \\['natural_stop'\\]"):
        summarize_quality([{"task_id": "a", "passed": True, "contract_ok": True}], runs, Policy())
    bad = [{**runs[0], "passed": 1}, runs[1]]
    with pytest.raises(TypeError, match="passed must be a bool"):
        summarize_quality(bad, runs, Policy())
    dup = [runs[0], {**runs[1], "task_id": "t0"}]
    with pytest.raises(ValueError, match="task ids repeat"):
        summarize_quality(dup, dup, Policy())


@pytest.mark.parametrize(("passes", "decides"), [(0, False), (4, False), (5, True)])
def test_a_baseline_passing_too_few_tasks_leaves_the_gate_without_power(passes, decides):
    """Even a candidate failing every task the baseline passes reaches only p = 0.5**passes:
    over alpha (0.05) for 4 or fewer, so no candidate could be shown worse: inconclusive."""
    base = [True] * passes + [False] * (20 - passes)
    summary = summarize_quality(records(base), records(base), Policy())
    m = summary.measurements
    assert m["mcnemar_least_p"] == pytest.approx(0.5**passes)
    assert summary.ok  # nothing failed ...
    if decides:
        assert summary.inconclusive is None and m["decision"] == "pass"
    else:  # ... but an accept would be no evidence
        assert m["decision"] == "inconclusive"
        assert f"the baseline passes {passes} of 20 tasks" in summary.inconclusive
        assert "no power" in summary.figure


def test_a_contract_failure_still_fails_a_gate_without_power():
    base = records([False] * 10)
    cand = [dict(r) for r in base]
    cand[0]["contract_ok"] = False
    summary = summarize_quality(base, cand, Policy())
    assert not summary.ok and summary.inconclusive is None
    assert summary.measurements["decision"] == "fail"
