// Causal prefill attention with head dim 256: the `dflash_d256` op namespace and its CPU kernels.
//
// Ops (schemas in TORCH_LIBRARY below, shapes in docs/families.md):
//   dense(q [Tq,Hq,256], k [Tk,Hkv,256], v [Tk,Hkv,256], out [Tq,Hq,256]!, softmax_scale, causal)
//   paged(q, k_cache [NB,BS,Hkv,256], v_cache, block_table [nsb] int32, kv_len, out!, scale, causal)
//   dense_splitkv(q, k, v, out!, softmax_scale, causal, num_splits)      (optional)
// Queries are the LAST Tq positions of the Tk keys (prefix caching: Tq <= Tk), so with `causal`
// query row r sees keys 0 .. Tk - Tq + r (bottom-right aligned mask).
//
// Algorithm: FlashAttention-2 style tiled online softmax in fp32. One work item is one kv head
// and one tile of query rows; the Hq/Hkv query heads sharing that kv head are stacked into one
// [G * QB, 256] tile so every K/V tile is read once for all of them (GQA reuse). Key tiles stop at
// the causal bound of the query tile (fully masked tiles are never computed) and only the last
// QB keys need a mask. The two products per tile run through ATen's GEMM (MKL/oneDNN, selected
// at run time for the CPU), the softmax pieces through ATen's vectorised element-wise kernels:
// the library itself is compiled with portable flags only (-O3, no -march) and still gets AVX2
// or AVX-512 where the machine has it. Work items are scheduled longest-first over an atomic
// counter so the causal triangle does not leave one thread idle.
//
// Build macro DFLASH_WITH_CUDA (set by the build when it compiles attn_d256_cuda.cu into the same
// library): the ops also get CUDA kernels. Their op layer (checks, workspace, stream) is in this
// file; the kernels are behind the plain interface of attn_d256_cuda.h.
//
// Build macro DFLASH_DENSE_ONLY: register only `dense` (a deliberately partial library, used by
// the loader gate to exercise the "partial" state with a real file).

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "attn_d256_checks.h"

#ifdef DFLASH_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <string>

#include "attn_d256_cuda.h"
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace dflash_d256 {
namespace {

// Tiles: G * 64 query rows x 512 keys per GEMM (M = 256 for GQA 4). 64 query rows keep the
// causal waste on the diagonal at 32 keys per row (SDPA's CPU kernel uses 256-row query
// blocks per head, i.e. 128 wasted keys per row); 32 rows measured slower (smaller GEMMs).
constexpr int64_t kQueryTile = 64;   // query rows per head in one work item
constexpr int64_t kKeyTile = 512;    // keys per online-softmax step

// ---------------------------------------------------------------------------------------------
// The shared core: K and V are packed fp32 [Hkv, Tk, 256]; q/out are the caller's tensors.

struct Item {
  int64_t head;     // kv head
  int64_t q0, q1;   // query rows [q0, q1)
  int64_t k0, k1;   // keys [k0, k1) this item covers (a split of the causal range)
  int64_t split;    // index of the split (0 without split-KV)
  int64_t cost;     // rows x keys, for longest-first scheduling
};

// Runs `fn(item)` for every item on all intra-op threads, longest items first, dynamically.
// Every thread runs with the caller's thread-local state (inference mode, dispatch keys): an
// engine under torch.inference_mode hands the op an inference-tensor `out`, which a worker
// thread without that state may not write into.
template <typename Fn>
void run_items(std::vector<Item>& items, const Fn& fn) {
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  const at::ThreadLocalState caller;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard same_state(caller);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(items[i]);
  });
}

// ---------------------------------------------------------------------------------------------
// Fused online-softmax step over one score tile, written with GCC/Clang vector extensions so it
// vectorises without -march: on x86 it is compiled twice (baseline SSE2 and AVX2+FMA) and the
// AVX2 copy is chosen at run time only if the CPU reports AVX2 and FMA.

#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

#define DFLASH_INLINE static inline __attribute__((always_inline))

