"""The seam gates of prefill.geometry: the ppl gate's long contexts (perplexity per position
band) and the speed gate's cold-prefill agreement check catch what a geometry route gets wrong
at a chunk seam, with the real reference engine, while a correct route passes both.

| route | what it does wrong | caught by |
|---|---|---|
| prefill.geometry.fp32_q6592 (shipped) | nothing | passes both |
| seam_zeroed | SSM and conv state zeroed at every seam | ppl long contexts, agreement |
| bf16_q7920 | SSM state carried in bf16 | agreement |
| fp8_q7920 | SSM state carried in fp8 (e4m3) | agreement |
| last_kv_dropped | the last prefill chunk's paged KV zeroed | agreement (verify rows) |

The defects are ``pytest_dflash.selftest.seam_defects``; the gates are the shipped suites. The
agreement check runs inside the cold-prefill speed test, before its timing; only the agreement
is asserted here (a unit test never asserts a timing outcome), and two timing rounds keep the
correct route's test short.
"""

from __future__ import annotations

import json

import pytest
import timing_sizes

from pytest_dflash.metrics.seam_bands import (
    agreement_positions,
    band_perplexities,
    bands,
    seams,
)

# imported once here: pytester's in-process runs drop modules they import, and datasets
# cannot be imported twice in one process (pyarrow extension types are registered globally)
pytest.importorskip("datasets")


def test_seams_and_bands_cover_every_seam_and_the_tail() -> None:
    assert seams(1000, 300) == [300, 600, 900]
    assert seams(900, 300) == [300, 600]  # a prompt ending on a chunk boundary: no seam there
    cuts = bands(1000, 300, 50)
    assert [(b.label, b.start, b.end) for b in cuts] == [
        ("before seam 1", 0, 300),
        ("after seam 1 (@300)", 300, 350),
        ("after seam 2 (@600)", 600, 650),
        ("after seam 3 (@900)", 900, 950),
        ("tail", 949, 999),
    ]
    with pytest.raises(ValueError, match="no seam"):
        bands(200, 300, 50)
    with pytest.raises(ValueError, match="chunk size"):
        seams(10, 0)


def test_band_perplexity_is_the_band_mean() -> None:
    import math

    logprobs = [-1.0] * 300 + [-2.0] * 699
    ppl = band_perplexities(logprobs, bands(1000, 300, 50))
    assert ppl[0] == pytest.approx(math.e) and ppl[1] == pytest.approx(math.e**2)


def test_agreement_positions_follow_both_routes_seams() -> None:
    assert agreement_positions(1000, [300, 600], 3) == [
        300,
        301,
        302,
        600,
        601,
        602,
        900,
        901,
        902,
        999,
    ]
    assert agreement_positions(100, [300], 8) == [99]  # no seam: the first generated token


def test_prefill_logits_continue_like_prefill_and_the_fp64_reference_is_within_the_bound() -> None:
    import torch

    from pytest_dflash.engines import reference
    from pytest_dflash.engines.data import prompt_ids
    from pytest_dflash.policy.thresholds import Policy
    from pytest_dflash.routes.registry import Route, RouteRegistry
    from pytest_dflash.routes.shipped import pytest_dflash_routes

    registry = RouteRegistry()
    pytest_dflash_routes(registry)
    registry.register(
        Route(
            "prefill.geometry.reference_fp64",
            "prefill.geometry",
            "candidate",
            baseline="prefill.geometry.fp32_q3296",
            gates=("ppl",),
            impl="pytest_dflash.engines.geometry:REFERENCE_FP64",
        )
    )
    engine = reference.build({}, "quick", registry=registry)
    ids = prompt_ids(300, engine.encode)  # two chunks of 206 at the quick profile
    positions = agreement_positions(len(ids), [engine.chunk], 4)
    at = engine.prefill_logits(ids, positions)
    assert at.shape == (len(positions), engine.cfg.vocab_size) and at.dtype == torch.float64
    assert int(at[-1].argmax()) == engine.prefill(ids).first_token
    verify = engine.verify(ids[:2])  # on top of the prefill prefill_logits left cached
    assert verify.shape == (2, engine.cfg.vocab_size)
    with pytest.raises(reference.EngineError, match="outside the prompt"):
        engine.prefill_logits(ids, [len(ids)])
    half = reference.build({}, "quick", registry=registry, compute_dtype=torch.float16)
    ref = reference.build(
        {
            "attn.d256": "attn.d256.oracle",
            "gemm.nvfp4": "gemm.nvfp4.oracle",
            "prefill.geometry": "prefill.geometry.reference_fp64",
        },
        "quick",
        registry=registry,
        compute_dtype=torch.float64,
    )
    exact = ref.prefill_logits(ids, positions)
    rounded = half.prefill_logits(ids, positions)
    bound = Policy().agreement_kl_bound
    # the bound admits the fp16 arithmetic of the deployment, and lies far above the fp32
    # engine's own rounding: a KL over it is never noise of the reference
    fp32 = float((at.exp() * (at - exact)).sum(-1).max())
    fp16 = float((rounded.exp() * (rounded - exact)).sum(-1).max())
    assert 0 < fp32 < bound / 1e3 and fp32 < fp16 <= bound


