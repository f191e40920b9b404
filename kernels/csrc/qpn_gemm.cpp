// QPN2 / QPN4 NVFP4 GEMMs for the CPU: the `dflash_qpn` op namespace.
//
// Ops (schemas in TORCH_LIBRARY below; buffer layout in qpn_common.h):
//   qpn2_linear(x [M,K], buffer, scales, global_scale, n, k, gated) -> [M, n or n/2]
//       the small-M kernel: rows in passes of 32; every code byte and scale of the weight is
//       decoded once per pass (once per call for M <= 32); split-K slices of 256 K reduced in
//       slice order (a fixed order: bitwise identical across runs and thread counts); fp32
//       accumulation; the global scale applied in fp32 at the end.
//   qpn4_bounded_linear(x, buffer, scales, scales_fp16?, global_scale, n, k, workspace_id,
//                       workspace_bytes, gated)
//       the large-M path: whole 32-column tiles of the QPN4 view are dequantized into the
//       bounded workspace (as many as the bound holds), then one vendor GEMM (at::mm: MKL /
//       oneDNN / OpenBLAS) per chunk writes the chunk's output columns. fp16 inputs use the
//       fp16 pre-scaled scales (2^14 bias) when given, removed in fp32 at the end; otherwise the
//       raw E4M3 scales with the global scale in fp32. On the CPU the workspace holds fp32
//       values (a CPU fp16 GEMM is several times slower than fp32 and would only measure that).
//   qpn2_packed_linear(x, buffer, scales, scales_fp16?, n, plan, gated)
//       the dispatch op: M >= min_prefill_m runs qpn4_bounded's very function, smaller M the
//       qpn2 one, so type-A parity holds by construction; the branch costs one comparison.
//       plan: CPU int64 [k, min_prefill_m, workspace_id, workspace_bytes, global scale as
//       float64 bits] (PackedPlan), so the call crosses torch.ops with as many arguments as
//       qpn2_linear (7) and costs the host no more.
//   hit_counts() -> int64 [4]; set_poison(bool) -> previous; set_dispatch_checked(bool);
//   workspace_peak(id) -> int; workspace_reset_peak(id); workspace_trim(id, bound);
//   workspace_release(id)
//
// Vector code uses GCC/Clang vector extensions, compiled twice on x86 (baseline SSE2 and
// AVX2+FMA, chosen at run time; $DFLASH_QPN_DISABLE_AVX2 forces the baseline), because the
// library is built with portable flags only.

#include "qpn_common.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/silu.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <unordered_map>