DFLASH_INLINE v8f splat(float x) { return v8f{} + x; }

DFLASH_INLINE v8f load8(const float* p) {
  v8f x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

DFLASH_INLINE void store8(float* p, v8f x) { std::memcpy(p, &x, sizeof(x)); }

// exp(x) to ~1 ulp (Cephes expf polynomial); 0 below -87.3 (so exp(-inf) == 0 exactly).
DFLASH_INLINE v8f vexp(v8f x) {
  const v8f lo = splat(-87.3365447505531f);
  v8f xc = x > splat(88.3762626647949f) ? splat(88.3762626647949f) : x;
  xc = xc < lo ? lo : xc;
  const v8f magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to nearest integer
  const v8f n = (xc * splat(1.44269504088896341f) + magic) - magic;
  v8f r = xc - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  v8f p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  v8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const v8f y = p * scale;
  return x < lo ? splat(0.0f) : y;
}

DFLASH_INLINE float hmax(v8f x) {
  float m = x[0];
  for (int i = 1; i < 8; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

DFLASH_INLINE float hsum(v8f x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// One online-softmax step for `rows` rows of scores s [rows, kb] (row-major, contiguous).
// visible[r] = number of leading columns row r may see (kb when unmasked). Turns s into
// exp(s - m_new), updates the running max m and sum l, and rescales the output rows o [rows, 256].
DFLASH_INLINE void softmax_step_body(float* s, int64_t rows, int64_t kb, const int64_t* visible,
                                     float* m, float* l, float* o) {
  const float lowest = std::numeric_limits<float>::lowest();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * kb;
    const int64_t vis = visible ? visible[r] : kb;
    for (int64_t c = std::max<int64_t>(vis, 0); c < kb; ++c) row[c] = neg_inf;
    v8f vmax = splat(neg_inf);
    int64_t c = 0;
    for (; c + 8 <= kb; c += 8) {
      const v8f x = load8(row + c);
      vmax = x > vmax ? x : vmax;
    }
    float row_max = hmax(vmax);
    for (; c < kb; ++c) row_max = row[c] > row_max ? row[c] : row_max;
    const float m_old = m[r];
    float m_new = row_max > m_old ? row_max : m_old;
    m_new = m_new < lowest ? lowest : m_new;  // fully masked so far: exp(-inf - lowest) = 0
    const v8f vm = splat(m_new);
    v8f vsum = splat(0.0f);
    c = 0;
    for (; c + 8 <= kb; c += 8) {
      const v8f e = vexp(load8(row + c) - vm);
      store8(row + c, e);
      vsum += e;
    }
    float sum = hsum(vsum);
    for (; c < kb; ++c) {
      const float e = std::exp(row[c] - m_new);
      row[c] = e;
      sum += e;
    }
    const float alpha = std::exp(m_old - m_new);
    l[r] = l[r] * alpha + sum;
    m[r] = m_new;
    if (alpha != 1.0f) {
      float* orow = o + r * kHeadDim;
      const v8f va = splat(alpha);
      for (int64_t d = 0; d < kHeadDim; d += 8) store8(orow + d, load8(orow + d) * va);
    }
  }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
__attribute__((target("avx2,fma"))) void softmax_step_avx2(float* s, int64_t rows, int64_t kb,
                                                          const int64_t* visible, float* m,
                                                          float* l, float* o) {
  softmax_step_body(s, rows, kb, visible, m, l, o);
}

// $DFLASH_D256_DISABLE_AVX2 (any value) forces the baseline copy: the tests use it to check
// the path that machines without AVX2 run.
bool use_avx2_fma() {
  static const bool use = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          std::getenv("DFLASH_D256_DISABLE_AVX2") == nullptr;
  return use;
}
#endif

void softmax_step_generic(float* s, int64_t rows, int64_t kb, const int64_t* visible, float* m,
                          float* l, float* o) {
  softmax_step_body(s, rows, kb, visible, m, l, o);
}

void softmax_step(float* s, int64_t rows, int64_t kb, const int64_t* visible, float* m, float* l,
                  float* o) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  if (use_avx2_fma()) return softmax_step_avx2(s, rows, kb, visible, m, l, o);
#endif
  softmax_step_generic(s, rows, kb, visible, m, l, o);
}

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

// Online softmax over keys [k0, k1) for one item. On return `o` holds the unnormalised output
// [G*QB, 256], `m` the running row max and `l` the running row sum (both [G*QB]).
// Rows that see no key in [k0, k1) keep m = -FLT_MAX, l = 0, o = 0 (merged away by split-KV).
void attend(const at::Tensor& qt, const at::Tensor& kp, const at::Tensor& vp, const Item& it,
            int64_t group, int64_t offset, bool causal, at::Tensor& s_buf, at::Tensor& o,
            at::Tensor& m, at::Tensor& l) {
  const int64_t qb = it.q1 - it.q0;
  const int64_t rows = group * qb;
  o.zero_();
  m.fill_(std::numeric_limits<float>::lowest());
  l.zero_();
  const at::Tensor k_head = kp[it.head];
  const at::Tensor v_head = vp[it.head];
  // first key that some row of this tile cannot see: from there on a mask is needed
  const int64_t first_masked = causal ? offset + it.q0 + 1 : std::numeric_limits<int64_t>::max();
  std::vector<int64_t> visible(rows);
  for (int64_t j0 = it.k0; j0 < it.k1; j0 += kKeyTile) {
    const int64_t kb = std::min(kKeyTile, it.k1 - j0);
    at::Tensor s = s_buf.narrow(0, 0, rows * kb).view({rows, kb});
    at::mm_out(s, qt, k_head.narrow(0, j0, kb).t());
    const bool masked = j0 + kb > first_masked;
    if (masked) {
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t r = 0; r < qb; ++r) {
          // query row r sees absolute keys 0 .. offset + q0 + r
          visible[g * qb + r] = std::min(kb, offset + it.q0 + r + 1 - j0);
        }
      }
    }
    softmax_step(s.data_ptr<float>(), rows, kb, masked ? visible.data() : nullptr,
                 m.data_ptr<float>(), l.data_ptr<float>(), o.data_ptr<float>());
    o.addmm_(s, v_head.narrow(0, j0, kb));
  }
}

// Copies query rows [q0, q1) of the `group` heads of kv head `head` into a contiguous fp32
// [group * QB, 256] tile, pre-multiplied by the softmax scale.
void load_query_tile(const at::Tensor& q, const Item& it, int64_t group, double scale,
                     at::Tensor& qt) {
  const int64_t qb = it.q1 - it.q0;
  at::Tensor src = q.narrow(0, it.q0, qb).narrow(1, it.head * group, group).permute({1, 0, 2});
  qt.view({group, qb, kHeadDim}).copy_(src);
  qt.mul_(scale);
}

void store_output_tile(const at::Tensor& o, const at::Tensor& l, const Item& it, int64_t group,
                       at::Tensor& out) {
  const int64_t qb = it.q1 - it.q0;
  at::Tensor dst = out.narrow(0, it.q0, qb).narrow(1, it.head * group, group).permute({1, 0, 2});
  dst.copy_(o.div(l.unsqueeze(1)).view({group, qb, kHeadDim}));
}

// Causal bound: keys a query tile [q0, q1) may see are [0, kv_end).
int64_t kv_end(int64_t q1, int64_t offset, int64_t tk, bool causal) {
  return causal ? std::min(tk, offset + q1) : tk;
}

std::vector<Item> make_items(int64_t tq, int64_t tk, int64_t hkv, int64_t group, bool causal,
                             int64_t num_splits) {
  const int64_t offset = tk - tq;
  std::vector<Item> items;
  const int64_t split_len = (tk + num_splits - 1) / num_splits;
  for (int64_t h = 0; h < hkv; ++h) {
    for (int64_t q0 = 0; q0 < tq; q0 += kQueryTile) {
      const int64_t q1 = std::min(tq, q0 + kQueryTile);
      const int64_t end = kv_end(q1, offset, tk, causal);
      for (int64_t s = 0; s < num_splits; ++s) {
        const int64_t k0 = s * split_len;
        const int64_t k1 = std::min(end, k0 + split_len);
        if (k0 >= k1) continue;  // fully masked split: contributes nothing
        items.push_back({h, q0, q1, k0, k1, s, (q1 - q0) * group * (k1 - k0)});
      }
    }
  }
  return items;
}

at::Tensor pack_kv(const at::Tensor& x) {
  // [Tk, Hkv, 256] (any float dtype) -> contiguous fp32 [Hkv, Tk, 256]
  return x.permute({1, 0, 2}).to(at::kFloat).contiguous();
}

void attention_core(const at::Tensor& q, const at::Tensor& kp, const at::Tensor& vp,
                    at::Tensor& out, double scale, bool causal, int64_t num_splits) {
  const int64_t tq = q.size(0);
  const int64_t hq = q.size(1);
  const int64_t hkv = kp.size(0);
  const int64_t tk = kp.size(1);
  const int64_t group = hq / hkv;
  if (tq == 0) return;
  const int64_t offset = tk - tq;
  std::vector<Item> items = make_items(tq, tk, hkv, group, causal, num_splits);
  const auto f32 = q.options().dtype(at::kFloat);
  const int64_t max_rows = group * kQueryTile;

  if (num_splits == 1) {
    run_items(items, [&](const Item& it) {
      const int64_t rows = group * (it.q1 - it.q0);
      at::Tensor qt = at::empty({rows, kHeadDim}, f32);
      at::Tensor s_buf = at::empty({max_rows * kKeyTile}, f32);
      at::Tensor o = at::empty({rows, kHeadDim}, f32);
      at::Tensor m = at::empty({rows}, f32);
      at::Tensor l = at::empty({rows}, f32);
      load_query_tile(q, it, group, scale, qt);
      attend(qt, kp, vp, it, group, offset, causal, s_buf, o, m, l);
      store_output_tile(o, l, it, group, out);
    });
    return;
  }

  // Split-KV: each split writes its partial (o, m, l); a second pass merges them per tile.
  at::Tensor part_o = at::zeros({num_splits, hkv, tq * group, kHeadDim}, f32);
  at::Tensor part_m = at::full({num_splits, hkv, tq * group}, std::numeric_limits<float>::lowest(),
                               f32);
  at::Tensor part_l = at::zeros({num_splits, hkv, tq * group}, f32);
  run_items(items, [&](const Item& it) {
    const int64_t qb = it.q1 - it.q0;
    const int64_t rows = group * qb;
    at::Tensor qt = at::empty({rows, kHeadDim}, f32);
    at::Tensor s_buf = at::empty({max_rows * kKeyTile}, f32);
    at::Tensor o = at::empty({rows, kHeadDim}, f32);
    at::Tensor m = at::empty({rows}, f32);
    at::Tensor l = at::empty({rows}, f32);
    load_query_tile(q, it, group, scale, qt);
    attend(qt, kp, vp, it, group, offset, causal, s_buf, o, m, l);
    // partial rows are stored per tile as [group, qb] blocks at row offset group * q0
    const int64_t base = group * it.q0;
    part_o[it.split][it.head].narrow(0, base, rows).copy_(o);
    part_m[it.split][it.head].narrow(0, base, rows).copy_(m);
    part_l[it.split][it.head].narrow(0, base, rows).copy_(l);
  });
  std::vector<Item> tiles = make_items(tq, tk, hkv, group, causal, 1);
  run_items(tiles, [&](const Item& it) {
    const int64_t rows = group * (it.q1 - it.q0);
    const int64_t base = group * it.q0;
    at::Tensor pm = part_m.select(1, it.head).narrow(1, base, rows);  // [S, rows]
    at::Tensor pl = part_l.select(1, it.head).narrow(1, base, rows);
    at::Tensor po = part_o.select(1, it.head).narrow(1, base, rows);  // [S, rows, 256]
    at::Tensor gm = pm.amax(0);                                       // [rows]
    at::Tensor w = pm.sub(gm.unsqueeze(0)).exp_();                     // [S, rows]
    at::Tensor l = w.mul(pl).sum(0);
    at::Tensor o = po.mul(w.unsqueeze(2)).sum(0);
    store_output_tile(o, l, it, group, out);
  });
}

// ---------------------------------------------------------------------------------------------
// Op implementations (CPU) and shape-only implementations (Meta, for fake tensors / opcheck).

void dense_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
               double softmax_scale, bool causal) {
  check_dense("dense", q, k, v, out, softmax_scale);
  c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset);
  attention_core(q, pack_kv(k), pack_kv(v), out, softmax_scale, causal, 1);
}

