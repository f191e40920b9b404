"""The kernel libraries' routes (docs/library-routes.md) on a machine without CUDA.

What can be checked here is checked for real: the routes register in the transformers engine's
sessions only, every library implementation meets its family contract, on this machine every
candidate ends pending with the reason (never passed, never crashed), transformers' own
gated-DeltaNet dispatch point is swapped for the selected route while its engine runs and put
back afterwards (the oracle route really computes the model's DeltaNet layers, counted from
inside each layer), Liger's patch reaches one model only, a SiLU-mul route is compared on the
checkpoint's own MLPs (a correct one accepted, a planted one rejected by parity and ppl), a
forced SDPA backend that torch cannot run here skips with torch's reason, the linear.gdn parity
suite accepts a correct route and rejects one that drops its state, and the self-test's planted
gated-delta-rule defects change what the served route computes. The kernels themselves (fla,
Liger, the CUDA SDPA backends) run only on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_dflash.library import probes
from pytest_dflash.routes import library
from pytest_dflash.routes.registry import RouteRegistry
from pytest_dflash.routes.shipped import pytest_dflash_routes as shipped_routes

CANDIDATES = {route.name for route in library.CANDIDATES}
HF_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
needs_hf = pytest.mark.skipif(
    __import__("importlib").util.find_spec("transformers") is None,
    reason="transformers not installed: pip install 'pytest-dflash[hf]'")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                             reason="checks what a machine without CUDA says")


def hf_registry() -> RouteRegistry:
    from pytest_dflash.engines import transformers as hf

    return hf.default_registry()


def test_library_candidates_come_with_the_transformers_engine_only() -> None:
    reference = RouteRegistry()
    shipped_routes(reference)
    library.pytest_dflash_routes(reference)
    reference.validate()
    # the families and their references are there (the suites name them), no candidate is
    assert {"linear.gdn", "norm_mlp"} <= set(reference.families())
    assert not CANDIDATES & {r.name for r in reference.candidates()}
    registry = hf_registry()
    assert CANDIDATES <= {r.name for r in registry.candidates()}
    assert {r.name for r in registry.candidates("attn.d256")} >= {
        "attn.d256.sdpa_flash", "attn.d256.sdpa_efficient", "attn.d256.sdpa_cudnn"}
    assert registry.family_of("linear.gdn").verify_route == "linear.gdn.torch"
    assert "validation_cost" in registry.get("linear.gdn.fla_chunk").gates


def test_every_library_route_meets_its_family_contract_and_has_a_probe() -> None:
    registry = hf_registry()
    for family in ("linear.gdn", "norm_mlp", "attn.d256"):
        for route in registry.family(family):
            registry.family_of(family).check(route.implementation(), route.name)
    for route in library.CANDIDATES:
        assert route.probe is not None, route.name


@no_cuda
def test_on_a_machine_without_cuda_every_candidate_says_why() -> None:
    for route in library.CANDIDATES:
        reason = route.unavailable_reason()
        assert reason is not None, route.name
        library_missing = "install 'pytest-dflash[gpu-routes]'" in reason
        assert library_missing or reason.startswith("needs a CUDA device"), reason


def test_without_the_libraries_the_reason_is_the_install_command() -> None:
    """A real absence: the libraries' imports blocked in a fresh interpreter."""
    code = (
        "import sys\n"
        "sys.modules['fla'] = None; sys.modules['liger_kernel'] = None\n"
        "from pytest_dflash.library import probes\n"
        "print(probes.fla()); print(probes.liger())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    fla, liger = done.stdout.strip().splitlines()
    assert fla.startswith("fla-core") and probes.EXTRA in fla, fla
    assert liger.startswith("liger-kernel") and probes.EXTRA in liger, liger


@needs_hf
@no_cuda
def test_the_gpu_command_on_a_cpu_ends_pending_with_the_reason(tmp_path: Path) -> None:
    """``pytest -m sm70 --dflash-engine hf`` on the library routes: every gate pending with
    the reason, exit code 0 or 1, no error."""
    report = tmp_path / "report.json"
    routes = ["linear.gdn.fla_chunk", "linear.gdn.fla_recurrent", "linear.gdn.fla_norm",
              "norm_mlp.liger_rmsnorm", "norm_mlp.liger_swiglu", "attn.d256.sdpa_flash",
              "attn.d256.sdpa_efficient", "attn.d256.sdpa_cudnn"]
    args = [sys.executable, "-m", "pytest", "--pyargs", "dflash_suites", "-m", "sm70",
            "--dflash-engine", "hf", "--dflash-profile", "quick", "--dflash-report",
            str(report), "-p", "no:cacheprovider", "-q"]
    for route in routes:
        args += ["--dflash-route", route]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, **HF_ENV})
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    assert " error" not in done.stdout.splitlines()[-1], done.stdout[-2000:]
    verdicts = json.loads(report.read_text())["routes"]
    assert set(verdicts) == set(routes)
    for name, entry in verdicts.items():
        assert entry["verdict"] == "pending", (name, entry["verdict"])
        for kind, gate in entry["gates"].items():
            assert gate["status"] == "pending", (name, kind, gate["status"])
            messages = " ".join(t["message"] or "" for t in gate["tests"])
            assert "needs a CUDA device" in messages or probes.EXTRA in messages, messages
    # the GPU job's result script reads this report as it reads a GPU run's: every library
    # route in a row, with its run's dtype, its verdict and each pending gate's reason
    from benchmark_scripts import script

    job = tmp_path / "job"
    job.mkdir()
    (job / "hf-ci.json").write_bytes(report.read_bytes())
    (job / "env.json").write_text(json.dumps({"card": "cpu", "capability": "n/a",
                                              "torch": torch.__version__, "cuda": None,
                                              "python": sys.version.split()[0]}))
    (job / "stages.log").write_text(f"== hf: {' '.join(args)}\nhf rc=0 seconds=1.0\n")
    out = tmp_path / "results"
    out.mkdir()
    assert script("gpu_results").main([str(job), "--commit", "abc1234", "--date",
                                       "2026-12-06", "--results", str(out)]) == 0
    rows = json.loads((out / "cpu-library-routes.json").read_text())["values"]["rows"]
    assert [row[:3] for row in rows] == [[name, "float32", "pending"] for name in routes]
    for row in rows:
        assert "needs a CUDA device" in row[3] or probes.EXTRA in row[3], row


