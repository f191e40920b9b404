"""Quality gate of family prefill.geometry (docs/gates.md, "quality").

Both routes complete the same held-out coding tasks (names and constants never seen in training)
with the predeclared decoding (greedy, ``policy.quality_max_new_tokens``, the task stop strings);
every completion runs against its asserts in the sandbox; per-task records feed the paired
verdict (one-sided exact McNemar on discordant tasks, output-contract failures, natural-stop rate)
and go into the report (both routes' pass/fail, sandbox status, contract violations and the two
completions, truncated), so a reject can be diagnosed from the report alone.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sm70


def complete_tasks(engine, tasks: list[dict], policy) -> list[dict]:
    """One greedy completion per task, scored in the sandbox and against the output contract."""
    from dflash_fixtures.tasks import STOP
    from pytest_dflash.engines import Sampling
    from pytest_dflash.quality import check_output_contract
    from pytest_dflash.sandbox import run_untrusted

    records = []
    for task in tasks:
        gen = engine.generate(task["prompt"], policy.quality_max_new_tokens, STOP, Sampling())
        program = f"{task['prompt']}{gen.text}\n\n{task['test']}\n"
        result = run_untrusted(program, timeout_s=policy.sandbox_timeout_s,
                               memory_mb=policy.sandbox_memory_mb)
        contract = check_output_contract(gen.text, gen.token_ids, finish_reason=gen.finish_reason)
        records.append({"task_id": task["task_id"], "passed": bool(result.passed),
                        "contract_ok": bool(contract.ok),
                        "natural_stop": gen.finish_reason == "stop",
                        "status": result.status, "violations": contract.violations,
                        "finish_reason": gen.finish_reason, "completion": gen.text})
    return records


def pass_at_1(records: list[dict]) -> float:
    from pytest_dflash.metrics import load_metric

    metric = load_metric("pass_at_k")
    return metric.compute(task_ids=[r["task_id"] for r in records],
                          passed=[[r["passed"]] for r in records], k=1)["pass@1"]


@pytest.mark.gate("quality", family="prefill.geometry")
def test_quality_heldout_tasks(dflash_gate):
    """No significant pass@1 regression, no extra contract failures, no fewer natural stops."""
    from pytest_dflash.engines.data import coding_tasks
    from pytest_dflash.quality import summarize_quality
    from pytest_dflash.sandbox import SandboxUnavailable, check_permitted

    try:  # before generating: without a jail (and no opt-in) the gate stays pending
        isolation = check_permitted()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    route, policy = dflash_gate.route, dflash_gate.policy
    tasks = coding_tasks(dflash_gate.profile, dflash_gate.data_dir)
    baseline, candidate = dflash_gate.engines()
    base = complete_tasks(baseline, tasks, policy)
    cand = complete_tasks(candidate, tasks, policy)
    dflash_gate.record_engines(baseline, candidate)
    summary = summarize_quality(base, cand, policy)
    failing = {r["task_id"]: r["violations"] for r in cand if not r["contract_ok"]}
    dflash_gate.record(**summary.measurements,
                       pass_at_1_metric_baseline=pass_at_1(base),
                       pass_at_1_metric_candidate=pass_at_1(cand),
                       decoding={"temperature": 0.0, "max_new_tokens":
                                 policy.quality_max_new_tokens},
                       data=str(dflash_gate.data_dir) if dflash_gate.data_dir else "shipped",
                       contract_violations_candidate=failing,
                       sandbox_isolation=list(isolation))
    assert summary.ok, f"{route.name}: " + "; ".join(summary.reasons)
