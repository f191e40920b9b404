"""Routes of kernel libraries nobody here wrote (docs/library-routes.md): flash-linear-attention
for the gated-DeltaNet layers (family ``linear.gdn``), Liger's RMSNorm and SwiGLU (family
``norm_mlp``) and torch's flash, memory-efficient and cuDNN SDPA backends (``attn.d256``).

Two hook implementations, registered like the shipped stack's:

- :func:`pytest_dflash_routes` declares the two families with their oracles and baselines. It
  is registered in every session, so the gate suites can name the families whatever engine
  runs; a baseline is never judged, so the default job's verdict table is unchanged.
- :data:`CANDIDATES` are the library routes themselves, registered by the transformers engine's
  hook (``pytest_dflash.engines.transformers.pytest_dflash_routes``) only while
  ``--dflash-engine hf`` is selected: they switch code inside a transformers model, which the
  reference engine does not run.

Every candidate's probe (``pytest_dflash.library.probes``) leaves it pending with the reason on a
machine without CUDA or without the library (``pip install 'pytest-dflash[gpu-routes]'``).
"""

from __future__ import annotations

from pytest_dflash.routes.families import Family, GatedDeltaRule, NormMlp
from pytest_dflash.routes.registry import Route

GDN = "linear.gdn"
NORM_MLP = "norm_mlp"
ATTN = "attn.d256"
_GDN = "pytest_dflash.library.gdn"
_NORM = "pytest_dflash.library.norm_mlp"
_SDPA = "pytest_dflash.library.sdpa_backends"
_PROBE = "pytest_dflash.library.probes"
MODEL_LEVEL = ("prefill", "ppl", "quality")
# torch's flash and cuDNN SDPA kernels take half precision only: their op-level tests run in
# float16 (Route.dtypes), their model-level gates under --dflash-dtype bfloat16 or float16
HALF = ("float16", "bfloat16")

FAMILIES: tuple[Family, ...] = (
    # verify blocks (M <= 8) run on the baseline while a prefill candidate is on: that is what
    # the validation-cost gate must show unchanged
    Family(GDN, GatedDeltaRule, baseline=f"{GDN}.torch", oracle=f"{GDN}.oracle",
           verify_route=f"{GDN}.torch",
           description="gated delta rule and gated norm of the gated-DeltaNet layers",
           gates=("parity", "speed", "validation_cost", *MODEL_LEVEL)),
    Family(NORM_MLP, NormMlp, baseline=f"{NORM_MLP}.torch", oracle=f"{NORM_MLP}.oracle",
           description="RMSNorm of the decoder layers and the SwiGLU activation of their MLP",
           gates=("parity", *MODEL_LEVEL)),
)

REFERENCES: tuple[Route, ...] = (
    Route(f"{GDN}.oracle", GDN, "oracle", impl=f"{_GDN}:ORACLE",
          description="the gated delta rule one token at a time in fp64"),
    Route(f"{GDN}.torch", GDN, "baseline", impl=f"{_GDN}:TORCH", default_enabled=True,
          description="transformers' torch fallback of Qwen3.5 (the dispatch point's "
                      "__wrapped__) and its Qwen3_5RMSNormGated"),
    Route(f"{NORM_MLP}.oracle", NORM_MLP, "oracle", impl=f"{_NORM}:ORACLE",
          description="RMSNorm and silu(gate) * up in fp64"),
    Route(f"{NORM_MLP}.torch", NORM_MLP, "baseline", impl=f"{_NORM}:TORCH",
          default_enabled=True,
          description="transformers' Qwen3_5RMSNorm and its MLP's silu(gate) * up"),
    # the ground of norm_mlp.liger_swiglu: an engine's gated MLPs are otherwise NVFP4 codes with
    # silu(gate) * up fused into gemm.nvfp4's gate_up, where no SiLU-mul can be swapped
    Route(f"{NORM_MLP}.torch_mlp", NORM_MLP, "baseline", impl=f"{_NORM}:TORCH_MLP",
          description="transformers' own Qwen3_5MLP in the checkpoint's weights (no NVFP4): "
                      "the baseline Liger's SwiGLU MLP is compared with"),
)

