// Shared declarations of the `dflash_qpn` op namespace (QPN2 / QPN4 NVFP4 GEMMs).
//
// The CPU translation unit (qpn_gemm.cpp) defines everything declared here and registers the
// schemas; the CUDA one (qpn_gemm_cuda.cu) adds CUDA kernels for the same ops and reuses the
// argument checks, the hit counters, the poison flag and the workspace registry, so both
// devices behave alike and report into one place.
//
// Buffer layout (see dflash_kernels/qpn.py): a flat uint8 buffer of Np * K/2 bytes in tile
// order [T][G][32][8] (T = Np/32 column tiles, G = K/16 groups, 8 bytes = 16 E2M1 codes of one
// column, low nibble = even k) and raw E4M3 scale bytes [T][G][32].
#pragma once

// The C++ source gets the core Tensor class only, not <ATen/ATen.h>: every at:: function it calls
// comes from its own <ATen/ops/...> header (and no tensor operator: <ATen/TensorOperators.h>
// pulls in every ATen function), which takes a fifth off each compile. The CUDA source
// (qpn_gemm_cuda.cu) calls more of ATen and gets all of it, as it always has.
#ifdef __CUDACC__
#include <ATen/ATen.h>
#else
#include <ATen/core/Tensor.h>
#endif

#include <cstdint>
#include <mutex>
#include <optional>

namespace dflash_qpn {

constexpr int64_t kTileN = 32;        // columns per tile
constexpr int64_t kGroupK = 16;       // K elements per scale (one NVFP4 block)
constexpr int64_t kGroupBytes = 8;    // code bytes per (group, column)
constexpr int64_t kKMultiple = 64;    // QPN shape contract: K % 64 == 0
constexpr int64_t kMaxSmallM = 32;    // rows served by one pass of the small-M kernel
constexpr int64_t kMaxVerifyM = 8;    // verify width (draft 7 + 1): never the large-M path
constexpr int64_t kSplitK = 256;      // K elements per split-K slice of the small-M kernel
constexpr double kFp16ScaleBias = 16384.0;  // 2^14 bias of the fp16 pre-scaled scales

// Route hit counters: which code path served a call (read by dflash_qpn::hit_counts).
enum Hit : int { kHitQpn2SmallM = 0, kHitQpn4LargeM, kHitPackedSmallM, kHitPackedLargeM,
                 kHitCount };
void count_hit(Hit hit, int64_t n = 1);

// Parity gates ask for every scratch, workspace and output buffer to be filled with 0xFF
// (NaN as fp32/fp16) before a kernel uses it, so an element a kernel forgets shows as NaN.
bool poison_enabled();
void poison(at::Tensor& t);

// min_prefill_m <= kMaxVerifyM is refused unless a test switched the check off.
void check_min_prefill_m(int64_t min_prefill_m);

// qpn2_packed_linear's static dispatch fields, carried in one CPU int64 tensor [5]
// (k, min_prefill_m, workspace_id, workspace_bytes, the global scale's float64 bits) built once
// per weight: every argument that crosses torch.ops costs host time on each call, and a verify
// step must not pay more to reach the qpn2 kernel through this op than through qpn2_linear (the
// validation_cost gate).
struct PackedPlan {
  int64_t k, min_prefill_m, workspace_id, workspace_bytes;
  double global_scale;
};
constexpr int64_t kPackedPlanFields = 5;
// The plan, checked (ValueError naming the expected layout), min_prefill_m included.
PackedPlan read_packed_plan(const at::Tensor& plan);

struct Geometry {
  int64_t m, n, k, n_padded, tiles, groups;
};

// Every argument of a QPN op, checked; raises ValueError naming the problem and the fix.
Geometry check_args(const char* op, const at::Tensor& x, const at::Tensor& buffer,
                    const at::Tensor& scales, const std::optional<at::Tensor>& scales_fp16,
                    int64_t n, int64_t k, bool gated);

// True when the large-M path uses the fp16 pre-scaled scales (fp16 inputs and scales given).
bool use_fp16_scales(const at::Tensor& x, const std::optional<at::Tensor>& scales_fp16);

// Bytes of bounded workspace one 32-column tile needs: 32 * K values of `value_bytes`.
int64_t workspace_bytes_per_tile(int64_t k, int64_t value_bytes);
// Whole tiles per workspace chunk; raises ValueError naming the minimum bound if < 1.
int64_t tiles_per_chunk(int64_t tiles, int64_t k, int64_t value_bytes, int64_t bound);

// The bounded workspace of one Python Workspace object (id), kept by the library so a call
// needs no Python: the lease holds the slot's lock (one user at a time) and `bytes` (uint8).
struct WorkspaceLease {
  std::unique_lock<std::mutex> lock;
  at::Tensor bytes;
};
WorkspaceLease take_workspace(int64_t id, int64_t nbytes, int64_t bound, at::Device device);

// Slice the padding away, apply the SiLU gate in fp32, cast once to `dtype`.
at::Tensor finish(const at::Tensor& y32, int64_t n, bool gated, at::ScalarType dtype);

}  // namespace dflash_qpn
