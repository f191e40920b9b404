// Causal prefill attention with head dim 256 on CUDA: the CUDA kernels of the `dflash_d256` ops
// (schemas and the CPU kernels in attn_d256.cpp; argument checks shared in attn_d256_checks.h).
//
// Contract as on the CPU: queries are the LAST Tq of the Tk positions, so with `causal` query row
// r sees keys 0 .. Tk - Tq + r (bottom-right aligned mask); GQA (Hq a multiple of Hkv); `paged`
// reads keys/values through a block table; fp16 and fp32 inputs; accumulation in fp32;
// `dense_splitkv` splits the keys, keeps each split's unnormalised output with its running max and
// sum, and merges them exactly.
//
// Algorithm: FlashAttention-2 forward. One thread block owns a tile of query rows of one query
// head (and one key split) and makes ONE pass over its keys in tiles, keeping the running row max
// m, row sum l and the unnormalised output O on chip (online softmax); no [Tq, Tk] matrix ever
// reaches global memory. Key tiles past the causal bound of the query tile are never visited, and
// only tiles that cross the bound (or the end of the keys) are masked.
//
// Only what SM70 (V100) has: fp16 tensor cores through WMMA 16x16x16 (half in, float accumulate),
// plain 16-byte global loads (no cp.async, TMA, wgmma, bf16), at most 96 KB of shared memory per
// block. The build compiles this file for compute_75 PTX as well, which proves it.
//
// * fp16 (`Fp16Kernel`): 4 warps, 64 query rows (16 per warp), key tiles of 64. Q lives in shared
//   memory for the whole pass, K and V tiles take turns in one buffer (85 KB in all, so two blocks
//   share an SM of an A100/H100 and one fits a V100). Per key tile a warp computes its 16 x 64
//   scores with WMMA, does the online-softmax step on them through shared memory, rescales its
//   16 x 256 output accumulator (kept in WMMA fragments, in registers) and adds P V with WMMA, P
//   rounded to fp16 in [0, 1] as in every FA2 kernel. Rescaling the accumulator fragments needs
//   the row of each fragment element, whose layout CUDA leaves unspecified: the kernel learns it
//   at start by loading a matrix of row numbers into a fragment (portable to any architecture).
// * fp32 (`Fp32Kernel`): SIMT in fp32 throughout (the fp32 parity bounds are tight), 16 query rows
//   per block, 256 threads, key tiles of 32.
// * split-KV: every (query tile, split) block writes O, m, l in fp32 to a workspace, and a second
//   kernel merges the splits per row: M = max m_s, O = sum 2^(m_s - M) O_s / sum 2^(m_s - M) l_s.
//
// Build macro DFLASH_DENSE_ONLY: no `paged` (the op is not defined then), as in attn_d256.cpp.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "attn_d256_checks.h"

