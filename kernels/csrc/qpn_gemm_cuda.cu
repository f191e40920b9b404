// QPN2 / QPN4 NVFP4 GEMMs for CUDA: CUDA kernels of the `dflash_qpn` ops (schemas and the CPU
// kernels are in qpn_gemm.cpp; shared checks, hit counters and workspaces in qpn_common.h).
//
// SM70 features only (the target deployment runs V100s): SIMT, WMMA 8x32x16 and 16x16x16
// (fp16 in, fp32 accumulate), vendor GEMM through ATen's cuBLAS wrapper; no bf16, no cp.async,
// no ldmatrix-only paths, no TMA or wgmma.
//
// qpn2 (small M, <= 32 rows per pass): one block per (32-column tile, K split); lane c of a warp
// owns column c of the tile and each warp takes every W-th group of the split, so every code byte
// and scale is read from memory exactly once per pass. fp16 inputs (W = 4): the lane decodes its
// 16 codes to fp16 values e2m1 * e4m3 * 2^-7 (exact: at most 5 significant bits, all within
// fp16's range) into a per-warp staging tile, by bit placement in a k order of its own within
// each group that x is staged in too, and the warp multiplies it with WMMA m8n32k16 against the
// rows of x (fp32 accumulators); fp32 inputs (W = 8): the same walk with fp32 FMAs. The warps'
// accumulators are summed in warp order, the K splits in split order by the finishing kernel,
// which also applies the global scale (and 2^7) in fp32, the SiLU gate and the cast: a fixed
// reduction order, bitwise identical run to run on one device.
//
// The fp16 kernel is bound by instruction issue and shared-memory traffic, not by DRAM (Nsight
// Compute on an H200, gate/up M = 1: 0.76 warp instructions issued per scheduler cycle, L1/shared
// 76% busy, DRAM 23%), so its shape cuts both: the scale is decoded by bit placement too (no
// float conversion, no branch), the staging rows are padded to 24 halves (a 16-half row put 8
// lanes on one bank group), x rows are padded off a 128-byte multiple, and 4-warp blocks of
// ~64 groups fit 9 blocks per SM. Measured variants: docs/benchmarks.md.
//
// A pass of one row (M = 1, the decode step) has its own fp16 kernel, qpn2_row_kernel: the same
// decode with no staging tile, the lane's own pairs put straight into the A fragments of WMMA
// m16n16k16 against a block-diagonal x (where the device's fragment layout is the one it was
// written for: sm_80 and newer), or in SIMT fp32 (everywhere else, SM70 included, or on
// request: $DFLASH_QPN_M1_SIMT=1); docs/qpn.md, "The M = 1 kernel".
//
// qpn4_bounded (large M): a chunk of whole tiles of the QPN4 view is dequantized into the
// bounded workspace (fp16 for fp16 inputs: e2m1 x fp16 pre-scaled scale with its 2^14 bias, or
// e2m1 x e4m3 when the pre-scaled form is not given; fp32 for fp32 inputs), then one cuBLAS GEMM
// per chunk writes the chunk's output columns with alpha = 2^-14 (or the global scale): the bias
// is removed from the fp32 accumulators before the single rounding to the output dtype.

#include "qpn_common.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace dflash_qpn {
namespace {

constexpr int kWarps = 8;               // fp32 (SIMT) small-M kernel
constexpr int kThreads = kWarps * 32;
constexpr int kWmmaWarps = 4;           // fp16 (WMMA) small-M kernel
constexpr int kWmmaThreads = kWmmaWarps * 32;
constexpr int kStageLd = 24;            // halves per staged column: 16 codes + 8 padding
constexpr int kStageBytes = 32 * kStageLd * 2;  // one warp's staging tile
constexpr int64_t kWmmaGroupsPerSplit = 64;     // K groups per block of the fp16 kernel
constexpr int kSmemBytes = 48 * 1024;  // default dynamic shared memory limit, every SM70+ GPU

// e4m3 byte b times 2^7 in fp32, exactly and without a branch: b's 7 magnitude bits placed as
// fp32 exponent/mantissa read as e4m3 * 2^-120, normal and subnormal alike (both formats'
// subnormals line up at that shift); * 2^127 is exact for every e4m3 value.
__device__ __forceinline__ float e4m3_times_128(uint32_t b) {
  return __uint_as_float(((b & 0x7Fu) << 20) | ((b & 0x80u) << 24)) * 0x1p127f;
}

__device__ __forceinline__ float e4m3_to_float(uint32_t b) {
  return e4m3_times_128(b) * 0x1p-7f;  // exact: a power of two, far from fp32's limits
}

__device__ __forceinline__ float e2m1_to_float(uint32_t nib) {
  const uint32_t e = (nib >> 1) & 3, m = nib & 1;
  const float mag = e ? __uint_as_float(((e + 126u) << 23) | (m << 22)) : 0.5f * m;
  return (nib & 8) ? -mag : mag;
}

// e4m3 byte b times 2^7 as an fp16 pair, exactly and without a branch: b's 7 magnitude bits
// placed as fp16 exponent/mantissa (and its sign as fp16's) read as e4m3 * 2^-8, normal and
// subnormal alike (both formats' subnormals line up at that shift); * 2^15 is exact in fp16 for
// every e4m3 value (the largest, 480 * 2^7, is below 65504).
__device__ __forceinline__ __half2 e4m3_x128_pair(uint32_t b) {
  const uint32_t h = ((b & 0x7Fu) << 7) | ((b & 0x80u) << 8);
  const uint32_t pair = h | (h << 16);
  return __hmul2(*reinterpret_cast<const __half2*>(&pair), __float2half2_rn(32768.0f));
}

// Row stride (halves) of a block's staged x: whole groups plus one, moved off a multiple of 64
// halves (128 bytes), where the 8 rows of a WMMA A fragment would all fall on one bank group.
__host__ __device__ __forceinline__ int x_stage_ld(int64_t groups) {
  const int ld = static_cast<int>(groups) * 16 + 16;
  return ld % 64 == 0 ? ld + 16 : ld;
}

// The 8 codes of word w (code i in bits 4i..4i+3, i.e. k = i of this word) as 4 fp16 pairs:
// pair j holds codes j (low half) and j + 4 (high half), which sit 16 bits apart in w, so one
// shift places both. A code's 3 magnitude bits placed as fp16 exponent/mantissa give
// e2m1 * 2^-14 exactly (fp16 subnormals cover 0.5 * 2^-14), its sign bit is the fp16 sign. In
// w a sign sits 3 bits above its magnitude, in fp16 6 bits: so w and w rotated by 3 are merged
// twice, once keeping the even codes' magnitudes (and the signs 6 bits above them), once the
// odd codes', and each pair is then one shift (a rotation for codes 3 and 7, whose sign wrapped
// round) and one mask: 11 integer operations per word, where separate shifts for magnitude and
// sign took 16 (the same bits: every one of the 2^32 words was compared on an H200, docs/qpn.md).
// The k order this leaves (0, 4, 1, 5, 2, 6, 3, 7) is undone by staging x in the same order.
__device__ __forceinline__ void e2m1_word_pairs(uint32_t w, uint32_t* h) {
  const uint32_t t = __funnelshift_l(w, w, 3);                  // each sign 3 bits up
  const uint32_t even = (w & 0x07070707u) | (t & ~0x07070707u);  // codes 0, 2, 4, 6
  const uint32_t odd = (w & 0x70707070u) | (t & ~0x70707070u);    // codes 1, 3, 5, 7
  h[0] = (even << 9) & 0x8E008E00u;
  h[1] = (odd << 5) & 0x8E008E00u;
  h[2] = (even << 1) & 0x8E008E00u;
  h[3] = __funnelshift_r(odd, odd, 3) & 0x8E008E00u;
}

// 8 consecutive halves (h0..h7) in the k order of e2m1_word_pairs: h0 h4 h1 h5 h2 h6 h3 h7.
__device__ __forceinline__ uint4 interleave_halves(uint4 v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                    __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
}

// One group of the warp's 32 columns (lane c: column c's 16 codes and scale byte) decoded to
// fp16 e2m1 * e4m3 * 2^-7 (exact) through the warp's staging tile, loaded as the B fragment of
// an m8n32k16 WMMA.
__device__ __forceinline__ void decode_group(
    uint2 code, uint32_t scale_byte, __half* stage, int lane,
    nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 8, 32, 16, __half, nvcuda::wmma::col_major>& bf) {
  const __half2 s2 = e4m3_x128_pair(scale_byte);  // e4m3 * 2^7 in fp16, exact
  uint32_t h[8];
  e2m1_word_pairs(code.x, h);
  e2m1_word_pairs(code.y, h + 4);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    __half2 v = *reinterpret_cast<__half2*>(&h[j]);
    v = __hmul2(v, s2);  // e2m1 * e4m3 * 2^-7, exact
    h[j] = *reinterpret_cast<uint32_t*>(&v);
  }
  __syncwarp();  // the warp's previous fragment load has read the tile
  uint4* dst = reinterpret_cast<uint4*>(stage + lane * kStageLd);
  dst[0] = make_uint4(h[0], h[1], h[2], h[3]);
  dst[1] = make_uint4(h[4], h[5], h[6], h[7]);
  __syncwarp();
  nvcuda::wmma::load_matrix_sync(bf, stage, kStageLd);
}

