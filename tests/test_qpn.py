"""QPN2 / QPN4: one tile-ordered buffer, the documented index math, scale forms, padding."""

from __future__ import annotations

import pytest
import torch

from dflash_kernels.nvfp4 import quantize
from dflash_kernels.qpn import FP16_SCALE_BIAS, QPNWeight, prepare_qpn2, tile_view


def _prepared(n: int = 64, k: int = 128, seed: int = 0, scale: float = 0.05):
    gen = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=gen) * scale)
    return w, prepare_qpn2(w)


def test_buffer_follows_the_documented_offset_formula() -> None:
    w, q = _prepared(n=96, k=192)
    n_idx = torch.arange(96)[:, None]
    k_idx = torch.arange(0, 192, 2)[None, :]
    t, c, g, j = n_idx // 32, n_idx % 32, k_idx // 16, (k_idx % 16) // 2
    offset = ((t * q.groups + g) * 32 + c) * 8 + j
    assert torch.equal(q.buffer[offset], w.packed)


def test_qpn2_and_qpn4_are_views_of_the_same_bytes() -> None:
    _, q = _prepared(n=64, k=256)
    assert q.qpn2.shape == (64, 128)
    assert q.qpn4.shape == (256, 32)
    assert q.qpn2.data_ptr() == q.qpn4.data_ptr() == q.buffer.data_ptr()
    assert q.qpn2.untyped_storage().data_ptr() == q.qpn4.untyped_storage().data_ptr()
    assert tile_view(q.qpn4, q.tiles, q.groups).data_ptr() == q.buffer.data_ptr()
    # same storage, not equal copies: a write through one view shows through the other
    before = int(q.qpn2[1, 3])
    q.qpn4.view(-1)[128 + 3] = (before + 1) % 256
    assert int(q.qpn2[1, 3]) == (before + 1) % 256


def test_qpn2_rows_of_a_tile_are_that_tile() -> None:
    _, q = _prepared(n=64, k=128)
    tiles = tile_view(q.qpn2, q.tiles, q.groups)
    assert torch.equal(q.qpn2[32:64].reshape(-1), tiles[1].reshape(-1))


def test_scales_are_raw_e4m3_bytes_in_tile_order() -> None:
    w, q = _prepared(n=64, k=128)
    raw = w.scales.view(torch.uint8)
    tile, group, col = 1, 5, 7
    assert q.scales.dtype == torch.uint8
    assert int(q.scales[tile, group, col]) == int(raw[32 * tile + col, group])
    assert torch.equal(q.scales_e4m3().float().sum(), w.scales.float().sum())


def test_n_is_padded_with_zero_columns() -> None:
    w, q = _prepared(n=70, k=64)
    assert (q.n, q.n_padded, q.tiles) == (70, 96, 3)
    tiles = tile_view(q.qpn2, q.tiles, q.groups)
    assert torch.count_nonzero(tiles[2, :, 6:]) == 0
    assert torch.count_nonzero(q.scales[2, :, 6:]) == 0
    assert torch.equal(tiles[2, :, :6].permute(1, 0, 2).reshape(6, -1), w.packed[64:70])


def test_contract_errors_name_the_contract() -> None:
    w, _ = _prepared(n=70, k=64)
    with pytest.raises(ValueError, match="N % 32 == 0; pass pad_n=True"):
        prepare_qpn2(w, pad_n=False)
    w96 = quantize(torch.randn(32, 96))
    with pytest.raises(ValueError, match="K % 64 == 0"):
        prepare_qpn2(w96)


def test_fp16_prescaled_scales_carry_the_bias() -> None:
    w, q = _prepared()
    expected = (w.scales.float() * w.global_scale * FP16_SCALE_BIAS).half()
    got = q.scales_fp16_prescaled()
    assert got.dtype == torch.float16
    assert torch.equal(got[1, 2, 3], expected[32 + 3, 2])


def test_small_weights_underflow_fp16_without_the_bias() -> None:
    w, q = _prepared(scale=1e-7)
    exact = q.scales_e4m3().float() * w.global_scale  # what the kernel needs, in fp32
    nonzero = exact > 0
    unbiased = exact.half().float()
    biased = q.scales_fp16_prescaled().float() / FP16_SCALE_BIAS
    unbiased_err = ((unbiased - exact).abs() / exact)[nonzero]
    biased_err = ((biased - exact).abs() / exact)[nonzero]
    assert float(unbiased_err.max()) > 0.1  # fp16 subnormals or zero: unusable
    assert float(biased_err.max()) <= 2.0**-11  # normal fp16: half an ulp


def test_large_weights_refuse_the_fp16_form_with_the_fix() -> None:
    _, q = _prepared(scale=50.0)
    assert q.fp16_prescaled_or_none() is None
    with pytest.raises(ValueError, match="use the raw E4M3 form"):
        q.scales_fp16_prescaled()


def test_qpn_weight_needs_no_copy_to_rebuild() -> None:
    _, q = _prepared()
    again = QPNWeight(q.buffer, q.scales, q.global_scale, q.n, q.k)
    assert again.qpn4.data_ptr() == q.qpn2.data_ptr()