namespace dflash_d256 {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int D = 256;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------------
// Key/value addressing: dense [Tk, Hkv, 256] or paged [NB, BS, Hkv, 256] + block table.

template <typename T>
struct DenseKV {
  const T* k;
  const T* v;
  int64_t row_stride;  // Hkv * 256
  __device__ __forceinline__ int64_t offset(int64_t pos, int head) const {
    return pos * row_stride + static_cast<int64_t>(head) * D;
  }
};

template <typename T>
struct PagedKV {
  const T* k;
  const T* v;
  const int32_t* table;
  int block_size;
  int64_t row_stride;    // Hkv * 256
  int64_t block_stride;  // block_size * Hkv * 256
  __device__ __forceinline__ int64_t offset(int64_t pos, int head) const {
    const int64_t block = table[pos / block_size];
    return block * block_stride + (pos % block_size) * row_stride +
           static_cast<int64_t>(head) * D;
  }
};

struct Params {
  const void* q;        // [Tq, Hq, 256]
  void* out;            // [Tq, Hq, 256], written when ws_o is null
  float* ws_o;          // split-KV workspace [splits, Hq, Tq, 256] (unnormalised), or null
  float* ws_m;          // [splits, Hq, Tq] running max (log2 domain)
  float* ws_l;          // [splits, Hq, Tq] running sum
  int tq, tk, hq, group;
  int split_len;        // keys per split (a multiple of every key tile)
  float scale_log2;     // softmax_scale * log2(e): scores go straight into exp2
  bool causal;
};

// Keys [k0, k1) that query rows [q0, q0 + rows) of split `split` attend to.
__device__ __forceinline__ void key_range(const Params& p, int q0, int rows, int split, int& k0,
                                          int& k1) {
  const int offset = p.tk - p.tq;
  const int last_row = min(p.tq, q0 + rows);
  const int end = p.causal ? min(p.tk, offset + last_row) : p.tk;
  k0 = split * p.split_len;
  k1 = min(end, k0 + p.split_len);
}

// Last key (exclusive) query row qi may see within [.., k1).
__device__ __forceinline__ int row_key_end(const Params& p, int qi, int k1) {
  return p.causal ? min(k1, p.tk - p.tq + qi + 1) : k1;
}

// ---------------------------------------------------------------------------------------------
// fp16: WMMA tensor cores.

namespace f16 {

constexpr int BC = 64;           // keys per tile
constexpr int LDQ = D + 8;       // halves; padded rows (bank conflicts), multiple of 8 for WMMA
constexpr int LDS = BC + 4;      // floats; score rows
constexpr int LDP = BC + 8;      // halves; probability rows
constexpr int kKVBytes = BC * LDQ * 2;
constexpr int kWarpBytes = 16 * LDS * 4;      // scores, then P (fp16) + scratch + row factors
constexpr int kScratchOff = 16 * LDP * 2;     // 16 x 16 floats after P
constexpr int kRowOff = kScratchOff + 16 * 16 * 4;  // 16 floats: per-row factor
static_assert(kRowOff + 16 * 4 <= kWarpBytes, "warp region too small");
static_assert(kScratchOff % 32 == 0 && kKVBytes % 32 == 0 && kWarpBytes % 32 == 0,
              "WMMA pointers must be 256-bit aligned");

// NW warps of 16 query rows each. 4 warps (85 KB) fit a V100; 8 warps (136 KB) halve the K/V
// traffic per query row where the device allows that much shared memory per block.
template <int NW>
struct Cfg {
  static constexpr int kWarps = NW;
  static constexpr int kThreads = NW * 32;
  static constexpr int BR = 16 * NW;  // query rows per block
  static constexpr int kQBytes = BR * LDQ * 2;
  static constexpr int kSmemBytes = kQBytes + kKVBytes + NW * kWarpBytes;
  static_assert(kQBytes % 32 == 0, "WMMA pointers must be 256-bit aligned");
};
static_assert(Cfg<4>::kSmemBytes <= 96 * 1024, "4 warps must fit a V100's 96 KB per block");

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major>;
using FragBc = wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major>;
using FragBr = wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
constexpr int kAccElems = FragC::num_elements;

// rows x 256 halves from global rows (row_ptr(i) or null for a zero row) into shared [rows][LDQ].
template <int ROWS, int THREADS, typename RowPtr>
__device__ __forceinline__ void load_tile(half* dst, RowPtr row_ptr) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += THREADS) {
    const int r = idx / kChunks;
    const int c = idx % kChunks;
    const half* src = row_ptr(r);
    uint4 val = make_uint4(0, 0, 0, 0);
    if (src != nullptr) val = __ldg(reinterpret_cast<const uint4*>(src) + c);
    *reinterpret_cast<uint4*>(dst + r * LDQ + c * 8) = val;
  }
}

