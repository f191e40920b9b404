"""NVFP4 quantize / dequantize / validate against the format's definition (docs/families.md)."""

from __future__ import annotations

import pytest
import torch

from dflash_kernels.nvfp4 import (
    GLOBAL_DIVISOR,
    NVFP4Weight,
    dequantize,
    e2m1_table,
    quantize,
    unpack_codes,
    validate,
)


def _weight(n: int = 24, k: int = 64, seed: int = 0, scale: float = 0.05) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * scale


def test_e2m1_table_has_sign_in_bit_3() -> None:
    table = e2m1_table()
    assert table[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert torch.equal(table[8:], -table[:8])


def test_global_scale_follows_modelopt_convention() -> None:
    w = _weight()
    q = quantize(w)
    expected = (w.abs().max() / GLOBAL_DIVISOR).item()
    assert q.global_scale == expected
    assert GLOBAL_DIVISOR == 6 * 448


def test_block_scales_are_e4m3_of_block_amax_over_six_globals() -> None:
    w = _weight(n=8, k=128, seed=1)
    q = quantize(w)
    target = w.view(8, 8, 16).abs().amax(-1) / (6 * q.global_scale)
    got = q.scales.float()
    # E4M3 has 3 mantissa bits: a correctly rounded normal value is within 2^-4 relative
    assert torch.all((got - target).abs() <= target * 2.0**-4 + 2.0**-10)
    assert q.scales.dtype == torch.float8_e4m3fn
    assert float(got.max()) == 448.0  # the block holding amax lands on E4M3's maximum


def test_codes_are_the_nearest_representable_value() -> None:
    w = _weight(n=6, k=64, seed=2)
    q = quantize(w)
    step = (q.scales.float() * q.global_scale).repeat_interleave(16, dim=1)  # [N, K]
    candidates = e2m1_table()[None, None, :] * step[..., None]  # every value of the block
    best = (candidates - w[..., None]).abs().min(dim=-1).values
    chosen = (dequantize(q) - w).abs()
    # the quantizer divides by the step, this check multiplies: allow fp32 rounding of that
    assert torch.all(chosen <= best + step * 1e-6)


def test_low_nibble_holds_even_k_and_sign_bit_is_bit_3() -> None:
    w = torch.zeros(1, 16)
    w[0, 0], w[0, 1] = 0.5, -6.0  # amax 6: global = 6/2688, block scale 448, step exactly ~1
    q = quantize(w)
    assert q.packed.shape == (1, 8)
    assert int(q.packed[0, 0]) == 0x01 | (0x0F << 4)  # code(0.5) = 1 low, code(-6) = 15 high


def test_ties_round_to_even_codes() -> None:
    # amax 2.625 makes global = 2^-10 and the step 448 * 2^-10 = 7/16, all exact in fp32
    step = 448 * 2.0**-10
    ratios = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -3.5, 0, 0, 0, 0, 0, 0]
    w = torch.tensor([ratios]) * step
    q = quantize(w)
    assert q.global_scale == 2.0**-10
    got = (dequantize(q) / step)[0, :10].tolist()
    assert got == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, -4.0]


def test_quantize_is_idempotent_on_representable_weights() -> None:
    once = dequantize(quantize(_weight(seed=3)))
    twice = dequantize(quantize(once))
    assert torch.equal(once, twice)


def test_unpack_inverts_packing() -> None:
    q = quantize(_weight(seed=4))
    codes = unpack_codes(q.packed)
    assert torch.equal(codes[:, 0::2] | (codes[:, 1::2] << 4), q.packed)


def test_dequantize_fp64_is_exact_product() -> None:
    q = quantize(_weight(seed=5))
    d64 = dequantize(q, torch.float64)
    codes = unpack_codes(q.packed).long()
    manual = (
        e2m1_table(torch.float64)[codes]
        * q.scales.double().repeat_interleave(16, dim=1)
        * q.global_scale
    )
    assert torch.equal(d64, manual)
    assert torch.equal(dequantize(q), d64.float())


def test_all_zero_weight_quantizes_to_zero() -> None:
    q = quantize(torch.zeros(4, 32))
    assert q.global_scale == 1.0
    assert torch.count_nonzero(dequantize(q)) == 0


def test_global_scale_tensor_is_accepted_as_fp32() -> None:
    q = quantize(_weight())
    again = NVFP4Weight(q.packed, q.scales, torch.tensor(q.global_scale), q.shape)
    assert again.global_scale == q.global_scale


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda q: dict(packed=q.packed.view(torch.int8)), r"view\(torch.uint8\)"),
        (lambda q: dict(packed=q.packed.to(torch.int32)), "pack two 4-bit codes"),
        (lambda q: dict(packed=unpack_codes(q.packed)), "looks unpacked"),
        (lambda q: dict(scales=q.scales.view(torch.uint8)), r"view\(torch.float8_e4m3fn\)"),
        (lambda q: dict(scales=q.scales.float()), r"to\(torch.float8_e4m3fn\)"),
        (lambda q: dict(scales=q.scales[:, :2]), r"\[N, K/16\]"),
        (lambda q: dict(global_scale=float("nan")), "global_scale"),
        (lambda q: dict(global_scale=float("inf")), "global_scale"),
        (lambda q: dict(global_scale=0.0), "amax was lost"),
        (lambda q: dict(global_scale=-1.0), "finite and > 0"),
        (lambda q: dict(global_scale=torch.tensor(1.0, dtype=torch.float64)), "fp32"),
        (lambda q: dict(global_scale=torch.ones(2)), "one value per tensor"),
        (lambda q: dict(shape=(24, 48)), r"\[N, K/2\]"),
    ],
)
def test_checkpoint_style_errors_name_the_field_and_fix(mutate, match) -> None:
    q = quantize(_weight())
    fields = dict(packed=q.packed, scales=q.scales, global_scale=q.global_scale, shape=q.shape)
    fields.update(mutate(q))
    with pytest.raises(ValueError, match=match):
        NVFP4Weight(**fields)


def test_k_not_multiple_of_16_is_rejected() -> None:
    packed = torch.zeros(4, 12, dtype=torch.uint8)
    scales = torch.ones(4, 1).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="not a multiple of 16"):
        NVFP4Weight(packed, scales, 1.0, (4, 24))
    with pytest.raises(ValueError, match="pad the weight"):
        quantize(torch.ones(4, 24))


def test_nan_scale_found_by_validate_after_in_place_corruption() -> None:
    q = quantize(_weight())
    q.scales.view(torch.uint8)[3, 1] = 0x7F  # the E4M3FN NaN encoding
    with pytest.raises(ValueError, match=r"NaN \(first at index \[3, 1\]\)"):
        validate(q)


def test_quantize_rejects_bad_weights() -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(16))
    with pytest.raises(ValueError, match="float tensor"):
        quantize(torch.ones(2, 16, dtype=torch.int32))
    bad = torch.ones(2, 16)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(bad)