namespace dflash_qpn {

// ---------------------------------------------------------------------------------------------
// Shared state: hit counters, poison flag, dispatch check, workspace registry.

namespace {
std::atomic<int64_t> g_hits[kHitCount];
std::atomic<bool> g_poison{false};
std::atomic<bool> g_dispatch_checked{true};

struct Slot {
  std::mutex mutex;
  at::Tensor storage;
  int64_t peak = 0;
};
std::mutex g_slots_mutex;
std::unordered_map<int64_t, std::unique_ptr<Slot>> g_slots;

Slot& slot(int64_t id) {
  std::lock_guard<std::mutex> guard(g_slots_mutex);
  auto& entry = g_slots[id];
  if (!entry) entry = std::make_unique<Slot>();
  return *entry;
}
}  // namespace

void count_hit(Hit hit, int64_t n) { g_hits[hit].fetch_add(n, std::memory_order_relaxed); }

bool poison_enabled() { return g_poison.load(std::memory_order_relaxed); }

void poison(at::Tensor& t) {
  if (poison_enabled()) t.view(at::kByte).fill_(0xFF);
}

void check_min_prefill_m(int64_t min_prefill_m) {
  if (!g_dispatch_checked.load(std::memory_order_relaxed)) return;
  TORCH_CHECK_VALUE(min_prefill_m > kMaxVerifyM, "min_prefill_m = ", min_prefill_m,
                    " would send verify steps (M <= ", kMaxVerifyM,
                    ": draft width 7 + 1) to the large-M path and change the speculative "
                    "verification cost; use min_prefill_m > ", kMaxVerifyM, " (default ",
                    kMaxSmallM + 1, ")");
}

PackedPlan read_packed_plan(const at::Tensor& plan) {
  TORCH_CHECK_VALUE(plan.device().is_cpu() && plan.scalar_type() == at::kLong &&
                        plan.dim() == 1 && plan.numel() == kPackedPlanFields &&
                        plan.is_contiguous(),
                    "dflash_qpn::qpn2_packed_linear: plan must be a contiguous CPU int64 tensor "
                    "[k, min_prefill_m, workspace_id, workspace_bytes, global scale bits] "
                    "(dflash_kernels.gemm.packed_plan), got ", plan.scalar_type(), " ",
                    plan.sizes(), " on ", plan.device());
  const int64_t* f = plan.const_data_ptr<int64_t>();
  PackedPlan p{f[0], f[1], f[2], f[3], 0.0};
  std::memcpy(&p.global_scale, &f[4], sizeof(double));
  check_min_prefill_m(p.min_prefill_m);
  return p;
}

Geometry check_args(const char* op, const at::Tensor& x, const at::Tensor& buffer,
                    const at::Tensor& scales, const std::optional<at::Tensor>& scales_fp16,
                    int64_t n, int64_t k, bool gated) {
  TORCH_CHECK_VALUE(x.dim() == 2, "dflash_qpn::", op, ": x must be 2-D [M, K], got ",
                    x.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf,
                    "dflash_qpn::", op, ": x has dtype ", x.scalar_type(),
                    "; these ops take fp32 or fp16 (SM70 has no bf16): convert with x.float() "
                    "or x.half()");
  TORCH_CHECK_VALUE(k > 0 && k % kKMultiple == 0, "dflash_qpn::", op, ": K = ", k,
                    " breaks the QPN shape contract K % ", kKMultiple,
                    " == 0; pad K with zero columns before quantizing");
  TORCH_CHECK_VALUE(x.size(1) == k, "dflash_qpn::", op, ": x has K = ", x.size(1),
                    " but the weight has K = ", k);
  TORCH_CHECK_VALUE(buffer.scalar_type() == at::kByte && buffer.dim() == 1 &&
                        buffer.is_contiguous(),
                    "dflash_qpn::", op, ": buffer must be the contiguous flat uint8 QPN buffer "
                    "(QPNWeight.buffer), got ", buffer.scalar_type(), " ", buffer.sizes());
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kByte && scales.dim() == 3 &&
                        scales.size(2) == kTileN && scales.is_contiguous(),
                    "dflash_qpn::", op, ": scales must be contiguous uint8 [T, K/16, 32] raw "
                    "E4M3 bytes in tile order (QPNWeight.scales), got ", scales.scalar_type(),
                    " ", scales.sizes());
  const int64_t tiles = scales.size(0), groups = k / kGroupK, n_padded = tiles * kTileN;
  TORCH_CHECK_VALUE(scales.size(1) == groups, "dflash_qpn::", op, ": scales have ",
                    scales.size(1), " groups, K = ", k, " needs ", groups);
  TORCH_CHECK_VALUE(buffer.numel() == n_padded * k / 2, "dflash_qpn::", op, ": buffer has ",
                    buffer.numel(), " bytes, ", tiles, " tiles of K = ", k, " need ",
                    n_padded * k / 2);
  TORCH_CHECK_VALUE(n > n_padded - kTileN && n <= n_padded, "dflash_qpn::", op, ": n = ", n,
                    " does not match the ", tiles, " tiles of the buffer (N padded to ",
                    n_padded, ")");
  TORCH_CHECK_VALUE(!gated || n % 2 == 0, "dflash_qpn::", op,
                    ": gated needs a fused weight with even N (first N/2 rows gate, last N/2 "
                    "up), got N = ", n);
  TORCH_CHECK_VALUE(buffer.device() == x.device() && scales.device() == x.device(),
                    "dflash_qpn::", op, ": x is on ", x.device(), ", the weight on ",
                    buffer.device(), ": move one");
  if (scales_fp16.has_value()) {
    const at::Tensor& s = *scales_fp16;
    TORCH_CHECK_VALUE(s.scalar_type() == at::kHalf && s.sizes() == scales.sizes() &&
                          s.is_contiguous() && s.device() == x.device(),
                      "dflash_qpn::", op, ": scales_fp16 must be contiguous fp16 ",
                      scales.sizes(), " on ", x.device(),
                      " (QPNWeight.fp16_prescaled_or_none()), got ", s.scalar_type(), " ",
                      s.sizes(), " on ", s.device());
  }
  return Geometry{x.size(0), n, k, n_padded, tiles, groups};
}

