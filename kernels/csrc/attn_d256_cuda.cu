// Causal prefill attention with head dim 256 on CUDA: the kernels behind the CUDA dispatch of
// the `dflash_d256` ops. The op layer (schemas, argument checks, workspace, stream, dispatch
// registration) is attn_d256.cpp; this file sees only the plain launch interface of
// attn_d256_cuda.h and no torch header.
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
// plain 16-byte global loads (no cp.async, TMA, wgmma, bf16). The build compiles this file for
// compute_75 PTX as well (the oldest target CUDA 13 accepts), which proves it.
//
// * fp16 (`attn_fp16_kernel`): NW warps of 16 query rows each (4 warps: 87 KB of shared memory,
//   fits a V100; 8 warps: 137 KB, half the K/V traffic per query row, where the device allows),
//   key tiles of 64. Q lives in shared memory for the whole pass; K and V tiles take turns in one
//   buffer, loaded with every 16-byte load of a batch in flight. Per key tile a warp computes its
//   16 x 64 scores with WMMA, does the online-softmax step on them through shared memory,
//   rescales its 16 x 256 output accumulator (WMMA fragments, in registers) and adds P V with
//   WMMA, P rounded to fp16 in [0, 1] as in every FA2 kernel. Optionally V is staged transposed
//   so its fragments load with 32-bit reads (slower on an H200: off by default). Rescaling accumulator fragments needs the row of
//   each fragment element, whose layout CUDA leaves unspecified: the kernel learns it at start by
//   loading a matrix of row numbers into a fragment (portable to any architecture). Paged K/V
//   rows are located once per tile (block-table read issued a tile ahead).
// * fp32 (`attn_fp32_kernel`): SIMT in fp32 throughout (the fp32 parity bounds are tight), 16
//   query rows per block, 256 threads, key tiles of 32.
// * split-KV: every (query tile, split) block writes O, m, l in fp32 to a workspace, and a second
//   kernel merges the splits per row: M = max m_s, O = sum 2^(m_s - M) O_s / sum 2^(m_s - M) l_s.

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>
#include <type_traits>

#include "attn_d256_cuda.h"