// ---------------------------------------------------------------------------------------------
// qpn2: small-M kernels. partials: [splits][rows][Np] fp32 (this pass's rows).

struct SmallMArgs {
  const void* x;  // [rows, K] of this pass, fp16 or fp32
  int64_t rows, k;
  const uint8_t* buffer;
  const uint8_t* scales;
  int64_t groups, groups_per_split, n_padded;
  float* partials;
};

template <int MB>  // 8-row blocks (rows <= 8 * MB)
__global__ void __launch_bounds__(kWmmaThreads) qpn2_wmma_kernel(SmallMArgs a) {
  using namespace nvcuda;
  constexpr int kWarps = kWmmaWarps, kThreads = kWmmaThreads;
  extern __shared__ __align__(32) unsigned char smem[];
  const int t = blockIdx.x, s = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t g0 = s * a.groups_per_split;
  const int ng = static_cast<int>(min(a.groups_per_split, a.groups - g0));
  const int ld = x_stage_ld(a.groups_per_split);  // a multiple of 16: fragments 32-byte aligned
  __half* xs = reinterpret_cast<__half*>(smem);                       // [MB * 8][ld]
  __half* stage = xs + MB * 8 * ld + warp * (32 * kStageLd);          // [32 cols][kStageLd]
  const uint8_t* codes = a.buffer + ((t * a.groups + g0) * 32 + lane) * 8;
  const uint8_t* scales = a.scales + (t * a.groups + g0) * 32 + lane;
  constexpr int kAhead = 4;  // groups per batch; the next batch's loads fly while this one runs
  constexpr int kStride = kWarps * kAhead;
  uint2 code[kAhead], next_code[kAhead];
  uint32_t sb[kAhead], next_sb[kAhead];
  auto load_batch = [&](int base, uint2* c, uint32_t* b) {
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int gl = base + u * kWarps;
      if (gl < ng) {
        c[u] = __ldg(reinterpret_cast<const uint2*>(codes + gl * 256));
        b[u] = __ldg(scales + gl * 32);
      }
    }
  };
  load_batch(warp, code, sb);  // the first weights fly while x is staged

  const __half* x = static_cast<const __half*>(a.x);
  // Only the pass's rows are staged: the A fragments' rows past them hold whatever shared memory
  // held, and feed only accumulator rows that are never written out (an MMA's output row depends
  // on its own A row alone). At M = 1 this stages 1 row instead of 8.
  for (int i = threadIdx.x; i < static_cast<int>(a.rows) * ng * 2; i += kThreads) {
    const int row = i / (ng * 2), col = (i % (ng * 2)) * 8;  // 8 halves per item
    const uint4 v = *reinterpret_cast<const uint4*>(x + row * a.k + g0 * 16 + col);
    *reinterpret_cast<uint4*>(xs + row * ld + col) = interleave_halves(v);
  }
  __syncthreads();

  wmma::fragment<wmma::accumulator, 8, 32, 16, float> acc[MB];
#pragma unroll
  for (int b = 0; b < MB; ++b) wmma::fill_fragment(acc[b], 0.0f);
  for (int base = warp; base < ng; base += kStride) {
    if (base + kStride < ng) load_batch(base + kStride, next_code, next_sb);
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int gl = base + u * kWarps;
      if (gl >= ng) break;
      wmma::fragment<wmma::matrix_b, 8, 32, 16, __half, wmma::col_major> bf;
      decode_group(code[u], sb[u], stage, lane, bf);
#pragma unroll
      for (int b = 0; b < MB; ++b) {
        wmma::fragment<wmma::matrix_a, 8, 32, 16, __half, wmma::row_major> af;
        wmma::load_matrix_sync(af, xs + b * 8 * ld + gl * 16, ld);
        wmma::mma_sync(acc[b], af, bf, acc[b]);
      }
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      code[u] = next_code[u];
      sb[u] = next_sb[u];
    }
  }
  __syncthreads();  // xs is reused for the warps' accumulators
  float* red = reinterpret_cast<float*>(smem);  // [warp][MB * 8][32]