@needs_hf
def test_a_backend_without_float32_is_judged_on_the_dtypes_it_takes(tmp_path: Path) -> None:
    """flash and cuDNN declare float16/bfloat16 (Route.dtypes): their float32 parity tests are
    deselected, not left pending forever; the memory-efficient backend keeps every dtype."""
    args = [sys.executable, "-m", "pytest", "--pyargs", "dflash_suites", "-m", "parity",
            "--dflash-engine", "hf", "--dflash-profile", "quick", "--collect-only", "-q",
            "-p", "no:cacheprovider", "--dflash-route", "attn.d256.sdpa_flash",
            "--dflash-route", "attn.d256.sdpa_efficient"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, **HF_ENV})
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    flash = [i for i in ids if "sdpa_flash" in i]
    efficient = [i for i in ids if "sdpa_efficient" in i]
    assert flash and all("float32" not in i for i in flash), done.stdout[-3000:]
    assert any("float16" in i for i in flash)
    assert any("float32" in i for i in efficient) and any("float16" in i for i in efficient)
    assert "deselected" in done.stdout.splitlines()[-1]


def test_a_route_naming_an_unknown_dtype_is_refused() -> None:
    from pytest_dflash.routes.registry import RegistryError, Route

    with pytest.raises(RegistryError, match="float64.*use some of float32"):
        Route("attn.d256.x", "attn.d256", "candidate", baseline="attn.d256.sdpa",
              gates=("parity",), dtypes=("float64",))


# --------------------------------------------------------------------- the switch, for real
def _model():
    from transformers import AutoModelForCausalLM

    from pytest_dflash.engines.transformers import default_model_dir

    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()


