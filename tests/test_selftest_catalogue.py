"""The self-test's catalogue and its planted defects, checked on the real routes' outputs.

Each planted defect must do exactly what the catalogue says (and nothing the gate could catch
for another reason): the copy is bit-identical to the served route, a scaled output is the
served output times 1 + 2^-9, an unwritten row keeps the poison, and so on. Whether the gates
catch them is the job of ``test_selftest_session.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from pytest_dflash.evidence import catch as summary
from pytest_dflash.native import hits
from pytest_dflash.policy.thresholds import Policy
from pytest_dflash.routes.registry import RouteRegistry
from pytest_dflash.routes.shipped import pytest_dflash_routes as shipped_routes
from pytest_dflash.selftest import catalogue, wrappers
from pytest_dflash.selftest.catalogue import Planted, plan


@pytest.fixture
def registry() -> RouteRegistry:
    reg = RouteRegistry()
    shipped_routes(reg)
    return reg


def _planted(registry: RouteRegistry, route: str, key: str) -> Planted:
    return next(p for p in plan([registry.get(route)], registry, Policy()) if p.key == key)


def test_catalogue_plants_every_gate_kind_of_each_shipped_candidate(registry):
    planned = plan(registry.candidates(), registry, Policy())
    by_route: dict[str, set[str]] = {}
    for p in planned:
        by_route.setdefault(p.original.name, set()).add(p.key)
    slow = {"slow_1pct", "slow_3pct", "slow_10pct"}
    prefill = {"prefill_slow_1pct", "prefill_slow_3pct", "prefill_slow_10pct"}
    assert by_route["attn.d256.fa2"] == {"copy", "out_scaled", "row_unwritten", "gqa_heads",
                                         "paged_block_off", *slow, *prefill}
    # and the family's verify route behind the wrapper, for the planted validation_cost gates
    assert by_route["gemm.nvfp4.qpn2"] == {"copy", "out_scaled", "row_unwritten",
                                           "k_group_dropped", "passthrough"}
    assert by_route["gemm.nvfp4.qpn4_bounded"] == {"copy", "out_scaled", "row_unwritten",
                                                   "k_group_dropped", *slow}
    # the seed's plan for QPN2-packed: no op-level speed, the model-level gates instead
    assert by_route["gemm.nvfp4.qpn2_packed"] == {"copy", "out_scaled", "row_unwritten",
                                                  "k_group_dropped", *prefill, "verify_path",
                                                  "verify_cost_2pct", "ppl_shift", "degenerate",
                                                  "scale_slip"}
    assert by_route["prefill.geometry.fp16_q7920"] == {"copy", *prefill, "ppl_shift",
                                                       "degenerate"}
    for p in planned:
        if p.pass_through:
            assert p.gates == () and not p.engine_level
            continue
        expected = (tuple(k for k in (p.defect.kind, *p.defect.also) if k in p.original.gates)
                    if p.defect else tuple(k for k in p.original.gates if k != "loader"))
        assert p.gates == expected
        # a slowdown relative to the baseline: the served code is the baseline's
        if p.defect and p.defect.kind in ("speed", "prefill"):
            assert p.serves.name == p.original.baseline
        else:
            assert p.serves is p.original
        # the model's predictions moved, so the model-level gates must catch it
        if p.key == "scale_slip":
            assert p.gates == ("ppl", "prefill")
        # engine-level: every planted geometry route and the model-level defects
        assert p.engine_level == (p.original.family == "prefill.geometry" or p.key in (
            *prefill, "ppl_shift", "degenerate"))


def test_slowdown_rungs_follow_the_policy(registry):
    defects = catalogue.catalogue(Policy(speed_min_gain=0.02))
    assert {d.key for d in defects if d.kind == "speed"} == {"slow_2pct", "slow_3pct",
                                                             "slow_10pct"}
    assert {d.key for d in defects if d.kind == "prefill"} == {
        "prefill_slow_2pct", "prefill_slow_3pct", "prefill_slow_10pct"}


def test_planted_routes_are_ordinary_candidates(registry):
    for p in plan(registry.candidates(), registry, Policy()):
        registry.register(wrappers.as_route(p, registry, Policy()))
    registry.validate()
    copy = registry.get("gemm.nvfp4.qpn2_packed~copy")
    assert copy.role == "candidate" and copy.baseline == "gemm.nvfp4.turbomind"
    assert catalogue.original_of(copy.name) == "gemm.nvfp4.qpn2_packed"
    assert catalogue.original_of("gemm.nvfp4.qpn2_packed") is None


# ------------------------------------------------------------------------------ attn.d256

D = 256


def _qkv(tq=9, tk=40, hq=4, hkv=2, dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(tq, hq, D, generator=gen, dtype=dtype),
            torch.randn(tk, hkv, D, generator=gen, dtype=dtype),
            torch.randn(tk, hkv, D, generator=gen, dtype=dtype))


def _attn(registry, key, base="attn.d256.sdpa"):
    """The planted attention route of ``key`` serving the SDPA route (no native build)."""
    p = _planted(registry, "attn.d256.fa2", key)
    p = Planted(p.name, p.original, registry.get(base), p.defect)
    return wrappers.as_route(p, registry, Policy()).implementation()


def _dense(impl, q, k, v):
    out = torch.full_like(q, float("nan"))
    impl.dense(q, k, v, out, D ** -0.5, True)
    return out


def test_the_copy_is_the_route_itself_with_its_hits_booked_per_test(registry):
    """The A/A control: the copy's record names the very same implementation, so its calls
    run no extra code; its hits are the original's, booked as the copy's while the gate test's
    ``hits.attributed`` block is open (outside the timed calls)."""
    q, k, v = _qkv()
    copy = wrappers.as_route(_planted(registry, "attn.d256.fa2", "copy"), registry, Policy())
    original = registry.get("attn.d256.fa2")
    assert copy.impl == original.impl and copy.hit_source == "attn.d256.fa2"
    assert copy.verify_route == original.verify_route
    sdpa = registry.get("attn.d256.sdpa").implementation()  # runs without a native build
    with hits.counting() as outside:
        hits.record("attn.d256.fa2", "dense")
    with hits.attributed(copy.hit_source, copy.name), hits.counting() as inside:
        hits.record("attn.d256.fa2", "dense")
        out = _dense(sdpa, q, k, v)
    assert outside.as_json() == {"attn.d256.fa2/dense": 1}
    assert inside.as_json() == {"attn.d256.fa2~copy/dense": 1, "attn.d256.sdpa/dense": 1}
    assert torch.equal(out, _dense(sdpa, q, k, v))


def test_attention_parity_defects_do_what_the_catalogue_says(registry):
    q, k, v = _qkv()
    good = _dense(registry.get("attn.d256.sdpa").implementation(), q, k, v)
    scaled = _dense(_attn(registry, "out_scaled"), q, k, v)
    assert torch.equal(scaled, (good.double() * (1 + 2**-9)).float())
    unwritten = _dense(_attn(registry, "row_unwritten"), q, k, v)
    assert torch.isnan(unwritten[-1]).all() and torch.equal(unwritten[:-1], good[:-1])
    wrong = _dense(_attn(registry, "gqa_heads"), q, k, v)
    heads = [h % 2 for h in range(4)]  # h % Hkv instead of h // 2
    from dflash_kernels.attention import reference_attention

    expected = reference_attention(q, k[:, heads], v[:, heads], D ** -0.5, True).float()
    assert torch.allclose(wrong, expected, atol=1e-5)
    assert not torch.allclose(wrong, good, atol=1e-3)


def test_paged_block_off_by_one_reads_the_neighbouring_block(registry):
    from dflash_kernels.attention import gather_pages

    q, k, v = _qkv(tk=40)
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(5, 16, 2, D, generator=gen) for _ in range(2))
    table = torch.tensor([3, 0, 4], dtype=torch.int32)
    impl = _attn(registry, "paged_block_off")
    out = torch.full_like(q, float("nan"))
    impl.paged(q, k_cache, v_cache, table, 40, out, D ** -0.5, True)
    shifted = torch.tensor([3, 0, 0], dtype=torch.int32)  # last block 4 -> (4 + 1) % 5
    k2, v2 = gather_pages(k_cache, v_cache, shifted, 40)
    assert torch.equal(out, _dense(registry.get("attn.d256.sdpa").implementation(), q, k2, v2))
    assert torch.equal(table, torch.tensor([3, 0, 4], dtype=torch.int32)), "caller's table kept"


# ------------------------------------------------------------------------------ gemm.nvfp4

def _gemm(registry, key, route="gemm.nvfp4.qpn2_packed"):
    return wrappers.as_route(_planted(registry, route, key), registry, Policy()).implementation()


def _weight(n=64, k=128):
    from dflash_kernels.nvfp4 import quantize

    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05)


def test_gemm_parity_defects_do_what_the_catalogue_says(registry):
    w = _weight()
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2))
    qpn2 = registry.get("gemm.nvfp4.qpn2").implementation()
    good = qpn2.linear(x, qpn2.prepare(w))
    for key, check in {
        "copy": lambda y: torch.equal(y, good),
        "out_scaled": lambda y: torch.equal(y, (good.double() * (1 + 2**-9)).float()),
        "row_unwritten": lambda y: torch.isnan(y[-1]).all() and torch.equal(y[:-1], good[:-1]),
    }.items():
        impl = _gemm(registry, key, "gemm.nvfp4.qpn2")
        # the copy's hits are booked per gate test (as the gate fixture does), not per call
        with hits.attributed("gemm.nvfp4.qpn2", "gemm.nvfp4.qpn2~copy"), \
                hits.counting() as delta:
            y = impl.linear(x, impl.prepare(w))
        assert check(y), key
        assert delta.route(f"gemm.nvfp4.qpn2~{key}") == 1 and delta.route("gemm.nvfp4.qpn2") == 0
    dropped = _gemm(registry, "k_group_dropped", "gemm.nvfp4.qpn2")
    x0 = x.clone()
    x0[:, -16:] = 0
    assert torch.equal(dropped.linear(x, dropped.prepare(w)), qpn2.linear(x0, qpn2.prepare(w)))


def test_verify_path_defect_sends_verify_widths_to_the_baseline_path(registry):
    w = _weight()
    impl = _gemm(registry, "verify_path")
    prepared = impl.prepare(w)
    for m, expect in ((8, "gemm.nvfp4.turbomind"), (40, "gemm.nvfp4.qpn4_bounded")):
        x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m))
        with hits.counting() as delta:
            impl.gate_up(x, prepared)
        assert delta.route(expect) >= 1, (m, delta.as_json())
        assert delta.route("gemm.nvfp4.qpn2") == 0, (m, delta.as_json())


def test_scale_slip_passes_the_parity_cases_and_moves_the_models_predictions(registry):
    """The planted scale slip is the defect op-level parity cannot see: no parity case of any
    profile has the slipped weight's shape, and the real parity rule passes the planted route
    on the quick profile's cases; in the reference model it is layer 0's down projection, and
    the next-token distribution moves."""
    from dflash_suites.support.gemm import (
        ODD_SHAPE,
        TARGET_LAYERS,
        large_m,
        layer_shape,
        make_weight,
        make_x,
        parity_case,
    )
    from pytest_dflash.engines import reference
    from pytest_dflash.routes.vocabulary import PROFILES

    parity_shapes = {(n, k) for profile in PROFILES for layer in TARGET_LAYERS
                     for k, n in [layer_shape(layer, profile)]} | {ODD_SHAPE[::-1]}
    assert catalogue.SLIP_SHAPE not in parity_shapes
    name = "gemm.nvfp4.qpn2_packed~scale_slip"
    impl = _gemm(registry, "scale_slip")
    oracle = registry.get("gemm.nvfp4.oracle").implementation()
    base = registry.get("gemm.nvfp4.turbomind").implementation()
    for layer in TARGET_LAYERS:
        k, n = layer_shape(layer, "quick")
        w = make_weight(n, k, seed=3, device=torch.device("cpu"))
        x = make_x(large_m("quick"), k, seed=4, dtype=torch.float32, device=torch.device("cpu"))
        result = parity_case(name, impl, oracle, base, w, x, gated=layer == "gate_up",
                             policy=Policy(), label=layer)
        assert result.ok, result
    for p in plan([registry.get("gemm.nvfp4.qpn2_packed")], registry, Policy()):
        registry.register(wrappers.as_route(p, registry, Policy()))
    registry.validate()
    with hits.counting() as delta:
        slipped = reference.build({"gemm.nvfp4": name}, "quick", registry=registry)
    assert delta.as_json() == {f"{name}/scale_slip": 1}  # one weight of the whole model
    clean = reference.build({"gemm.nvfp4": "gemm.nvfp4.qpn2_packed"}, "quick",
                            registry=registry)
    ids = [256, *clean.encode("def add(a, b):\n    return a + b\n")]
    moved = max(abs(a - b) for a, b in zip(slipped.score(ids), clean.score(ids), strict=True))
    assert moved > 0.05  # nats of some token's log-probability


# ---------------------------------------------------------------- validation_cost: both sides

@pytest.fixture
def declared() -> RouteRegistry:
    """The shipped routes with their family declarations (gemm.nvfp4's verify route)."""
    from pytest_dflash.routes.shipped import pytest_dflash_routes

    reg = RouteRegistry()
    pytest_dflash_routes(reg)
    return reg


def _install(registry: RouteRegistry, route: str = "gemm.nvfp4.qpn2_packed") -> list[Planted]:
    planted = plan([registry.get(route)], registry, Policy())
    for p in planted:
        registry.register(wrappers.as_route(p, registry, Policy()))
    registry.validate()
    return planted


def _gate(registry: RouteRegistry, name: str):
    from pytest_dflash.measure.gate import GateContext

    return GateContext(route=registry.get(name), kind="validation_cost", registry=registry,
                       policy=Policy(), profile="quick", device=torch.device("cpu"),
                       record=lambda **_: None, engine=lambda selection: dict(selection))


def _python_calls(step) -> list[tuple[str, str]]:
    """The Python functions one call of ``step`` runs, in order (file, function): the host
    path a timed call pays, compared without a clock."""
    import os
    import sys

    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            calls.append((os.path.basename(code.co_filename), code.co_name))

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def test_validation_cost_compares_planted_routes_with_the_verify_route_wrapped_alike(declared):
    """The asymmetry this guards against: a planted route (Python wrapper) timed against the
    bare verify route pays the wrapper's per-call cost alone, and at the quick size that cost
    read as a 1.15-1.28x regression of the unchanged copy. Both sides must run the same host
    path, differ only by the planted defect, and keep the verify route's hits."""
    from dflash_suites.support import check_same_kernels
    from dflash_suites.support.gemm import _verify_step, make_x, shares_resident_weights

    planted = _install(declared)
    through = [p.name for p in planted if p.pass_through]
    assert through == ["gemm.nvfp4.qpn2~passthrough"]  # one per verify route, never judged
    helper = declared.get(through[0])
    assert (helper.role, helper.gates) == ("baseline", ())  # a comparator: no verdict, no report
    assert through[0] not in {r.name for r in declared.candidates()}
    sides = {}
    for p in planted:
        if "validation_cost" not in p.gates:
            assert declared.get(p.name).verify_route is None
            continue
        gate = _gate(declared, p.name)
        verify = gate.verify_route.implementation()
        if p.key == "copy":  # the A/A control meets what the route itself meets, bare
            assert gate.verify_route.name == "gemm.nvfp4.qpn2", p.name
            sides[p.key] = gate.impl, verify
            continue
        assert type(verify) is type(gate.impl), p.name  # the same wrapper on both sides
        assert (verify.planted.serves.name, verify.defect, verify.slowdown.fraction) == (
            "gemm.nvfp4.qpn2", None, 0.0)
        sides[p.key] = gate.impl, verify
    assert set(sides) == {"copy", "verify_path", "verify_cost_2pct"}
    # the route itself still meets the family's verify route, bare
    assert _gate(declared, "gemm.nvfp4.qpn2_packed").verify_route.name == "gemm.nvfp4.qpn2"

    copy, bare_verify = sides["copy"]
    original = _gate(declared, "gemm.nvfp4.qpn2_packed").impl
    assert copy is original  # the same object: not a wrapper
    # the copy keeps its served route's resident form: one weight copy, as the route's own gate
    assert shares_resident_weights(copy, bare_verify)
    verify = sides["verify_path"][1]
    assert not shares_resident_weights(*sides["verify_path"])
    weights = (verify.prepare(_weight(256, 128)), verify.prepare(_weight(128, 128)))
    x = make_x(3, 128, seed=3, dtype=torch.float32, device=torch.device("cpu"))
    bare = declared.get("gemm.nvfp4.qpn2").implementation()
    slowed = sides["verify_cost_2pct"][0]
    through = sides["verify_cost_2pct"][1]
    on, direct, slow, off = (_verify_step(impl, x, *weights)
                             for impl in (copy, bare, slowed, through))
    for step in (on, direct, slow, off):
        step()  # first calls build each route's op arguments
    # the copy's timed path is the route's own, call for call
    assert _python_calls(on) == _python_calls(_verify_step(original, x, *weights))
    # the planted slowdown differs from its comparison by the wait alone, not by bookkeeping
    assert _python_calls(slow) == _python_calls(off)
    assert len(_python_calls(direct)) < len(_python_calls(off))  # what the wrapper costs
    with hits.attributed("gemm.nvfp4.qpn2_packed", "gemm.nvfp4.qpn2_packed~copy"):
        with hits.counting() as enabled:
            on()
        with hits.counting() as disabled:
            _verify_step(bare, x, *weights)()
    assert disabled.as_json() == {"gemm.nvfp4.qpn2/small_m": 2}  # the verify route's own hits
    check_same_kernels("gemm.nvfp4.qpn2_packed~copy", enabled, disabled, "copy")
    wrong, _ = sides["verify_path"]
    with hits.counting() as other:
        _verify_step(wrong, x, *(wrong.prepare(_weight(256, 128)),
                                 wrong.prepare(_weight(128, 128))))()
    with pytest.raises(AssertionError, match="route hits differ"):
        check_same_kernels(wrong.name, other, disabled, "verify_path")


# ------------------------------------------------------------------------------ engine

@pytest.fixture(scope="module")
def inner_engine():
    from pytest_dflash.engines import reference

    return reference.build({}, "quick")


def _engine(registry, inner, key, policy=None):
    from pytest_dflash.selftest.engine import EngineSelftest

    policy = policy or Policy()
    p = next(p for p in plan([registry.get("prefill.geometry.fp16_q7920")], registry, policy)
             if p.key == key)
    return EngineSelftest(inner, p, {"prefill.geometry": p.name}, policy)


def test_ppl_shift_raises_each_segment_perplexity_by_twice_the_tolerance(registry, inner_engine):
    ids = [256, *inner_engine.encode("def add(a, b):\n    return a + b\n")]
    policy = Policy()
    base = inner_engine.score(ids)
    shifted = _engine(registry, inner_engine, "ppl_shift", policy).score(ids)

    def ppl(lps):
        return math.exp(-math.fsum(lps) / len(lps))

    assert ppl(shifted) / ppl(base) - 1 == pytest.approx(2 * policy.ppl_rel_tolerance, rel=1e-9)


def test_a_planted_engine_offers_a_capturable_prefill_only_where_its_engine_has_one(
        registry, inner_engine):
    """The prefill gate captures ``cold_prefill_call`` on CUDA: a planted slowdown's engine
    hands out the inner call with the spin planted after it, a copy the inner call itself, and
    over an engine without one (the transformers engine) the wrapper has none either, so the
    gate times that pair eagerly instead of failing to build it."""
    from pytest_dflash.engines.reference import ColdPrefillCall
    from pytest_dflash.selftest.engine import SlowedPrefillCall

    ids = inner_engine.encode("def f(x):\n    return x\n", add_special_tokens=True)
    assert isinstance(_engine(registry, inner_engine, "copy").cold_prefill_call(ids),
                      ColdPrefillCall)
    slow = _engine(registry, inner_engine, "prefill_slow_3pct")
    slowed = slow.cold_prefill_call(ids)
    assert isinstance(slowed, SlowedPrefillCall) and slowed.fraction == pytest.approx(0.03)
    assert isinstance(slowed.inner, ColdPrefillCall) and slowed.chunks == slowed.inner.chunks
    pytest.importorskip("transformers")
    from pytest_dflash.engines import transformers as hf

    plain = hf.build(hf.llama_model_dir(), {}, "quick")
    assert not hasattr(plain, "cold_prefill_call")
    assert not hasattr(_engine(registry, plain, "prefill_slow_3pct"), "cold_prefill_call")


def test_every_fourth_completion_degenerates(registry, inner_engine):
    from pytest_dflash.metrics.quality import check_output_contract

    eng = _engine(registry, inner_engine, "degenerate")
    gens = [eng.generate("def f(x):\n", 1, ["\n\n"]) for _ in range(5)]
    runs = [i for i, g in enumerate(gens)
            if not check_output_contract(g.text, g.token_ids, finish_reason=g.finish_reason)
            .rules["same_token_run"]["ok"]]
    assert runs == [0, 4]
    assert gens[0].finish_reason == "length" and gens[0].text.startswith(gens[1].text[:1])


def test_engine_hits_carry_the_planted_name(registry, inner_engine):
    eng = _engine(registry, inner_engine, "prefill_slow_3pct")
    before = eng.route_hits().get("prefill.geometry.fp16_q7920~prefill_slow_3pct", 0)
    eng.reset_prefix_cache()
    eng.prefill([256, 1, 2, 3])
    assert eng.route_hits()["prefill.geometry.fp16_q7920~prefill_slow_3pct"] > before
    assert "prefill.geometry.fp32_q3296" not in eng.route_hits()


# ------------------------------------------------------------------------------ summary

def _test(status, **measurements):
    return {"nodeid": "x", "outcome": status, "measurements": measurements}


def _report(gates_by_route, policy=None):
    routes = {}
    for name, (required, tests) in gates_by_route.items():
        routes[name] = {"required": required, "gates": {
            kind: {"status": summary_status(t), "figure": "", "tests": t}
            for kind, t in zip(required, tests, strict=True)}}
        original, sep, key = name.partition("~")
        if sep:  # a planted route, marked as the self-test marks it
            slowdown = (float(key.removeprefix("slow_").removesuffix("pct")) / 100
                        if key.startswith("slow_") else None)
            routes[name]["planted"] = {"from": original, "defect": key, "what": "",
                                       "slowdown": slowdown}
    return {"routes": routes, "policy": policy or Policy().as_dict()}


def summary_status(tests):
    from pytest_dflash.evidence.verdict import gate_status

    return gate_status(tests)


def _timing(lo, processes, threshold=0.99, rule="gain"):
    """A timing record as the worker-process protocol writes it (``ProcessResult``), its
    interval computed across ``processes`` workers of four rounds each."""
    from pytest_dflash.measure.process_statistics import ProcessResult, ProcessSample

    ratio = lo + 0.01
    timed = [ProcessSample(worker=i, pid=1000 + i, candidate_s=[ratio * 1e-3] * 4,
                           baseline_s=[1e-3] * 4, orders=["cb", "bc"] * 2)
             for i in range(processes)]
    return ProcessResult(processes=timed, ratio=ratio, ci_low=lo, ci_high=lo + 0.02,
                         decision="fail", outcome="slower", rule=rule, threshold=threshold,
                         confidence=0.95, looks=[processes],
                         rounds_per_process=[4]).measurements()


def test_min_rounds_of_a_distribution_free_median_interval():
    assert summary.min_rounds(0.95) == 6
    assert summary.min_rounds(0.99) == 8


def test_summary_counts_catches_misses_and_resolution():
    report = _report({
        "r": (["speed"], [[_test("passed")]]),
        "r~copy": (["speed"], [[_test("passed")]]),
        "r~slow_1pct": (["speed"], [[_test("failed", **_timing(0.985, 18))]]),  # fail closed
        "r~slow_3pct": (["speed"], [[_test("failed", **_timing(1.01, 6))]]),  # resolved
        "r~slow_10pct": (["speed"], [[_test("passed")]]),  # missed
        "p~copy": (["parity"], [[_test("passed")]]),
        "p~out_scaled": (["parity"], [[_test("error")]]),
    })
    section = summary.summarize(report)["routes"]
    speed = section["r"]["speed"]
    assert speed["caught"] == 2 and speed["planted"] == 3 and speed["missed"] == ["slow_10pct"]
    assert speed["resolution"] == 0.03 and not speed["resolves_policy"]
    assert speed["copy_agrees"] and not speed["evidence"]
    assert section["p"]["parity"]["errors"] == ["out_scaled"]
    assert section["p"]["parity"]["evidence"]  # an error is not a miss, but it is reported
    marks = summary.marks({"routes": section})
    assert list(marks) == [("r", "speed")]
    text = "\n".join(summary.render({"routes": section}))
    assert "cannot resolve the policy's 1% here" in text and "MISSED: slow_10pct" in text


def test_too_few_processes_never_resolve():
    """Two processes of 4 rounds each are 8 rounds but 2 independent units: not enough."""
    report = _report({"r~slow_10pct": (["speed"], [[_test("failed", **_timing(1.2, 2))]])})
    gate = summary.summarize(report)["routes"]["r"]["speed"]
    assert gate["caught"] == 1 and gate["resolution"] is None


def test_a_slowdown_of_zero_runs_the_call_once_and_bad_fractions_are_refused():
    """The zero slowdown is what unslowed planted routes run through (the same host path as a
    slowed one); a negative or absurd fraction is a usage error, not a silent no-op."""
    from pytest_dflash.selftest.slowdown import Slowdown, wait_overhead_s

    calls = []
    assert Slowdown(0.0).run(lambda: calls.append(1) or "y", device="cpu", signature=()) == "y"
    assert calls == [1]
    for bad in (-0.01, 10.0):
        with pytest.raises(ValueError, match=r"fraction in \[0, 10\)"):
            Slowdown(bad)
    overhead = wait_overhead_s()
    assert 0.0 <= overhead == wait_overhead_s()  # measured once per process
    slowed = Slowdown(0.02)
    # measured at the first slowed call, not when routes are built (workers start side by side)
    assert slowed._overhead_s is None and Slowdown(0.0)._overhead_s == 0.0
    assert slowed.run(lambda: "z", device="cpu", signature=()) == "z"
    assert slowed._overhead_s == overhead