#pragma unroll
  for (int b = 0; b < MB; ++b)
    wmma::store_matrix_sync(red + (warp * MB * 8 + b * 8) * 32, acc[b], 32, wmma::mem_row_major);
  __syncthreads();
  for (int i = threadIdx.x; i < MB * 8 * 32; i += kThreads) {
    const int row = i / 32, col = i % 32;
    if (row >= a.rows) continue;
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += red[(w * MB * 8 + row) * 32 + col];
    a.partials[(s * a.rows + row) * a.n_padded + t * 32 + col] = sum;
  }
}

// qpn2 at M = 1 (a pass of one row: the decode step). Lane c of a warp keeps column c's codes
// in registers (one 8-byte load per group) and e2m1_word_pairs places them as fp16 pairs
// (e2m1 * 2^-14, exact); no staging tile. Two bodies share the loop (kMma):
// - SIMT fp32 (every device): each half is widened to fp32 (exact) and FMA'd with x in fp32,
//   the group's sum is scaled once by its e4m3 scale in fp32 (e4m3_times_128) and added to the
//   lane's running sum. x is staged as fp32, [group][16].
// - tensor core (devices whose WMMA m16n16k16 fragments have the sm_80+ layout, checked once per
//   device by wmma_layout_probe): the pairs, scaled in fp16 (e4m3_x128_pair: exact), go
//   straight into the A fragments of two m16n16k16 MMAs, as they are: lane (g, q) = 4g + q owns
//   rows g and g + 8 of the fragment at k slots {2q, 2q+1, 2q+8, 2q+9}, and puts its own
//   column's codes there (codes {0,4,1,5} in row g, {2,6,3,7} in row g + 8 of the first MMA;
//   {8,12,9,13} and {10,14,11,15} of the second). B is block diagonal: column q + 4i holds x of
//   code set i in the slots of k block q and zeros elsewhere, so D[g][q + 4i] (i = 0, 2) and
//   D[g + 8][q + 4i] (i = 1, 3) are column 4g + q's sums over its set i, while the other
//   outputs are never read. Only the 8 lanes with g % 4 == q hold non-zero B (x staged once
//   per block in that order, [group][16] fp16); the others read 16 zero bytes. At the end a
//   lane adds its sets (0 + 2, 1 + 3) and one shuffle adds the two halves. The MMA replaces
//   the 16 widenings and 16 FMAs per group and lane of the SIMT body (docs/qpn.md, "The M = 1
//   kernel").
// Every product is exact and every sum fp32 in a fixed order (sets, then groups in the warp's
// order, then the warps in warp order), bitwise identical run to run.
// - full batches of kRowBatch groups run without bounds checks, from one code and one scale
//   pointer per lane at fixed offsets, in two register sets used in turn (no copies); the
//   split's last < kRowBatch groups run one per warp after them.
// Splits and load depth per layer: row_plan.
constexpr int kRowWarps = 4;
constexpr int kRowThreads = kRowWarps * 32;
// Groups per block per load batch of kAhead groups per warp.
__host__ __device__ constexpr int row_batch(int ahead) { return kRowWarps * ahead; }

using RowFragA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half,
                                        nvcuda::wmma::row_major>;
using RowFragB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half,
                                        nvcuda::wmma::col_major>;
using RowAcc = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;

// Fills a 16-half fragment whose elements 8..15 repeat 0..7 (the sm_80+ layout): register j
// (two halves; the fragment is 8-byte aligned, as the WMMA intrinsics read it) is r[j % 4].
template <typename Frag>
__device__ __forceinline__ void set_pairs(Frag& f, uint32_t r0, uint32_t r1, uint32_t r2,
                                          uint32_t r3) {
  static_assert(Frag::num_elements == 16, "16 halves per lane");
  uint32_t* regs = reinterpret_cast<uint32_t*>(f.x);
  regs[0] = regs[4] = r0;
  regs[1] = regs[5] = r1;
  regs[2] = regs[6] = r2;
  regs[3] = regs[7] = r3;
}