@needs_hf
def test_the_switch_swaps_transformers_dispatch_point_and_puts_it_back() -> None:
    from pytest_dflash.engines.transformers_library import GdnSwitch
    from pytest_dflash.library import gdn
    from pytest_dflash.library.dispatch_points import (
        DISPATCH,
        dispatch_target,
        modelling_module,
        torch_fallbacks,
    )

    module = modelling_module()
    before = {name: getattr(module, name) for name in DISPATCH.values()}
    target = dispatch_target(before["torch_chunk_gated_delta_rule"])
    # the torch fallback stays reachable as the dispatch wrapper's __wrapped__
    assert target["fallback"] is target["dispatcher"].__wrapped__
    assert torch_fallbacks().chunk is target["fallback"]
    if probes.installed("fla"):  # transformers bound fla's kernel at import time
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        assert target["library"] and target["implementation"] is chunk_gated_delta_rule
    switch = GdnSwitch(_model(), "linear.gdn.oracle", gdn.ORACLE, "linear.gdn.torch")
    assert len(switch.layers) == 6  # the tiny Qwen3.5's gated-DeltaNet layers
    with switch.installed():
        for name, original in before.items():
            now = getattr(module, name)
            assert now is not original and now.__name__ == f"{name}_via_route"
            assert dispatch_target(now)["fallback"] is dispatch_target(original)["fallback"]
    assert {name: getattr(module, name) for name in DISPATCH.values()} == before
    with pytest.raises(RuntimeError), switch.installed():
        raise RuntimeError("a failing forward")
    assert {name: getattr(module, name) for name in DISPATCH.values()} == before


@needs_hf
def test_the_selected_route_computes_the_deltanet_layers_counted_inside_them() -> None:
    """The engine with the fp64 oracle route switched in: every gated-DeltaNet layer's calls
    are the oracle's (prefill chunk, verify block, decode step, gated norm), the baseline
    engine's are the torch fallback's, and the logits differ by rounding only."""
    from pytest_dflash.engines import transformers as hf

    registry = hf_registry()
    selection = registry.engine_selection()
    base = hf.build(hf.default_model_dir(), selection, "quick", registry=registry)
    oracle = hf.build(hf.default_model_dir(), {**selection, "linear.gdn": "linear.gdn.oracle"},
                      "quick", registry=registry)
    ids = base.encode("def add(a, b):\n    return a + b\n" * 3, add_special_tokens=True)
    logits = []
    for engine in (base, oracle):
        engine.prefill(ids)
        logits.append(engine.verify(ids[:4]))
        engine.verify(ids[:1])
    diff = float((logits[0] - logits[1]).abs().max())
    assert 0 < diff < 1e-3, diff
    for engine, route in ((base, "linear.gdn.torch"), (oracle, "linear.gdn.oracle")):
        hits = engine.route_hits()
        for layer in (0, 1, 2, 4, 5, 6):
            for op in ("chunk:m>8", "chunk:m<=8", "gated_norm"):
                assert hits.get(f"{route}:layer{layer}:{op}", 0) >= 1, (route, layer, op, hits)
        assert f"{route}:layer3:chunk:m>8" not in hits  # layer 3 is full attention
        assert hits[f"{route}/chunk"] >= 6
        other = "linear.gdn.oracle" if route == "linear.gdn.torch" else "linear.gdn.torch"
        assert not any(key.startswith(other) for key in hits), hits
    # a decode step runs the recurrent op: the oracle serves it too
    assert oracle.route_hits()["linear.gdn.oracle:layer0:recurrent:m<=8"] >= 1


@needs_hf
def test_liger_reaches_one_model_and_leaves_transformers_classes_alone() -> None:
    if not probes.installed("liger_kernel"):
        pytest.skip("liger-kernel not installed: pip install 'pytest-dflash[gpu-routes]'")
    from pytest_dflash.engines import transformers as hf
    from pytest_dflash.engines.transformers_library import apply_liger, modelling_module

    module = modelling_module()
    classes = dict(vars(module))
    model = _model()
    patched = apply_liger(model, "norm_mlp.liger_rmsnorm", rms_norm=True, swiglu=False)
    assert patched == sum(type(m) is module.Qwen3_5RMSNorm for m in model.modules()) > 0
    assert {k: v for k, v in vars(module).items() if k in classes} == classes
    norm = model.model.norm
    assert norm.forward.__name__ == "counted" and norm.casting_mode == "gemma"
    assert norm.offset == 1.0  # Liger's Qwen3.5 setting
    fresh = _model()
    assert "forward" not in vars(fresh.model.norm)  # transformers' own forward
    # Liger's SwiGLU MLP replaces the checkpoint's MLPs of one engine's model, each counted
    registry = hf_registry()
    engine = hf.build(hf.default_model_dir(), {**registry.engine_selection(),
                                               "norm_mlp": "norm_mlp.liger_swiglu"},
                      "quick", registry=registry)
    mlps = [m for m in engine.model.modules() if type(m) is module.Qwen3_5MLP]
    assert engine.mlps == len(mlps) > 0
    assert all(m.forward.__name__ == "counted" for m in mlps)
    assert {k: v for k, v in vars(module).items() if k in classes} == classes