void dense_splitkv_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out, double softmax_scale, bool causal, int64_t num_splits) {
  check_dense("dense_splitkv", q, k, v, out, softmax_scale);
  TORCH_CHECK(num_splits >= 1 && num_splits <= kMaxSplits, "dflash_d256::dense_splitkv: "
              "num_splits must be in [1, ", kMaxSplits, "], got ", num_splits);
  c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset);
  const int64_t splits = std::max<int64_t>(1, std::min(num_splits, k.size(0)));
  attention_core(q, pack_kv(k), pack_kv(v), out, softmax_scale, causal, splits);
}

// Gathers the first kv_len positions of a paged cache into packed fp32 [Hkv, kv_len, 256].
at::Tensor gather_pages(const at::Tensor& cache, const at::Tensor& block_table, int64_t kv_len) {
  const int64_t bs = cache.size(1);
  const int64_t used = (kv_len + bs - 1) / bs;
  at::Tensor idx = block_table.narrow(0, 0, used).to(at::kLong);
  // [used, bs, Hkv, 256] -> [used * bs, Hkv, 256] -> first kv_len rows
  at::Tensor rows = cache.index_select(0, idx).flatten(0, 1).narrow(0, 0, kv_len);
  return pack_kv(rows);
}

void paged_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& block_table, int64_t kv_len, at::Tensor& out,
               double softmax_scale, bool causal) {
  check_paged_shapes(q, k_cache, v_cache, block_table, kv_len, out, softmax_scale);
  check_block_table_values(block_table, kv_len, k_cache.size(1), k_cache.size(0));
  c10::impl::ExcludeDispatchKeyGuard no_autograd(c10::autograd_dispatch_keyset);
  at::Tensor kp = gather_pages(k_cache, block_table, kv_len);
  at::Tensor vp = gather_pages(v_cache, block_table, kv_len);
  attention_core(q, kp, vp, out, softmax_scale, causal, 1);
}

