"""Availability probes of the library routes: None when the route can run here, else the reason.

A probe is asked before a gate runs its route; a reason leaves the gate pending with that reason
(never passed, never crashed). The libraries are Triton code for CUDA devices, and torch's flash,
memory-efficient and cuDNN SDPA backends are CUDA kernels, so on a machine without CUDA every
library route says so; a library that is not installed says how to install it.
"""

from __future__ import annotations

import importlib.util

EXTRA = "pip install 'pytest-dflash[gpu-routes]'"
# import name -> distribution name, for the install hint
DISTRIBUTIONS = {"fla": "fla-core", "einops": "einops", "liger_kernel": "liger-kernel",
                 "triton": "triton"}


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (a module blocked with ``sys.modules[name] = None``
    counts as absent, as Python's import would)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[name] is None or has no spec
        return False


def missing(*modules: str) -> str | None:
    """The install hint naming the libraries of ``modules`` that are absent, None if none is."""
    absent = [DISTRIBUTIONS.get(m, m) for m in modules if not installed(m)]
    if not absent:
        return None
    return f"{', '.join(absent)} not installed: {EXTRA}"


def no_cuda(what: str) -> str | None:
    """None when torch sees a CUDA device, else why ``what`` cannot run here."""
    import torch

    if torch.cuda.is_available():
        return None
    return (f"needs a CUDA device: {what}; this machine has none (run the gates on a GPU with "
            "--dflash-device cuda)")


def fla() -> str | None:
    """flash-linear-attention's gated-delta-rule kernels and gated norm (Triton)."""
    return missing("fla", "einops", "triton") or no_cuda(
        "flash-linear-attention's kernels are Triton code for CUDA devices")


def liger() -> str | None:
    """Liger's RMSNorm and SwiGLU kernels (Triton)."""
    return missing("liger_kernel", "triton") or no_cuda(
        "Liger's kernels are Triton code for CUDA devices")


def sdpa_backend() -> str | None:
    """torch's flash, memory-efficient and cuDNN SDPA backends (CUDA kernels; the CPU has only
    its own flash and math backends)."""
    return no_cuda("torch's flash, memory-efficient and cuDNN SDPA backends are CUDA kernels")