PLUGIN = """
import torch

from pytest_dflash import Route
from pytest_dflash.session.engine_factory import factory_of
from pytest_dflash.engines.geometry import Geometry
from pytest_dflash.selftest import seam_defects

BASE = "prefill.geometry.fp32_q3296"
SEAM_ZEROED = Geometry("prefill.geometry.seam_zeroed", torch.float32, 3296)
LAST_KV_DROPPED = Geometry("prefill.geometry.last_kv_dropped", torch.float32, 3296)
ENGINES = {SEAM_ZEROED.name: seam_defects.StateZeroedAtSeams,
           LAST_KV_DROPPED.name: seam_defects.LastChunkKVDropped}


def pytest_dflash_routes(registry):
    for geometry in (SEAM_ZEROED, LAST_KV_DROPPED, seam_defects.BF16_Q7920, seam_defects.FP8_Q7920):
        registry.register(Route(geometry.name, "prefill.geometry", "candidate", baseline=BASE,
                                gates=("ppl", "prefill"), impl=geometry))


def pytest_dflash_engine(config, selection, profile):
    cls = ENGINES.get(selection.get("prefill.geometry"))
    if cls is None:
        return None
    factory = factory_of(config)
    return factory.adopt(cls({**factory.registry.engine_selection(), **selection}, profile,
                             factory.device, registry=factory.registry))
"""

# route -> {test: expected outcome}; "agreement" is the cold-prefill test (prefill gate), whose
# agreement check runs before its timing (the timing outcome depends on the machine: not asserted)
EXPECTED = {
    "prefill.geometry.fp32_q6592": {"long_contexts": "passed", "agreement": "passed"},
    "prefill.geometry.seam_zeroed": {"long_contexts": "failed", "agreement": "failed"},
    "prefill.geometry.bf16_q7920": {"agreement": "failed"},
    "prefill.geometry.fp8_q7920": {"agreement": "failed"},
    "prefill.geometry.last_kv_dropped": {"long_contexts": "passed", "agreement": "failed"},
}
NODE = {"long_contexts": "test_ppl_long_contexts", "agreement": "test_speed_cold_prefill"}
DISAGREES = "after the same cold prefill as"


def test_seam_defects_are_caught_and_a_correct_route_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(seam_routes=PLUGIN)
    pytester.syspathinsert()
    # the smallest timing (timing_sizes): only the agreement check, which runs before the
    # timing, is asserted here
    pytester.makepyprojecttoml(timing_sizes.pyproject())
    report = pytester.path / "seam-report.json"
    selected = [arg for name in EXPECTED for arg in ("--dflash-route", name)]
    result = pytester.runpytest(
        "-p", "seam_routes", "--pyargs", "dflash_suites", *selected, "-m", "ppl or prefill",
        "-k", " or ".join(NODE.values()), "--dflash-profile", "quick",
        "--dflash-report", str(report), "-p", "no:cacheprovider",
        "--dflash-every-test",  # each seam test must judge, not only the gate's first
    )  # fmt: skip
    assert report.is_file(), result.stdout.str()[-3000:]
    routes = json.loads(report.read_text())["routes"]
    for name, expected in EXPECTED.items():
        tests = [t for gate in routes[name]["gates"].values() for t in gate["tests"]]
        for part, outcome in expected.items():
            mine = [t for t in tests if NODE[part] in t["nodeid"]]
            assert mine, f"{name}: no {part} test ran ({[t['nodeid'] for t in tests]})"
            seen = [(t["nodeid"], t["outcome"], t["message"][:400]) for t in mine]
            # judged, never errored; two timing rounds may leave the timing itself inconclusive
            assert all(t["outcome"] in ("passed", "failed", "inconclusive") for t in mine), (
                name, seen)
            if part == "agreement":
                agreement = [t["measurements"]["agreement"] for t in mine]
                caught = [DISAGREES in t["message"] for t in mine]
                if outcome == "passed":
                    assert not any(caught), (name, seen)
                    assert all(a["max_kl"] <= a["kl_bound"] for a in agreement), (name, agreement)
                    assert all(
                        "agreement: greedy equal" in t["measurements"]["figure"] for t in mine
                    ), (name, seen)
                else:
                    assert any(caught), (name, seen)
            else:
                got = {t["outcome"] for t in mine}
                assert got == {outcome}, (name, seen)
    ppl = routes["prefill.geometry.fp32_q6592"]["gates"]["ppl"]["tests"]
    long = next(t for t in ppl if NODE["long_contexts"] in t["nodeid"])["measurements"]
    assert "max band PPL change" in long["figure"] and len(long["bands"]) == 1