template <int NW, typename KV>
__global__ void __launch_bounds__(NW * 32, 8 / NW) attn_fp16_kernel(Params p, KV kv) {
  using C = Cfg<NW>;
  constexpr int BR = C::BR;
  constexpr int kQBytes = C::kQBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  half* sQ = reinterpret_cast<half*>(smem);
  half* sKV = reinterpret_cast<half*>(smem + kQBytes);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  unsigned char* region = smem + kQBytes + kKVBytes + warp * kWarpBytes;
  float* sS = reinterpret_cast<float*>(region);
  half* sP = reinterpret_cast<half*>(region);
  float* scratch = reinterpret_cast<float*>(region + kScratchOff);
  float* row_factor = reinterpret_cast<float*>(region + kRowOff);

  const int head = blockIdx.x;
  const int kv_head = head / p.group;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;  // longest (causal) tiles first
  const int split = blockIdx.z;
  int k0, k1;
  key_range(p, q0, BR, split, k0, k1);

  const half* q = static_cast<const half*>(p.q);
  load_tile<BR, C::kThreads>(sQ, [&](int r) -> const half* {
    const int qi = q0 + r;
    return qi < p.tq ? q + (static_cast<int64_t>(qi) * p.hq + head) * D : nullptr;
  });

  // Which row of the 16 x 16 tile each accumulator element of this lane holds.
  for (int e = lane; e < 256; e += 32) scratch[e] = static_cast<float>(e / 16);
  __syncwarp();
  FragC rowmap;
  wmma::load_matrix_sync(rowmap, scratch, 16, wmma::mem_row_major);
  int acc_row[kAccElems];
#pragma unroll
  for (int i = 0; i < kAccElems; ++i) acc_row[i] = static_cast<int>(rowmap.x[i]);

  FragC acc[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);

  // Online-softmax state: lanes 2r and 2r+1 both own row r (each half of the columns).
  const int srow = lane / 2;
  const int shalf = lane % 2;
  const int qi = q0 + warp * 16 + srow;
  const int key_end = row_key_end(p, qi, k1);
  float m_run = -INFINITY;
  float l_part = 0.0f;

  for (int j0 = k0; j0 < k1; j0 += BC) {
    __syncthreads();  // previous tile's V (and, first time, nothing) no longer read
    load_tile<BC, C::kThreads>(sKV, [&](int r) -> const half* {
      const int pos = j0 + r;
      return pos < k1 ? kv.k + kv.offset(pos, kv_head) : nullptr;
    });
    __syncthreads();

    // S = Q K^T for this warp's 16 rows x 64 keys.
    FragC s[BC / 16];
#pragma unroll
    for (int n = 0; n < BC / 16; ++n) wmma::fill_fragment(s[n], 0.0f);
#pragma unroll 4
    for (int kk = 0; kk < D / 16; ++kk) {
      FragA a;
      wmma::load_matrix_sync(a, sQ + warp * 16 * LDQ + kk * 16, LDQ);
#pragma unroll
      for (int n = 0; n < BC / 16; ++n) {
        FragBc b;
        wmma::load_matrix_sync(b, sKV + n * 16 * LDQ + kk * 16, LDQ);
        wmma::mma_sync(s[n], a, b, s[n]);
      }
    }
#pragma unroll
    for (int n = 0; n < BC / 16; ++n) {
      wmma::store_matrix_sync(sS + n * 16, s[n], LDS, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax step on row srow, columns shalf, shalf + 2, ... (32 per lane).
    float sv[BC / 2];
    float tile_max = -INFINITY;
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) {
      const int col = shalf + 2 * i;
      const float x = sS[srow * LDS + col] * p.scale_log2;
      sv[i] = (j0 + col < key_end) ? x : -INFINITY;
      tile_max = fmaxf(tile_max, sv[i]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, 1));
    const float m_new = fmaxf(m_run, tile_max);
    // alpha rescales what was accumulated against the old max; a row that has seen no key yet
    // (m = -inf, possible within a split) keeps factor 1 and contributes exact zeros.
    const float alpha = (m_new == -INFINITY) ? 1.0f : exp2f(m_run - m_new);
    const float base = (m_new == -INFINITY) ? 0.0f : m_new;
    m_run = m_new;
    __syncwarp();  // every lane has read its scores: P may overwrite them
    float psum = 0.0f;
#pragma unroll
    for (int i = 0; i < BC / 2; ++i) {
      const float pr = exp2f(sv[i] - base);
      psum += pr;
      sP[srow * LDP + shalf + 2 * i] = __float2half_rn(pr);
    }
    l_part = l_part * alpha + psum;
    if (shalf == 0) row_factor[srow] = alpha;
    const bool rescale = __any_sync(kFullMask, alpha != 1.0f);
    __syncwarp();
    if (rescale) {
      float f[kAccElems];
#pragma unroll
      for (int i = 0; i < kAccElems; ++i) f[i] = row_factor[acc_row[i]];
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
#pragma unroll
        for (int i = 0; i < kAccElems; ++i) acc[n].x[i] *= f[i];
      }
    }

    __syncthreads();  // all warps done with K
    load_tile<BC, C::kThreads>(sKV, [&](int r) -> const half* {
      const int pos = j0 + r;
      return pos < k1 ? kv.v + kv.offset(pos, kv_head) : nullptr;
    });
    __syncthreads();

    // O += P V
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      FragA a;
      wmma::load_matrix_sync(a, sP + kk * 16, LDP);
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        FragBr b;
        wmma::load_matrix_sync(b, sKV + kk * 16 * LDQ + n * 16, LDQ);
        wmma::mma_sync(acc[n], a, b, acc[n]);
      }
    }
  }

  // Row sums: the two lanes of a row hold halves of it.
  const float l_row = l_part + __shfl_xor_sync(kFullMask, l_part, 1);
  __syncwarp();
  if (shalf == 0) row_factor[srow] = (p.ws_o == nullptr) ? 1.0f / l_row : 1.0f;
  if (p.ws_o != nullptr && shalf == 0 && qi < p.tq) {
    const int64_t row = (static_cast<int64_t>(split) * p.hq + head) * p.tq + qi;
    p.ws_m[row] = m_run;
    p.ws_l[row] = l_row;
  }
  __syncwarp();
  // Each lane writes 8 consecutive columns of one row per 16 x 16 fragment.
  const int orow = lane / 2;
  const int ocol = (lane % 2) * 8;
  const int oqi = q0 + warp * 16 + orow;
  const float factor = row_factor[orow];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::store_matrix_sync(scratch, acc[n], 16, wmma::mem_row_major);
    __syncwarp();
    float vals[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) vals[t] = scratch[orow * 16 + ocol + t] * factor;
    __syncwarp();
    if (oqi < p.tq) {
      const int col = n * 16 + ocol;
      if (p.ws_o != nullptr) {
        float* dst = p.ws_o + ((static_cast<int64_t>(split) * p.hq + head) * p.tq + oqi) * D + col;
        reinterpret_cast<float4*>(dst)[0] = make_float4(vals[0], vals[1], vals[2], vals[3]);
        reinterpret_cast<float4*>(dst)[1] = make_float4(vals[4], vals[5], vals[6], vals[7]);
      } else {
        uint4 packed;
        half2* h2 = reinterpret_cast<half2*>(&packed);
#pragma unroll
        for (int t = 0; t < 4; ++t) h2[t] = __floats2half2_rn(vals[2 * t], vals[2 * t + 1]);
        half* dst = static_cast<half*>(p.out) + (static_cast<int64_t>(oqi) * p.hq + head) * D + col;
        *reinterpret_cast<uint4*>(dst) = packed;
      }
    }
  }
}

}  // namespace f16

