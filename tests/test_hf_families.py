"""Every shipped family applied inside a real transformers hybrid model (a tiny random
Qwen3.5: gated-DeltaNet layers beside full attention with head dim 256 and GQA), through
transformers' own extension points: attention functions with their mask function, NVFP4 MLPs,
the recurrent-state dtype set through the cache; and the Hub's ``kernels`` package beside the
checkout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")

import torch  # noqa: E402
from qwen35_model import make_qwen35  # noqa: E402

from pytest_dflash.engines import EngineError  # noqa: E402
from pytest_dflash.engines import transformers as hf  # noqa: E402
from pytest_dflash.engines.transformers_mlp import NVFP4MLP  # noqa: E402
from pytest_dflash.policy.thresholds import Policy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = "def lift(pts):\n    return [p + 1 for p in pts]\n" * 9
CHUNK = 48
POLICY = Policy()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen35(tmp_path_factory.mktemp("qwen35"))


@pytest.fixture(scope="module")
def base(model_dir: Path) -> hf.TransformersEngine:
    engine = hf.build(model_dir, {}, "quick")
    engine.chunk = CHUNK
    return engine


def engine_of(model_dir: Path, **selection: str) -> hf.TransformersEngine:
    engine = hf.build(model_dir, dict(selection), "quick")
    engine.chunk = CHUNK
    return engine


def ids_of(engine: hf.TransformersEngine) -> list[int]:
    ids = engine.encode(TEXT, add_special_tokens=True)
    assert len(ids) > 128 and len(ids) > 2 * CHUNK  # several query tiles; at least two seams
    return ids


def one_forward(engine: hf.TransformersEngine, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = engine.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return torch.log_softmax(out.double(), -1)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_attention_is_the_routes_registered_function(base: hf.TransformersEngine) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = base.model.config._attn_implementation
    assert name in AttentionInterface._global_mapping
    assert name in AttentionMaskInterface._global_mapping  # else transformers passes mask=None
    assert base.attention_served_by == "attn.d256.sdpa"


def test_baseline_route_equals_transformers_sdpa(base: hf.TransformersEngine) -> None:
    """Same model, same NVFP4 MLPs: only the attention function differs."""
    ids = ids_of(base)
    ours = one_forward(base, ids)
    routed = base.model.config._attn_implementation
    base.model.set_attn_implementation("sdpa")
    try:
        theirs = one_forward(base, ids)
    finally:
        base.model.set_attn_implementation(routed)
    assert rel_l2(ours, theirs) <= POLICY.parity_rel_l2["float32"]


@pytest.mark.parametrize("route", ["attn.d256.sdpa", "attn.d256.oracle", "attn.d256.fa2"])
def test_chunked_prefill_through_a_route_equals_one_forward(model_dir: Path, route: str) -> None:
    from dflash_kernels.attention import fa2_status

    if route.endswith("fa2") and not fa2_status().ok:
        pytest.skip(f"fa2 ops not built here: {fa2_status().summary()}")
    engine = engine_of(model_dir, **{"attn.d256": route})
    ids = ids_of(engine)
    positions = list(range(len(ids)))
    chunked = engine.prefill_logits(ids, positions)
    hits = engine.route_hits()
    chunks = -(-len(ids) // CHUNK)
    # every chunk through both attention layers: a fresh chunk, then the rest over the cache
    for layer in (3, 7):
        assert hits[f"{route}:layer{layer}:fresh"] == 1
        assert hits[f"{route}:layer{layer}:cached"] == chunks - 1
    # the route's own ops served every call: dense for the fresh chunk, paged over the cache
    assert hits[f"{route}/dense"] == 2 and hits[f"{route}/paged"] == 2 * (chunks - 1)
    whole = one_forward(engine, ids)
    assert (chunked - whole).abs().max() < 1e-4


def test_a_mask_the_family_cannot_serve_is_an_error(base: hf.TransformersEngine) -> None:
    """A padded batch asks for a mask other than the causal one: refused, never dropped."""
    ids = torch.tensor([ids_of(base)[:20]])
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(EngineError, match="causal attention only"), torch.inference_mode():
        base.model(input_ids=ids, attention_mask=mask)


def test_a_static_cache_is_served_over_the_keys_written(model_dir: Path,
                                                      base: hf.TransformersEngine) -> None:
    """A StaticCache hands the attention function every slot it reserved, the ones not yet
    written masked: the route attends the written keys only, so the chunked prefill over a
    static cache equals one forward, through the same dense and paged ops."""
    static = engine_of(model_dir, **{"prefill.geometry": hf.STATIC_CACHE.name})
    ids = ids_of(static)
    positions = list(range(len(ids)))
    chunked = static.prefill_logits(ids, positions)
    assert (chunked - one_forward(base, ids)).abs().max() < 1e-4
    hits = static.route_hits()
    assert hits[f"{hf.STATIC_CACHE.name}:cache:StaticCache"] > 0
    chunks = -(-len(ids) // CHUNK)
    assert hits["attn.d256.sdpa:layer3:cached"] == chunks - 1


def test_a_quantized_cache_cannot_be_applied_in_a_hybrid(model_dir: Path) -> None:
    """transformers' QuantizedCache holds full-attention layers only: the route is
    unsupported on this model (pending, with the reason), not a candidate that raised."""
    from pytest_dflash.engines import EngineUnsupported

    with pytest.raises(EngineUnsupported, match="linear_attention layers"):
        engine_of(model_dir, **{"prefill.geometry": hf.KV_QUANTO_INT4.name})


def test_mlps_run_the_gemm_route_on_nvfp4_codes(model_dir: Path,
                                               base: hf.TransformersEngine) -> None:

    mlps = [m for m in base.model.modules() if isinstance(m, NVFP4MLP)]
    assert len(mlps) == base.model.config.num_hidden_layers
    oracle = engine_of(model_dir, **{"gemm.nvfp4": "gemm.nvfp4.oracle"})
    same = [m for m in oracle.model.modules() if isinstance(m, NVFP4MLP)]
    assert torch.equal(mlps[0].gate_up.packed, same[0].gate_up.packed)  # the same codes
    ids = ids_of(oracle)
    oracle.prefill(ids)
    oracle.verify(ids[:5])
    hits = oracle.route_hits()
    layers = oracle.model.config.num_hidden_layers
    chunks = -(-len(ids) // CHUNK)
    assert hits["gemm.nvfp4.oracle:m>8"] == 2 * layers * chunks  # two GEMMs a layer and chunk
    assert hits["gemm.nvfp4.oracle:m<=8"] == 2 * layers  # the verify block
    assert hits["gemm.nvfp4.oracle/fp64"] == hits["gemm.nvfp4.oracle"]
    # the baseline over the same codes predicts what the fp64 oracle predicts
    assert rel_l2(one_forward(oracle, ids), one_forward(base, ids)) < 1e-4


def test_verify_runs_on_a_copy_of_the_cached_prefix(base: hf.TransformersEngine) -> None:
    ids = ids_of(base)
    prefix, draft = ids[:-4], ids[-4:]
    base.prefill(prefix)
    first = base.verify(draft)
    again = base.verify(draft)  # the prefix is untouched by the first verify
    assert torch.equal(first, again)
    whole = one_forward(base, ids)[-4:]
    assert (torch.log_softmax(first.double(), -1) - whole).abs().max() < 1e-4


def test_fp16_state_geometry_is_stored_in_the_cache(model_dir: Path,
                                                   base: hf.TransformersEngine) -> None:
    fp16 = engine_of(model_dir, **{"prefill.geometry": "prefill.geometry.fp16_q7920"})
    ids = ids_of(fp16)
    positions = list(range(len(ids)))
    state16 = fp16.prefill_logits(ids, positions)
    state32 = base.prefill_logits(ids, positions)
    assert fp16.route_hits()["prefill.geometry.fp16_q7920:state:float16"] > 0
    assert "prefill.geometry.fp32_q3296:state:float16" not in base.route_hits()
    first_seam = CHUNK
    # identical up to the first seam; the state rounded to fp16 there moves what follows
    assert torch.equal(state16[:first_seam], state32[:first_seam])
    assert 0 < (state16[first_seam:] - state32[first_seam:]).abs().max() < 0.1


def test_a_narrower_state_moves_the_logits_more(model_dir: Path,
                                                base: hf.TransformersEngine) -> None:
    """The self-test's planted fp8 state (a seam defect) is stored as such on a real hybrid,
    and moves the predictions after the first seam more than the fp16 state does."""
    from pytest_dflash.routes.registry import Route

    registry = hf.default_registry()
    registry.register(Route("prefill.geometry.fp8_q7920", "prefill.geometry", "candidate",
                            baseline=hf.BASELINE, gates=("ppl",),
                            impl="pytest_dflash.selftest.seam_defects:FP8_Q7920"))
    fp8, fp16 = (hf.build(model_dir, {"prefill.geometry": f"prefill.geometry.{n}"}, "quick",
                          registry=registry) for n in ("fp8_q7920", "fp16_q7920"))
    ids = ids_of(base)
    positions = list(range(len(ids)))
    reference = base.prefill_logits(ids, positions)[CHUNK:]
    moved = {}
    for name, engine in (("fp8", fp8), ("fp16", fp16)):
        engine.chunk = CHUNK
        moved[name] = float((engine.prefill_logits(ids, positions)[CHUNK:] - reference).abs().max())
    assert fp8.route_hits()["prefill.geometry.fp8_q7920:state:float8_e4m3fn"] > 0
    assert moved["fp8"] > 4 * moved["fp16"] > 0, moved


def test_the_hub_kernels_package_is_not_shadowed(model_dir: Path) -> None:
    """transformers >= 5.25 imports the Hub's ``kernels``; the checkout's ``kernels/`` folder
    (first on sys.path here, as in the repository's own test runs) must not shadow it."""
    pytest.importorskip("kernels")
    code = (
        "import json, kernels, transformers\n"
        "from transformers.integrations import hub_kernels\n"
        "from pytest_dflash.engines import transformers as hf\n"
        f"engine = hf.build({str(model_dir)!r}, {{}}, 'quick')\n"
        "print(json.dumps({'kernels': kernels.__file__, "
        "'version': transformers.__version__, 'served': engine.attention_served_by}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert not Path(seen["kernels"]).resolve().is_relative_to(ROOT / "kernels"), seen
    assert seen["served"] == "attn.d256.sdpa"


def test_the_default_model_is_a_hybrid_every_family_applies_in() -> None:
    """``--dflash-engine hf`` without a path: the shipped Qwen3.5-architecture model, on which
    an attn.d256 route serves the attention layers and the gemm.nvfp4 route every MLP."""
    path = hf.default_model_dir()
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["head_dim"] == 256 and "linear_attention" in config["layer_types"]
    engine = hf.build(path, {"prefill.geometry": "prefill.geometry.fp16_q7920"}, "quick")
    engine.prefill(engine.encode(TEXT, add_special_tokens=True))
    hits = engine.route_hits()
    assert engine.attention_served_by == "attn.d256.sdpa" and hits["attn.d256.sdpa"] > 0
    assert engine.mlps == config["num_hidden_layers"] and hits["gemm.nvfp4.turbomind"] > 0
    assert hits["prefill.geometry.fp16_q7920:state:float16"] > 0