@needs_hf
def test_liger_swiglu_is_compared_on_the_checkpoint_mlps_of_both_engines() -> None:
    """Liger's SwiGLU swaps the SiLU-mul, which gemm.nvfp4 fuses into its GEMM, so the route
    and its baseline norm_mlp.torch_mlp both serve the checkpoint's own MLPs: the baseline
    engine computes what the plain transformers model computes (no NVFP4 left), its MLP calls
    are counted inside the MLPs under its name, every other engine keeps NVFP4 MLPs, and a
    gemm.nvfp4 candidate cannot be combined with it."""
    from pytest_dflash.engines import EngineUnsupported
    from pytest_dflash.engines import transformers as hf
    from pytest_dflash.engines.transformers_mlp import NVFP4MLP

    registry = hf_registry()
    assert registry.get("norm_mlp.liger_swiglu").baseline == "norm_mlp.torch_mlp"
    # the family's own baseline runs in every engine; torch_mlp is a candidate's ground only
    assert registry.engine_selection()["norm_mlp"] == "norm_mlp.torch"
    selection = registry.engine_selection(["norm_mlp.torch_mlp"])
    assert selection["norm_mlp"] == "norm_mlp.torch_mlp"
    ground = hf.build(hf.default_model_dir(), selection, "quick", registry=registry)
    default = hf.build(hf.default_model_dir(), registry.engine_selection(), "quick",
                       registry=registry)
    assert not any(isinstance(m, NVFP4MLP) for m in ground.model.modules())
    assert ground.mlps == default.mlps == sum(isinstance(m, NVFP4MLP)
                                              for m in default.model.modules()) > 0
    ids = ground.encode("def add(a, b):\n    return a + b\n" * 2, add_special_tokens=True)
    scored = {name: torch.tensor(engine.score(ids))
              for name, engine in (("ground", ground), ("default", default))}
    with torch.inference_mode():
        logp = torch.log_softmax(_model()(torch.tensor([ids])).logits[0, :-1].double(), -1)
    plain = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert float((scored["ground"].double() - plain).abs().max()) < 1e-4
    assert float((scored["default"].double() - plain).abs().max()) > 1e-3  # NVFP4 codes
    hits = ground.route_hits()
    assert hits["norm_mlp.torch_mlp:mlp"] == ground.mlps * 1  # one scoring forward
    assert not any(key.startswith("gemm.nvfp4") for key in hits), hits
    with pytest.raises(EngineUnsupported, match="separate runs"):
        hf.build(hf.default_model_dir(),
                 registry.engine_selection(["norm_mlp.torch_mlp", "gemm.nvfp4.qpn2"]),
                 "quick", registry=registry)


@pytest.mark.parametrize("backend", ["sdpa_efficient", "sdpa_cudnn"])
@no_cuda
def test_a_backend_torch_cannot_run_skips_with_torchs_reason(backend: str) -> None:
    from pytest_dflash.library import sdpa_backends

    impl = {"sdpa_efficient": sdpa_backends.EFFICIENT, "sdpa_cudnn": sdpa_backends.CUDNN}[backend]
    q, k, v = (torch.randn(5, 4, 256), torch.randn(9, 2, 256), torch.randn(9, 2, 256))
    out = torch.empty_like(q)
    with pytest.raises(pytest.skip.Exception) as skipped:
        impl.dense(q, k, v, out, 256 ** -0.5, True)
    message = str(skipped.value)
    assert f"attn.d256.{backend}" in message and impl.backend in message
    assert "Tq=5, Tk=9" in message and "explicit mask" in message