namespace dflash_d256 {
namespace {

namespace wmma = nvcuda::wmma;
using cuda::Launch;

constexpr int D = 256;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------------
// Key/value addressing: dense [Tk, Hkv, 256] or paged [NB, BS, Hkv, 256] + block table.

// Two steps so a paged lookup's global load can be issued early and used late: page(pos) reads
// what locating `pos` needs (the block id; nothing for dense), offset() turns it into an element
// offset. Positions and block sizes are 32-bit (a 32-bit division is far cheaper than 64-bit).

template <typename T>
struct DenseKV {
  const T* k;
  const T* v;
  int64_t row_stride;  // Hkv * 256
  __device__ __forceinline__ int page(int pos) const { return pos; }
  __device__ __forceinline__ int64_t offset(int /*page*/, int pos, int head) const {
    return static_cast<int64_t>(pos) * row_stride + static_cast<int64_t>(head) * D;
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
  __device__ __forceinline__ int page(int pos) const { return __ldg(table + pos / block_size); }
  __device__ __forceinline__ int64_t offset(int page, int pos, int head) const {
    return static_cast<int64_t>(page) * block_stride +
           static_cast<int64_t>(pos % block_size) * row_stride + static_cast<int64_t>(head) * D;
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
constexpr int LDV = BC + 8;      // halves; rows of the transposed V tile [256][LDV]
// one buffer holds the K tile [BC][LDQ], then the V tile ([BC][LDQ], or transposed [D][LDV])
constexpr int kKVBytes = (BC * LDQ > D * LDV ? BC * LDQ : D * LDV) * 2;
constexpr int kOffBytes = 2 * BC * 8;  // row offsets of this key tile and the next
constexpr int kWarpBytes = 16 * LDS * 4;      // scores, then P (fp16) + scratch + row factors
constexpr int kScratchOff = 16 * LDP * 2;     // 16 x 16 floats after P
constexpr int kRowOff = kScratchOff + 16 * 16 * 4;  // 16 floats: per-row factor
static_assert(kRowOff + 16 * 4 <= kWarpBytes, "warp region too small");
static_assert(kScratchOff % 32 == 0 && kKVBytes % 32 == 0 && kWarpBytes % 32 == 0,
              "WMMA pointers must be 256-bit aligned");

// NW warps of 16 query rows each. 4 warps (87 KB) fit a V100; 8 warps (137 KB) halve the K/V
// traffic per query row where the device allows that much shared memory per block.
template <int NW>
struct Cfg {
  static constexpr int kThreads = NW * 32;
  static constexpr int BR = 16 * NW;  // query rows per block
  static constexpr int kQBytes = BR * LDQ * 2;
  static constexpr int kSmemBytes = kQBytes + kKVBytes + NW * kWarpBytes + kOffBytes;
  static_assert(kQBytes % 32 == 0, "WMMA pointers must be 256-bit aligned");
};
static_assert(Cfg<4>::kSmemBytes <= 96 * 1024, "4 warps must fit a V100's 96 KB per block");

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, half, wmma::row_major>;
using FragBc = wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::col_major>;
using FragBr = wmma::fragment<wmma::matrix_b, 16, 16, 16, half, wmma::row_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
constexpr int kAccElems = FragC::num_elements;

// ROWS x 256 halves into shared [ROWS][LDQ] from base + row_off(r) (a negative offset is a
// zero row). The trip count is a compile-time constant, so every 16-byte load of a batch is in
// flight before the first store: one memory latency per batch, not one per load.
template <int ROWS, int THREADS, typename RowOff>
__device__ __forceinline__ void load_tile(half* dst, const half* base, RowOff row_off) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kIters = ROWS * kChunks / THREADS;
  constexpr int kBatch = kIters < 8 ? kIters : 8;  // at most 32 registers in flight
  static_assert(ROWS * kChunks % THREADS == 0 && kIters % kBatch == 0, "tile/thread mismatch");
#pragma unroll
  for (int b = 0; b < kIters; b += kBatch) {
    uint4 val[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int idx = threadIdx.x + (b + i) * THREADS;
      const int64_t off = row_off(idx / kChunks);
      val[i] = off >= 0 ? __ldg(reinterpret_cast<const uint4*>(base + off) + idx % kChunks)
                        : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int idx = threadIdx.x + (b + i) * THREADS;
      *reinterpret_cast<uint4*>(dst + (idx / kChunks) * LDQ + (idx % kChunks) * 8) = val[i];
    }
  }
}

// The V tile transposed into shared [256][LDV] (Vt[d][key]), so P V reads V as a column-major
// WMMA operand with 32-bit loads. Consecutive lanes take consecutive keys, which makes the
// 2-byte transposing stores free of bank conflicts.
template <int THREADS>
__device__ __forceinline__ void load_v_transposed(half* dst, const half* base,
                                                  const int64_t* row_off) {
  constexpr int kChunks = D / 8;
  constexpr int kIters = BC * kChunks / THREADS;
  constexpr int kBatch = kIters < 8 ? kIters : 8;
  static_assert(BC * kChunks % THREADS == 0 && kIters % kBatch == 0, "tile/thread mismatch");
#pragma unroll
  for (int b = 0; b < kIters; b += kBatch) {
    uint4 val[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int idx = threadIdx.x + (b + i) * THREADS;
      const int64_t off = row_off[idx % BC];
      val[i] = off >= 0 ? __ldg(reinterpret_cast<const uint4*>(base + off) + idx / BC)
                        : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int idx = threadIdx.x + (b + i) * THREADS;
      const int key = idx % BC;
      const int d0 = (idx / BC) * 8;
      const uint32_t words[4] = {val[i].x, val[i].y, val[i].z, val[i].w};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const uint32_t w = words[e / 2];
        const unsigned short bits = static_cast<unsigned short>(e % 2 ? w >> 16 : w & 0xffffu);
        dst[(d0 + e) * LDV + key] = __ushort_as_half(bits);
      }
    }
  }
}

// VT: V tile transposed in shared memory (see load_v_transposed) or row-major as loaded.
template <int NW, bool VT, typename KV>
__global__ void __launch_bounds__(NW * 32, 8 / NW) attn_fp16_kernel(Params p, KV kv) {
  using C = Cfg<NW>;
  constexpr int BR = C::BR;
  constexpr int kQBytes = C::kQBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  half* sQ = reinterpret_cast<half*>(smem);
  half* sKV = reinterpret_cast<half*>(smem + kQBytes);
  int64_t* s_off = reinterpret_cast<int64_t*>(smem + kQBytes + kKVBytes + NW * kWarpBytes);
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
  load_tile<BR, C::kThreads>(sQ, q, [&](int r) -> int64_t {
    const int qi = q0 + r;
    return qi < p.tq ? (static_cast<int64_t>(qi) * p.hq + head) * D : -1;
  });
  // Row offsets of key tile j0 (-1 past the end) go to s_off[buf * BC + r]; the block-table
  // read of the NEXT tile is issued before P V and stored after it, so its latency is hidden.
  if (threadIdx.x < BC && k0 < k1) {
    const int pos = k0 + threadIdx.x;
    s_off[threadIdx.x] = pos < k1 ? kv.offset(kv.page(pos), pos, kv_head) : -1;
  }

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

  int buf = 0;
  for (int j0 = k0; j0 < k1; j0 += BC, buf ^= 1) {
    __syncthreads();  // previous tile's V no longer read; this tile's offsets visible
    const int64_t* off = s_off + buf * BC;
    load_tile<BC, C::kThreads>(sKV, kv.k, [&](int r) -> int64_t { return off[r]; });
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
    if constexpr (VT) {
      load_v_transposed<C::kThreads>(sKV, kv.v, off);
    } else {
      load_tile<BC, C::kThreads>(sKV, kv.v, [&](int r) -> int64_t { return off[r]; });
    }
    const int next_pos = j0 + BC + static_cast<int>(threadIdx.x);
    const bool fetch = threadIdx.x < BC && j0 + BC < k1;
    const int next_page = (fetch && next_pos < k1) ? kv.page(next_pos) : 0;
    __syncthreads();

    // O += P V
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      FragA a;
      wmma::load_matrix_sync(a, sP + kk * 16, LDP);
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        if constexpr (VT) {
          FragBc b;
          wmma::load_matrix_sync(b, sKV + n * 16 * LDV + kk * 16, LDV);
          wmma::mma_sync(acc[n], a, b, acc[n]);
        } else {
          FragBr b;
          wmma::load_matrix_sync(b, sKV + kk * 16 * LDQ + n * 16, LDQ);
          wmma::mma_sync(acc[n], a, b, acc[n]);
        }
      }
    }
    if (fetch) {
      s_off[(buf ^ 1) * BC + threadIdx.x] =
          next_pos < k1 ? kv.offset(next_page, next_pos, kv_head) : -1;
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
        const int64_t off = kv.offset(kv.page(pos), pos, kv_head) + c;
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

static_assert(cuda::kKeyTile % f16::BC == 0 && cuda::kKeyTile % f32::BC == 0,
              "split lengths must hold whole key tiles");

// ---------------------------------------------------------------------------------------------
// Host side: argument checks, workspace and stream are the op layer's (attn_d256.cpp).

template <typename KV>
cudaError_t launch_attention(const Launch& a, const KV& kv, const dim3& grid, const Params& p,
                             cudaStream_t stream, const char** what) {
  const int bytes = cuda::smem_bytes(a);
  cudaError_t err = cudaSuccess;
  auto start = [&](auto kernel, int threads) {
    *what = "setting the kernel's shared memory size";
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return;
    *what = "launching the attention kernel";
    kernel<<<grid, threads, bytes, stream>>>(p, kv);
    err = cudaGetLastError();
  };
  if constexpr (std::is_same_v<decltype(kv.k), const float*>) {
    start(f32::attn_fp32_kernel<KV>, f32::kThreads);
  } else if (a.warps == 8) {
    a.v_transposed ? start(f16::attn_fp16_kernel<8, true, KV>, 256)
                   : start(f16::attn_fp16_kernel<8, false, KV>, 256);
  } else {
    a.v_transposed ? start(f16::attn_fp16_kernel<4, true, KV>, 128)
                   : start(f16::attn_fp16_kernel<4, false, KV>, 128);
  }
  return err;
}

template <typename T>
cudaError_t run_typed(const Launch& a, cudaStream_t stream, const char** what) {
  Params p{};
  p.q = a.q;
  p.out = a.out;
  p.tq = a.tq;
  p.tk = a.tk;
  p.hq = a.hq;
  p.group = a.hq / a.hkv;
  p.split_len = a.split_len;
  p.scale_log2 = a.softmax_scale * kLog2e;
  p.causal = a.causal;
  if (a.splits > 1) {
    p.ws_o = a.ws_o;
    p.ws_m = a.ws_m;
    p.ws_l = a.ws_l;
  }
  const int tile = cuda::query_tile(a);
  const dim3 grid(static_cast<unsigned>(a.hq), static_cast<unsigned>((a.tq + tile - 1) / tile),
                  static_cast<unsigned>(a.splits));
  const int64_t row_stride = static_cast<int64_t>(a.hkv) * D;
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  cudaError_t err;
  if (a.block_table != nullptr) {
    const PagedKV<T> kv{k, v, a.block_table, a.block_size, row_stride,
                        static_cast<int64_t>(a.block_size) * row_stride};
    err = launch_attention(a, kv, grid, p, stream, what);
  } else {
    const DenseKV<T> kv{k, v, row_stride};
    err = launch_attention(a, kv, grid, p, stream, what);
  }
  if (err != cudaSuccess || a.splits == 1) return err;
  *what = "launching the split-KV merge";
  const dim3 mgrid(static_cast<unsigned>(a.tq), static_cast<unsigned>(a.hq));
  merge_splits_kernel<T><<<mgrid, D, 0, stream>>>(a.ws_o, a.ws_m, a.ws_l, static_cast<T*>(a.out),
                                                   a.splits, a.tq, a.hq);
  return cudaGetLastError();
}

}  // namespace

namespace cuda {

int query_tile(const Launch& a) { return a.fp16 ? 16 * a.warps : f32::BR; }

int smem_bytes(const Launch& a) {
  if (!a.fp16) return f32::kSmemBytes;
  return a.warps == 8 ? f16::Cfg<8>::kSmemBytes : f16::Cfg<4>::kSmemBytes;
}

int run(const Launch& a, const char** what) {
  *what = "nothing";
  if (a.tq == 0) return cudaSuccess;
  const cudaStream_t stream = static_cast<cudaStream_t>(a.stream);
  return static_cast<int>(a.fp16 ? run_typed<half>(a, stream, what)
                                 : run_typed<float>(a, stream, what));
}

}  // namespace cuda
}  // namespace dflash_d256
