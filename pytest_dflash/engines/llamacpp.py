"""Routes of a llama.cpp server (llama-cpp-python's ``llama_cpp.server``), gated by the shipped
model-level gates through the server engine (docs/engines.md, "llama.cpp").

Load it as a plugin next to ``--dflash-serve`` (``-p pytest_dflash.engines.llamacpp``). Each
route is one of llama.cpp's own settings, switched through the environment the plugin gives the
server of a selection (``Route.server_env``): llama_cpp.server reads its settings from the
environment where its command line leaves them out (``FLASH_ATTN``, ``N_UBATCH``, ``TYPE_K``,
``TYPE_V``), so the command stays the same for every selection and the switches are llama.cpp's.

The routes join the ``prefill.geometry`` family, whose ppl, quality and prefill gates they
need: they are the served engine's numerics and prefill geometry, as the shipped geometry routes
are the reference engine's. The baseline selection is llama.cpp's defaults (no switch set:
flash attention off, ``n_ubatch`` 512, f16 KV cache). llama.cpp quantizes the V cache only with
flash attention on, so the KV-cache routes are judged against flash attention with the f16
cache (their ``baseline``): the one difference between the two servers is the cache type.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from pytest_dflash.routes.registry import Route

FAMILY = "prefill.geometry"
BASELINE = f"{FAMILY}.fp32_q3296"  # the family's baseline: a server started with no switch
FLASH_ATTN = f"{FAMILY}.llamacpp_flash_attn"
UBATCH = f"{FAMILY}.llamacpp_ubatch64"
KV_Q8_0 = f"{FAMILY}.llamacpp_kv_q8_0"
KV_Q4_0 = f"{FAMILY}.llamacpp_kv_q4_0"

# ggml tensor types (ggml.h, enum ggml_type): what llama_cpp.server's type_k / type_v take
GGML_Q4_0, GGML_Q8_0 = 2, 8
N_CTX = 4096  # the tiny model's max_position_embeddings
# the server's context holds a scored context of N_CTX tokens (the ci profile's long contexts)
# and the one token the scoring completion generates, which nobody reads
N_CTX_SERVED = N_CTX + 16

LLAMACPP_ROUTES: tuple[Route, ...] = (
    Route(
        FLASH_ATTN,
        FAMILY,
        "candidate",
        baseline=BASELINE,
        gates=("ppl", "quality"),
        server_env={"FLASH_ATTN": "true"},
        description="llama.cpp flash attention on (default off in llama_cpp.server)",
    ),
    Route(
        UBATCH,
        FAMILY,
        "candidate",
        baseline=BASELINE,
        gates=("prefill", "ppl", "quality"),
        server_env={"N_UBATCH": "64"},
        description="llama.cpp prefill in physical batches of 64 tokens (default 512)",
    ),
    Route(
        KV_Q8_0,
        FAMILY,
        "candidate",
        baseline=FLASH_ATTN,
        gates=("ppl", "quality"),
        server_env={"FLASH_ATTN": "true", "TYPE_K": str(GGML_Q8_0), "TYPE_V": str(GGML_Q8_0)},
        description="llama.cpp KV cache in q8_0 (K and V) against f16, flash attention on",
    ),
    Route(
        KV_Q4_0,
        FAMILY,
        "candidate",
        baseline=FLASH_ATTN,
        gates=("ppl", "quality"),
        server_env={"FLASH_ATTN": "true", "TYPE_K": str(GGML_Q4_0), "TYPE_V": str(GGML_Q4_0)},
        description="llama.cpp KV cache in q4_0 (K and V) against f16, flash attention on",
    ),
)


def pytest_dflash_routes(registry) -> None:
    """Register the llama.cpp routes (the shipped family ``prefill.geometry`` declares them)."""
    for route in LLAMACPP_ROUTES:
        registry.register(route)


def serve_command(gguf: str | Path, python: str | None = None, n_ctx: int = N_CTX_SERVED) -> str:
    """The ``--dflash-serve`` command that serves ``gguf`` with llama_cpp.server on ``{port}``.

    Nothing a route switches is on the command line (a command-line value would override the
    route's environment setting); ``interrupt_requests`` is off so a streamed prefill is never
    cut short by the next request.
    """
    return (
        f"{shlex.quote(python or sys.executable)} -m llama_cpp.server --model "
        f"{shlex.quote(str(Path(gguf)))} "
        f"--host 127.0.0.1 --port {{port}} --n_ctx {n_ctx} --interrupt_requests false"
    )
