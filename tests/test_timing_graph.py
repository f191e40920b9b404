"""Graph-timed verification steps on CUDA (docs/gates.md, "validation_cost"): a capturable
pair is captured once and its replays are timed, the eager time beside it; a pair that cannot
be captured is timed eagerly and says why. Runs where CUDA is; skipped elsewhere."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _policy():
    from pytest_dflash.policy.thresholds import Policy

    return Policy()


def test_a_capturable_verify_step_is_timed_as_graph_replays():
    from pytest_dflash.measure.timing import pair_timers
    from pytest_dflash.measure.timing_pool import TimedPair

    dev = torch.device("cuda")
    x = torch.randn(8, 1024, device=dev, dtype=torch.float16)
    w = torch.randn(4096, 1024, device=dev, dtype=torch.float16)
    out = torch.empty(8, 4096, device=dev, dtype=torch.float16)
    launches = {"n": 0}

    def step() -> None:
        launches["n"] += 1  # Python runs only when called eagerly, never in a replay
        torch.matmul(x, w.T, out=out)

    run_round, info = pair_timers(TimedPair(step, step, graph=True), dev, _policy())
    assert info["graph"] == "captured"
    assert info["eager_s"]["candidate"] > 0 and info["eager_s"]["baseline"] > 0
    before = launches["n"]
    times = [t for order in ("cb", "bc") * 3 for t in run_round(order)]
    assert launches["n"] == before  # the timed calls were replays, not Python calls
    assert len(times) == 12 and all(0 < t < 0.1 for t in times)
    expected = x @ w.T
    out.zero_()
    run_round("cb")
    torch.cuda.synchronize()
    assert torch.allclose(out, expected, atol=1e-2, rtol=1e-2)  # the replay did the work


def test_a_step_that_cannot_be_captured_is_timed_eagerly_and_says_so():
    from pytest_dflash.measure.timing import pair_timers
    from pytest_dflash.measure.timing_pool import TimedPair

    dev = torch.device("cuda")
    x = torch.randn(8, 256, device=dev)
    calls = {"n": 0}

    def syncing() -> None:
        calls["n"] += 1
        float((x * 2).sum().item())  # a host sync: not allowed while capturing

    run_round, info = pair_timers(TimedPair(syncing, syncing, graph=True), dev, _policy())
    assert info["graph"].startswith("not captured, timed eagerly: ")
    before = calls["n"]
    assert all(t > 0 for t in run_round("cb"))
    assert calls["n"] == before + 2  # eager: the Python calls of both sides ran
    # the refused capture left the device's random ops usable (the eager timing and the next
    # job of the same worker draw from it)
    assert torch.randn(4, device=dev).isfinite().all()


def test_the_reference_engine_speculative_round_is_captured_and_replays_its_logits():
    """The engine-level validation_cost pair (a speculative round, verify M = 1..8 on a warm
    prefix) is captured as CUDA graphs, as a deployment replays it; a replay writes the logits
    an eager round computes."""
    from dflash_suites.support.engine import speculative_round, verify_drafts
    from pytest_dflash.engines.data import prompt_ids
    from pytest_dflash.engines.reference import build
    from pytest_dflash.measure.timing import pair_timers
    from pytest_dflash.measure.timing_pool import TimedPair

    dev = torch.device("cuda")
    engine = build({"gemm.nvfp4": "gemm.nvfp4.qpn2"}, "quick", dev)
    prompt = prompt_ids(64, engine.encode)
    engine.prefill(prompt)
    drafts = verify_drafts(prompt, 8)
    eager = [t.clone() for t in speculative_round(engine, drafts)()]
    outputs: dict[str, list] = {"candidate": [], "baseline": []}

    def round_of(side: str):
        def round_() -> None:
            got = speculative_round(engine, drafts)()
            if torch.cuda.is_current_stream_capturing():  # replays write these tensors
                outputs[side][:] = got
        return round_

    run_round, info = pair_timers(
        TimedPair(round_of("candidate"), round_of("baseline"), graph=True), dev, _policy())
    assert info["graph"] == "captured", info["graph"]
    with torch.inference_mode():  # the engine's outputs are inference tensors
        for t in outputs["candidate"] + outputs["baseline"]:
            t.zero_()
    assert all(t > 0 for t in run_round("cb"))
    torch.cuda.synchronize()
    for side in ("candidate", "baseline"):
        got = outputs[side]
        assert [tuple(t.shape) for t in got] == [(m, eager[0].shape[1]) for m in range(1, 9)]
        for replayed, want in zip(got, eager, strict=True):
            assert torch.equal(replayed, want)


def test_the_prefill_gate_times_replays_of_each_whole_cold_prefill():
    """The prefill gate's worker pair on CUDA (``cold_prefill_pair``): both routes' cold
    prefills are captured in CUDA graphs, a timed call is one replay, every replay yields the
    eager prefill's first-token hash, and each books one run's route hits."""
    from types import SimpleNamespace

    from dflash_suites.support.engine import cold_prefill_pair
    from pytest_dflash.engines.data import prompt_ids
    from pytest_dflash.engines.factory import EngineFactory
    from pytest_dflash.measure.timing import pair_timers
    from pytest_dflash.routes import shipped
    from pytest_dflash.routes.registry import RouteRegistry

    dev = torch.device("cuda")
    registry = RouteRegistry()
    shipped.pytest_dflash_routes(registry)
    factory = EngineFactory(registry, "quick", "cuda")
    route, base = "prefill.geometry.fp16_q7920", "prefill.geometry.fp32_q3296"

    def engine(*names):
        return factory.engine(registry.engine_selection(names))

    ctx = SimpleNamespace(device=dev, policy=_policy(), engine=engine)
    candidate = engine(route)
    ids = prompt_ids(512, candidate.encode)
    candidate.reset_prefix_cache()
    eager = candidate.prefill(ids)
    pair = cold_prefill_pair(ctx, route=route, baseline=base, ids=ids)
    assert pair.info["graph"].startswith("captured"), pair.info["graph"]
    run_round, info = pair_timers(pair, dev, _policy())
    assert info["graph"].startswith("captured")
    hits_before = candidate.route_hits()[route]
    times = [t for order in ("cb", "bc", "cb") for t in run_round(order)]
    assert all(0 < t < 1 for t in times)
    facts = pair.facts()
    assert facts["candidate"]["runs"] == facts["baseline"]["runs"] == 3
    assert facts["candidate"]["hashes"] == [eager.first_token_hash]
    assert facts["candidate"]["chunks"] == [eager.chunks] == [facts["candidate"]["expected_chunks"]]
    assert candidate.route_hits()[route] - hits_before == 3 * eager.chunks  # booked per replay


def test_a_planted_prefill_slowdown_is_captured_with_the_prefill():
    """The self-test's planted prefill slowdown on CUDA is a spin kernel inside the captured
    prefill, sized from the prefill's own replay (not its eager span, mostly host launches):
    the slowed graph replays the same logits, its spin is the planted fraction of the plain
    prefill's replay, and it runs only in the replays' GPU time."""
    import statistics

    from pytest_dflash.engines.data import prompt_ids
    from pytest_dflash.engines.reference import build
    from pytest_dflash.measure import cuda_graphs
    from pytest_dflash.measure.timing import cuda_timer
    from pytest_dflash.selftest.engine import SlowedPrefillCall

    dev = torch.device("cuda")
    engine = build({}, "quick", dev)
    ids = prompt_ids(512, engine.encode)
    plain = engine.cold_prefill_call(ids)
    slowed = SlowedPrefillCall(engine.cold_prefill_call(ids), 0.5, dev)
    captured = cuda_graphs.capture([plain, slowed], dev, warmup=1)
    plain_s, slowed_s = (statistics.median(cuda_timer(replay, dev) for _ in range(7))
                         for replay in captured.replays)
    assert slowed.spin_s == pytest.approx(0.5 * plain_s, rel=0.3)
    assert slowed_s > plain_s + 0.5 * slowed.spin_s
    hashes = [call.result(out).first_token_hash
              for call, out in zip((plain, slowed), captured.outputs, strict=True)]
    assert hashes[0] == hashes[1]


def test_release_skips_the_collection_when_emptying_the_cache_returns_the_memory():
    """After a worker's turn its pair's buffers go: where emptying the cache gets the process
    back to what it held before the build, ``release(down_to=...)`` runs no full collection
    (tens of milliseconds in every job a worker times, one at a time)."""
    import gc

    from pytest_dflash.measure import cuda_graphs

    cuda_graphs.release("cuda")
    before = cuda_graphs.reserved("cuda")
    x = torch.ones(4096, 4096, device="cuda")  # 64 MiB
    assert cuda_graphs.reserved("cuda") > before
    gc.disable()  # what frees it here is the last reference, not a collection
    try:
        del x
        collections = gc.get_stats()[2]["collections"]
        cuda_graphs.release("cuda", down_to=before)
        assert cuda_graphs.reserved("cuda") <= before
        assert gc.get_stats()[2]["collections"] == collections  # no full collection ran
    finally:
        gc.enable()


def test_release_collects_memory_held_in_a_reference_cycle():
    """A buffer (a graph's pool) in a reference cycle survives emptying the cache: ``release``
    then collects, and the memory comes back all the same."""
    import gc

    from pytest_dflash.measure import cuda_graphs

    cuda_graphs.release("cuda")
    before = cuda_graphs.reserved("cuda")
    gc.disable()
    try:
        cycle = {"buffer": torch.ones(4096, 4096, device="cuda")}
        cycle["self"] = cycle
        del cycle
        torch.cuda.empty_cache()
        assert cuda_graphs.reserved("cuda") > before  # the cycle still holds it
        cuda_graphs.release("cuda", down_to=before)
        assert cuda_graphs.reserved("cuda") <= before
    finally:
        gc.enable()
