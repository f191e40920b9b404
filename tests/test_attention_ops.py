"""Unit tests of the attn.d256 routes and the native ``dflash_d256`` ops (real library, built
into the per-user cache on first use).

The gate suites judge parity with the policy's thresholds; these tests pin the contract details
a gate would only report as "mismatch": the bottom-right causal alignment for Tq < Tk, GQA head
mapping, paged == dense on the same keys, every output element written, every bad argument
refused with a message that names it, and route hits per call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dflash_kernels.attention import (
    FA2,
    ORACLE,
    SDPA,
    causal_mask,
    fa2_status,
    gather_pages,
    reference_attention,
)
from pytest_dflash.native import hits

SCALE = 0.0625


@pytest.fixture(scope="module")
def ops():
    status = fa2_status()
    assert status.ok, status.summary()
    return torch.ops.dflash_d256


def make_qkv(tq, tk, hq, hkv, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, hq, 256, generator=gen).to(dtype)
    k = torch.randn(tk, hkv, 256, generator=gen).to(dtype)
    v = torch.randn(tk, hkv, 256, generator=gen).to(dtype)
    return q, k, v


def rel_l2(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def paged_copy(k, v, block_size, num_blocks, seed=1):
    """Scatter k/v into a paged cache with a shuffled block table (extra garbage blocks)."""
    tk, hkv, d = k.shape
    used = -(-tk // block_size)
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks, generator=gen)[:used].to(torch.int32)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(k.dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(k.dtype)
    for i, block in enumerate(table.tolist()):
        n = min(block_size, tk - i * block_size)
        k_cache[block, :n] = k[i * block_size : i * block_size + n]
        v_cache[block, :n] = v[i * block_size : i * block_size + n]
    return k_cache, v_cache, table


def test_reference_matches_textbook_softmax_with_bottom_right_mask():
    q, k, v = make_qkv(3, 5, 2, 1, seed=3)
    out = reference_attention(q, k, v, SCALE, True)
    # row r = absolute position 2 + r sees keys 0 .. 2 + r
    for h in range(2):
        for r in range(3):
            s = (q[r, h].double() @ k[: 3 + r, 0].double().T) * SCALE
            expected = s.softmax(-1) @ v[: 3 + r, 0].double()
            torch.testing.assert_close(out[r, h], expected, rtol=1e-12, atol=1e-12)
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


@pytest.mark.parametrize("route", [ORACLE, SDPA, FA2], ids=lambda r: r.route)
@pytest.mark.parametrize("tq,tk,hq,hkv,causal", [
    (1, 1, 1, 1, True), (37, 37, 4, 1, True), (19, 70, 4, 2, True), (130, 200, 4, 4, True),
    (33, 65, 2, 1, False), (257, 600, 4, 1, True),
])
def test_dense_routes_match_fp64_reference(route, tq, tk, hq, hkv, causal):
    q, k, v = make_qkv(tq, tk, hq, hkv, seed=tq)
    out = torch.full_like(q, float("nan"))
    with hits.counting() as delta:
        route.dense(q, k, v, out, SCALE, causal)
    assert delta.as_json() == {f"{route.route}/dense": 1}
    assert torch.isfinite(out).all(), "an output element was never written"
    assert rel_l2(out, reference_attention(q, k, v, SCALE, causal)) <= 2e-6


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_fa2_writes_an_inference_mode_output_from_every_thread(ops, paged):
    """An engine runs under torch.inference_mode and allocates ``out`` there (an inference
    tensor). Many query tiles spread the op over the intra-op threads, each of which writes its
    rows: a thread without the caller's inference mode may not (torch refuses the write).
    At least two threads, whatever the run's share of the cores (one under xdist on 2 cores)."""
    q, k, v = make_qkv(300, 300, 4, 2, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        with torch.inference_mode():
            out = torch.full_like(q, float("nan"))
            if paged:
                FA2.paged(q, *paged_copy(k, v, 32, 10), 300, out, SCALE, True)
            else:
                FA2.dense(q, k, v, out, SCALE, True)
    finally:
        torch.set_num_threads(threads)
    assert rel_l2(out, reference_attention(q, k, v, SCALE, True)) <= 2e-6


@pytest.mark.parametrize("route", [SDPA, FA2], ids=lambda r: r.route)
def test_fp16_accumulates_in_fp32(route):
    q, k, v = make_qkv(300, 300, 4, 1, dtype=torch.float16, seed=5)
    out = torch.full_like(q, float("nan"))
    route.dense(q, k, v, out, SCALE, True)
    assert out.dtype == torch.float16
    assert rel_l2(out, reference_attention(q, k, v, SCALE, True)) <= 2e-3


@pytest.mark.parametrize("block_size", [16, 32, 5])
@pytest.mark.parametrize("route", [ORACLE, SDPA, FA2], ids=lambda r: r.route)
def test_paged_equals_dense_on_the_gathered_keys(route, block_size):
    q, k, v = make_qkv(41, 123, 4, 2, seed=block_size)
    k_cache, v_cache, table = paged_copy(k, v, block_size, num_blocks=40)
    dense = torch.full_like(q, float("nan"))
    paged = torch.full_like(q, float("nan"))
    route.dense(q, k, v, dense, SCALE, True)
    with hits.counting() as delta:
        route.paged(q, k_cache, v_cache, table, 123, paged, SCALE, True)
    assert delta.as_json() == {f"{route.route}/paged": 1}
    # the same keys in the same order through the same arithmetic: bitwise equal
    assert torch.equal(paged, dense)


def test_gather_pages_refuses_out_of_range_blocks():
    k_cache = torch.zeros(4, 16, 1, 256)
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        gather_pages(k_cache, k_cache, torch.tensor([0, 4], dtype=torch.int32), 20)
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        gather_pages(k_cache, k_cache, torch.tensor([-1, 0], dtype=torch.int32), 20)
    with pytest.raises(ValueError, match="kv_len"):
        gather_pages(k_cache, k_cache, torch.tensor([0], dtype=torch.int32), 17)


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 64])
def test_splitkv_matches_dense(ops, splits):
    q, k, v = make_qkv(70, 300, 4, 2, seed=splits)
    dense = torch.empty_like(q)
    split = torch.full_like(q, float("nan"))
    ops.dense(q, k, v, dense, SCALE, True)
    FA2.dense_splitkv(q, k, v, split, SCALE, True, splits)
    torch.testing.assert_close(split, dense, rtol=1e-5, atol=1e-6)


