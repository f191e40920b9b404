// The launch interface between the op layer (attn_d256.cpp, ATen, compiled by the C++ compiler)
// and the CUDA kernels (attn_d256_cuda.cu, compiled by nvcc). Plain types only: the .cu file
// includes no torch header, so nvcc never compiles ATen's inline code (one definition of each
// torch inline function in the library, the C++ compiler's) and builds in seconds.
#pragma once

#include <cstdint>

namespace dflash_d256 {
namespace cuda {

constexpr int kKeyTile = 64;  // splits hold whole key tiles of every kernel

struct Launch {
  const void* q;                // [Tq, Hq, 256], fp16 or fp32 (`fp16`)
  void* out;                    // [Tq, Hq, 256], same dtype
  const void* k;                // dense [Tk, Hkv, 256] or paged [NB, block_size, Hkv, 256]
  const void* v;
  const int32_t* block_table;   // device block ids, or null for dense k/v
  int block_size;
  int tq, tk, hq, hkv;
  float softmax_scale;
  bool causal;
  bool fp16;
  int splits;                   // key splits (>= 1), each of split_len keys
  int split_len;
  float* ws_o;                  // splits > 1: fp32 workspace [splits, Hq, Tq, 256]
  float* ws_m;                  // [splits, Hq, Tq]
  float* ws_l;                  // [splits, Hq, Tq]
  int warps;                    // fp16 kernel: 4 or 8 warps per block
  bool v_transposed;            // fp16 kernel: V staged transposed in shared memory (option)
  void* stream;                 // cudaStream_t
};

// Rows of queries per block and bytes of shared memory per block of the kernel `a` selects.
int query_tile(const Launch& a);
int smem_bytes(const Launch& a);

// Runs the attention kernel (and the split merge); returns a cudaError_t value (0 = success)
// and sets *what to the step that failed.
int run(const Launch& a, const char** what);

}  // namespace cuda
}  // namespace dflash_d256
