"""QPN2 / QPN4: two views of ONE tile-ordered byte buffer of NVFP4 codes (docs/families.md,
"QPN layouts").

The small-M decode path reads the codes as QPN2 and the large-M prefill path as QPN4; since both
are views of the same storage, a model keeps one resident copy of its weight codes and the
prefill route costs no extra weight memory (only its bounded workspace).

Physical order (``T = Np / 32`` tiles, ``G = K / 16`` groups; ``Np`` = N padded to 32)::

    for t in range(T):             # 32-column N tile
        for g in range(G):         # 16-element K group
            for c in range(32):    # column n = 32 t + c of the tile
                8 bytes: codes (n, 16 g + 2 j) low nibble, (n, 16 g + 2 j + 1) high, j = 0..7

so the byte holding codes ``(n, k)`` and ``(n, k + 1)`` (k even) is at flat offset::

    o(n, k) = ((t * G + g) * 32 + c) * 8 + j,   t = n // 32, c = n % 32, g = k // 16,
                                                 j = (k % 16) // 2

Views (all of them share ``data_ptr``; none copies):

- ``qpn2 = buffer.view(Np, K/2)``: ``qpn2[r, b] = buffer[r * K/2 + b]``. A tile is
  ``32 * K/2`` bytes, i.e. exactly 32 rows, so ``qpn2[32 t : 32 t + 32]`` is tile ``t``: the
  small-M path walks the weight in row blocks of 32.
- ``qpn4 = buffer.view(K, Np/2)``: ``qpn4[r, b] = buffer[r * Np/2 + b]``. This is a pure
  reinterpretation of the same bytes as the K-major operand a prefill GEMM is handed; it is NOT
  a logical transpose (a byte holds two K neighbours of one column, never two N neighbours).
  Consumers recover the tile structure zero-copy with :func:`tile_view`, i.e.
  ``qpn4.view(T, G, 32, 8)[t, g, c, j] = buffer[o(32 t + c, 16 g + 2 j)]``.

Scales follow the same tile order, one E4M3 byte per (tile, group, column): ``[T, G, 32]``.
Two scale forms are offered: the raw E4M3 bytes (global applied in fp32 after the matmul) and
fp16 pre-multiplied by the global scale with a 2^14 bias (:data:`FP16_SCALE_BIAS`), so that
``e4m3 * global`` products of small-magnitude weights, which are often below fp16's smallest
subnormal (6e-8), stay representable; the bias is removed in fp32 after the matmul.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dflash_kernels.nvfp4 import E2M1_MAX, GROUP_K, NVFP4Weight, validate

TILE_N = 32
K_MULTIPLE = 64
BYTES_PER_GROUP_COLUMN = GROUP_K // 2
FP16_SCALE_BIAS = 2.0**14
_FP16_MAX = 65504.0


@dataclass(frozen=True, eq=False)
class QPNWeight:
    """The resident form of one NVFP4 weight for the QPN routes.

    ``buffer``: flat uint8 ``[Np * K/2]`` in tile order; ``scales``: uint8 ``[T, G, 32]`` raw
    E4M3 bytes in tile order; ``n`` is the logical (unpadded) N, outputs are sliced back to it.
    """

    buffer: Tensor
    scales: Tensor
    global_scale: float
    n: int
    k: int
    # per-weight memo: the fp16 scales, and each route's op arguments (built once, in prepare)
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def n_padded(self) -> int:
        return self.buffer.numel() * 2 // self.k

    @property
    def tiles(self) -> int:
        return self.n_padded // TILE_N

    @property
    def groups(self) -> int:
        return self.k // GROUP_K

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def qpn2(self) -> Tensor:
        """uint8 ``[Np, K/2]`` view; rows ``32 t .. 32 t + 31`` are tile ``t``."""
        return self.buffer.view(self.n_padded, self.k // 2)

    @property
    def qpn4(self) -> Tensor:
        """uint8 ``[K, Np/2]`` view of the same bytes (a reinterpretation, see module doc)."""
        return self.buffer.view(self.k, self.n_padded // 2)

    def scales_e4m3(self) -> Tensor:
        """The raw scale bytes as ``float8_e4m3fn [T, G, 32]`` (a view, no copy)."""
        return self.scales.view(torch.float8_e4m3fn)

    def scales_fp16_prescaled(self) -> Tensor:
        """fp16 ``[T, G, 32]`` = ``e4m3 * global * 2^14``, computed in fp32 and cached.

        Raises ValueError when a product, or the largest value it dequantizes (6 x product),
        overflows fp16 (weights with amax > 4): such weights must use the raw E4M3 form
        (:meth:`fp16_prescaled_or_none` picks it).
        """
        scales = self.fp16_prescaled_or_none()
        if scales is None:
            raise ValueError(
                f"fp16 pre-scaled scales overflow: max 6 * e4m3 * global * 2^14 exceeds "
                f"{_FP16_MAX} (global_scale = {self.global_scale:g}, i.e. weight amax > "
                f"{_FP16_MAX / FP16_SCALE_BIAS:.0f}); use the raw E4M3 form (scales_e4m3) "
                "and apply the global scale in fp32"
            )
        return scales

    def fp16_prescaled_or_none(self) -> Tensor | None:
        """The fp16 pre-scaled scales, or None when they (or 6 x them) would overflow fp16."""
        if "fp16" not in self._cache:
            product = self.scales_e4m3().float() * (self.global_scale * FP16_SCALE_BIAS)
            # the largest dequantized value, 6 x scale, must fit too: the CUDA large-M path
            # holds e2m1 x scale in an fp16 workspace
            ok = (bool(torch.isfinite(product).all())
                  and float(product.max()) * E2M1_MAX <= _FP16_MAX)
            self._cache["fp16"] = product.half() if ok else None
        return self._cache["fp16"]


def tile_view(view: Tensor, tiles: int, groups: int) -> Tensor:
    """``[T, G, 32, 8]`` zero-copy view of a QPN2 or QPN4 view (both contiguous, same bytes)."""
    return view.view(tiles, groups, TILE_N, BYTES_PER_GROUP_COLUMN)


def prepare_qpn2(w: NVFP4Weight, *, pad_n: bool = True) -> QPNWeight:
    """Build the tile-ordered buffer (and tile-ordered scales) from an NVFP4 weight.

    ``pad_n``: N is padded with zero columns (code 0, scale 0) up to a multiple of 32 and the
    routes slice their output back; with ``pad_n=False`` an unaligned N is an error instead.
    """
    validate(w)
    n, k = w.shape
    if k % K_MULTIPLE:
        raise ValueError(
            f"K = {k} breaks the QPN shape contract K % {K_MULTIPLE} == 0 (docs/families.md); "
            f"pad K with zero columns to {-(-k // K_MULTIPLE) * K_MULTIPLE} before quantizing, "
            "or use the turbomind route for this layer"
        )
    n_padded = -(-n // TILE_N) * TILE_N
    if n_padded != n and not pad_n:
        raise ValueError(
            f"N = {n} breaks the QPN shape contract N % {TILE_N} == 0; pass pad_n=True to pad "
            f"with zero columns to {n_padded} (outputs are sliced back to N)"
        )
    packed = w.packed.contiguous()
    scales = w.scales.view(torch.uint8).contiguous()
    if n_padded != n:
        packed = torch.cat([packed, packed.new_zeros(n_padded - n, k // 2)])
        scales = torch.cat([scales, scales.new_zeros(n_padded - n, k // GROUP_K)])
    tiles, groups = n_padded // TILE_N, k // GROUP_K
    buffer = (
        packed.view(tiles, TILE_N, groups, BYTES_PER_GROUP_COLUMN)
        .permute(0, 2, 1, 3)
        .contiguous()
        .view(-1)
    )
    tile_scales = scales.view(tiles, TILE_N, groups).permute(0, 2, 1).contiguous()
    return QPNWeight(buffer, tile_scales, w.global_scale, n, k)