def test_long_prefix_error_stays_flat(ops):
    """fp32 relative L2 stays at the fp32 rounding level as T grows (no drift in the
    online-softmax rescaling)."""
    errors = []
    for t in (256, 2048):
        q, k, v = make_qkv(t, t, 2, 1, seed=t)
        out = torch.empty_like(q)
        ops.dense(q, k, v, out, SCALE, True)
        errors.append(rel_l2(out, reference_attention(q, k, v, SCALE, True)))
    assert max(errors) <= 1e-5, errors


def test_opcheck_dense_and_paged(ops):
    q, k, v = make_qkv(9, 20, 4, 2, seed=9)
    out = torch.empty_like(q)
    torch.library.opcheck(ops.dense.default, (q, k, v, out, SCALE, True))
    k_cache, v_cache, table = paged_copy(k, v, 8, num_blocks=6)
    torch.library.opcheck(ops.paged.default, (q, k_cache, v_cache, table, 20, out, SCALE, True))


def _dense_args(**over):
    q, k, v = make_qkv(4, 6, 4, 2)
    args = {"q": q, "k": k, "v": v, "scale": SCALE, **over}
    args.setdefault("out", torch.empty_like(args["q"]))
    return args


@pytest.mark.parametrize("over,match", [
    ({"q": torch.zeros(4, 4, 128)}, "head dim must be 256"),
    ({"q": torch.zeros(4, 3, 256)}, "multiple of Hkv"),
    ({"q": torch.zeros(7, 4, 256)}, r"Tk \(6\) must be >= Tq \(7\)"),
    ({"k": torch.zeros(6, 2, 256, dtype=torch.float16)}, "share one dtype"),
    ({"q": torch.zeros(4, 4, 256, dtype=torch.float64)}, "float16 or float32"),
    ({"out": torch.zeros(4, 4, 255)}, "out must have q's shape"),
    ({"out": torch.zeros(4, 4, 512)[:, :, ::2]}, "contiguous"),
    ({"v": torch.zeros(5, 2, 256)}, "v must have k's shape"),
    ({"scale": float("nan")}, "softmax_scale"),
    ({"scale": 0.0}, "softmax_scale"),
])
def test_dense_refuses_bad_arguments(ops, over, match):
    a = _dense_args(**over)
    with pytest.raises(RuntimeError, match=match):
        ops.dense(a["q"], a["k"], a["v"], a["out"], a["scale"], True)