template <bool kMma, int kRowAhead>
__global__ void __launch_bounds__(kRowThreads) qpn2_row_kernel(SmallMArgs a) {
  using namespace nvcuda;
  constexpr int kRowBatch = row_batch(kRowAhead);
  extern __shared__ __align__(32) unsigned char smem[];
  const int t = blockIdx.x, s = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t g0 = s * a.groups_per_split;
  const int ng = static_cast<int>(min(a.groups_per_split, a.groups - g0));
  // this warp's first group: local group gl is at (gl - warp) * 32 from these
  const uint2* codes =
      reinterpret_cast<const uint2*>(a.buffer) + (t * a.groups + g0 + warp) * 32 + lane;
  const uint8_t* scales = a.scales + (t * a.groups + g0 + warp) * 32 + lane;
  const int batches = ng / kRowBatch;
  uint2 code_a[kRowAhead], code_b[kRowAhead];
  uint32_t sb_a[kRowAhead], sb_b[kRowAhead];
  auto load_batch = [&](int b, uint2* c, uint32_t* sb) {
#pragma unroll
    for (int u = 0; u < kRowAhead; ++u) {
      const int off = (b * kRowBatch + u * kRowWarps) * 32;
      c[u] = __ldg(codes + off);
      sb[u] = __ldg(scales + off);
    }
  };
  if (batches > 0) load_batch(0, code_a, sb_a);  // the first weights fly while x is staged

  const __half* x = static_cast<const __half*>(a.x) + g0 * 16;
  float acc = 0.0f;                // SIMT body
  RowAcc acc1, acc2;               // tensor-core body: code sets 0, 1 and 2, 3
  const uint4* xb = nullptr;       // tensor-core body: this lane's B pairs of group 0
  int xb_stride = 0;               // (in uint4) and their stride
  if constexpr (kMma) {
    // [group][16] fp16 in the B order (x0 x4 x1 x5 x8 x12 x9 x13 | x2 x6 x3 x7 x10 x14 x11 x15),
    // then 16 zero bytes for the lanes that hold no x
    uint4* xs = reinterpret_cast<uint4*>(smem);
    const uint4* xg = reinterpret_cast<const uint4*>(x);
    for (int i = threadIdx.x; i < ng; i += kRowThreads) {
      const uint4 lo = interleave_halves(xg[2 * i]), hi = interleave_halves(xg[2 * i + 1]);
      xs[2 * i] = make_uint4(lo.x, lo.y, hi.x, hi.y);
      xs[2 * i + 1] = make_uint4(lo.z, lo.w, hi.z, hi.w);
    }
    if (threadIdx.x == 0) xs[2 * ng] = make_uint4(0, 0, 0, 0);
    const int g = lane / 4, q = lane % 4;
    const bool holds_x = g % 4 == q;
    xb = holds_x ? xs + g / 4 : xs + 2 * ng;
    xb_stride = holds_x ? 2 : 0;
    wmma::fill_fragment(acc1, 0.0f);
    wmma::fill_fragment(acc2, 0.0f);
  } else {
    float* xs = reinterpret_cast<float*>(smem);  // [group][16]
    const __half2* x2 = reinterpret_cast<const __half2*>(x);
    for (int i = threadIdx.x; i < ng * 8; i += kRowThreads)
      reinterpret_cast<float2*>(xs)[i] = __half22float2(x2[i]);
  }
  __syncthreads();

  auto add_group = [&](int gl, uint2 code, uint32_t sb) {
    uint32_t h[8];
    e2m1_word_pairs(code.x, h);
    e2m1_word_pairs(code.y, h + 4);
    if constexpr (kMma) {
      const uint4 xv = xb[gl * xb_stride];
      const __half2 s2 = e4m3_x128_pair(sb);  // e4m3 * 2^7 in fp16, exact
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h[j]), s2);  // exact
        h[j] = *reinterpret_cast<uint32_t*>(&v);
      }
      RowFragA a1, a2;
      RowFragB bf;
      set_pairs(a1, h[0], h[2], h[1], h[3]);
      set_pairs(a2, h[4], h[6], h[5], h[7]);
      set_pairs(bf, xv.x, xv.y, xv.z, xv.w);
      wmma::mma_sync(acc1, a1, bf, acc1);
      wmma::mma_sync(acc2, a2, bf, acc2);
    } else {
      const float4* xq = reinterpret_cast<const float4*>(smem) + gl * 4;
      const float4 q0 = xq[0], q1 = xq[1], q2 = xq[2], q3 = xq[3];
      const float xv[16] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w,
                            q2.x, q2.y, q2.z, q2.w, q3.x, q3.y, q3.z, q3.w};
      float lo = 0.0f, hi = 0.0f;  // codes j and j + 4 of each word
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&h[j]));
        const int k = (j / 4) * 8 + j % 4;
        lo = fmaf(v.x, xv[k], lo);
        hi = fmaf(v.y, xv[k + 4], hi);
      }
      acc = fmaf(e4m3_times_128(sb), lo + hi, acc);  // e2m1 * e4m3 * 2^-7 per product
    }
  };
  for (int b = 0; b < batches; b += 2) {
    if (b + 1 < batches) load_batch(b + 1, code_b, sb_b);
#pragma unroll
    for (int u = 0; u < kRowAhead; ++u)
      add_group(b * kRowBatch + u * kRowWarps + warp, code_a[u], sb_a[u]);
    if (b + 2 < batches) load_batch(b + 2, code_a, sb_a);
    if (b + 1 < batches) {
#pragma unroll
      for (int u = 0; u < kRowAhead; ++u)
        add_group((b + 1) * kRowBatch + u * kRowWarps + warp, code_b[u], sb_b[u]);
    }
  }
  for (int gl = batches * kRowBatch + warp; gl < ng; gl += kRowWarps)
    add_group(gl, __ldg(codes + (gl - warp) * 32), __ldg(scales + (gl - warp) * 32));

  __syncthreads();  // xs is reused for the warps' sums
  float* red = reinterpret_cast<float*>(smem);  // [warp][32]
  if constexpr (kMma) {
    // lane (g, q < 2) ends with columns 4g + 2q + j (sets 0 + 2), lane (g, q + 2) with the
    // same columns' sets 1 + 3
    const int g = lane / 4, q = lane % 4;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float mine = q < 2 ? acc1.x[j] + acc2.x[4 + j] : acc1.x[2 + j] + acc2.x[6 + j];
      const float other = __shfl_xor_sync(0xFFFFFFFFu, mine, 2);
      if (q < 2) red[warp * 32 + 4 * g + 2 * q + j] = mine + other;
    }
  } else {
    red[warp * 32 + lane] = acc;
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    float sum = 0.0f;
    for (int w = 0; w < kRowWarps; ++w) sum += red[w * 32 + threadIdx.x];
    a.partials[s * a.n_padded + t * 32 + threadIdx.x] = sum;
  }
}

// Whether the current device's WMMA m16n16k16 fp16 fragments (A row-major, B col-major, fp32
// accumulator) have the layout qpn2_row_kernel<true, *> writes: element e of lane (g, q) at row
// g + 8 * bit1(e), column 2q + bit0(e) + 8 * bit2(e) (B: k and n in those roles), elements
// 8..15 repeating 0..7. Measured on an H200 (docs/qpn.md); SM70's fragments differ.
__global__ void wmma_layout_probe(int* ok) {
  using namespace nvcuda;
  __shared__ __half mat[256];
  __shared__ float acc_mat[256];
  for (int i = threadIdx.x; i < 256; i += 32) {
    mat[i] = __int2half_rn(i);  // exact: integers below 2048
    acc_mat[i] = static_cast<float>(i);
  }
  __syncwarp();
  RowFragA fa;
  RowFragB fb;
  RowAcc fc;
  wmma::load_matrix_sync(fa, mat, 16);  // A[r][c] = r * 16 + c
  wmma::load_matrix_sync(fb, mat, 16);  // B[k][n] = n * 16 + k
  wmma::load_matrix_sync(fc, acc_mat, 16, wmma::mem_row_major);
  const int g = threadIdx.x / 4, q = threadIdx.x % 4;
  bool good = fa.num_elements == 16 && fb.num_elements == 16 && fc.num_elements == 8;
  for (int e = 0; e < 16; ++e) {
    const int f = e % 8, row = g + 8 * ((f >> 1) & 1), col = 2 * q + (f & 1) + 8 * (f >> 2);
    const int k = 2 * q + (f & 1) + 8 * ((f >> 1) & 1), n = g + 8 * (f >> 2);
    good = good && __half2int_rn(fa.x[e]) == row * 16 + col &&
           __half2int_rn(fb.x[e]) == n * 16 + k && (e >= 8 || fc.x[e] == row * 16 + col);
  }
  if (__all_sync(0xFFFFFFFFu, good) && threadIdx.x == 0) *ok = 1;
}

