"""NVFP4 weights: E2M1 codes, one E4M3 scale per 16 K elements, one fp32 global scale.

This is the checkpoint form every gemm.nvfp4 route starts from (docs/families.md, "NVFP4 weights"):

- codes: E2M1, 4 bits, sign in bit 3, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6};
- ``packed``: uint8 ``[N, K/2]``, element ``k`` even in the low nibble, ``k`` odd in the high one;
- ``scales``: ``float8_e4m3fn`` ``[N, K/16]``, one per 16 consecutive K elements;
- ``global_scale``: one fp32 per tensor, ModelOpt convention ``global = amax / (6 * 448)``.

``dequantized = e2m1(code) * e4m3(scale) * global``. The E4M3 rounding is torch's own
``float8_e4m3fn`` conversion, never a hand-written one, so what we quantize is exactly what a
checkpoint produced by torch-based tooling (ModelOpt) contains.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

GROUP_K = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# ModelOpt: global = amax / (6 * 448), so the largest block scale lands on E4M3's maximum.
GLOBAL_DIVISOR = E2M1_MAX * E4M3_MAX

# Magnitude of the 3 low bits of a code; bit 3 is the sign.
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; a value exactly on one rounds to the even code
# (IEEE round-half-to-even on the 1-bit mantissa), as a hardware E2M1 conversion does.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_ROUNDING_UP = (0.75, 1.75, 3.5)  # the lower neighbour of these has an odd code


def e2m1_table(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Tensor:
    """Value of each of the 16 E2M1 codes (index = code)."""
    values = list(_E2M1_MAGNITUDES) + [-v for v in _E2M1_MAGNITUDES]
    return torch.tensor(values, dtype=dtype, device=device)


@functools.lru_cache(maxsize=32)
def _byte_table(dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[256, 2]``: the E2M1 values of a packed byte's low and high nibble (read-only, cached).

    Cached per device because building it is a host-to-device copy, which on CUDA waits for
    every queued kernel: once per dequantize, it serialised the reference engine's decode step.
    """
    table = e2m1_table(dtype, device)
    byte = torch.arange(256, device=device)
    return torch.stack((table[byte & 0x0F], table[byte >> 4]), dim=-1)


@dataclass(frozen=True, eq=False)
class NVFP4Weight:
    """One NVFP4 weight of logical shape ``(N, K)``.

    Construction validates the fields (see :func:`validate`), so a checkpoint with the wrong
    dtype, shape or a NaN scale fails where it is loaded, not as garbage output several layers
    later. ``global_scale`` may be given as a float or a one-element fp32 tensor; it is stored
    as a Python float so the routes never synchronize a device to read it. ``shape`` defaults
    to ``(N, 2 * packed.shape[1])``. ``eq=False``: weights compare by identity (tensor fields
    have no single truth value), which also makes them usable as cache keys.
    """

    packed: Tensor
    scales: Tensor
    global_scale: float
    shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_scale", _global_as_float(self.global_scale))
        if self.shape is None and isinstance(self.packed, Tensor) and self.packed.dim() == 2:
            object.__setattr__(self, "shape", (self.packed.shape[0], 2 * self.packed.shape[1]))
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        validate(self)

    @property
    def n(self) -> int:
        return self.shape[0]

    @property
    def k(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.packed.device


def _global_as_float(value: object) -> float:
    if isinstance(value, Tensor):
        if value.dtype != torch.float32:
            raise ValueError(
                f"global_scale is a {value.dtype} tensor; NVFP4 stores it as fp32 "
                "(ModelOpt 'weight_scale_2'): pass value.float() or a Python float"
            )
        if value.numel() != 1:
            raise ValueError(
                f"global_scale must be one value per tensor, got shape {tuple(value.shape)}; "
                "per-channel global scales are not NVFP4: fold them into the block scales"
            )
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"global_scale must be a float or a one-element fp32 tensor, got "
            f"{type(value).__name__}"
        )
    # Round through fp32: the format holds an fp32 global, and the routes multiply fp32 tensors
    # by it, so a float64 value would be rounded there anyway, differently per route.
    return float(torch.tensor(float(value), dtype=torch.float32).item())


