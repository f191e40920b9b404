"""Torch reference of the QPN kernels: for tests only, never a route.

The routes run the native ops (:mod:`dflash_kernels.qpn_native`); this module computes the same
thing in plain torch from the same tile-ordered buffer, so tests can check the native kernels'
index math and scale handling against an independent implementation:

- :func:`qpn2_linear`: small-M, fp32 dequantized slices of ``SPLIT_K`` K multiplied and added
  in slice order, global scale in fp32 at the end;
- :func:`qpn4_bounded_linear`: the bounded large-M path, chunk of whole 32-column tiles by chunk
  (fp16 inputs use the fp16 pre-scaled scales with the 2^14 bias when representable, removed in
  fp32 at the end).

Both accumulate in fp32 (on the CPU through torch's GEMM), so they agree with the native kernels
to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_kernels.nvfp4 import GROUP_K, e2m1_table
from dflash_kernels.qpn import FP16_SCALE_BIAS, TILE_N, QPNWeight, tile_view

SPLIT_K = 256


def _e4m3(raw: Tensor) -> Tensor:
    return raw.view(torch.float8_e4m3fn).float()


def _decode(codes: Tensor, scales32: Tensor) -> Tensor:
    """Tiles ``codes [t, g, 32, 8]`` with fp32 ``scales [t, g, 32]`` -> fp32 ``[t * 32, g * 16]``
    (row = column n, K contiguous)."""
    t, g = codes.shape[0], codes.shape[1]
    values = e2m1_table(torch.float32, codes.device)
    pairs = torch.stack((values[(codes & 0x0F).long()], values[(codes >> 4).long()]), dim=-1)
    w = pairs.view(t, g, TILE_N, GROUP_K) * scales32.unsqueeze(-1)
    return w.permute(0, 2, 1, 3).reshape(t * TILE_N, g * GROUP_K)


def finish(y: Tensor, n: int, gated: bool, dtype: torch.dtype) -> Tensor:
    """Slice padding away, apply the SiLU gate in fp32, cast once."""
    y = y[:, :n]
    if gated:
        y = F.silu(y[:, : n // 2]) * y[:, n // 2 :]
    return y.to(dtype).contiguous()


def qpn2_linear(x: Tensor, w: QPNWeight, gated: bool = False) -> Tensor:
    """The small-M path: slices of ``SPLIT_K`` K, partial products added in slice order."""
    codes = tile_view(w.qpn2, w.tiles, w.groups)
    scales32 = _e4m3(w.scales)
    x32 = x.float()
    out = torch.zeros(x.shape[0], w.n_padded, dtype=torch.float32, device=x.device)
    step = SPLIT_K // GROUP_K
    for g0 in range(0, w.groups, step):
        g1 = min(w.groups, g0 + step)
        part = _decode(codes[:, g0:g1], scales32[:, g0:g1])
        out.addmm_(x32[:, g0 * GROUP_K : g1 * GROUP_K], part.T)
    return finish(out * w.global_scale, w.n, gated, x.dtype)


def qpn4_bounded_linear(x: Tensor, w: QPNWeight, bound_bytes: int, gated: bool = False) -> Tensor:
    """The large-M path: as many whole tiles per chunk as ``bound_bytes`` of fp32 values hold."""
    codes = tile_view(w.qpn4, w.tiles, w.groups)
    per_tile = TILE_N * w.k * 4
    chunk = min(w.tiles, bound_bytes // per_tile)
    if chunk < 1:
        raise ValueError(f"bound {bound_bytes} is below one tile ({per_tile} bytes)")
    fp16 = w.fp16_prescaled_or_none() if x.dtype == torch.float16 else None
    if fp16 is not None:
        scales32, unscale = fp16.float(), 1.0 / FP16_SCALE_BIAS
    else:
        scales32, unscale = _e4m3(w.scales), w.global_scale
    x32 = x.float()
    out = torch.empty(x.shape[0], w.n_padded, dtype=torch.float32, device=x.device)
    for t0 in range(0, w.tiles, chunk):
        t1 = min(w.tiles, t0 + chunk)
        out[:, t0 * TILE_N : t1 * TILE_N] = x32 @ _decode(codes[t0:t1], scales32[t0:t1]).T
    return finish(out * unscale, w.n, gated, x.dtype)
