"""pass@k with the unbiased estimator, as an ``evaluate`` metric.

Loaded by absolute path through ``pytest_dflash.metrics.load_metric("pass_at_k")``, never by hub
name: a gate's score must not depend on what a network hub serves today. ``evaluate`` copies this
file into its module cache before importing it, so it imports nothing from this package.

For a task with ``n`` sampled completions of which ``c`` pass, the unbiased estimator of the
chance that at least one of ``k`` draws passes is ``1 - C(n - c, k) / C(n, k)`` (Chen et al.
2021, "Evaluating Large Language Models Trained on Code"). The binomials overflow and lose
precision for large ``n``, so the ratio is computed as the stable product
``prod_{i = n - c + 1}^{n} (1 - k / i)``.
"""

import math

import datasets
import evaluate

_DESCRIPTION = "pass@k: unbiased estimate of the chance that one of k samples per task passes."
_CITATION = """@article{chen2021codex,
  title={Evaluating Large Language Models Trained on Code},
  author={Chen, Mark and others},
  journal={arXiv preprint arXiv:2107.03374},
  year={2021}
}"""
_INPUTS = """
Args:
    task_ids (list of str): one id per task (each once).
    passed (list of list of bool): per task, the outcome of every sampled completion.
    k (int or list of int, default 1): the k values to report.
Returns:
    "pass@<k>" for every k: mean over tasks of the unbiased estimate; "tasks": task count.
Example:
    >>> metric.compute(task_ids=["a", "b"], passed=[[True, False], [False, False]], k=[1, 2])
    {'pass@1': 0.25, 'pass@2': 0.5, 'tasks': 2}
"""


def estimate_pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with ``n`` samples, ``c`` of them passing (needs n >= k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


class PassAtK(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_INPUTS,
            features=datasets.Features(
                {
                    "task_ids": datasets.Value("string"),
                    "passed": datasets.Sequence(datasets.Value("bool")),
                }
            ),
        )

    def _compute(self, task_ids, passed, k=1):
        ks = [k] if isinstance(k, int) else list(k)
        if not ks or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in ks):
            raise ValueError(f"k must be a positive integer or a list of them, got {k!r}")
        if not task_ids:
            raise ValueError("no tasks given: pass task_ids and one list of outcomes per task")
        seen = set()
        for task in task_ids:
            if task in seen:
                raise ValueError(f"task {task!r} appears twice: give each task's samples once")
            seen.add(task)
        result = {}
        for kk in sorted(set(ks)):
            total = 0.0
            for task, outcomes in zip(task_ids, passed, strict=True):
                if len(outcomes) < kk:
                    raise ValueError(
                        f"task {task!r} has {len(outcomes)} sample(s), fewer than k={kk}: "
                        f"pass@{kk} needs at least {kk} samples per task; sample more completions "
                        "or lower k"
                    )
                total += estimate_pass_at_k(len(outcomes), sum(bool(x) for x in outcomes), kk)
            result[f"pass@{kk}"] = total / len(task_ids)
        result["tasks"] = len(task_ids)
        return result