void dense_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                double softmax_scale, bool) {
  check_dense("dense", q, k, v, out, softmax_scale);
}

void dense_splitkv_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor& out, double softmax_scale, bool, int64_t num_splits) {
  check_dense("dense_splitkv", q, k, v, out, softmax_scale);
  TORCH_CHECK(num_splits >= 1 && num_splits <= kMaxSplits, "dflash_d256::dense_splitkv: "
              "num_splits must be in [1, ", kMaxSplits, "], got ", num_splits);
}

void paged_meta(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_table, int64_t kv_len, at::Tensor& out,
                double softmax_scale, bool) {
  check_paged_shapes(q, k_cache, v_cache, block_table, kv_len, out, softmax_scale);
}

#ifdef DFLASH_WITH_CUDA
// ---------------------------------------------------------------------------------------------
// CUDA implementations: the same checks, then the kernels of attn_d256_cuda.cu through the
// plain launch interface (the .cu file is compiled by nvcc and includes no torch header).

// "$name" if set, one of `allowed`, else `fallback`; anything else is a clear error.
std::string env_choice(const char* name, std::initializer_list<const char*> allowed,
                       const std::string& fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr) return fallback;
  const std::string value(env);
  bool known = false;
  std::string names;
  for (const char* ok : allowed) {
    known = known || value == ok;
    names += (names.empty() ? "" : ", ") + std::string(ok);
  }
  TORCH_CHECK(known, "dflash_d256: ", name, " must be one of ", names, ", got '", value, "'");
  return value;
}