@pytest.mark.parametrize("table,kv_len,match", [
    ([0, 9], 20, r"block_table\[1\] = 9 is out of range \[0, 4\)"),
    ([0, -1], 20, r"block_table\[1\] = -1 is out of range"),
    ([0, 1], 33, r"kv_len \(33\) must be in \[0, len\(block_table\) \* block_size\]"),
    ([0, 1], 3, r"Tq \(4\) must be <= kv_len \(3\)"),
])
def test_paged_refuses_bad_block_table_and_kv_len(ops, table, kv_len, match):
    q, _, _ = make_qkv(4, 6, 4, 2)
    cache = torch.zeros(4, 16, 2, 256)
    bt = torch.tensor(table, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=match):
        ops.paged(q, cache, cache, bt, kv_len, torch.empty_like(q), SCALE, True)


def test_paged_refuses_int64_block_table(ops):
    q, _, _ = make_qkv(4, 6, 4, 2)
    cache = torch.zeros(4, 16, 2, 256)
    with pytest.raises(RuntimeError, match="1-D int32"):
        ops.paged(q, cache, cache, torch.tensor([0]), 6, torch.empty_like(q), SCALE, True)


def test_splitkv_refuses_bad_split_count(ops):
    a = _dense_args()
    with pytest.raises(RuntimeError, match=r"num_splits must be in \[1, 64\]"):
        ops.dense_splitkv(a["q"], a["k"], a["v"], a["out"], SCALE, True, 0)


# ------------------------------------------------------------------ the gates can fail

BROKEN_CONFTEST = """
from pytest_dflash import Route
def pytest_dflash_routes(registry):
    for name in ("topleft", "fallback"):
        registry.register(Route(f"attn.d256.{name}", "attn.d256", "candidate",
                                baseline="attn.d256.sdpa", gates=("parity", "speed"),
                                impl=f"brokenattn:{name.upper()}"))
"""

BROKEN_IMPL = """
import torch.nn.functional as F
from dflash_kernels.attention import gather_pages
from pytest_dflash.native import hits
class TopLeft:
    '''SDPA's is_causal as is: top-left aligned, wrong whenever Tq < Tk.'''

    def dense(self, q, k, v, out, scale, causal):
        hits.record("attn.d256.topleft", "dense")
        self._attend(q, k, v, out, scale, causal)

    def paged(self, q, k_cache, v_cache, table, kv_len, out, scale, causal):
        hits.record("attn.d256.topleft", "paged")
        self._attend(q, *gather_pages(k_cache, v_cache, table, kv_len), out, scale, causal)

    def _attend(self, q, k, v, out, scale, causal):
        g = q.shape[1] // k.shape[1]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(g, 0),
            v.transpose(0, 1).repeat_interleave(g, 0), is_causal=causal, scale=scale)
        out.copy_(o.transpose(0, 1))


class Fallback:
    '''Claims to be a faster route, but its calls are counted on the SDPA fallback (and it
    writes nothing useful): fast on the clock, so only the route hits can expose it.'''

    def dense(self, q, k, v, out, scale, causal):
        hits.record("attn.d256.sdpa", "dense")
        out.zero_()

    def paged(self, q, k_cache, v_cache, table, kv_len, out, scale, causal):
        hits.record("attn.d256.sdpa", "paged")
        out.zero_()


TOPLEFT = TopLeft()
FALLBACK = Fallback()
"""


@pytest.fixture
def broken_project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(BROKEN_CONFTEST)
    pytester.makepyfile(brokenattn=BROKEN_IMPL)
    return pytester


def _gate(report_path, route: str, kind: str) -> dict:
    return json.loads(report_path.read_text())["routes"][route]["gates"][kind]


def test_parity_gate_rejects_a_top_left_causal_mask(broken_project):
    """The bottom-right alignment for Tq < Tk is what a prefix-cached prefill needs; a route
    with SDPA's top-left ``is_causal`` passes Tq == Tk cases and must still be rejected."""
    result = broken_project.runpytest_subprocess(
        "--pyargs", "dflash_suites.test_parity_attn", "--dflash-route", "attn.d256.topleft",
        "--dflash-profile", "quick", "-k", "edges or paged", "-p", "no:cacheprovider",
        "--dflash-every-test")  # every parity test must reject it, not only the first
    result.assert_outcomes(failed=6)
    result.stdout.fnmatch_lines(["*parity cases failed*", "*dense Tq=63 Tk=130*"])
    gate = _gate(broken_project.path / "dflash-report.json", "attn.d256.topleft", "parity")
    assert gate["status"] == "failed"


