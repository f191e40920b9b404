"""Unit tests of the shared parity checks (pytest_dflash.measure.numerics) on real torch
computations."""

from __future__ import annotations

import json

import pytest
import torch

from pytest_dflash.measure.numerics import (
    assert_bitwise_equal,
    assert_parity,
    check_parity,
    poison_,
)
from pytest_dflash.policy.thresholds import Policy

POLICY = Policy()


def _matmul_case(m: int = 33, k: int = 517, n: int = 29, seed: int = 7):
    """fp32 inputs, fp64 oracle, and the same-dtype torch reference (fp32 matmul)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(m, k, generator=g) + 0.1  # no zeros
    b = torch.rand(k, n, generator=g) - 0.45
    oracle = a.double() @ b.double()
    reference = a @ b
    return a, b, oracle, reference


def _split_k(a: torch.Tensor, b: torch.Tensor, chunk: int) -> torch.Tensor:
    """A type-B candidate: the same product with fp32 partial sums over K chunks."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for start in range(0, a.shape[1], chunk):
        out += a[:, start : start + chunk] @ b[start : start + chunk]
    return out


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn],
)
def test_poison_fills_every_element_with_nan(dtype):
    t = torch.zeros(3, 7, dtype=dtype)
    assert poison_(t) is t
    assert bool(torch.isnan(t.to(torch.float32)).all())


def test_poison_refuses_integer_buffers():
    with pytest.raises(TypeError, match="integer dtypes have no NaN"):
        poison_(torch.zeros(4, dtype=torch.int32))


def test_split_k_fp32_passes_the_three_way_rule():
    a, b, oracle, reference = _matmul_case()
    cand = _split_k(a, b, chunk=64)
    result = check_parity(cand, oracle, reference, policy=POLICY, dtype=torch.float32, label="mm")
    assert result.ok, result.message()
    assert result.mismatches == 0 and result.nonfinite == 0
    assert result.total == cand.numel()
    assert result.ref_max_abs is not None and result.ref_max_abs > 0
    assert result.bound == pytest.approx(POLICY.parity_k * result.ref_max_abs + 1e-6)
    assert result.max_abs <= result.bound
    assert 0 < result.rel_l2 <= POLICY.rel_l2("float32")


def test_fp16_accumulation_fails_against_fp32_reference():
    """A kernel that silently accumulates in fp16 is far more wrong than the fp32 stack."""
    a, b, oracle, reference = _matmul_case()
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float16)
    for start in range(0, a.shape[1], 8):
        acc += (a[:, start : start + 8].half() @ b[start : start + 8].half()).half()
    result = check_parity(acc, oracle, reference, policy=POLICY, dtype="float32", label="fp16acc")
    assert not result.ok
    assert result.mismatches > 0.5 * result.total
    assert result.rel_l2 > POLICY.rel_l2("float32")


def test_single_wrong_element_is_located():
    a, b, oracle, reference = _matmul_case()
    cand = _split_k(a, b, chunk=128)
    cand[5, 11] += 0.5
    result = check_parity(cand, oracle, reference, policy=POLICY, dtype="float32", label="one")
    assert not result.ok
    assert result.mismatches == 1
    assert result.first_bad == [(5, 11)]
    assert result.share == pytest.approx(1 / cand.numel())
    msg = result.message()
    assert f"1/{cand.numel()} elements" in msg and "(5, 11)" in msg and "parity FAILED" in msg
    assert result.max_abs == pytest.approx(0.5, rel=1e-3)


def test_nan_never_passes_and_unwritten_output_is_caught():
    """A kernel that skips its tail leaves the poisoned NaN there: it must fail, not pass."""
    a, b, oracle, reference = _matmul_case(m=17)
    out = poison_(torch.empty(17, b.shape[1]))
    out[:16] = _split_k(a[:16], b, chunk=64)  # "forgets" the odd tail row
    result = check_parity(out, oracle, reference, policy=POLICY, dtype="float32", label="tail")
    assert not result.ok
    assert result.nonfinite == b.shape[1] == result.mismatches
    assert result.first_bad[0] == (16, 0)
    assert "NaN/Inf" in result.message()
    record = result.measurements()
    json.dumps(record, allow_nan=False)  # JSON-able even with an infinite rel L2
    assert record["rel_l2"] is None and record["nonfinite"] == b.shape[1]