void check_aligned(const char* op, std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "dflash_d256::", op,
                ": CUDA tensors must start on a 16-byte boundary; this one is a view at an "
                "unaligned offset: pass .clone() of it");
  }
}

void run_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor* block_table, int64_t tk, int64_t hkv, at::Tensor& out,
              double softmax_scale, bool causal, int64_t num_splits) {
  const int64_t tq = q.size(0);
  const int64_t hq = q.size(1);
  TORCH_CHECK(tk < (int64_t{1} << 30) && tq * hq < (int64_t{1} << 30), "dflash_d256: sequence "
              "too long for the CUDA kernels (Tk ", tk, ", Tq x Hq ", tq * hq, "); at most 2^30");
  TORCH_CHECK(hq <= 65535, "dflash_d256: at most 65535 query heads on CUDA, got ", hq);
  const c10::cuda::CUDAGuard guard(q.device());
  cuda::Launch a{};
  a.q = q.data_ptr();
  a.out = out.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.block_table = block_table ? block_table->data_ptr<int32_t>() : nullptr;
  a.block_size = block_table ? static_cast<int>(k.size(1)) : 0;
  a.tq = static_cast<int>(tq);
  a.tk = static_cast<int>(tk);
  a.hq = static_cast<int>(hq);
  a.hkv = static_cast<int>(hkv);
  a.softmax_scale = static_cast<float>(softmax_scale);
  a.causal = causal;
  a.fp16 = q.scalar_type() == at::kHalf;
  int optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        q.get_device()));
  // fp16 kernel shape: $DFLASH_D256_CUDA_WARPS (4 or 8; default 8 where a block may have the
  // shared memory, else 4) and $DFLASH_D256_CUDA_VT (V staged transposed: 1, or as loaded: 0,
  // the default; on an H200 the transposing stores cost more than the 32-bit V reads save)
  a.warps = 8;
  const bool fits8 = cuda::smem_bytes(a) <= optin;
  a.warps = std::stoi(env_choice("DFLASH_D256_CUDA_WARPS", {"4", "8"}, fits8 ? "8" : "4"));
  a.v_transposed = env_choice("DFLASH_D256_CUDA_VT", {"0", "1"}, "0") == "1";
  TORCH_CHECK(cuda::smem_bytes(a) <= optin, "dflash_d256: the CUDA kernel needs ",
              cuda::smem_bytes(a), " bytes of shared memory per block, device ", q.get_device(),
              " allows ", optin, (a.fp16 && a.warps == 8 ? "; set DFLASH_D256_CUDA_WARPS=4" : ""));
  const int64_t tiles = (tq + cuda::query_tile(a) - 1) / cuda::query_tile(a);
  TORCH_CHECK(tiles <= 65535, "dflash_d256: Tq ", tq, " needs ", tiles, " query tiles, the "
              "CUDA grid allows 65535; split the prefill into chunks");
  const int64_t key_tile = cuda::kKeyTile;
  int64_t split_len = (tk + num_splits - 1) / num_splits;
  split_len = std::max<int64_t>(key_tile, (split_len + key_tile - 1) / key_tile * key_tile);
  a.split_len = static_cast<int>(split_len);
  a.splits = static_cast<int>(std::max<int64_t>(1, (tk + split_len - 1) / split_len));
  at::Tensor ws_o, ws_m, ws_l;
  if (a.splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    ws_o = at::empty({a.splits, hq, tq, kHeadDim}, f32);
    ws_m = at::empty({a.splits, hq, tq}, f32);
    ws_l = at::empty({a.splits, hq, tq}, f32);
    a.ws_o = ws_o.data_ptr<float>();
    a.ws_m = ws_m.data_ptr<float>();
    a.ws_l = ws_l.data_ptr<float>();
  }
  a.stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  const char* what = "nothing";
  const int err = cuda::run(a, &what);
  TORCH_CHECK(err == 0, "dflash_d256: CUDA error while ", what, ": ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void dense_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                double softmax_scale, bool causal) {
  check_dense("dense", q, k, v, out, softmax_scale);
  check_aligned("dense", {&q, &k, &v, &out});
  run_cuda(q, k, v, nullptr, k.size(0), k.size(1), out, softmax_scale, causal, 1);
}