// ---------------------------------------------------------------------------------------------
// fp32: SIMT, fp32 arithmetic throughout.

namespace f32 {

constexpr int kThreads = 256;  // one thread per output column
constexpr int BR = 16;
constexpr int BC = 32;
constexpr int LDK = D + 1;  // floats; odd stride: lanes reading different keys hit distinct banks
constexpr int kSmemBytes = (BR * D + 2 * BC * LDK + BR * BC + 2 * BR) * 4;
static_assert(kSmemBytes <= 96 * 1024, "must fit a V100's 96 KB of shared memory per block");

template <typename KV>
__global__ void __launch_bounds__(kThreads) attn_fp32_kernel(Params p, KV kv) {
  extern __shared__ __align__(128) unsigned char smem[];
  float* sQ = reinterpret_cast<float*>(smem);  // [BR][D]
  float* sK = sQ + BR * D;                     // [BC][LDK]
  float* sV = sK + BC * LDK;                   // [BC][LDK]
  float* sP = sV + BC * LDK;                   // [BR][BC]
  float* sAlpha = sP + BR * BC;                // [BR]
  float* sL = sAlpha + BR;                     // [BR]

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int head = blockIdx.x;
  const int kv_head = head / p.group;
  const int q0 = (gridDim.y - 1 - blockIdx.y) * BR;
  const int split = blockIdx.z;
  int k0, k1;
  key_range(p, q0, BR, split, k0, k1);

  const float* q = static_cast<const float*>(p.q);
  for (int idx = tid; idx < BR * D; idx += kThreads) {
    const int r = idx / D;
    const int qi = q0 + r;
    sQ[idx] = qi < p.tq ? q[(static_cast<int64_t>(qi) * p.hq + head) * D + idx % D] : 0.0f;
  }

  // Softmax state: warp w owns rows w and w + 8 (every lane holds the same values).
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.0f, 0.0f};
  int key_end[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) key_end[h] = row_key_end(p, q0 + warp + 8 * h, k1);
  float o[BR];
#pragma unroll
  for (int r = 0; r < BR; ++r) o[r] = 0.0f;