template <int MR>  // rows per pass handled in registers
__global__ void __launch_bounds__(kThreads) qpn2_simt_kernel(SmallMArgs a) {
  extern __shared__ __align__(32) unsigned char smem[];
  const int t = blockIdx.x, s = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t g0 = s * a.groups_per_split;
  const int ng = static_cast<int>(min(a.groups_per_split, a.groups - g0));
  const int len = ng * 16;
  float* xs = reinterpret_cast<float*>(smem);  // [MR][len]
  const float* x = static_cast<const float*>(a.x);
  for (int i = threadIdx.x; i < MR * len; i += kThreads) {
    const int row = i / len, col = i % len;
    xs[i] = row < a.rows ? x[row * a.k + g0 * 16 + col] : 0.0f;
  }
  __syncthreads();
  float acc[MR];
#pragma unroll
  for (int r = 0; r < MR; ++r) acc[r] = 0.0f;
  const uint8_t* codes = a.buffer + ((t * a.groups + g0) * 32 + lane) * 8;
  const uint8_t* scales = a.scales + (t * a.groups + g0) * 32 + lane;
  for (int gl = warp; gl < ng; gl += kWarps) {
    const uint2 code = __ldg(reinterpret_cast<const uint2*>(codes + gl * 256));
    const float sc = e4m3_to_float(__ldg(scales + gl * 32));
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t word = j < 8 ? code.x : code.y;
      const float w = e2m1_to_float((word >> (4 * (j % 8))) & 0xF) * sc;  // exact
      const float* xr = xs + gl * 16 + j;
#pragma unroll
      for (int r = 0; r < MR; ++r) acc[r] = fmaf(w, xr[r * len], acc[r]);
    }
  }
  __syncthreads();
  float* red = reinterpret_cast<float*>(smem);  // [warp][MR][32]
#pragma unroll
  for (int r = 0; r < MR; ++r) red[(warp * MR + r) * 32 + lane] = acc[r];
  __syncthreads();
  for (int i = threadIdx.x; i < MR * 32; i += kThreads) {
    const int row = i / 32, col = i % 32;
    if (row >= a.rows) continue;
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += red[(w * MR + row) * 32 + col];
    a.partials[(s * a.rows + row) * a.n_padded + t * 32 + col] = sum;
  }
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }

// y[c] = the sum over splits s, in split order, of p[c * second + s * stride], for c < C. The
// loads are issued kFinishBatch splits at a time so that their latencies overlap (a plain loop
// waits for each load before the next: about 0.15 us per split on an H200); the additions
// keep the split order, so the result is the plain loop's, bit for bit.
constexpr int kFinishBatch = 8;
template <int C>
__device__ __forceinline__ void sum_splits(const float* p, int64_t second, int splits,
                                           int64_t stride, float (&y)[C]) {
#pragma unroll
  for (int c = 0; c < C; ++c) y[c] = 0.0f;
  for (int s0 = 0; s0 < splits; s0 += kFinishBatch) {
    float v[C][kFinishBatch];
#pragma unroll
    for (int u = 0; u < kFinishBatch; ++u)
#pragma unroll
      for (int c = 0; c < C; ++c)
        if (s0 + u < splits) v[c][u] = p[c * second + (s0 + u) * stride];
#pragma unroll
    for (int u = 0; u < kFinishBatch; ++u)
#pragma unroll
      for (int c = 0; c < C; ++c)
        if (s0 + u < splits) y[c] += v[c][u];
  }
}

// out[row][j] = alpha * sum over splits (in split order), SiLU-gated if asked, cast once.
// Its index math is 32-bit (the host checks that a pass fits): 64-bit divisions took 0.2-0.3 us
// of a 1.5-1.8 us kernel on an H200.
template <typename Out>
__global__ void small_m_finish_kernel(const float* partials, int splits, int rows, int n_padded,
                                      int n, bool gated, float alpha, Out* out, int ldo) {
  const int n_out = gated ? n / 2 : n;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < rows * n_out;
       i += gridDim.x * blockDim.x) {
    const int row = rows == 1 ? 0 : i / n_out, j = i - row * n_out;
    const float* p = partials + int64_t(row) * n_padded + j;
    float y;
    if (gated) {
      float gate_up[2];
      sum_splits(p, n / 2, splits, int64_t(rows) * n_padded, gate_up);
      y = silu(gate_up[0] * alpha) * (gate_up[1] * alpha);
    } else {
      float sum[1];
      sum_splits(p, 0, splits, int64_t(rows) * n_padded, sum);
      y = sum[0] * alpha;
    }
    store(out + int64_t(row) * ldo + j, y);
  }
}

// Gated output of the large-M path: out[row][j] = silu(y[row][j]) * y[row][j + n/2] in fp32.
template <typename T>
__global__ void gate_kernel(const T* y, int64_t rows, int64_t n_padded, int64_t n, T* out) {
  const int64_t half = n / 2;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < rows * half;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / half, j = i % half;
    const float g = load(y + row * n_padded + j), u = load(y + row * n_padded + j + half);
    store(out + i, silu(g) * u);
  }
}

// A value of the current device, computed once per device (past the 64th: on every call).
template <typename F>
int cached_for_device(int (&cache)[64], F compute) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64) return compute(dev);
  if (cache[dev] == 0) cache[dev] = compute(dev);
  return cache[dev];
}

// Streaming multiprocessors of the current device.
int sm_count() {
  static int counts[64] = {0};
  return cached_for_device(counts, [](int dev) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  });
}

// Blocks of qpn2_row_kernel<kMma, kAhead> one SM holds at once (its registers decide: its x
// takes a few KiB).
template <bool kMma, int kAhead>
int row_blocks_per_sm() {
  static int blocks[64] = {0};
  return cached_for_device(blocks, [](int) {
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, qpn2_row_kernel<kMma, kAhead>, kRowThreads, 0));
    return std::max(n, 1);
  });
}

