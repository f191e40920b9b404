"""Graph-timed verification steps on CUDA (docs/gates.md, "validation_cost"): a capturable
pair is captured once and its replays are timed, the eager time beside it; a pair that cannot
be captured is timed eagerly and says why. Runs where CUDA is; skipped elsewhere."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _policy():
    from pytest_dflash.session.policy import Policy

    return Policy()


def test_a_capturable_verify_step_is_timed_as_graph_replays():
    from pytest_dflash.measure.timing import pair_timers
    from pytest_dflash.measure.workers import TimedPair

    dev = torch.device("cuda")
    x = torch.randn(8, 1024, device=dev, dtype=torch.float16)
    w = torch.randn(4096, 1024, device=dev, dtype=torch.float16)
    out = torch.empty(8, 4096, device=dev, dtype=torch.float16)
    launches = {"n": 0}

    def step() -> None:
        launches["n"] += 1  # Python runs only when called eagerly, never in a replay
        torch.matmul(x, w.T, out=out)

    run_c, run_b, info = pair_timers(TimedPair(step, step, graph=True), dev, _policy())
    assert info["graph"] == "captured"
    assert info["eager_s"]["candidate"] > 0 and info["eager_s"]["baseline"] > 0
    before = launches["n"]
    times = [run_c() for _ in range(5)] + [run_b() for _ in range(5)]
    assert launches["n"] == before  # the timed calls were replays, not Python calls
    assert all(0 < t < 0.1 for t in times)
    expected = x @ w.T
    out.zero_()
    run_c()
    torch.cuda.synchronize()
    assert torch.allclose(out, expected, atol=1e-2, rtol=1e-2)  # the replay did the work


def test_a_step_that_cannot_be_captured_is_timed_eagerly_and_says_so():
    from pytest_dflash.measure.timing import pair_timers
    from pytest_dflash.measure.workers import TimedPair

    dev = torch.device("cuda")
    x = torch.randn(8, 256, device=dev)
    calls = {"n": 0}

    def syncing() -> None:
        calls["n"] += 1
        float((x * 2).sum().item())  # a host sync: not allowed while capturing

    run_c, _, info = pair_timers(TimedPair(syncing, syncing, graph=True), dev, _policy())
    assert info["graph"].startswith("not captured, timed eagerly: ")
    before = calls["n"]
    assert run_c() > 0
    assert calls["n"] == before + 1  # eager: the Python call ran