void dense_splitkv_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor& out, double softmax_scale, bool causal, int64_t num_splits) {
  check_dense("dense_splitkv", q, k, v, out, softmax_scale);
  TORCH_CHECK(num_splits >= 1 && num_splits <= kMaxSplits, "dflash_d256::dense_splitkv: "
              "num_splits must be in [1, ", kMaxSplits, "], got ", num_splits);
  check_aligned("dense_splitkv", {&q, &k, &v, &out});
  run_cuda(q, k, v, nullptr, k.size(0), k.size(1), out, softmax_scale, causal,
           std::max<int64_t>(1, std::min(num_splits, k.size(0))));
}

#ifndef DFLASH_DENSE_ONLY
void paged_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_table, int64_t kv_len, at::Tensor& out,
                double softmax_scale, bool causal) {
  check_paged_shapes(q, k_cache, v_cache, block_table, kv_len, out, softmax_scale);
  check_aligned("paged", {&q, &k_cache, &v_cache, &out});
  // Block ids are checked on a host copy of the used entries (a small synchronous copy): an
  // out-of-range id read on the device would be an illegal address, not an error message.
  // Not while a CUDA graph is captured: a capture refuses the copy, and an engine captures a
  // step only after eager calls of the very same step, which made the check.
  const int64_t bs = k_cache.size(1);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(
      c10::cuda::getCurrentCUDAStream(q.get_device()).stream(), &capture));
  if (capture == cudaStreamCaptureStatusNone) {
    const at::Tensor used = block_table.narrow(0, 0, (kv_len + bs - 1) / bs).cpu();
    check_block_table_values(used, kv_len, bs, k_cache.size(0));
  }
  run_cuda(q, k_cache, v_cache, &block_table, kv_len, k_cache.size(2), out, softmax_scale,
           causal, 1);
}
#endif  // DFLASH_DENSE_ONLY
#endif  // DFLASH_WITH_CUDA

}  // namespace
}  // namespace dflash_d256