  for (int j0 = k0; j0 < k1; j0 += BC) {
    __syncthreads();
    for (int idx = tid; idx < BC * D; idx += kThreads) {
      const int r = idx / D;
      const int c = idx % D;
      const int pos = j0 + r;
      float kx = 0.0f, vx = 0.0f;
      if (pos < k1) {
        const int64_t off = kv.offset(pos, kv_head) + c;
        kx = kv.k[off];
        vx = kv.v[off];
      }
      sK[r * LDK + c] = kx;
      sV[r * LDK + c] = vx;
    }
    __syncthreads();
    // Scores: thread -> key lane, rows warp and warp + 8.
    {
      const float* qa = sQ + warp * D;
      const float* qb = sQ + (warp + 8) * D;
      const float* kr = sK + lane * LDK;
      float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) {
        s0 = fmaf(qa[d], kr[d], s0);
        s1 = fmaf(qb[d], kr[d], s1);
      }
      const float s[2] = {s0, s1};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp + 8 * h;
        const float x = (j0 + lane < key_end[h]) ? s[h] * p.scale_log2 : -INFINITY;
        float mx = x;
#pragma unroll
        for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, off));
        const float m_new = fmaxf(m_run[h], mx);
        const float alpha = (m_new == -INFINITY) ? 1.0f : exp2f(m_run[h] - m_new);
        const float pr = exp2f(x - ((m_new == -INFINITY) ? 0.0f : m_new));
        float sum = pr;
#pragma unroll
        for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(kFullMask, sum, off);
        m_run[h] = m_new;
        l_run[h] = l_run[h] * alpha + sum;
        sP[row * BC + lane] = pr;
        if (lane == 0) sAlpha[row] = alpha;
      }
    }
    __syncthreads();
    // O[r][tid] = O[r][tid] * alpha[r] + sum_j P[r][j] V[j][tid]