bool use_fp16_scales(const at::Tensor& x, const std::optional<at::Tensor>& scales_fp16) {
  return x.scalar_type() == at::kHalf && scales_fp16.has_value();
}

int64_t workspace_bytes_per_tile(int64_t k, int64_t value_bytes) {
  return kTileN * k * value_bytes;
}

int64_t tiles_per_chunk(int64_t tiles, int64_t k, int64_t value_bytes, int64_t bound) {
  const int64_t per_tile = workspace_bytes_per_tile(k, value_bytes);
  TORCH_CHECK_VALUE(bound >= per_tile, "workspace bound ", bound,
                    " bytes is below one 32-column tile of this K = ", k, " weight (", per_tile,
                    " bytes); raise workspace_bytes to at least ", per_tile);
  return std::min(tiles, bound / per_tile);
}

WorkspaceLease take_workspace(int64_t id, int64_t nbytes, int64_t bound, at::Device device) {
  TORCH_CHECK(nbytes <= bound, "workspace request of ", nbytes, " bytes exceeds its bound ",
              bound, ": the chunking must be derived from the bound (a bug in the route)");
  Slot& s = slot(id);
  WorkspaceLease lease{std::unique_lock<std::mutex>(s.mutex), at::Tensor()};
  if (s.storage.defined() && s.storage.numel() > bound) s.storage = at::Tensor();  // bound shrank
  if (!s.storage.defined() || s.storage.numel() < nbytes || s.storage.device() != device) {
    s.storage = at::Tensor();  // free the old storage before taking the new one
    s.storage = at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device));
    s.peak = std::max(s.peak, nbytes);
  }
  lease.bytes = s.storage.narrow(0, 0, nbytes);
  return lease;
}

at::Tensor finish(const at::Tensor& y32, int64_t n, bool gated, at::ScalarType dtype) {
  at::Tensor y = y32.narrow(1, 0, n);
  if (gated) y = at::silu(y.narrow(1, 0, n / 2)).mul(y.narrow(1, n / 2, n / 2));
  return y.to(dtype).contiguous();
}

namespace {

// ---------------------------------------------------------------------------------------------
// Utility ops (no tensor arguments).

at::Tensor hit_counts() {
  at::Tensor out = at::empty({kHitCount}, at::kLong);
  for (int i = 0; i < kHitCount; ++i) out[i] = g_hits[i].load(std::memory_order_relaxed);
  return out;
}

bool set_poison(bool on) { return g_poison.exchange(on); }

void set_dispatch_checked(bool on) { g_dispatch_checked.store(on); }

int64_t workspace_peak(int64_t id) {
  Slot& s = slot(id);
  std::lock_guard<std::mutex> guard(s.mutex);
  return s.peak;
}

void workspace_reset_peak(int64_t id) {
  Slot& s = slot(id);
  std::lock_guard<std::mutex> guard(s.mutex);
  s.peak = s.storage.defined() ? s.storage.numel() : 0;
}

void workspace_trim(int64_t id, int64_t bound) {
  Slot& s = slot(id);
  std::lock_guard<std::mutex> guard(s.mutex);
  if (s.storage.defined() && s.storage.numel() > bound) s.storage = at::Tensor();
}

void workspace_release(int64_t id) {
  std::unique_ptr<Slot> gone;
  {
    std::lock_guard<std::mutex> guard(g_slots_mutex);
    auto it = g_slots.find(id);
    if (it == g_slots.end()) return;
    std::lock_guard<std::mutex> busy(it->second->mutex);  // not while a call uses it
    gone = std::move(it->second);
    g_slots.erase(it);
  }
}

// ---------------------------------------------------------------------------------------------
// Decode tables.

// fp32 value of every E4M3 byte: torch's own float8_e4m3fn conversion.
const float* e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      t[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b),
                                                   c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table.data();
}

