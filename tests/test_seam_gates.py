"""The seam gates of prefill.geometry: the ppl gate's long contexts (perplexity per position
band) and the speed gate's cold-prefill agreement check catch what a geometry route gets wrong
at a chunk seam, with the real reference engine, while a correct route passes both.

| route | what it does wrong | caught by |
|---|---|---|
| prefill.geometry.fp32_q6592 (shipped) | nothing | passes both |
| seam_zeroed | SSM and conv state zeroed at every seam | ppl long contexts, agreement |
| bf16_q7920 | SSM state carried in bf16 | agreement |
| fp8_q7920 | SSM state carried in fp8 (e4m3) | ppl long contexts, agreement |
| last_kv_dropped | the last prefill chunk's paged KV zeroed | agreement (verify rows) |

The defects are ``pytest_dflash.selftest.seams``; the gates are the shipped suites, selected
with ``-k`` so that no timing test runs (a unit test never asserts a timing outcome).
"""

from __future__ import annotations

import json

import pytest

from pytest_dflash.metrics.seams import (
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


PLUGIN = """
import torch

from pytest_dflash import Route
from pytest_dflash.engine_setup import factory_of
from pytest_dflash.engines.geometry import Geometry
from pytest_dflash.selftest import seams

BASE = "prefill.geometry.fp32_q3296"
SEAM_ZEROED = Geometry("prefill.geometry.seam_zeroed", torch.float32, 3296)
LAST_KV_DROPPED = Geometry("prefill.geometry.last_kv_dropped", torch.float32, 3296)
ENGINES = {SEAM_ZEROED.name: seams.StateZeroedAtSeams,
           LAST_KV_DROPPED.name: seams.LastChunkKVDropped}


def pytest_dflash_routes(registry):
    for geometry in (SEAM_ZEROED, LAST_KV_DROPPED, seams.BF16_Q7920, seams.FP8_Q7920):
        registry.register(Route(geometry.name, "prefill.geometry", "candidate", baseline=BASE,
                                gates=("ppl", "speed"), impl=geometry))


def pytest_dflash_engine(config, selection, profile):
    cls = ENGINES.get(selection.get("prefill.geometry"))
    if cls is None:
        return None
    factory = factory_of(config)
    return factory.adopt(cls({**factory.registry.engine_selection(), **selection}, profile,
                             factory.device, registry=factory.registry))
"""

# route -> {test name: expected outcome}
EXPECTED = {
    "prefill.geometry.fp32_q6592": {"long_contexts": "passed", "agreement": "passed"},
    "prefill.geometry.seam_zeroed": {"long_contexts": "failed", "agreement": "failed"},
    "prefill.geometry.bf16_q7920": {"agreement": "failed"},
    "prefill.geometry.fp8_q7920": {"long_contexts": "failed", "agreement": "failed"},
    "prefill.geometry.last_kv_dropped": {"long_contexts": "passed", "agreement": "failed"},
}


def test_seam_defects_are_caught_and_a_correct_route_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(seam_routes=PLUGIN)
    pytester.syspathinsert()
    report = pytester.path / "seam-report.json"
    selected = [arg for name in EXPECTED for arg in ("--dflash-route", name)]
    result = pytester.runpytest(
        "-p",
        "seam_routes",
        "--pyargs",
        "dflash_suites",
        *selected,
        "-m",
        "ppl or speed",
        "-k",
        "test_ppl_long_contexts or test_agreement_cold_prefill",
        "--dflash-profile",
        "quick",
        "--dflash-report",
        str(report),
        "-p",
        "no:cacheprovider",
    )
    assert report.is_file(), result.stdout.str()[-3000:]
    routes = json.loads(report.read_text())["routes"]
    for name, expected in EXPECTED.items():
        tests = [t for gate in routes[name]["gates"].values() for t in gate["tests"]]
        for part, outcome in expected.items():
            mine = [t for t in tests if part in t["nodeid"]]
            assert mine, f"{name}: no {part} test ran ({[t['nodeid'] for t in tests]})"
            got = {t["outcome"] for t in mine}
            want = {"passed"} if outcome == "passed" else {"failed"}
            if outcome == "failed":
                # a defect must fail at least one of the test's cases, none may error or skip
                assert "failed" in got and got <= {"passed", "failed"}, (
                    name,
                    part,
                    [(t["nodeid"], t["outcome"], t["message"][:300]) for t in mine],
                )
            else:
                assert got == want, (
                    name,
                    part,
                    [(t["nodeid"], t["outcome"], t["message"][:300]) for t in mine],
                )
    # the figures the verdict line shows name the agreement and the band figures
    fp32 = routes["prefill.geometry.fp32_q6592"]["gates"]
    assert "agreement @" in fp32["speed"]["figure"]
    assert "max band PPL delta" in fp32["ppl"]["figure"]
    zeroed = routes["prefill.geometry.seam_zeroed"]["gates"]["speed"]["tests"]
    assert any("KL(candidate || baseline)" in t["message"] for t in zeroed)
