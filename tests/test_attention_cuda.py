"""The ``dflash_d256`` ops and the attn.d256 routes on CUDA, against the fp64 oracle.

Skipped (with the reason) where torch sees no CUDA device; on a CUDA machine the bundled build
must carry the CUDA kernels (nvcc present), otherwise the ``cuda_ops`` fixture fails with the
loader's reason rather than skipping: a CUDA run that silently lacks the kernels proves nothing.

Bounds are the policy's relative-L2 limits (fp32 1e-5, fp16 2e-3); the fp16 elementwise check
is against the fp64 oracle on the fp16-rounded inputs. Outputs start as NaN so an unwritten
element fails. Split-KV cases use enough keys for several real splits.
"""

from __future__ import annotations

import pytest
import torch

from dflash_kernels.attention import FA2, ORACLE, SDPA, fa2_status, reference_attention
from dflash_suites.support.attn import to_pages
from pytest_dflash.policy.thresholds import Policy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch sees none)")

SCALE = 256 ** -0.5
POLICY = Policy()
EDGE_SHAPES = [  # (Tq, Tk, Hq, Hkv): single token, GQA 1/2/4/6, prefixes, tile edges
    (1, 1, 4, 1), (1, 77, 4, 2), (17, 17, 4, 4), (63, 130, 4, 2), (64, 64, 4, 1),
    (65, 65, 4, 1), (129, 700, 8, 2), (257, 257, 4, 4), (300, 1000, 6, 1),
]
DTYPES = [torch.float32, torch.float16]


@pytest.fixture(scope="module")
def cuda_ops():
    status = fa2_status("cuda")
    assert status.ok, f"CUDA kernels not real on this CUDA machine: {status.summary()}"
    return torch.ops.dflash_d256


def make_qkv(tq, tk, hq, hkv, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, 256, generator=gen).to("cuda", dtype)
                 for t, h in ((tq, hq), (tk, hkv), (tk, hkv)))


