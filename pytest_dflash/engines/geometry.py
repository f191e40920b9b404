"""Routes of the ``prefill.geometry`` family: SSM state dtype + prefill chunk size
(docs/families.md).

The target deployment prefilled in chunks of Q = 3296 or 6592 tokens with an fp32 SSM state and
7920 tokens with an fp16 state (a 2-byte state fits more tokens in the same aligned cache block).
CPU profiles keep the ratios and divide the sizes, so a chunk-count or dtype effect that decides
a gate on the GPU is still present, at a size a laptop prefills in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytest_dflash.policy.profiles import SIZES
from pytest_dflash.routes.vocabulary import PROFILES

# full = the deployment's sizes; ci and quick divide every chunk by the same factor
# (ProfileSizes.geometry_divisor; kept under this name for code that reads it)
PROFILE_DIVISOR: dict[str, int] = {name: s.geometry_divisor for name, s in SIZES.items()}
KV_BLOCK_SIZE = 32  # tokens per paged-KV block (every chunk size below is a multiple of 1)


@dataclass(frozen=True)
class Geometry:
    """One geometry route: the SSM state dtype and the deployment's prefill chunk size."""

    name: str
    state_dtype: torch.dtype
    full_chunk: int

    def chunk(self, profile: str) -> int:
        """Prefill chunk size Q for ``profile`` (same ratios in every profile)."""
        if profile not in PROFILE_DIVISOR:
            raise ValueError(
                f"unknown profile {profile!r} for geometry {self.name}; known: {PROFILES}"
            )
        return self.full_chunk // PROFILE_DIVISOR[profile]

    def __repr__(self) -> str:
        return f"<Geometry {self.name}: {str(self.state_dtype).removeprefix('torch.')} state, " \
               f"Q{self.full_chunk}>"


FP32_Q3296 = Geometry("prefill.geometry.fp32_q3296", torch.float32, 3296)
FP32_Q6592 = Geometry("prefill.geometry.fp32_q6592", torch.float32, 6592)
FP16_Q7920 = Geometry("prefill.geometry.fp16_q7920", torch.float16, 7920)
# Not a route: the fp64-state geometry of the fp64 reference engine, which measures the fp32
# engine's own rounding spread that the agreement bound derives from (docs/gates.md,
# "Cross-route agreement").
REFERENCE_FP64 = Geometry("prefill.geometry.reference_fp64", torch.float64, 3296)