CANDIDATES: tuple[Route, ...] = (
    # flash-linear-attention (fla-core)
    Route(f"{GDN}.fla_chunk", GDN, "candidate", baseline=f"{GDN}.torch",
          gates=("parity", "speed", "validation_cost", *MODEL_LEVEL),
          impl=f"{_GDN}:FLA_CHUNK", probe=f"{_PROBE}:fla",
          description="fla chunk_gated_delta_rule for prefill chunks (M > 8)"),
    # not ppl: scoring a segment prefills it in blocks of more than 8 tokens, so this route never
    # serves a call there (its hits stay empty); greedy decoding's one-token steps are its calls
    Route(f"{GDN}.fla_recurrent", GDN, "candidate", baseline=f"{GDN}.torch",
          gates=("parity", "quality"), impl=f"{_GDN}:FLA_RECURRENT",
          probe=f"{_PROBE}:fla",
          description="fla fused_recurrent_gated_delta_rule for decode and verify (M <= 8)"),
    Route(f"{GDN}.fla_norm", GDN, "candidate", baseline=f"{GDN}.torch",
          gates=("parity", *MODEL_LEVEL), impl=f"{_GDN}:FLA_NORM", probe=f"{_PROBE}:fla",
          description="fla FusedRMSNormGated's rms_norm_gated for the layers' output norm"),
    # Liger (liger-kernel)
    Route(f"{NORM_MLP}.liger_rmsnorm", NORM_MLP, "candidate", baseline=f"{NORM_MLP}.torch",
          gates=("parity", *MODEL_LEVEL), impl=f"{_NORM}:LIGER_RMSNORM",
          probe=f"{_PROBE}:liger",
          description="Liger's RMSNorm (offset 1, gemma casting), apply_liger_kernel_to_qwen3_5"),
    Route(f"{NORM_MLP}.liger_swiglu", NORM_MLP, "candidate", baseline=f"{NORM_MLP}.torch_mlp",
          gates=("parity", "ppl", "quality"), impl=f"{_NORM}:LIGER_SWIGLU",
          probe=f"{_PROBE}:liger",
          description="Liger's SiLU-mul of its SwiGLU MLP, apply_liger_kernel_to_qwen3_5"),
    # torch's SDPA backends, one forced at a time
    Route(f"{ATTN}.sdpa_flash", ATTN, "candidate", baseline=f"{ATTN}.sdpa",
          gates=("parity", "speed", *MODEL_LEVEL), impl=f"{_SDPA}:FLASH",
          probe=f"{_PROBE}:sdpa_backend", dtypes=HALF,
          description="torch SDPA forced to its flash backend (sdpa_kernel); float16 and "
                      "bfloat16 only"),
    Route(f"{ATTN}.sdpa_efficient", ATTN, "candidate", baseline=f"{ATTN}.sdpa",
          gates=("parity", "speed", *MODEL_LEVEL), impl=f"{_SDPA}:EFFICIENT",
          probe=f"{_PROBE}:sdpa_backend",
          description="torch SDPA forced to its memory-efficient backend (sdpa_kernel)"),
    Route(f"{ATTN}.sdpa_cudnn", ATTN, "candidate", baseline=f"{ATTN}.sdpa",
          gates=("parity", "speed", *MODEL_LEVEL), impl=f"{_SDPA}:CUDNN",
          probe=f"{_PROBE}:sdpa_backend", dtypes=HALF,
          description="torch SDPA forced to its cuDNN backend (sdpa_kernel); float16 and "
                      "bfloat16 only"),
)


def pytest_dflash_routes(registry) -> None:
    """Declare the library families and register their oracles and baselines (every session;
    the candidates come with the transformers engine: :data:`CANDIDATES`)."""
    for family in FAMILIES:
        registry.declare(family)
    for route in REFERENCES:
        registry.register(route)


def register_candidates(registry) -> None:
    """Register :data:`CANDIDATES` (the transformers engine's hook calls this)."""
    for route in CANDIDATES:
        registry.register(route)