// Whether M = 1 runs the tensor-core body of qpn2_row_kernel on the current device: its WMMA
// fragments have the layout that body writes (wmma_layout_probe, run once per device; not while
// the stream is being captured into a graph, where that call takes the SIMT body), and
// $DFLASH_QPN_M1_SIMT does not ask for the SIMT body.
bool row_kernel_uses_mma(cudaStream_t stream) {
  const char* simt = std::getenv("DFLASH_QPN_M1_SIMT");
  if (simt != nullptr && simt[0] != '\0' && std::strcmp(simt, "0") != 0) return false;
  static int verdict[64] = {0};  // 0 not probed, 1 layout as expected, 2 not
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 64 && verdict[dev] == 0) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
    if (capturing != cudaStreamCaptureStatusNone) return false;
  }
  return cached_for_device(verdict, [stream](int index) {
           at::Tensor ok = at::zeros({1}, at::TensorOptions().dtype(at::kInt).device(
                                              at::kCUDA, static_cast<c10::DeviceIndex>(index)));
           wmma_layout_probe<<<1, 32, 0, stream>>>(ok.data_ptr<int>());
           C10_CUDA_KERNEL_LAUNCH_CHECK();
           return ok.item<int>() == 1 ? 1 : 2;
         }) == 1;
}

int grid_for(int64_t items) {
  const int sms = sm_count();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((items + 255) / 256, sms * 8)));
}

// Splits of K for one pass: enough blocks for every SM (about 8 per SM), each split's x
// rows fitting the shared memory next to the staging tiles.
int64_t groups_per_split(const Geometry& g, int64_t max_groups) {
  const int sms = sm_count();
  const int64_t want = std::max<int64_t>(1, (8 * sms + g.tiles - 1) / g.tiles);
  int64_t per = std::max<int64_t>(1, (g.groups + want - 1) / want);
  per = std::min(per, max_groups);
  return std::max<int64_t>(1, per);
}

// Groups per split of qpn2_row_kernel<kMma, kAhead>, rounded up to whole batches, x within the
// default shared memory. SIMT body: at most one wave of blocks (every SM full at the kernel's
// occupancy); on an H200 (12 blocks per SM) 64 groups (5 splits) for gate/up, 32 (9 splits) for
// down. Tensor-core body: about two waves, at most kRowMmaGroupsPerSplit groups before the
// rounding. Measured over 24-128 groups per split: docs/benchmarks.md, "QPN kernels".
constexpr int64_t kRowMmaGroupsPerSplit = 48;
template <bool kMma, int kAhead>
int64_t row_groups_per_split(const Geometry& g) {
  const int64_t blocks =
      int64_t(row_blocks_per_sm<kMma, kAhead>()) * sm_count() * (kMma ? 2 : 1);
  const int64_t want = std::max<int64_t>(1, kMma ? (blocks + g.tiles - 1) / g.tiles
                                                 : blocks / g.tiles);  // splits per tile
  int64_t per = std::min<int64_t>((g.groups + want - 1) / want, kSmemBytes / (16 * 4));
  if (kMma) per = std::min(per, kRowMmaGroupsPerSplit);
  return (per + row_batch(kAhead) - 1) / row_batch(kAhead) * row_batch(kAhead);
}

// How qpn2_row_kernel runs one layer: its body, load depth (groups per warp per batch) and
// groups per split. SIMT: 2 (4 took registers and blocks without a gain). Tensor core: 8 where
// that depth's splits give every block at least two batches, each batch's loads hidden behind
// the other's work (gate/up on an H200: 64 groups, 5 splits, 5 blocks of 88 registers per SM),
// else 4 (64 registers, 8 blocks per SM; down on an H200: 32 groups, 9 splits). Deeper batches
// on fewer blocks pay only where the blocks run long: docs/benchmarks.md, "QPN kernels".
struct RowPlan {
  bool mma;
  int ahead;
  int64_t per;
};

RowPlan row_plan(const Geometry& g, bool mma) {
  if (!mma) return {false, 2, row_groups_per_split<false, 2>(g)};
  const int64_t deep = row_groups_per_split<true, 8>(g);
  if (deep >= 2 * row_batch(8)) return {true, 8, deep};
  return {true, 4, row_groups_per_split<true, 4>(g)};
}

template <typename Kernel>
void launch_small_m(Kernel kernel, int threads, const SmallMArgs& a, int64_t splits, size_t smem,
                    cudaStream_t stream) {
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  kernel<<<dim3(static_cast<unsigned>(a.n_padded / 32), static_cast<unsigned>(splits)), threads,
           smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One pass of <= 32 rows: partials [splits][rows][Np] and the alpha that finishes them.
std::pair<at::Tensor, float> small_m_pass(const at::Tensor& x, int64_t r0, int64_t rows,
                                          const at::Tensor& buffer, const at::Tensor& scales,
                                          double global_scale, const Geometry& g,
                                          cudaStream_t stream) {
  const bool half = x.scalar_type() == at::kHalf;
  const int rows_pad = static_cast<int>((rows + 7) / 8 * 8);
  int64_t per;
  size_t smem;
  RowPlan row{};
  if (half && rows == 1) {
    row = row_plan(g, row_kernel_uses_mma(stream));
    per = row.per;
    // x (fp16 and 16 zero bytes, or fp32); the warps' sums
    const size_t xs = row.mma ? (size_t(per) * 2 + 1) * 16 : size_t(per) * 16 * 4;
    smem = std::max(xs, size_t(kRowWarps) * 32 * 4);
  } else if (half) {
    const int mb = rows_pad / 8;
    // xs: [8 mb][x_stage_ld(per)] halves, then a staging tile per warp; reduction: warps x 8 mb
    // x 32 fp32. ~64 groups per block: the measured optimum on the target shapes (docs/qpn.md).
    const int64_t max_groups =
        ((kSmemBytes - kWmmaWarps * kStageBytes) / (2 * 8 * mb) - 32) / 16;
    const int64_t splits = (g.groups + std::min(kWmmaGroupsPerSplit, max_groups) - 1) /
                           std::min(kWmmaGroupsPerSplit, max_groups);
    per = (g.groups + splits - 1) / splits;  // the same number of groups in every split
    const size_t xs = size_t(8 * mb) * x_stage_ld(per) * 2 + kWmmaWarps * kStageBytes;
    smem = std::max(xs, size_t(kWmmaWarps) * 8 * mb * 32 * 4);
  } else {
    const int mr = rows_pad <= 8 ? 8 : rows_pad <= 16 ? 16 : 32;
    const int64_t max_groups = kSmemBytes / (4 * mr * 16);
    per = groups_per_split(g, max_groups);
    smem = std::max(size_t(mr) * per * 16 * 4, size_t(kWarps) * mr * 32 * 4);
  }
  const int64_t splits = (g.groups + per - 1) / per;
  at::Tensor partials = at::empty({splits, rows, g.n_padded}, x.options().dtype(at::kFloat));
  poison(partials);
  SmallMArgs a{static_cast<const char*>(x.data_ptr()) + r0 * g.k * x.element_size(), rows, g.k,
               buffer.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), g.groups, per,
               g.n_padded, partials.data_ptr<float>()};
  if (half && rows == 1) {
    const auto kernel = !row.mma         ? qpn2_row_kernel<false, 2>
                        : row.ahead == 8 ? qpn2_row_kernel<true, 8>
                                         : qpn2_row_kernel<true, 4>;
    launch_small_m(kernel, kRowThreads, a, splits, smem, stream);
    return {partials, static_cast<float>(global_scale * 128.0)};
  }
  if (half) {
    switch (rows_pad / 8) {
      case 1: launch_small_m(qpn2_wmma_kernel<1>, kWmmaThreads, a, splits, smem, stream); break;
      case 2: launch_small_m(qpn2_wmma_kernel<2>, kWmmaThreads, a, splits, smem, stream); break;
      case 3: launch_small_m(qpn2_wmma_kernel<3>, kWmmaThreads, a, splits, smem, stream); break;
      default: launch_small_m(qpn2_wmma_kernel<4>, kWmmaThreads, a, splits, smem, stream); break;
    }
    return {partials, static_cast<float>(global_scale * 128.0)};
  }
  if (rows_pad <= 8) launch_small_m(qpn2_simt_kernel<8>, kThreads, a, splits, smem, stream);
  else if (rows_pad <= 16) launch_small_m(qpn2_simt_kernel<16>, kThreads, a, splits, smem, stream);
  else launch_small_m(qpn2_simt_kernel<32>, kThreads, a, splits, smem, stream);
  return {partials, static_cast<float>(global_scale)};
}