#pragma unroll
    for (int r = 0; r < BR; ++r) o[r] *= sAlpha[r];
    for (int j = 0; j < BC; ++j) {
      const float vj = sV[j * LDK + tid];
#pragma unroll
      for (int r = 0; r < BR; ++r) o[r] = fmaf(sP[r * BC + j], vj, o[r]);
    }
  }

  if (lane == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp + 8 * h;
      sL[row] = l_run[h];
      const int qi = q0 + row;
      if (p.ws_o != nullptr && qi < p.tq) {
        const int64_t at = (static_cast<int64_t>(split) * p.hq + head) * p.tq + qi;
        p.ws_m[at] = m_run[h];
        p.ws_l[at] = l_run[h];
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < BR; ++r) {
    const int qi = q0 + r;
    if (qi >= p.tq) continue;
    if (p.ws_o != nullptr) {
      p.ws_o[((static_cast<int64_t>(split) * p.hq + head) * p.tq + qi) * D + tid] = o[r];
    } else {
      static_cast<float*>(p.out)[(static_cast<int64_t>(qi) * p.hq + head) * D + tid] =
          o[r] / sL[r];
    }
  }
}

}  // namespace f32

// ---------------------------------------------------------------------------------------------
// Split-KV merge: one block per (query row, head), one thread per column.

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ half from_float<half>(float x) { return __float2half_rn(x); }

template <typename T>
__global__ void __launch_bounds__(D) merge_splits_kernel(const float* ws_o, const float* ws_m,
                                                         const float* ws_l, T* out, int splits,
                                                         int tq, int hq) {
  const int qi = blockIdx.x;
  const int head = blockIdx.y;
  const int d = threadIdx.x;
  float m_max = -INFINITY;
  for (int s = 0; s < splits; ++s) {
    m_max = fmaxf(m_max, ws_m[(static_cast<int64_t>(s) * hq + head) * tq + qi]);
  }
  float l = 0.0f, acc = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const int64_t row = (static_cast<int64_t>(s) * hq + head) * tq + qi;
    const float m = ws_m[row];
    if (m == -INFINITY) continue;  // a split this row sees no key of: exactly nothing
    const float w = exp2f(m - m_max);
    l = fmaf(w, ws_l[row], l);
    acc = fmaf(w, ws_o[row * D + d], acc);
  }
  out[(static_cast<int64_t>(qi) * hq + head) * D + d] = from_float<T>(acc / l);
}

// ---------------------------------------------------------------------------------------------
// Host side.

int round_up(int x, int to) { return (x + to - 1) / to * to; }

int smem_optin(const at::Tensor& q) {
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        q.get_device()));
  return optin;
}

template <typename Kernel>
void set_smem(Kernel kernel, int bytes, const at::Tensor& q) {
  const int optin = smem_optin(q);
  TORCH_CHECK(bytes <= optin, "dflash_d256: the kernel needs ", bytes, " bytes of shared memory "
              "per block, device ", q.get_device(), " allows ", optin);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// The kernels move 16-byte vectors: every tensor must start on a 16-byte boundary (any tensor
// torch allocates does; a view at an odd element offset may not).
void check_aligned(const char* op, std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "dflash_d256::", op,
                ": CUDA tensors must start on a 16-byte boundary; this one is a view at an "
                "unaligned offset: pass .clone() of it");
  }
}

// Warps per block of the fp16 kernel: $DFLASH_D256_CUDA_WARPS (4 or 8) if set, else 8 where the
// device gives a block enough shared memory (A100, H100: yes; V100: no, 4).
int fp16_warps(const at::Tensor& q) {
  if (const char* env = std::getenv("DFLASH_D256_CUDA_WARPS")) {
    const std::string v(env);
    TORCH_CHECK(v == "4" || v == "8", "dflash_d256: DFLASH_D256_CUDA_WARPS must be 4 or 8, got '",
                v, "'");
    return v == "8" ? 8 : 4;
  }
  return smem_optin(q) >= f16::Cfg<8>::kSmemBytes ? 8 : 4;
}

