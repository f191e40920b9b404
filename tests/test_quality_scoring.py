"""The quality gate's scoring path (suites/test_quality.py): completions scored on a pool
while the engine generates give the very records, in task order, that scoring each at once
gives (the pool is what a GPU run uses; the CPU scores inline)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from dflash_suites.test_quality import complete_tasks
from pytest_dflash.engines.data import coding_tasks
from pytest_dflash.engines.reference import build
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.sandbox.executor import SandboxUnavailable, check_permitted


def test_pooled_scoring_gives_the_inline_records_in_task_order():
    try:
        check_permitted()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    engine = build({}, "quick")
    tasks = coding_tasks("quick")[:3]
    policy = Policy(quality_max_new_tokens=48)
    futures, generation = complete_tasks(engine, tasks, policy, None)
    inline = [f.result() for f in futures]
    assert generation["how"] == "generate_many, up to 32 sequences per decode step"
    assert generation["seconds"] > 0
    with ThreadPoolExecutor(max_workers=2) as pool:
        pooled = [f.result() for f in complete_tasks(engine, tasks, policy, pool)[0]]
    assert [r["task_id"] for r in pooled] == [t["task_id"] for t in tasks]
    assert pooled == inline
    assert all(r["status"] in ("passed", "failed", "timeout", "error") for r in pooled), pooled

