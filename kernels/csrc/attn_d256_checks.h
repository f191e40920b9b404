// Argument checks of the `dflash_d256` ops, shared by the CPU (attn_d256.cpp) and CUDA
// (attn_d256_cuda.cu) implementations so both refuse bad input with the same words.
#pragma once

// The core Tensor class only, not <ATen/ATen.h>: every at:: function a source calls comes from
// its own <ATen/ops/...> header (and no tensor operator: <ATen/TensorOperators.h> pulls in every
// ATen function), which takes a fifth off each compile of the library.
#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace dflash_d256 {

constexpr int64_t kHeadDim = 256;
constexpr int64_t kMaxSplits = 64;

// Every violation is a clear error before any data is touched.

inline bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf;
}

inline void check_qkv_common(const char* op, const at::Tensor& q, const at::Tensor& out,
                             double softmax_scale) {
  TORCH_CHECK(q.dim() == 3, "dflash_d256::", op, ": q must be [Tq, Hq, 256], got ", q.sizes());
  TORCH_CHECK(q.size(2) == kHeadDim, "dflash_d256::", op, ": head dim must be 256, q has ",
              q.size(2), " (these ops are specialised for D=256; use SDPA for other head dims)");
  TORCH_CHECK(supported_dtype(q.scalar_type()), "dflash_d256::", op,
              ": q dtype must be float16 or float32, got ", q.scalar_type());
  TORCH_CHECK(out.sizes() == q.sizes(), "dflash_d256::", op, ": out must have q's shape ",
              q.sizes(), ", got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "dflash_d256::", op,
              ": out dtype must equal q dtype (", q.scalar_type(), "), got ", out.scalar_type());
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous(), "dflash_d256::", op,
              ": q and out must be contiguous (call .contiguous() on them)");
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0.0, "dflash_d256::", op,
              ": softmax_scale must be a positive finite number, got ", softmax_scale);
  TORCH_CHECK(q.size(1) >= 1, "dflash_d256::", op, ": q must have at least one head");
}

inline void check_same_device(const char* op, std::initializer_list<const at::Tensor*> ts) {
  const auto dev = (*ts.begin())->device();
  for (const at::Tensor* t : ts) {
    TORCH_CHECK(t->device() == dev, "dflash_d256::", op,
                ": all tensors must be on one device, got ", dev, " and ", t->device());
  }
}

inline void check_kv_heads(const char* op, int64_t hq, int64_t hkv) {
  TORCH_CHECK(hkv >= 1 && hq % hkv == 0, "dflash_d256::", op,
              ": Hq (", hq, ") must be a multiple of Hkv (", hkv, ") for grouped-query attention");
}

inline void check_dense(const char* op, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, double softmax_scale) {
  check_qkv_common(op, q, out, softmax_scale);
  check_same_device(op, {&q, &k, &v, &out});
  TORCH_CHECK(k.dim() == 3 && k.size(2) == kHeadDim, "dflash_d256::", op,
              ": k must be [Tk, Hkv, 256], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "dflash_d256::", op, ": v must have k's shape ", k.sizes(),
              ", got ", v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "dflash_d256::", op, ": q, k, v must share one dtype, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "dflash_d256::", op,
              ": k and v must be contiguous (call .contiguous() on them)");
  check_kv_heads(op, q.size(1), k.size(1));
  TORCH_CHECK(k.size(0) >= q.size(0), "dflash_d256::", op, ": Tk (", k.size(0),
              ") must be >= Tq (", q.size(0), "): queries are the last Tq of the Tk positions");
}

inline void check_paged_shapes(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_table,
                               int64_t kv_len, const at::Tensor& out, double softmax_scale) {
  const char* op = "paged";
  check_qkv_common(op, q, out, softmax_scale);
  check_same_device(op, {&q, &k_cache, &v_cache, &block_table, &out});
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == kHeadDim, "dflash_d256::paged: k_cache "
              "must be [num_blocks, block_size, Hkv, 256], got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "dflash_d256::paged: v_cache must have "
              "k_cache's shape ", k_cache.sizes(), ", got ", v_cache.sizes());
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "dflash_d256::paged: q, k_cache, v_cache must share one dtype, got ",
              q.scalar_type(), ", ", k_cache.scalar_type(), ", ", v_cache.scalar_type());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "dflash_d256::paged: k_cache and v_cache must be contiguous");
  TORCH_CHECK(k_cache.size(1) >= 1, "dflash_d256::paged: block_size must be >= 1");
  check_kv_heads(op, q.size(1), k_cache.size(2));
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kInt,
              "dflash_d256::paged: block_table must be a 1-D int32 tensor, got ",
              block_table.scalar_type(), " ", block_table.sizes());
  TORCH_CHECK(block_table.is_contiguous(), "dflash_d256::paged: block_table must be contiguous");
  const int64_t capacity = block_table.size(0) * k_cache.size(1);
  TORCH_CHECK(kv_len >= 0 && kv_len <= capacity, "dflash_d256::paged: kv_len (", kv_len,
              ") must be in [0, len(block_table) * block_size] = [0, ", capacity, "]");
  TORCH_CHECK(q.size(0) <= kv_len, "dflash_d256::paged: Tq (", q.size(0), ") must be <= kv_len (",
              kv_len, "): queries are the last Tq of the kv_len positions");
}

// `block_table` must be on the CPU here (the CUDA op checks a host copy of the used entries).
inline void check_block_table_values(const at::Tensor& block_table, int64_t kv_len,
                                     int64_t block_size, int64_t num_blocks) {
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t used = (kv_len + block_size - 1) / block_size;
  for (int64_t i = 0; i < used; ++i) {
    TORCH_CHECK(bt[i] >= 0 && bt[i] < num_blocks, "dflash_d256::paged: block_table[", i, "] = ",
                bt[i], " is out of range [0, ", num_blocks, ") of k_cache/v_cache blocks");
  }
}

}  // namespace dflash_d256