def test_parity_and_speed_gates_reject_a_silent_fallback(broken_project):
    """A route whose calls are counted on the SDPA fallback fails on its route hits in the
    parity gate and, although it beats the clock, in the speed gate."""
    result = broken_project.runpytest_subprocess(
        "--pyargs", "dflash_suites.test_parity_attn", "dflash_suites.test_speed_attn",
        "--dflash-route", "attn.d256.fallback", "--dflash-profile", "quick",
        "-k", "edges or speed", "-p", "no:cacheprovider",
        "--dflash-every-test")  # every test must reject it, not only the gate's first
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(["*attn.d256.fallback.dense must record exactly one hit*",
                                 "*route hits*do not match the timed calls*"])
    report = broken_project.path / "dflash-report.json"
    assert _gate(report, "attn.d256.fallback", "parity")["status"] == "failed"
    speed = _gate(report, "attn.d256.fallback", "speed")
    assert speed["status"] == "failed"


def test_baseline_simd_path_matches_the_reference():
    """The softmax step has an AVX2+FMA copy chosen at run time and a baseline copy for other
    CPUs; this machine runs the AVX2 one, so the baseline copy is forced in a child process."""
    code = (
        "import torch\n"
        "from dflash_kernels.attention import FA2, reference_attention\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q, k, v = (torch.randn(t, h, 256, generator=g)\n"
        "           for t, h in ((300, 4), (333, 2), (333, 2)))\n"
        "out = torch.full_like(q, float('nan'))\n"
        "FA2.dense(q, k, v, out, 0.0625, True)\n"
        "ref = reference_attention(q, k, v, 0.0625, True)\n"
        "print(float((out.double() - ref).norm() / ref.norm()))\n")
    env = {**os.environ, "DFLASH_D256_DISABLE_AVX2": "1"}
    env.pop("DFLASH_D256_LIBRARY", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) <= 2e-6


@pytest.mark.parametrize("route", [ORACLE, SDPA, FA2], ids=lambda r: r.route)
def test_routes_accept_strided_views(route):
    """An engine's q is a view into a fused projection and its out a slice of a bigger buffer:
    every route takes them (the native one through contiguous copies)."""
    qkv = torch.randn(50, 4 + 1 + 1, 256, generator=torch.Generator().manual_seed(4))
    q, k, v = qkv[:, :4], qkv[:, 4:5], qkv[:, 5:6]
    assert not q.is_contiguous()
    big = torch.full((50, 8, 256), float("nan"))
    out = big[:, 2:6]
    route.dense(q, k, v, out, SCALE, True)
    assert rel_l2(out, reference_attention(q, k, v, SCALE, True)) <= 2e-6
    assert torch.isnan(big[:, :2]).all() and torch.isnan(big[:, 6:]).all()


def test_a_dense_case_grounds_are_computed_once_and_shared_by_the_family_routes() -> None:
    """The oracle's and the baseline's outputs of a case are computed once, before any
    candidate touches the inputs, and handed to every route that meets the case; another dtype,
    causality or baseline is another case, and the oldest case leaves first beyond the bound."""
    from dflash_suites.support.attn import AttnCalls, CaseGrounds, make_qkv

    calls = AttnCalls.__new__(AttnCalls)
    calls.name, calls.impl, calls.oracle, calls.reference = "attn.d256.fa2", FA2, ORACLE, SDPA
    grounds = CaseGrounds()
    q, k, v = make_qkv(40, 72, 4, 2, seed=7, dtype=torch.float32, device=torch.device("cpu"))
    with hits.counting() as delta:
        oracle, ref = grounds.get(calls, q, k, v, True, (7, (40, 72, 4, 2), torch.float32))
        again = grounds.get(calls, q, k, v, True, (7, (40, 72, 4, 2), torch.float32))
    assert again[0] is oracle and again[1] is ref
    assert delta.as_json() == {"attn.d256.oracle/dense": 1, "attn.d256.sdpa/dense": 1}
    assert torch.equal(oracle, AttnCalls.call(ORACLE, "dense", q.double(), k.double(),
                                              v.double(), 256 ** -0.5, True))
    assert torch.equal(ref, AttnCalls.call(SDPA, "dense", q, k, v, 256 ** -0.5, True))
    other = grounds.get(calls, q, k, v, False, (7, (40, 72, 4, 2), torch.float32))
    assert not torch.equal(other[0], oracle)  # not causal: another case
    small = CaseGrounds(max_bytes=oracle.numel() * 8 + ref.numel() * 4)
    first = small.get(calls, q, k, v, True, (1,))
    small.get(calls, q, k, v, False, (2,))
    assert small.get(calls, q, k, v, True, (1,))[0] is not first[0]  # dropped, computed again
