"""Benchmark: causal prefill attention, D=256, fp16, 6 query heads sharing 1 KV head (the target
deployment's per-GPU shape), T = 32768 and 65536, on one CUDA device.

Run explicitly (not part of ``testpaths``; skips without CUDA):

    pytest benchmarks/test_attn_d256_cuda.py -s --benchmark-json=bench.json

Each round: the L2 cache is flushed (untimed setup, twice the device's L2 written), then ONE
call runs between two CUDA events and the host synchronises on the end event, so
pytest-benchmark's wall time is that of a synchronised call and the event time is the GPU time.
``extra_info`` (and the printed BENCH line) carries the median event time in ms and TFLOP/s,
counting 4 * D * Hq * T(T+1)/2 FLOP (the causal half of Q K^T and P V, nothing masked).

Compared: ``fa2`` (this package's ``dflash_d256.dense``), ``fa2_paged`` (``dflash_d256.paged``,
block size 16, shuffled table) and torch SDPA with K/V expanded to 6 heads under each CUDA
backend that accepts the shape (efficient = what torch runs for D=256 on a V100; flash; cuDNN).
"""

from __future__ import annotations

import statistics

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch sees none)")

D, HQ, HKV = 256, 6, 1
LENGTHS = (32768, 65536)
ROUNDS = 10
# variants of the fp16 kernel: 4 or 8 warps per block, V staged transposed (vt1) or not (vt0)
VARIANTS = {"fa2_w4_vt1": ("4", "1"), "fa2_w8_vt1": ("8", "1"), "fa2_w4_vt0": ("4", "0"),
            "fa2_w8_vt0": ("8", "0")}
IMPLS = ("fa2", *VARIANTS, "fa2_paged", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn")


def causal_flops(t: int) -> float:
    return 4.0 * D * HQ * t * (t + 1) / 2


def _setup(impl: str, t: int):
    """Inputs and a zero-argument call for ``impl`` at length ``t``."""
    gen = torch.Generator(device="cuda").manual_seed(t)
    q = torch.randn(t, HQ, D, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(t, HKV, D, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(t, HKV, D, device="cuda", dtype=torch.float16, generator=gen)
    out = torch.empty_like(q)
    scale = D ** -0.5
    if impl.startswith("fa2"):
        from dflash_kernels.attention import fa2_status

        status = fa2_status("cuda")
        assert status.ok, status.summary()
        ops = torch.ops.dflash_d256
        if impl != "fa2_paged":
            return lambda: ops.dense(q, k, v, out, scale, True)
        block = 16
        blocks = t // block
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(1))
        table = perm.to(device="cuda", dtype=torch.int32)
        k_cache = torch.empty(blocks, block, HKV, D, device="cuda", dtype=torch.float16)
        v_cache = torch.empty_like(k_cache)
        k_cache[perm.cuda()] = k.view(blocks, block, HKV, D)
        v_cache[perm.cuda()] = v.view(blocks, block, HKV, D)
        return lambda: ops.paged(q, k_cache, v_cache, table, t, out, scale, True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa_flash": SDPBackend.FLASH_ATTENTION,
               "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    qh = q.permute(1, 0, 2).unsqueeze(0)
    kh = k.permute(1, 0, 2).expand(HQ, t, D).contiguous().unsqueeze(0)
    vh = v.permute(1, 0, 2).expand(HQ, t, D).contiguous().unsqueeze(0)

    def call() -> None:
        with sdpa_kernel(backend):
            torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True,
                                                             scale=scale)

    return call


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", LENGTHS, ids=[f"T{t}" for t in LENGTHS])
def test_causal_prefill_d256(benchmark, monkeypatch, impl, t):
    from pytest_dflash.measure.timing import l2_flush_buffer

    if impl in VARIANTS:
        monkeypatch.setenv("DFLASH_D256_CUDA_WARPS", VARIANTS[impl][0])
        monkeypatch.setenv("DFLASH_D256_CUDA_VT", VARIANTS[impl][1])
    fn = _setup(impl, t)
    try:
        fn()
        torch.cuda.synchronize()
    except RuntimeError as exc:  # a backend that refuses the shape on this card
        if impl.startswith("sdpa_"):
            pytest.skip(f"{impl} does not run this shape here: {str(exc).splitlines()[0]}")
        raise
    flush = l2_flush_buffer("cuda")
    events: list[float] = []

    def setup() -> None:
        flush.fill_(1)
        torch.cuda.synchronize()

    def timed() -> None:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        events.append(start.elapsed_time(end))

    benchmark.group = f"causal prefill D256 fp16 Hq{HQ} Hkv{HKV} T{t}"
    benchmark.pedantic(timed, setup=setup, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    ms = statistics.median(events[1:])  # events[0] is the warm-up round
    tflops = causal_flops(t) / (ms * 1e-3) / 1e12
    benchmark.extra_info.update(event_median_ms=ms, tflops=tflops,
                                device=torch.cuda.get_device_name())
    print(f"\nBENCH {impl} T={t}: {ms:.2f} ms, {tflops:.1f} TFLOP/s "
          f"({torch.cuda.get_device_name()})")