// The two E2M1 values (low nibble, high nibble) of every code byte.
const float* e2m1_pairs() {
  static const std::array<float, 512> table = [] {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    std::array<float, 512> t{};
    for (int b = 0; b < 256; ++b) {
      const int lo = b & 15, hi = b >> 4;
      t[2 * b] = (lo & 8) ? -mag[lo & 7] : mag[lo & 7];
      t[2 * b + 1] = (hi & 8) ? -mag[hi & 7] : mag[hi & 7];
    }
    return t;
  }();
  return table.data();
}

// ---------------------------------------------------------------------------------------------
// Vector code (compiled for the baseline and for AVX2+FMA).

#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

typedef float v8f __attribute__((vector_size(32)));

#define QPN_INLINE static inline __attribute__((always_inline))

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define QPN_FMA(a, b, c) __builtin_ia32_vfmaddps256((a), (b), (c))
#else
#define QPN_FMA(a, b, c) ((a) * (b) + (c))
#endif

QPN_INLINE v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

QPN_INLINE void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

QPN_INLINE float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// Decode `ng` groups of column `c` of one tile: w[16 g + i] = e2m1 * e4m3 (exact in fp32).
// codes: the tile's first group of this slice; scales likewise (stride 32 per group).
QPN_INLINE void decode_column(const uint8_t* codes, const uint8_t* scales, int64_t ng,
                              const float* e4m3, const float* pairs, const float* scale_f32,
                              float* w) {
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* b = codes + g * kTileN * kGroupBytes;
    float* out = w + g * kGroupK;
    for (int j = 0; j < kGroupBytes; ++j) std::memcpy(out + 2 * j, pairs + 2 * b[j], 8);
    const float s = scale_f32 ? scale_f32[g * kTileN] : e4m3[scales[g * kTileN]];
    store8(out, load8(out) * s);
    store8(out + 8, load8(out + 8) * s);
  }
}

// partial[m] = sum_k w[k] * x[m][k] over `len` K (a multiple of 16) for MB rows, in a fixed
// order: lanes accumulate in k order, two accumulators (first and second half of each group)
// when there are registers for them, then one fixed-order horizontal sum.
template <int MB, bool kFma>
QPN_INLINE void dot_rows(const float* w, int64_t len, const float* x, int64_t ldx,
                         float* partial) {
  constexpr int kAcc = MB <= 4 ? 2 : 1;
  v8f acc[MB][kAcc];
  for (int m = 0; m < MB; ++m)
    for (int a = 0; a < kAcc; ++a) acc[m][a] = v8f{};
  for (int64_t i = 0; i < len; i += 16) {
    const v8f w0 = load8(w + i), w1 = load8(w + i + 8);
    for (int m = 0; m < MB; ++m) {
      const float* xr = x + m * ldx + i;
      if constexpr (kFma) {
        acc[m][0] = QPN_FMA(w0, load8(xr), acc[m][0]);
        acc[m][kAcc - 1] = QPN_FMA(w1, load8(xr + 8), acc[m][kAcc - 1]);
      } else {
        acc[m][0] = w0 * load8(xr) + acc[m][0];
        acc[m][kAcc - 1] = w1 * load8(xr + 8) + acc[m][kAcc - 1];
      }
    }
  }
  for (int m = 0; m < MB; ++m) partial[m] = hsum(kAcc == 2 ? acc[m][0] + acc[m][kAcc - 1]
                                                           : acc[m][0]);
}

template <bool kFma>
QPN_INLINE void dot_block(int64_t mb, const float* w, int64_t len, const float* x, int64_t ldx,
                          float* partial) {
  switch (mb) {
    case 1: return dot_rows<1, kFma>(w, len, x, ldx, partial);
    case 2: return dot_rows<2, kFma>(w, len, x, ldx, partial);
    case 3: return dot_rows<3, kFma>(w, len, x, ldx, partial);
    case 4: return dot_rows<4, kFma>(w, len, x, ldx, partial);
    case 5: return dot_rows<5, kFma>(w, len, x, ldx, partial);
    case 6: return dot_rows<6, kFma>(w, len, x, ldx, partial);
    case 7: return dot_rows<7, kFma>(w, len, x, ldx, partial);
    default: return dot_rows<8, kFma>(w, len, x, ldx, partial);
  }
}