template <int NW, typename KVH>
void launch_fp16(const dim3& grid, const Params& p, const KVH& kv, const at::Tensor& q,
                 cudaStream_t stream) {
  using C = f16::Cfg<NW>;
  auto kernel = f16::attn_fp16_kernel<NW, KVH>;
  set_smem(kernel, C::kSmemBytes, q);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, kv);
}

template <typename KVH, typename KVF>
void launch(const at::Tensor& q, at::Tensor& out, int64_t tk, int64_t hkv, double scale,
            bool causal, int64_t num_splits, const KVH& kv_half, const KVF& kv_float) {
  const int64_t tq = q.size(0);
  const int64_t hq = q.size(1);
  if (tq == 0) return;
  TORCH_CHECK(tk < (int64_t{1} << 30) && tq * hq < (int64_t{1} << 30),
              "dflash_d256: sequence too long for the CUDA kernels (Tk ", tk, ", Tq x Hq ",
              tq * hq, "); at most 2^30");
  TORCH_CHECK(hq <= 65535, "dflash_d256: at most 65535 query heads on CUDA, got ", hq);
  const bool fp16 = q.scalar_type() == at::kHalf;
  const int warps = fp16 ? fp16_warps(q) : 0;
  const int br = fp16 ? 16 * warps : f32::BR;
  const int64_t tiles = (tq + br - 1) / br;
  TORCH_CHECK(tiles <= 65535, "dflash_d256: Tq ", tq, " needs ", tiles, " query tiles, the CUDA "
              "grid allows 65535; split the prefill into chunks");
  // Splits hold whole key tiles of either kernel (64 is a multiple of both).
  int split_len = round_up(static_cast<int>((tk + num_splits - 1) / num_splits), f16::BC);
  const int splits = std::max<int>(1, static_cast<int>((tk + split_len - 1) / split_len));
  if (splits == 1) split_len = round_up(static_cast<int>(std::max<int64_t>(tk, 1)), f16::BC);

  Params p{};
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.tq = static_cast<int>(tq);
  p.tk = static_cast<int>(tk);
  p.hq = static_cast<int>(hq);
  p.group = static_cast<int>(hq / hkv);
  p.split_len = split_len;
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.causal = causal;
  at::Tensor ws_o, ws_m, ws_l;
  if (splits > 1) {
    const auto f32opt = q.options().dtype(at::kFloat);
    ws_o = at::empty({splits, hq, tq, D}, f32opt);
    ws_m = at::empty({splits, hq, tq}, f32opt);
    ws_l = at::empty({splits, hq, tq}, f32opt);
    p.ws_o = ws_o.data_ptr<float>();
    p.ws_m = ws_m.data_ptr<float>();
    p.ws_l = ws_l.data_ptr<float>();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  const dim3 grid(static_cast<unsigned>(hq), static_cast<unsigned>(tiles),
                  static_cast<unsigned>(splits));
  if (fp16) {
    if (warps == 8) {
      launch_fp16<8>(grid, p, kv_half, q, stream);
    } else {
      launch_fp16<4>(grid, p, kv_half, q, stream);
    }
  } else {
    auto kernel = f32::attn_fp32_kernel<KVF>;
    set_smem(kernel, f32::kSmemBytes, q);
    kernel<<<grid, f32::kThreads, f32::kSmemBytes, stream>>>(p, kv_float);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (splits > 1) {
    const dim3 mgrid(static_cast<unsigned>(tq), static_cast<unsigned>(hq));
    if (fp16) {
      merge_splits_kernel<half><<<mgrid, D, 0, stream>>>(
          p.ws_o, p.ws_m, p.ws_l, static_cast<half*>(p.out), splits, p.tq, p.hq);
    } else {
      merge_splits_kernel<float><<<mgrid, D, 0, stream>>>(
          p.ws_o, p.ws_m, p.ws_l, static_cast<float*>(p.out), splits, p.tq, p.hq);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void run_dense(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
               double scale, bool causal, int64_t num_splits) {
  const int64_t row_stride = k.size(1) * D;
  DenseKV<half> kvh{nullptr, nullptr, row_stride};
  DenseKV<float> kvf{nullptr, nullptr, row_stride};
  if (q.scalar_type() == at::kHalf) {
    kvh.k = reinterpret_cast<const half*>(k.data_ptr());
    kvh.v = reinterpret_cast<const half*>(v.data_ptr());
  } else {
    kvf.k = k.data_ptr<float>();
    kvf.v = v.data_ptr<float>();
  }
  launch(q, out, k.size(0), k.size(1), scale, causal, num_splits, kvh, kvf);
}

void dense_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                double softmax_scale, bool causal) {
  check_dense("dense", q, k, v, out, softmax_scale);
  check_aligned("dense", {&q, &k, &v, &out});
  c10::cuda::CUDAGuard guard(q.device());
  run_dense(q, k, v, out, softmax_scale, causal, 1);
}

void dense_splitkv_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor& out, double softmax_scale, bool causal, int64_t num_splits) {
  check_dense("dense_splitkv", q, k, v, out, softmax_scale);
  TORCH_CHECK(num_splits >= 1 && num_splits <= kMaxSplits, "dflash_d256::dense_splitkv: "
              "num_splits must be in [1, ", kMaxSplits, "], got ", num_splits);
  check_aligned("dense_splitkv", {&q, &k, &v, &out});
  c10::cuda::CUDAGuard guard(q.device());
  run_dense(q, k, v, out, softmax_scale, causal, std::max<int64_t>(1, std::min(num_splits,
                                                                              k.size(0))));
}

#ifndef DFLASH_DENSE_ONLY
void paged_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_table, int64_t kv_len, at::Tensor& out,
                double softmax_scale, bool causal) {
  check_paged_shapes(q, k_cache, v_cache, block_table, kv_len, out, softmax_scale);
  check_aligned("paged", {&q, &k_cache, &v_cache, &out});
  const int64_t bs = k_cache.size(1);
  const int64_t used = (kv_len + bs - 1) / bs;
  // Block ids are checked on a host copy of the used entries (one small copy, synchronous):
  // an out-of-range id read on the device would be an illegal address, not an error message.
  check_block_table_values(block_table.narrow(0, 0, used).cpu(), kv_len, bs, k_cache.size(0));
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t hkv = k_cache.size(2);
  const int64_t row_stride = hkv * D;
  PagedKV<half> kvh{nullptr, nullptr, block_table.data_ptr<int32_t>(), static_cast<int>(bs),
                    row_stride, bs * row_stride};
  PagedKV<float> kvf = {nullptr, nullptr, kvh.table, kvh.block_size, row_stride,
                        bs * row_stride};
  if (q.scalar_type() == at::kHalf) {
    kvh.k = reinterpret_cast<const half*>(k_cache.data_ptr());
    kvh.v = reinterpret_cast<const half*>(v_cache.data_ptr());
  } else {
    kvf.k = k_cache.data_ptr<float>();
    kvf.v = v_cache.data_ptr<float>();
  }
  launch(q, out, kv_len, hkv, softmax_scale, causal, 1, kvh, kvf);
}
#endif

}  // namespace
}  // namespace dflash_d256

TORCH_LIBRARY_IMPL(dflash_d256, CUDA, m) {
  m.impl("dense", &dflash_d256::dense_cuda);
  m.impl("dense_splitkv", &dflash_d256::dense_splitkv_cuda);
#ifndef DFLASH_DENSE_ONLY
  m.impl("paged", &dflash_d256::paged_cuda);
#endif
}
