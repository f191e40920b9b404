"""The families and routes of the shipped stack, registered through the same hook an outside
project uses (docs/extending.md). This is the only module that names shipped routes for the
gates: which route is a family's baseline, oracle and verify route is declared here, once."""

from __future__ import annotations

from pytest_dflash.routes.families import AttnD256, Family, GemmNvfp4, PrefillGeometry
from pytest_dflash.routes.registry import Route

ATTN = "attn.d256"
GEMM = "gemm.nvfp4"
GEOMETRY = "prefill.geometry"

# The model-level gates (dflash_suites: test_ppl, test_quality, test_speed_prefill) run on an
# engine with the candidate switched in, so they serve every family the engines apply.
MODEL_LEVEL = ("prefill", "ppl", "quality")

# ``gates``: the kinds the shipped suites measure for each family (tests/test_shipped_gates.py
# checks this against the suites' gate markers)
SHIPPED_FAMILIES: tuple[Family, ...] = (
    Family(ATTN, AttnD256, baseline=f"{ATTN}.sdpa", oracle=f"{ATTN}.oracle",
           description="causal prefill attention, head dim 256",
           gates=("loader", "parity", "speed", *MODEL_LEVEL)),
    # speculative verify steps (M <= 8) run on the QPN2 small-M path when a prefill candidate
    # is off: that is the behaviour a validation-cost gate must show unchanged
    Family(GEMM, GemmNvfp4, baseline=f"{GEMM}.turbomind", oracle=f"{GEMM}.oracle",
           verify_route=f"{GEMM}.qpn2", description="linear layers over NVFP4 weights",
           gates=("parity", "speed", "validation_cost", *MODEL_LEVEL)),
    Family(GEOMETRY, PrefillGeometry, baseline=f"{GEOMETRY}.fp32_q3296",
           description="SSM state dtype and prefill chunk size of the engine",
           gates=MODEL_LEVEL),
)

SHIPPED_ROUTES: tuple[Route, ...] = (
    # causal prefill attention, head dim 256
    Route(f"{ATTN}.oracle", ATTN, "oracle", impl="dflash_kernels.attention:ORACLE",
          description="fp64 math in torch"),
    Route(f"{ATTN}.sdpa", ATTN, "baseline", impl="dflash_kernels.attention:SDPA",
          default_enabled=True, description="torch scaled_dot_product_attention fallback"),
    # the seed's D256 evidence: the ops load and match, the op is faster, and same-card cold
    # prefill pairs of the whole model gain with one first-token hash per route (docs/gates.md)
    Route(f"{ATTN}.fa2", ATTN, "candidate", baseline=f"{ATTN}.sdpa",
          gates=("loader", "parity", "speed", "prefill"), impl="dflash_kernels.attention:FA2",
          description="native tiled online-softmax D256 ops, through the loader"),
    # linear layers with NVFP4 weights
    Route(f"{GEMM}.oracle", GEMM, "oracle", impl="dflash_kernels.gemm:ORACLE",
          description="dequantize to fp32, fp64 matmul"),
    Route(f"{GEMM}.turbomind", GEMM, "baseline", impl="dflash_kernels.gemm:TURBOMIND",
          default_enabled=True, description="dequantize whole weight per call to fp16, matmul"),
    Route(f"{GEMM}.qpn2", GEMM, "candidate", baseline=f"{GEMM}.turbomind",
          gates=("parity",), impl="dflash_kernels.gemm:QPN2",
          description="small-M path over QPN2 codes, deterministic split-K"),
    # the seed ran the projection microbenchmark for it: op-level speed
    Route(f"{GEMM}.qpn4_bounded", GEMM, "candidate", baseline=f"{GEMM}.turbomind",
          gates=("parity", "speed"), impl="dflash_kernels.gemm:QPN4_BOUNDED",
          description="N-tiled dequantize into a bounded workspace, matmul per tile"),
    Route(f"{GEMM}.qpn2_packed", GEMM, "candidate", baseline=f"{GEMM}.turbomind",
          gates=("parity", "prefill", "validation_cost", "ppl", "quality"),
          impl="dflash_kernels.gemm:QPN2_PACKED",
          description="one dispatch op: M>=min_prefill_m bounded QPN4 view, else QPN2"),
    # SSM state dtype + prefill chunk geometry of the reference engine
    Route(f"{GEOMETRY}.fp32_q3296", GEOMETRY, "baseline", default_enabled=True,
          impl="pytest_dflash.engines.geometry:FP32_Q3296"),
    Route(f"{GEOMETRY}.fp32_q6592", GEOMETRY, "candidate", baseline=f"{GEOMETRY}.fp32_q3296",
          gates=("prefill", "ppl"), impl="pytest_dflash.engines.geometry:FP32_Q6592"),
    Route(f"{GEOMETRY}.fp16_q7920", GEOMETRY, "candidate", baseline=f"{GEOMETRY}.fp32_q3296",
          gates=("prefill", "ppl", "quality"),
          impl="pytest_dflash.engines.geometry:FP16_Q7920"),
)


def pytest_dflash_routes(registry) -> None:
    """Declare the shipped families and register their routes."""
    for family in SHIPPED_FAMILIES:
        registry.declare(family)
    for route in SHIPPED_ROUTES:
        registry.register(route)