def test_a_forced_backend_sets_what_sdpa_kernel_sets_and_puts_it_back() -> None:
    """forced_backends enables exactly what torch.nn.attention.sdpa_kernel enables (the same
    flags, without its per-call Python), restores the flags after, and names unknown backends;
    the forced call computes what the baseline's computes."""
    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, sdpa_kernel

    from dflash_kernels.attention import forced_backends, sdpa_dense

    before = _cur_sdpa_kernel_backends()
    for names in (("MATH",), ("FLASH_ATTENTION",), ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")):
        with sdpa_kernel([getattr(SDPBackend, n) for n in names]):
            expected = _cur_sdpa_kernel_backends()
        with forced_backends(names):
            assert _cur_sdpa_kernel_backends() == expected
        assert _cur_sdpa_kernel_backends() == before
    with pytest.raises(ValueError, match="unknown SDPA backends.*FLASH"):
        with forced_backends(("FLASH",)):
            pass
    assert _cur_sdpa_kernel_backends() == before
    q, k, v = (torch.randn(7, 4, 256), torch.randn(7, 2, 256), torch.randn(7, 2, 256))
    ref, out = torch.empty_like(q), torch.empty_like(q)
    sdpa_dense(q, k, v, ref, 256 ** -0.5, True)
    sdpa_dense(q, k, v, out, 256 ** -0.5, True, backends=("MATH",))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@needs_hf
def test_a_forced_backend_serves_the_models_attention_through_attention_interface() -> None:
    """Inside the model the SDPA routes are transformers attention functions: on this CPU the
    flash backend (torch's CPU flash kernel) serves every attention layer, and a backend torch
    has no kernel of here stops the forward with torch's reason (the gate would be pending)."""
    from pytest_dflash.engines import transformers as hf

    registry = hf_registry()
    selection = registry.engine_selection()
    flash = hf.build(hf.default_model_dir(), {**selection, "attn.d256": "attn.d256.sdpa_flash"},
                     "quick", registry=registry)
    ids = flash.encode("def add(a, b):\n    return a + b\n" * 3, add_special_tokens=True)
    flash.prefill(ids)
    flash.verify(ids[:3])
    hits = flash.route_hits()
    for layer in (3, 7):  # the full-attention layers
        assert hits[f"attn.d256.sdpa_flash:layer{layer}:fresh"] >= 1, hits
        assert hits[f"attn.d256.sdpa_flash:layer{layer}:cached"] >= 1, hits
    assert hits["attn.d256.sdpa_flash/dense"] >= 2 and hits["attn.d256.sdpa_flash/paged"] >= 2
    if torch.cuda.is_available():
        return
    cudnn = hf.build(hf.default_model_dir(), {**selection, "attn.d256": "attn.d256.sdpa_cudnn"},
                     "quick", registry=registry)
    with pytest.raises(pytest.skip.Exception, match="CUDNN_ATTENTION backend cannot run"):
        cudnn.prefill(ids)


# ------------------------------------------------------------- the suite and planted defects
GDN_ROUTES = '''
from pytest_dflash import Route
from pytest_dflash.library.gdn import GdnRoute, naive_recurrence


class Naive(GdnRoute):
    """The gated delta rule one token at a time in fp32 (optionally losing its state)."""

    def __init__(self, name, keep_state=True):
        self.route, self.keep_state = name, keep_state

    def _chunk(self, q, k, v, g, beta, initial_state, output_final_state, l2norm):
        state = initial_state if self.keep_state else None
        out, final = naive_recurrence(q.float(), k.float(), v.float(), g.float(),
                                      beta.float(), state, output_final_state, l2norm)
        return out.to(v.dtype), (final.float() if final is not None else None)

    _recurrent = _chunk

    def _gated_norm(self, x, gate, weight, eps):
        import torch
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (out * torch.nn.functional.silu(gate.float())).to(x.dtype)


class NaivePrefill(Naive):
    """Like fla_chunk: its own code for prefill chunks of more than 8 tokens only."""

    own = frozenset({"chunk"})

    def _serves(self, op, tokens):
        return op == "chunk" and tokens > 8


def pytest_dflash_routes(registry):
    registry.register(Route("linear.gdn.naive_prefill", "linear.gdn", "candidate",
                            baseline="linear.gdn.torch", gates=("validation_cost",),
                            impl=NaivePrefill("linear.gdn.naive_prefill")))
    registry.register(Route("linear.gdn.naive", "linear.gdn", "candidate",
                            baseline="linear.gdn.torch", gates=("parity",),
                            impl=Naive("linear.gdn.naive")))
    registry.register(Route("linear.gdn.stateless", "linear.gdn", "candidate",
                            baseline="linear.gdn.torch", gates=("parity",),
                            impl=Naive("linear.gdn.stateless", keep_state=False)))
'''


@needs_hf
def test_gdn_parity_suite_accepts_a_correct_route_and_rejects_a_lost_state(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(gdn_routes=GDN_ROUTES)
    pytester.syspathinsert()
    report = pytester.path / "gdn-report.json"
    result = pytester.runpytest_subprocess(
        "-p", "gdn_routes", "--pyargs", "dflash_suites.test_parity_gdn", "-m", "parity",
        "--dflash-route", "linear.gdn.naive", "--dflash-route", "linear.gdn.stateless",
        "--dflash-profile", "quick", "--dflash-report", str(report), "-p", "no:cacheprovider",
        "--dflash-every-test")  # which parity tests see the lost state, one by one
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    routes = json.loads(report.read_text())["routes"]
    assert routes["linear.gdn.naive"]["verdict"] == "accept"
    assert routes["linear.gdn.stateless"]["verdict"] == "reject"
    naive = routes["linear.gdn.naive"]["gates"]["parity"]["tests"]
    lost = {t["nodeid"].split("::")[1].split("[")[0]: t
            for t in routes["linear.gdn.stateless"]["gates"]["parity"]["tests"]}
    assert lost["test_gdn_state_carried_across_a_seam"]["outcome"] == "failed"
    assert lost["test_gdn_gated_norm_parity"]["outcome"] == "passed"
    chunk = next(t for t in naive if "test_gdn_chunk_parity" in t["nodeid"])
    figures = chunk["measurements"]
    assert figures["fla_anchor"] == 0.005 and figures["fla_ratio_worst"] < 1e-5
    assert set(figures["fla_ratio"]) == set(figures["our_bound"])


def test_the_self_test_plants_gated_delta_rule_defects_that_change_the_result() -> None:
    from dflash_suites.support.gdn import make_inputs
    from pytest_dflash.measure.numerics import check_parity
    from pytest_dflash.policy.thresholds import Policy
    from pytest_dflash.selftest.catalogue import Planted, plan
    from pytest_dflash.selftest.wrappers import as_route, implementation_for

    registry = hf_registry()
    fla_chunk = registry.get("linear.gdn.fla_chunk")
    planned = {p.key: p for p in plan([fla_chunk], registry, Policy())}
    assert set(planned) == {"copy", "state_not_carried", "qk_l2norm_dropped"}
    for key in ("state_not_carried", "qk_l2norm_dropped"):
        route = as_route(planned[key], registry, Policy())
        assert route.gates == ("parity", "ppl")
        assert route.probe == fla_chunk.probe  # pending where the route itself is
    # the defects planted on a route that runs here (the torch baseline as the served code)
    torch_route = registry.get("linear.gdn.torch")
    oracle = registry.get("linear.gdn.oracle").implementation()
    inputs = make_inputs(100, seed=7, dtype=torch.float32, device=torch.device("cpu"))
    args = [inputs[k] for k in ("q", "k", "v", "g", "beta", "initial_state")]
    want = oracle.chunk(*args, True, True)
    for key, defect in (("copy", None), *((k, planned[k].defect) for k in
                                          ("state_not_carried", "qk_l2norm_dropped"))):
        planted = Planted(f"linear.gdn.torch~{key}", fla_chunk, torch_route, defect)
        impl = implementation_for(planted, registry, Policy()) if defect else torch_route.impl
        impl = impl if not isinstance(impl, str) else torch_route.implementation()
        out, _ = impl.chunk(*args, True, True)
        ok = check_parity(out, want[0], None, policy=Policy(), dtype="float32", label=key).ok
        assert ok == (defect is None), key


# an outside project's SiLU-mul routes on the checkpoint's MLPs, as liger_swiglu is compared:
# a correct one, and one whose activation drops the gate's own factor (sigmoid(g) * up)
SWIGLU_ROUTES = '''
from pytest_dflash import Route
from pytest_dflash.library.norm_mlp import NormMlpRoute

class Swiglu(NormMlpRoute):
    own = frozenset({"swiglu"})
    checkpoint_mlps = True

    def __init__(self, route, planted=False):
        self.route, self.planted = route, planted

    def _swiglu(self, gate, up):
        import torch
        return (torch.sigmoid(gate) if self.planted else torch.nn.functional.silu(gate)) * up

def pytest_dflash_routes(registry):
    for name, planted in (("norm_mlp.mine", False), ("norm_mlp.mine_sigmoid", True)):
        registry.register(Route(name, "norm_mlp", "candidate", baseline="norm_mlp.torch_mlp",
                                gates=("parity", "ppl"), impl=Swiglu(name, planted)))
'''


@needs_hf
def test_a_swiglu_route_on_the_checkpoint_mlps_is_judged_inside_the_model(
        pytester: pytest.Pytester) -> None:
    """The ppl and parity gates of SiLU-mul routes compared as liger_swiglu is, in a real
    transformers-engine session: the correct route is accepted with its calls counted inside
    the MLPs (its own swiglu serving each), the planted one is rejected by both gates."""
    pytester.makepyfile(swiglu_routes=SWIGLU_ROUTES)
    pytester.syspathinsert()
    report = pytester.path / "swiglu-report.json"
    result = pytester.runpytest_subprocess(
        "-p", "swiglu_routes", "--pyargs", "dflash_suites.test_ppl",
        "dflash_suites.test_parity_norm_mlp", "--dflash-engine", "hf",
        "--dflash-route", "norm_mlp.mine", "--dflash-route", "norm_mlp.mine_sigmoid",
        "--dflash-profile", "quick", "--dflash-report", str(report), "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()[-3000:]
    routes = json.loads(report.read_text())["routes"]
    assert routes["norm_mlp.mine"]["verdict"] == "accept", routes["norm_mlp.mine"]
    assert routes["norm_mlp.mine_sigmoid"]["verdict"] == "reject"
    for gate in ("parity", "ppl"):
        tests = routes["norm_mlp.mine_sigmoid"]["gates"][gate]["tests"]
        assert tests and any(t["outcome"] == "failed" for t in tests), (gate, tests)
    # the planted route changes perplexity only because its swiglu serves the model's MLPs
    for test in routes["norm_mlp.mine"]["gates"]["ppl"]["tests"]:
        measured = test["measurements"]
        assert measured["candidate_route_hits"] > 0, test
        baseline, candidate = (e["selection"]["norm_mlp"] for e in measured["engines"])
        assert (baseline, candidate) == ("norm_mlp.torch_mlp", "norm_mlp.mine")
        if "heldout" in test["nodeid"]:  # silu(gate) * up, as transformers' own MLP computes
            assert measured["max_ppl_rel_delta"] < 1e-6, measured["figure"]


@needs_hf
def test_a_prefill_route_leaves_the_verify_path_as_it_was(pytester: pytest.Pytester) -> None:
    """The engine validation-cost gate on the transformers engine: a gated-delta-rule route
    serving prefill chunks only (as fla_chunk does) runs the same kernels in verify steps of
    M = 1..8 as the baseline, the gated norms included."""
    pytester.makepyfile(gdn_routes=GDN_ROUTES)
    pytester.syspathinsert()
    report = pytester.path / "gdn-report.json"
    result = pytester.runpytest_subprocess(
        "-p", "gdn_routes", "--pyargs", "dflash_suites.test_validation_cost_engine",
        "--dflash-engine", "hf", "--dflash-route", "linear.gdn.naive_prefill",
        "--dflash-profile", "quick", "--dflash-report", str(report), "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    route = json.loads(report.read_text())["routes"]["linear.gdn.naive_prefill"]
    assert route["verdict"] == "accept"
    (test,) = route["gates"]["validation_cost"]["tests"]
    hits = test["measurements"]["route_hits"]
    assert hits["m1"]["linear.gdn.naive_prefill/recurrent_dispatch"] > 0
    assert hits["m4"]["linear.gdn.naive_prefill/chunk_dispatch"] > 0
    assert hits["m4"]["linear.gdn.torch/gated_norm"] > 0


def test_gated_delta_rule_inputs_are_what_the_layer_hands_the_dispatch_point() -> None:
    """Qwen3.5's layer (transformers before 5.25) expands q/k to the value heads before the
    dispatch point, and that version's torch fallback refuses fewer q/k heads than value heads:
    the op-level suites must pass q/k already expanded, each drawn head repeated for its group."""
    from dflash_suites.support.gdn import HK, HV, make_inputs

    inputs = make_inputs(16, seed=3, dtype=torch.float32, device=torch.device("cpu"))
    for name in ("q", "k", "v"):
        assert inputs[name].shape[2] == HV, name
    group = HV // HK
    for name in ("q", "k"):
        heads = inputs[name].unflatten(2, (HK, group))
        assert torch.equal(heads, heads[:, :, :, :1].expand_as(heads)), name
        assert not torch.equal(heads[:, :, 0, 0], heads[:, :, 1, 0]), name  # HK distinct heads