struct SmallM {
  const float* x;  // [rows, K] fp32, row stride k
  int64_t rows, k, groups;
  const uint8_t* buffer;
  const uint8_t* scales;
  float* out;  // [rows, Np] fp32, row stride ldo
  int64_t ldo;
  float global_scale;
};

// One 32-column tile of the small-M kernel for up to 32 rows: per split-K slice, each column's
// codes are decoded once into `w`, every 8-row block takes its dot products from it, and the
// slice's partial sums are added to the running total in slice order.
template <bool kFma>
QPN_INLINE void small_m_tile(const SmallM& a, int64_t t) {
  constexpr int64_t kSliceGroups = kSplitK / kGroupK;
  alignas(64) float w[kSplitK];
  float total[kMaxSmallM * kTileN];  // [row][column]
  float partial[8];
  const float* e4m3 = e4m3_table();
  const float* pairs = e2m1_pairs();
  for (int64_t g0 = 0; g0 < a.groups; g0 += kSliceGroups) {
    const int64_t ng = std::min(kSliceGroups, a.groups - g0);
    for (int64_t c = 0; c < kTileN; ++c) {
      const int64_t first = (t * a.groups + g0) * kTileN + c;  // (tile, group, column) index
      decode_column(a.buffer + first * kGroupBytes, a.scales + first, ng, e4m3, pairs,
                    nullptr, w);
      for (int64_t m0 = 0; m0 < a.rows; m0 += 8) {
        const int64_t mb = std::min<int64_t>(8, a.rows - m0);
        dot_block<kFma>(mb, w, ng * kGroupK, a.x + m0 * a.k + g0 * kGroupK, a.k, partial);
        for (int64_t m = 0; m < mb; ++m) {
          float& acc = total[(m0 + m) * kTileN + c];
          acc = g0 == 0 ? partial[m] : acc + partial[m];
        }
      }
    }
  }
  for (int64_t m = 0; m < a.rows; ++m)
    for (int64_t c = 0; c < kTileN; ++c)
      a.out[m * a.ldo + t * kTileN + c] = total[m * kTileN + c] * a.global_scale;
}

struct Dequant {
  const uint8_t* buffer;
  const uint8_t* scales;
  const float* scales_f32;  // pre-scaled fp16 scales as fp32 [T, G, 32], or null (raw E4M3)
  int64_t groups, k;
  float* values;  // [tiles of the chunk * 32, K] fp32, row = column n
};

// Dequantize tile t (the chunk's tile `local`) into its 32 rows of the workspace.
QPN_INLINE void dequant_tile(const Dequant& a, int64_t t, int64_t local) {
  const float* e4m3 = e4m3_table();
  const float* pairs = e2m1_pairs();
  for (int64_t c = 0; c < kTileN; ++c) {
    const int64_t first = t * a.groups * kTileN + c;
    decode_column(a.buffer + first * kGroupBytes, a.scales + first, a.groups, e4m3, pairs,
                  a.scales_f32 ? a.scales_f32 + first : nullptr,
                  a.values + (local * kTileN + c) * a.k);
  }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define QPN_HAVE_AVX2_COPY 1
__attribute__((target("avx2,fma"))) void small_m_tile_avx2(const SmallM& a, int64_t t) {
  small_m_tile<true>(a, t);
}
__attribute__((target("avx2,fma"))) void dequant_tile_avx2(const Dequant& a, int64_t t,
                                                          int64_t local) {
  dequant_tile(a, t, local);
}
bool use_avx2_fma() {
  static const bool use = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          std::getenv("DFLASH_QPN_DISABLE_AVX2") == nullptr;
  return use;
}
#endif

void small_m_tile_generic(const SmallM& a, int64_t t) { small_m_tile<false>(a, t); }
void dequant_tile_generic(const Dequant& a, int64_t t, int64_t local) {
  dequant_tile(a, t, local);
}

#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

// Tiles per parallel task: at least ~32 KiB of codes each, so tiny weights stay on one thread.
int64_t tile_grain(int64_t k) { return std::max<int64_t>(1, 32768 / (kTileN * k / 2)); }

// ---------------------------------------------------------------------------------------------
// The two kernels (fp32 [M, Np] results) and the ops.

at::Tensor qpn2_small_m_cpu(const at::Tensor& x, const at::Tensor& buffer,
                            const at::Tensor& scales, double global_scale, const Geometry& g) {
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({g.m, g.n_padded}, x.options().dtype(at::kFloat));
  poison(out);
  SmallM args{nullptr, 0, g.k, g.groups, buffer.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
              nullptr, g.n_padded, static_cast<float>(global_scale)};
#ifdef QPN_HAVE_AVX2_COPY
  const bool avx2 = use_avx2_fma();
#endif
  for (int64_t r0 = 0; r0 < g.m; r0 += kMaxSmallM) {
    count_hit(kHitQpn2SmallM);
    SmallM block = args;
    block.rows = std::min(kMaxSmallM, g.m - r0);
    block.x = x32.data_ptr<float>() + r0 * g.k;
    block.out = out.data_ptr<float>() + r0 * g.n_padded;
    at::parallel_for(0, g.tiles, tile_grain(g.k), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
#ifdef QPN_HAVE_AVX2_COPY
        if (avx2) {
          small_m_tile_avx2(block, t);
          continue;
        }
#endif
        small_m_tile_generic(block, t);
      }
    });
  }
  return out;
}