def test_rel_l2_catches_systematic_bias_within_elementwise_bound():
    """A sloppy reference (which would loosen the elementwise bound) is refused outright; a
    systematic bias that every element hides under the bound still fails on rel L2."""
    from pytest_dflash.measure.numerics import ReferenceUnreliable

    _, _, oracle, _ = _matmul_case()
    sloppy = oracle.float() + 0.05  # would make the bound 2 * 0.05 + floor
    cand = (oracle * (1 + 5e-5)).float()
    with pytest.raises(ReferenceUnreliable, match="bias: reference unreliable"):
        check_parity(cand, oracle, sloppy, policy=POLICY, dtype="float32", label="bias")
    loose = Policy(parity_rel_l2={"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2})
    result = check_parity(cand, oracle, None, policy=loose, dtype="float32", label="bias")
    assert result.mismatches == 0  # within 1e-4 * max|oracle| elementwise...
    strict = check_parity(cand, oracle, None, policy=POLICY, dtype="float32", label="bias")
    assert strict.rel_l2 == pytest.approx(5e-5, rel=1e-2)
    assert not strict.ok  # ...but rel L2 5e-5 > 1e-5 fails


def test_global_scale_convention_error_is_caught_without_reference():
    """docs/families.md: a wrong NVFP4 global-scale convention shows as a factor 6 * 448 = 2688."""
    _, _, oracle, _ = _matmul_case()
    wrong = (oracle / 2688).float()
    result = check_parity(wrong, oracle, policy=POLICY, dtype="float32", label="nvfp4")
    assert not result.ok and result.ref_max_abs is None
    assert result.rel_l2 == pytest.approx(1 - 1 / 2688, rel=1e-6)
    right = check_parity(oracle.float(), oracle, policy=POLICY, dtype="float32", label="nvfp4")
    assert right.ok, right.message()


def test_assert_parity_raises_the_message_and_returns_the_result():
    a, b, oracle, reference = _matmul_case()
    good = assert_parity(
        _split_k(a, b, 64), oracle, reference, policy=POLICY, dtype="float32", label="ok"
    )
    assert good.ok and "rel L2" in good.measurements()["figure"]
    bad = _split_k(a, b, 64)
    bad[0, 0] = float("inf")
    with pytest.raises(AssertionError, match=r"bad \[float32\]: parity FAILED: 1/\d+ elements"):
        assert_parity(bad, oracle, reference, policy=POLICY, dtype="float32", label="bad")


def test_bad_inputs_get_clear_errors():
    x = torch.ones(3, 4)
    with pytest.raises(ValueError, match=r"candidate shape \(3, 4\) != oracle shape \(4, 3\)"):
        check_parity(x, torch.ones(4, 3), policy=POLICY, dtype="float32", label="s")
    with pytest.raises(ValueError, match=r"reference shape \(2,\)"):
        check_parity(x, x, torch.ones(2), policy=POLICY, dtype="float32", label="s")
    with pytest.raises(ValueError, match="no parity tolerance for dtype 'int8'"):
        check_parity(x, x, policy=POLICY, dtype=torch.int8, label="s")
    with pytest.raises(ValueError, match="oracle has 1 NaN/Inf"):
        check_parity(
            x,
            torch.tensor([[float("nan"), 1, 1, 1]] + [[1.0] * 4] * 2),
            policy=POLICY,
            dtype="float32",
            label="s",
        )
    with pytest.raises(ValueError, match="empty tensors"):
        check_parity(torch.ones(0, 4), torch.ones(0, 4), policy=POLICY, dtype="float32", label="s")
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        check_parity([1.0], x, policy=POLICY, dtype="float32", label="s")


def test_bitwise_equal_passes_identical_bytes_including_nan():
    a = torch.tensor([[1.5, float("nan")], [-0.0, 3.0]], dtype=torch.float16)
    record = assert_bitwise_equal(a, a.clone(), "same")
    assert record["max_abs"] == 0.0 and record["mismatches"] == 0 and record["total"] == 4
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    assert assert_bitwise_equal(codes.t().contiguous().t(), codes, "layout")["max_abs"] == 0.0


def test_bitwise_equal_reports_count_indices_and_max_diff():
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = a.clone()
    b[1, 2] += 0.25
    b[2, 3] = -b[2, 3]
    with pytest.raises(AssertionError) as info:
        assert_bitwise_equal(a, b, "qpn")
    msg = str(info.value)
    assert "2/12 elements" in msg and "[(1, 2), (2, 3)]" in msg and "max abs diff 22" in msg


def test_bitwise_equal_distinguishes_signed_zero_and_checks_dtype_and_shape():
    with pytest.raises(AssertionError, match="1/1 elements"):
        assert_bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]), "zero")
    with pytest.raises(AssertionError, match="dtype torch.float32 != torch.float16"):
        assert_bitwise_equal(torch.ones(2), torch.ones(2, dtype=torch.float16), "dt")
    with pytest.raises(AssertionError, match=r"shape \(2,\) != \(1, 2\)"):
        assert_bitwise_equal(torch.ones(2), torch.ones(1, 2), "sh")


def test_unreliable_reference_is_an_error_not_a_looser_bound():
    """A reference outside the oracle-only limits would widen the candidate's bound; the case
    must raise, naming the reference, even for a candidate that would pass under it."""
    from pytest_dflash.measure.numerics import ReferenceUnreliable

    a, b, oracle, reference = _matmul_case()
    cand = _split_k(a, b, chunk=64)
    wrong_ref = reference.clone()
    wrong_ref[3, 4] += 0.25  # one element far outside the fp32 limits
    with pytest.raises(ReferenceUnreliable, match=r"mm: reference unreliable.*max abs error"):
        check_parity(cand, oracle, wrong_ref, policy=POLICY, dtype="float32", label="mm")
    drifted = (reference.double() * (1 + 3e-5)).float()  # every element slightly off: rel L2
    with pytest.raises(ReferenceUnreliable, match=r"rel L2 3e-05 vs limit 1e-05"):
        check_parity(cand, oracle, drifted, policy=POLICY, dtype="float32", label="mm")