def validate(w: NVFP4Weight) -> NVFP4Weight:
    """Check a weight's fields; raise ValueError naming the field and the fix.

    Runs at construction and may be called again after the tensors were modified in place
    (the dataclass is frozen, the tensor contents are not).
    """
    packed, scales, shape = w.packed, w.scales, w.shape
    if not isinstance(packed, Tensor):
        raise ValueError(f"packed must be a uint8 tensor [N, K/2], got {type(packed).__name__}")
    if not isinstance(scales, Tensor):
        raise ValueError(
            f"scales must be a float8_e4m3fn tensor [N, K/16], got {type(scales).__name__}"
        )
    if packed.dtype != torch.uint8:
        fix = (
            "reinterpret the bytes with packed.view(torch.uint8)"
            if packed.element_size() == 1
            else "pack two 4-bit codes per byte (low nibble = even k) into uint8"
        )
        raise ValueError(f"packed has dtype {packed.dtype}, expected torch.uint8: {fix}")
    if packed.dim() != 2:
        raise ValueError(f"packed must be 2-D [N, K/2], got shape {tuple(packed.shape)}")
    if shape is None or len(shape) != 2:
        raise ValueError(f"shape must be (N, K), got {shape!r}")
    n, k = shape
    if n <= 0 or k <= 0:
        raise ValueError(f"shape (N, K) must be positive, got {shape}")
    if k % GROUP_K:
        raise ValueError(
            f"K = {k} is not a multiple of {GROUP_K}: NVFP4 has one block scale per {GROUP_K} "
            f"K elements; pad K with zero columns to {math.ceil(k / GROUP_K) * GROUP_K}"
        )
    if tuple(packed.shape) != (n, k // 2):
        hint = " (it looks unpacked: one code per byte)" if tuple(packed.shape) == (n, k) else ""
        raise ValueError(
            f"packed has shape {tuple(packed.shape)}, expected [N, K/2] = {(n, k // 2)} for "
            f"shape {shape}{hint}; two codes per byte, low nibble = even k"
        )
    if scales.dtype != torch.float8_e4m3fn:
        fix = (
            "reinterpret raw E4M3 bytes with scales.view(torch.float8_e4m3fn)"
            if scales.dtype in (torch.uint8, torch.int8)
            else "convert with scales.to(torch.float8_e4m3fn)"
        )
        raise ValueError(f"scales has dtype {scales.dtype}, expected float8_e4m3fn: {fix}")
    if tuple(scales.shape) != (n, k // GROUP_K):
        raise ValueError(
            f"scales has shape {tuple(scales.shape)}, expected [N, K/16] = {(n, k // GROUP_K)} "
            f"for shape {shape}: one E4M3 scale per {GROUP_K} consecutive K elements"
        )
    if scales.device != packed.device:
        raise ValueError(
            f"packed is on {packed.device} but scales on {scales.device}: move both to one device"
        )
    scale_values = scales.float()
    if not bool(torch.isfinite(scale_values).all()):
        bad = (~torch.isfinite(scale_values)).nonzero()[0].tolist()
        raise ValueError(
            f"scales contain NaN (first at index {bad}); the checkpoint is corrupt or was "
            "converted without saturation: requantize the weight"
        )
    if bool((scale_values < 0).any()):
        raise ValueError(
            "scales contain negative values; NVFP4 block scales are magnitudes (the sign lives "
            "in the E2M1 codes): requantize the weight"
        )
    g = w.global_scale
    if not math.isfinite(g) or g <= 0:
        raise ValueError(
            f"global_scale = {g} must be finite and > 0 (ModelOpt: amax / (6 * 448)); "
            "a zero or NaN global means the calibration amax was lost: requantize"
        )
    return w


def _nearest_e2m1_codes(q: Tensor) -> Tensor:
    """Nearest E2M1 code (uint8, 0..15) of each value; saturates at +-6, ties to even."""
    mag = q.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=q.dtype, device=q.device)
    index = torch.bucketize(mag, mids)  # ties round down
    for tie in _TIES_ROUNDING_UP:
        index += mag == tie
    negative = (q < 0) & (index > 0)  # canonical +0 for values that round to zero
    return (index + 8 * negative).to(torch.uint8)


def quantize(weight: Tensor) -> NVFP4Weight:
    """Quantize a float ``[N, K]`` weight to NVFP4 with the ModelOpt global convention.

    ``global = amax / (6 * 448)``; block scale ``= e4m3(block_amax / (6 * global))`` (clamped
    at 448 against fp32 rounding of the largest block); codes are the nearest E2M1 of
    ``w / (scale * global)``. An all-zero weight gets ``global = 1`` and zero scales, since a
    zero global is invalid (it carries no information and would divide by zero).
    """
    if not isinstance(weight, Tensor) or not weight.is_floating_point():
        raise ValueError(f"quantize takes a float tensor [N, K], got {weight!r:.80}")
    if weight.dim() != 2:
        raise ValueError(f"quantize takes a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if k % GROUP_K:
        raise ValueError(
            f"K = {k} is not a multiple of {GROUP_K}: pad the weight with zero columns to "
            f"{math.ceil(k / GROUP_K) * GROUP_K} before quantizing"
        )
    w = weight.detach().to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("weight contains NaN or Inf; NVFP4 cannot represent them: fix the weight")
    amax = w.abs().max()
    if float(amax) == 0.0:
        global_scale = torch.tensor(1.0, dtype=torch.float32, device=w.device)
    else:
        global_scale = amax / GLOBAL_DIVISOR
    blocks = w.view(n, k // GROUP_K, GROUP_K)
    block_amax = blocks.abs().amax(dim=-1)
    scales = (block_amax / (E2M1_MAX * global_scale)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (scales.float() * global_scale).unsqueeze(-1)
    q = torch.where(denom > 0, blocks / torch.where(denom > 0, denom, 1.0), 0.0)
    codes = _nearest_e2m1_codes(q).view(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return NVFP4Weight(packed.contiguous(), scales, global_scale, (n, k))


def unpack_codes(packed: Tensor) -> Tensor:
    """uint8 ``[N, K/2]`` packed bytes -> uint8 ``[N, K]`` codes (low nibble = even k)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).view(packed.shape[0], -1)


def dequantize(w: NVFP4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """``e2m1(code) * e4m3(scale) * global`` as a fresh ``[N, K]`` tensor of ``dtype``.

    The product is formed in ``dtype`` when it is fp64 (exact: the oracle) and in fp32
    otherwise, then cast: ``code * scale`` is exact in fp32, so the only rounding is the one
    multiplication by the global scale (and the final cast for fp16).
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    n, k = w.shape
    device = w.packed.device
    values = _byte_table(work, device)[w.packed.long()].view(n, k // GROUP_K, GROUP_K)
    scaled = values * w.scales.to(work).unsqueeze(-1)  # exact, like the codes themselves
    return (scaled * w.global_scale).view(n, k).to(dtype)