def rel_l2(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def assert_parity(out, q, k, v, causal, dtype, what):
    ref = reference_attention(q, k, v, SCALE, causal)
    assert torch.isfinite(out).all(), f"{what}: NaN/Inf (unwritten or broken) elements"
    err = rel_l2(out, ref)
    assert err <= POLICY.rel_l2(dtype), f"{what}: rel L2 {err:.3g} > {POLICY.rel_l2(dtype):g}"
    worst = float((out.double() - ref).abs().max())
    bound = POLICY.rel_l2(dtype) * float(ref.abs().max()) + POLICY.floor(dtype)
    if dtype == torch.float16:
        bound += 2.0 ** -11 * float(ref.abs().max())  # the fp16 rounding of the output itself
    assert worst <= bound, f"{what}: max abs error {worst:.3g} > {bound:.3g}"
    return err


FP16_WARPS_8_SMEM = 140288  # bytes per block of the 8-warp fp16 kernel


@pytest.fixture(params=[("4", "1"), ("8", "1"), ("4", "0"), ("8", "0")],
                ids=lambda p: f"warps{p[0]}-vt{p[1]}")
def fp16_variant(request, monkeypatch):
    """Every variant of the fp16 kernel: block shape ($DFLASH_D256_CUDA_WARPS; 8 only where it
    fits) and V staging ($DFLASH_D256_CUDA_VT)."""
    warps, vt = request.param
    props = torch.cuda.get_device_properties(0)
    # a block may use all of an SM's shared memory but 1 KB (the driver's reserve)
    optin = getattr(props, "shared_memory_per_block_optin",
                    props.shared_memory_per_multiprocessor - 1024)
    if warps == "8" and optin < FP16_WARPS_8_SMEM:
        pytest.skip(f"{props.name} gives a block {optin} bytes of shared memory, the 8-warp "
                    f"kernel needs {FP16_WARPS_8_SMEM}")
    monkeypatch.setenv("DFLASH_D256_CUDA_WARPS", warps)
    monkeypatch.setenv("DFLASH_D256_CUDA_VT", vt)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dense_matches_fp64_oracle(cuda_ops, fp16_variant, shape, dtype):
    q, k, v = make_qkv(*shape, dtype, seed=sum(shape))
    for causal in (True, False):
        out = torch.full_like(q, float("nan"))
        cuda_ops.dense(q, k, v, out, SCALE, causal)
        assert_parity(out, q, k, v, causal, dtype, f"dense {shape} causal={causal} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32, 7])
def test_paged_equals_dense_exactly(cuda_ops, fp16_variant, dtype, block_size):
    """Same keys, same arithmetic: the block-table indirection must not change one bit."""
    for tq, tk, hq, hkv in ((97, 203, 4, 1), (1031, 4099, 4, 2), (5, 5, 4, 4)):
        q, k, v = make_qkv(tq, tk, hq, hkv, dtype, seed=tk + block_size)
        k_cache, v_cache, table = to_pages(k, v, block_size, seed=1)
        dense = torch.full_like(q, float("nan"))
        paged = torch.full_like(q, float("nan"))
        cuda_ops.dense(q, k, v, dense, SCALE, True)
        cuda_ops.paged(q, k_cache, v_cache, table, tk, paged, SCALE, True)
        assert torch.equal(paged, dense), f"paged != dense for {(tq, tk, hq, hkv)} {dtype}"
        assert_parity(paged, q, k, v, True, dtype, f"paged {(tq, tk)} block {block_size}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
def test_splitkv_matches_oracle_and_dense(cuda_ops, fp16_variant, dtype, splits):
    q, k, v = make_qkv(70, 1000, 4, 2, dtype, seed=splits)
    dense = torch.full_like(q, float("nan"))
    split = torch.full_like(q, float("nan"))
    cuda_ops.dense(q, k, v, dense, SCALE, True)
    cuda_ops.dense_splitkv(q, k, v, split, SCALE, True, splits)
    assert_parity(split, q, k, v, True, dtype, f"splitkv {splits} {dtype}")
    tol = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 1e-3)}[dtype]
    torch.testing.assert_close(split, dense, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_causal_prefill_error_stays_flat(cuda_ops, fp16_variant, dtype):
    errors = {}
    for t in (512, 8192):
        q, k, v = make_qkv(t, t, 4, 1, dtype, seed=t)
        out = torch.full_like(q, float("nan"))
        cuda_ops.dense(q, k, v, out, SCALE, True)
        errors[t] = assert_parity(out, q, k, v, True, dtype, f"T={t} {dtype}")
    assert errors[8192] <= 2 * errors[512] + 1e-7, errors


def test_cuda_agrees_with_cpu_kernels(cuda_ops):
    q, k, v = make_qkv(129, 700, 8, 2, torch.float32, seed=3)
    out = torch.empty_like(q)
    cuda_ops.dense(q, k, v, out, SCALE, True)
    cpu = torch.empty(q.shape)
    cuda_ops.dense(q.cpu(), k.cpu(), v.cpu(), cpu, SCALE, True)
    torch.testing.assert_close(out.cpu(), cpu, rtol=1e-5, atol=1e-6)


def test_opcheck_on_cuda(cuda_ops):
    q, k, v = make_qkv(9, 40, 4, 2, torch.float16, seed=9)
    out = torch.empty_like(q)
    torch.library.opcheck(cuda_ops.dense.default, (q, k, v, out, SCALE, True))
    k_cache, v_cache, table = to_pages(k, v, 16, seed=1)
    torch.library.opcheck(cuda_ops.paged.default,
                          (q, k_cache, v_cache, table, 40, out, SCALE, True))


_REFUSALS = r"""
import json, os, torch
from dflash_kernels.attention import fa2_status
assert fa2_status("cuda").ok
ops = torch.ops.dflash_d256
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(t, h, 256, generator=gen).to("cuda", torch.float16)
           for t, h in ((4, 4), (40, 2), (40, 2)))
flat = torch.randn(4 * 4 * 256 + 1, device="cuda", dtype=torch.float16)
cache = torch.randn(6, 16, 2, 256, device="cuda", dtype=torch.float16)

def refused(call):
    try:
        call()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None

def bad_setting():
    os.environ["DFLASH_D256_CUDA_WARPS"] = "6"
    ops.dense(q, k, v, torch.empty_like(q), 0.0625, True)

cases = {
    "unaligned": lambda: ops.dense(flat[1:].view(4, 4, 256), k, v, torch.empty_like(q), 0.0625,
                                   True),
    "devices": lambda: ops.dense(q, k.cpu(), v, torch.empty_like(q), 0.0625, True),
    "block_ids": lambda: ops.paged(q, cache, cache,
                                   torch.tensor([0, 99, 1], dtype=torch.int32, device="cuda"),
                                   40, torch.empty_like(q), 0.0625, True),
    "setting": bad_setting,
}
print(json.dumps({name: refused(call) for name, call in cases.items()}))
"""


def test_cuda_refuses_bad_block_ids_unaligned_views_and_bad_settings(cuda_ops, run_child_json):
    """Each bad call must raise with a message naming the problem. Run in a child interpreter:
    a native crash on such a call must fail this test, not end the session."""
    messages = run_child_json(_REFUSALS)
    assert "16-byte boundary" in (messages["unaligned"] or ""), messages
    assert "one device" in (messages["devices"] or ""), messages
    assert "block_table[1] = 99 is out of range" in (messages["block_ids"] or ""), messages
    assert "DFLASH_D256_CUDA_WARPS must be one of 4, 8, got '6'" in (messages["setting"] or ""), (
        messages)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", EDGE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sdpa_baseline_matches_the_oracle_on_cuda(shape, dtype):
    """The fallback route (and the parity gate's same-dtype reference) must be right on CUDA,
    GQA with a cached prefix (Tq < Tk, explicit bottom-right mask) included."""
    q, k, v = make_qkv(*shape, dtype, seed=sum(shape) + 1)
    for causal in (True, False):
        out = torch.full_like(q, float("nan"))
        SDPA.dense(q, k, v, out, SCALE, causal)
        assert_parity(out, q, k, v, causal, dtype, f"sdpa {shape} causal={causal} {dtype}")


@pytest.mark.parametrize("hkv", [1, 2])
def test_sdpa_masked_calls_never_plan_cudnn(hkv):
    """A decoding engine calls the baseline with a new Tk every step: cuDNN would build an
    execution plan per call (~20 ms of host time), so masked calls must not reach it."""
    from torch.profiler import ProfilerActivity, profile

    names = []
    for tk in (300, 301):
        q, k, v = make_qkv(1, tk, 2, hkv, torch.float16, seed=tk)
        out = torch.full_like(q, float("nan"))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            SDPA.dense(q, k, v, out, SCALE, True)
            torch.cuda.synchronize()
        names += [e.name for e in prof.events()]
        assert_parity(out, q, k, v, True, torch.float16, f"sdpa decode Tk={tk} Hkv={hkv}")
    assert any("attention" in n.lower() or "fmha" in n.lower() for n in names), sorted(set(names))
    cudnn = sorted({n for n in names if "cudnn" in n.lower()})
    assert not cudnn, f"masked SDPA calls reached cuDNN: {cudnn}"


def test_routes_record_hits_and_match_the_oracle_route(cuda_ops):
    q, k, v = make_qkv(129, 700, 8, 2, torch.float32, seed=5)
    outs = {}
    for route in (FA2, SDPA, ORACLE):
        outs[route.route] = torch.full_like(q, float("nan"))
        route.dense(q, k, v, outs[route.route], SCALE, True)
    oracle = outs[ORACLE.route].double()
    for name, out in outs.items():
        assert rel_l2(out, oracle) <= POLICY.rel_l2(torch.float32), name