at::Tensor qpn4_bounded_large_m_cpu(const at::Tensor& x, const at::Tensor& buffer,
                                    const at::Tensor& scales,
                                    const std::optional<at::Tensor>& scales_fp16,
                                    double global_scale, int64_t workspace_id,
                                    int64_t workspace_bytes, const Geometry& g) {
  count_hit(kHitQpn4LargeM);
  constexpr int64_t kValueBytes = 4;  // fp32 values on the CPU
  const int64_t chunk = tiles_per_chunk(g.tiles, g.k, kValueBytes, workspace_bytes);
  const bool fp16_scales = use_fp16_scales(x, scales_fp16);
  const at::Tensor scales32 = fp16_scales ? scales_fp16->to(at::kFloat) : at::Tensor();
  const double unscale = fp16_scales ? 1.0 / kFp16ScaleBias : global_scale;
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({g.m, g.n_padded}, x.options().dtype(at::kFloat));
  poison(out);
  WorkspaceLease ws = take_workspace(
      workspace_id, chunk * workspace_bytes_per_tile(g.k, kValueBytes), workspace_bytes,
      x.device());
  poison(ws.bytes);
  const at::Tensor values = ws.bytes.view(at::kFloat).view({chunk * kTileN, g.k});
  Dequant args{buffer.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
               fp16_scales ? scales32.data_ptr<float>() : nullptr, g.groups, g.k,
               values.data_ptr<float>()};
#ifdef QPN_HAVE_AVX2_COPY
  const bool avx2 = use_avx2_fma();
#endif
  for (int64_t t0 = 0; t0 < g.tiles; t0 += chunk) {
    const int64_t nt = std::min(chunk, g.tiles - t0);
    at::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
      for (int64_t local = begin; local < end; ++local) {
#ifdef QPN_HAVE_AVX2_COPY
        if (avx2) {
          dequant_tile_avx2(args, t0 + local, local);
          continue;
        }
#endif
        dequant_tile_generic(args, t0 + local, local);
      }
    });
    at::Tensor cols = out.narrow(1, t0 * kTileN, nt * kTileN);
    at::mm_out(cols, x32, values.narrow(0, 0, nt * kTileN).t());
  }
  return out.mul_(unscale);
}

at::Tensor qpn2_linear_cpu(const at::Tensor& x, const at::Tensor& buffer,
                           const at::Tensor& scales, double global_scale, int64_t n, int64_t k,
                           bool gated) {
  const Geometry g = check_args("qpn2_linear", x, buffer, scales, std::nullopt, n, k, gated);
  return finish(qpn2_small_m_cpu(x, buffer, scales, global_scale, g), n, gated,
                x.scalar_type());
}