TORCH_LIBRARY(dflash_d256, m) {
  m.def("dense(Tensor q, Tensor k, Tensor v, Tensor(a!) out, float softmax_scale, bool causal)"
        " -> ()");
  m.def("dense_splitkv(Tensor q, Tensor k, Tensor v, Tensor(a!) out, float softmax_scale,"
        " bool causal, int num_splits) -> ()");
#ifndef DFLASH_DENSE_ONLY
  m.def("paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int kv_len,"
        " Tensor(a!) out, float softmax_scale, bool causal) -> ()");
#endif
}

TORCH_LIBRARY_IMPL(dflash_d256, CPU, m) {
  m.impl("dense", &dflash_d256::dense_cpu);
  m.impl("dense_splitkv", &dflash_d256::dense_splitkv_cpu);
#ifndef DFLASH_DENSE_ONLY
  m.impl("paged", &dflash_d256::paged_cpu);
#endif
}

#ifdef DFLASH_WITH_CUDA
TORCH_LIBRARY_IMPL(dflash_d256, CUDA, m) {
  m.impl("dense", &dflash_d256::dense_cuda);
  m.impl("dense_splitkv", &dflash_d256::dense_splitkv_cuda);
#ifndef DFLASH_DENSE_ONLY
  m.impl("paged", &dflash_d256::paged_cuda);
#endif
}
#endif

TORCH_LIBRARY_IMPL(dflash_d256, Meta, m) {
  m.impl("dense", &dflash_d256::dense_meta);
  m.impl("dense_splitkv", &dflash_d256::dense_splitkv_meta);
#ifndef DFLASH_DENSE_ONLY
  m.impl("paged", &dflash_d256::paged_meta);
#endif
}