at::Tensor qpn2_small_m_cuda(const at::Tensor& x_in, const at::Tensor& buffer,
                             const at::Tensor& scales, double global_scale, const Geometry& g,
                             bool gated) {
  // The kernels read x in 4- to 16-byte vectors: a view that starts off a 16-byte boundary (a
  // slice at an odd element, say) is copied to fresh storage first, not read misaligned.
  at::Tensor x = x_in.contiguous();
  if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) x = x.clone();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int64_t n_out = gated ? g.n / 2 : g.n;
  // The finishing kernel indexes a pass in 32 bits: up to 32 rows of Np outputs, far above any
  // layer's (gate/up: Np = 8704).
  TORCH_CHECK(g.n_padded * kMaxSmallM < (int64_t(1) << 31), "qpn2: N = ", g.n,
              " is beyond the small-M kernels' 32-bit indexing (N * 32 must stay below 2^31); "
              "split the weight into narrower ones");
  at::Tensor out = at::empty({g.m, n_out}, x.options());
  poison(out);
  for (int64_t r0 = 0; r0 < g.m; r0 += kMaxSmallM) {
    count_hit(kHitQpn2SmallM);
    const int64_t rows = std::min(kMaxSmallM, g.m - r0);
    auto [partials, alpha] = small_m_pass(x, r0, rows, buffer, scales, global_scale, g, stream);
    const int splits = static_cast<int>(partials.size(0));
    const int grid = grid_for(rows * n_out);
    if (x.scalar_type() == at::kHalf) {
      small_m_finish_kernel<__half><<<grid, 256, 0, stream>>>(
          partials.data_ptr<float>(), splits, static_cast<int>(rows),
          static_cast<int>(g.n_padded), static_cast<int>(g.n), gated, alpha,
          reinterpret_cast<__half*>(out.data_ptr<at::Half>()) + r0 * n_out,
          static_cast<int>(n_out));
    } else {
      small_m_finish_kernel<float><<<grid, 256, 0, stream>>>(
          partials.data_ptr<float>(), splits, static_cast<int>(rows),
          static_cast<int>(g.n_padded), static_cast<int>(g.n), gated, alpha,
          out.data_ptr<float>() + r0 * n_out, static_cast<int>(n_out));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// qpn4_bounded: dequantize a chunk of tiles into the workspace, one cuBLAS GEMM per chunk.

__device__ __forceinline__ void store16(__half* dst, const float* v) {
  uint32_t w[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    __half2 h = __floats2half2_rn(v[2 * j], v[2 * j + 1]);
    w[j] = *reinterpret_cast<uint32_t*>(&h);
  }
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(w[0], w[1], w[2], w[3]);
  d[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

__device__ __forceinline__ void store16(float* dst, const float* v) {
  float4* d = reinterpret_cast<float4*>(dst);
#pragma unroll
  for (int j = 0; j < 4; ++j) d[j] = make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
}

// Groups one dequantize block spans: 1 KiB of values per column (fp16: 32, fp32: 16).
template <typename T>
constexpr int kDequantSpan = 1024 / (16 * static_cast<int>(sizeof(T)));

// One block = one tile's 32 columns over a span of groups, in two phases through shared memory
// so that both sides of this memory-bound copy are coalesced: the reads walk the buffer in its
// own order (a warp load is 256 contiguous code bytes, 32 contiguous scales), the writes are
// 16-byte stores that walk each column's span of its workspace row (1 KiB contiguous). Measured
// on an H200 (gate/up N=8704 K=5120, fp16 into an 89 MB workspace): one (column, group) per
// thread, groups fastest, read 8 bytes per 32-byte sector and took 64 us; columns fastest
// wrote 16 bytes per line per store and took 113 us.
template <typename T>
__global__ void __launch_bounds__(256) dequant_kernel(
    const uint8_t* buffer, const uint8_t* scales, const __half* scales16, int64_t groups,
    int64_t k, int64_t t0, T* values) {
  constexpr int kSpan = kDequantSpan<T>;
  constexpr int kVec = 16 / sizeof(T);           // values per 16-byte store
  constexpr int kRow = kSpan * 16 + kVec;        // shared row: padded 16 bytes (no bank conflict)
  __shared__ __align__(16) T staged[32 * kRow];  // 33 KiB
  const int64_t tile = blockIdx.y, g0 = int64_t(blockIdx.x) * kSpan;
  const int ng = static_cast<int>(min(int64_t(kSpan), groups - g0));
  for (int i = threadIdx.x; i < ng * 32; i += blockDim.x) {
    const int gl = i / 32, c = i % 32;
    const int64_t src = ((t0 + tile) * groups + g0 + gl) * 32 + c;
    const uint2 code = __ldg(reinterpret_cast<const uint2*>(buffer + src * 8));
    const float s = scales16 ? __half2float(scales16[src]) : e4m3_to_float(__ldg(scales + src));
    float v[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t word = j < 8 ? code.x : code.y;
      v[j] = e2m1_to_float((word >> (4 * (j % 8))) & 0xF) * s;
    }
    store16(staged + c * kRow + gl * 16, v);
  }
  __syncthreads();
  const int per_row = ng * 16 / kVec;
  for (int i = threadIdx.x; i < 32 * per_row; i += blockDim.x) {
    const int c = i / per_row, j = i % per_row;
    *reinterpret_cast<uint4*>(values + (tile * 32 + c) * k + g0 * 16 + j * kVec) =
        *reinterpret_cast<const uint4*>(staged + c * kRow + j * kVec);
  }
}

at::Tensor qpn4_bounded_large_m_cuda(const at::Tensor& x_in, const at::Tensor& buffer,
                                     const at::Tensor& scales,
                                     const std::optional<at::Tensor>& scales_fp16,
                                     double global_scale, int64_t workspace_id,
                                     int64_t workspace_bytes, const Geometry& g, bool gated) {
  count_hit(kHitQpn4LargeM);
  const at::Tensor x = x_in.contiguous();
  const bool half = x.scalar_type() == at::kHalf;
  const int64_t value_bytes = half ? 2 : 4;
  const int64_t chunk = tiles_per_chunk(g.tiles, g.k, value_bytes, workspace_bytes);
  const bool fp16_scales = use_fp16_scales(x, scales_fp16);
  const float alpha = fp16_scales ? static_cast<float>(1.0 / kFp16ScaleBias)
                                  : static_cast<float>(global_scale);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  at::Tensor y = at::empty({g.m, g.n_padded}, x.options());
  poison(y);
  WorkspaceLease ws = take_workspace(
      workspace_id, chunk * workspace_bytes_per_tile(g.k, value_bytes), workspace_bytes,
      x.device());
  poison(ws.bytes);
  const __half* s16 = fp16_scales
      ? reinterpret_cast<const __half*>(scales_fp16->data_ptr<at::Half>()) : nullptr;
  const at::Tensor values_all =
      ws.bytes.view(half ? at::kHalf : at::kFloat).view({chunk * kTileN, g.k});
  for (int64_t t0 = 0; t0 < g.tiles; t0 += chunk) {
    const int64_t nt = std::min(chunk, g.tiles - t0);
    if (half) {
      const dim3 grid((g.groups + kDequantSpan<__half> - 1) / kDequantSpan<__half>, nt);
      dequant_kernel<__half><<<grid, 256, 0, stream>>>(
          buffer.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), s16, g.groups, g.k, t0,
          reinterpret_cast<__half*>(values_all.data_ptr<at::Half>()));
    } else {
      const dim3 grid((g.groups + kDequantSpan<float> - 1) / kDequantSpan<float>, nt);
      dequant_kernel<float><<<grid, 256, 0, stream>>>(
          buffer.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), nullptr, g.groups, g.k, t0,
          values_all.data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // cuBLAS (through ATen): y[:, chunk] = alpha * (x @ W_chunk^T), alpha applied to the fp32
    // accumulators before the one rounding to y's dtype; beta = 0 never reads y.
    at::Tensor cols = y.narrow(1, t0 * kTileN, nt * kTileN);
    at::addmm_out(cols, cols, x, values_all.narrow(0, 0, nt * kTileN).t(), 0.0, alpha);
  }
  if (!gated) return g.n == g.n_padded ? y : y.narrow(1, 0, g.n).contiguous();
  at::Tensor out = at::empty({g.m, g.n / 2}, x.options());
  poison(out);
  const int grid = grid_for(g.m * (g.n / 2));
  if (half) {
    gate_kernel<__half><<<grid, 256, 0, stream>>>(
        reinterpret_cast<const __half*>(y.data_ptr<at::Half>()), g.m, g.n_padded, g.n,
        reinterpret_cast<__half*>(out.data_ptr<at::Half>()));
  } else {
    gate_kernel<float><<<grid, 256, 0, stream>>>(y.data_ptr<float>(), g.m, g.n_padded, g.n,
                                                 out.data_ptr<float>());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// ---------------------------------------------------------------------------------------------
// Ops.

at::Tensor qpn2_linear_cuda(const at::Tensor& x, const at::Tensor& buffer,
                            const at::Tensor& scales, double global_scale, int64_t n, int64_t k,
                            bool gated) {
  const Geometry g = check_args("qpn2_linear", x, buffer, scales, std::nullopt, n, k, gated);
  const c10::cuda::CUDAGuard guard(x.device());
  return qpn2_small_m_cuda(x, buffer, scales, global_scale, g, gated);
}

at::Tensor qpn4_bounded_linear_cuda(const at::Tensor& x, const at::Tensor& buffer,
                                    const at::Tensor& scales,
                                    const std::optional<at::Tensor>& scales_fp16,
                                    double global_scale, int64_t n, int64_t k,
                                    int64_t workspace_id, int64_t workspace_bytes, bool gated) {
  const Geometry g =
      check_args("qpn4_bounded_linear", x, buffer, scales, scales_fp16, n, k, gated);
  const c10::cuda::CUDAGuard guard(x.device());
  return qpn4_bounded_large_m_cuda(x, buffer, scales, scales_fp16, global_scale, workspace_id,
                                   workspace_bytes, g, gated);
}

at::Tensor qpn2_packed_linear_cuda(const at::Tensor& x, const at::Tensor& buffer,
                                   const at::Tensor& scales,
                                   const std::optional<at::Tensor>& scales_fp16,
                                   int64_t n, const at::Tensor& plan, bool gated) {
  const PackedPlan p = read_packed_plan(plan);
  const Geometry g =
      check_args("qpn2_packed_linear", x, buffer, scales, scales_fp16, n, p.k, gated);
  const c10::cuda::CUDAGuard guard(x.device());
  if (g.m < p.min_prefill_m) {
    count_hit(kHitPackedSmallM);
    return qpn2_small_m_cuda(x, buffer, scales, p.global_scale, g, gated);
  }
  count_hit(kHitPackedLargeM);
  return qpn4_bounded_large_m_cuda(x, buffer, scales, scales_fp16, p.global_scale,
                                   p.workspace_id, p.workspace_bytes, g, gated);
}

}  // namespace
}  // namespace dflash_qpn

TORCH_LIBRARY_IMPL(dflash_qpn, CUDA, m) {
  m.impl("qpn2_linear", &dflash_qpn::qpn2_linear_cuda);
  m.impl("qpn4_bounded_linear", &dflash_qpn::qpn4_bounded_linear_cuda);
  m.impl("qpn2_packed_linear", &dflash_qpn::qpn2_packed_linear_cuda);
}