at::Tensor qpn4_bounded_linear_cpu(const at::Tensor& x, const at::Tensor& buffer,
                                   const at::Tensor& scales,
                                   const std::optional<at::Tensor>& scales_fp16,
                                   double global_scale, int64_t n, int64_t k,
                                   int64_t workspace_id, int64_t workspace_bytes, bool gated) {
  const Geometry g =
      check_args("qpn4_bounded_linear", x, buffer, scales, scales_fp16, n, k, gated);
  return finish(qpn4_bounded_large_m_cpu(x, buffer, scales, scales_fp16, global_scale,
                                         workspace_id, workspace_bytes, g),
                n, gated, x.scalar_type());
}

at::Tensor qpn2_packed_linear_cpu(const at::Tensor& x, const at::Tensor& buffer,
                                  const at::Tensor& scales,
                                  const std::optional<at::Tensor>& scales_fp16, int64_t n,
                                  const at::Tensor& plan, bool gated) {
  const PackedPlan p = read_packed_plan(plan);
  const Geometry g =
      check_args("qpn2_packed_linear", x, buffer, scales, scales_fp16, n, p.k, gated);
  at::Tensor y;
  if (g.m < p.min_prefill_m) {
    count_hit(kHitPackedSmallM);
    y = qpn2_small_m_cpu(x, buffer, scales, p.global_scale, g);
  } else {
    count_hit(kHitPackedLargeM);
    y = qpn4_bounded_large_m_cpu(x, buffer, scales, scales_fp16, p.global_scale, p.workspace_id,
                                 p.workspace_bytes, g);
  }
  return finish(y, n, gated, x.scalar_type());
}

// Shape-only implementations (fake tensors, opcheck).
at::Tensor out_like(const at::Tensor& x, int64_t n, bool gated) {
  return at::empty({x.size(0), gated ? n / 2 : n}, x.options());
}

at::Tensor qpn2_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, double,
                            int64_t n, int64_t, bool gated) {
  return out_like(x, n, gated);
}

at::Tensor qpn4_bounded_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                    const std::optional<at::Tensor>&, double, int64_t n,
                                    int64_t, int64_t, int64_t, bool gated) {
  return out_like(x, n, gated);
}

at::Tensor qpn2_packed_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&, int64_t n,
                                   const at::Tensor&, bool gated) {
  return out_like(x, n, gated);
}

}  // namespace
}  // namespace dflash_qpn

TORCH_LIBRARY(dflash_qpn, m) {
  m.def("qpn2_linear(Tensor x, Tensor buffer, Tensor scales, float global_scale, int n, int k, "
        "bool gated) -> Tensor");
  m.def("qpn4_bounded_linear(Tensor x, Tensor buffer, Tensor scales, Tensor? scales_fp16, "
        "float global_scale, int n, int k, int workspace_id, int workspace_bytes, bool gated) "
        "-> Tensor");
  m.def("qpn2_packed_linear(Tensor x, Tensor buffer, Tensor scales, Tensor? scales_fp16, "
        "int n, Tensor plan, bool gated) -> Tensor");
  m.def("hit_counts() -> Tensor", &dflash_qpn::hit_counts);
  m.def("set_poison(bool on) -> bool", &dflash_qpn::set_poison);
  m.def("set_dispatch_checked(bool on) -> ()", &dflash_qpn::set_dispatch_checked);
  m.def("workspace_peak(int id) -> int", &dflash_qpn::workspace_peak);
  m.def("workspace_reset_peak(int id) -> ()", &dflash_qpn::workspace_reset_peak);
  m.def("workspace_trim(int id, int bound) -> ()", &dflash_qpn::workspace_trim);
  m.def("workspace_release(int id) -> ()", &dflash_qpn::workspace_release);
}

TORCH_LIBRARY_IMPL(dflash_qpn, CPU, m) {
  m.impl("qpn2_linear", &dflash_qpn::qpn2_linear_cpu);
  m.impl("qpn4_bounded_linear", &dflash_qpn::qpn4_bounded_linear_cpu);
  m.impl("qpn2_packed_linear", &dflash_qpn::qpn2_packed_linear_cpu);
}

TORCH_LIBRARY_IMPL(dflash_qpn, Meta, m) {
  m.impl("qpn2_linear", &dflash_qpn::qpn2_linear_meta);
  m.impl("qpn4_bounded_linear", &dflash_qpn::qpn4_bounded_linear_meta);
  m.impl("qpn2_packed_linear", &dflash_qpn::qpn2_packed_linear_meta);
}
