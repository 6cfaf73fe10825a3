// A fast CPU kernel for MLX's affine quantized matmul `x @ dequantize(w)^T`, as an MLX custom
// primitive (`QuantizedMatmulCpu`), for the Linux CPU backend.
//
// Why: the `mlx-cpu` wheel is an SSE2 build whose quantized kernels move about 1 GB/s of
// weights, and its cost grows linearly with the number of activation rows (a verify window
// of 11 tokens costs ~8x one token). This kernel
//   - decodes each packed weight row once per call and applies it to every activation row
//     (with AVX-512 straight from registers for groups of up to 8 rows; with AVX2, and for
//     long rows, through a dequantized copy of the row in L1), so a verify window costs a
//     fraction of T one-token steps; prompt chunks go in blocks of at most 32 rows, each a
//     window (`run_rows`);
//   - in f32 precision repacks a matrix of whole panels of 32 features once (PanelCache) and
//     computes it in the broadcast form: per output one FMA chain over each scale group's
//     codes and MLX's per-group affine terms, 32 features per vector on AVX-512 (rows_panels)
//     and 8 on AVX2 + FMA + F16C (rows_panels_avx2), the same bits (prompt chunks of more
//     than 256 rows take the GEMM, whose panels are then packed from the copy: rows_gemm on
//     AVX-512, rows_gemm_avx2 on AVX2, or on CPUs with AMX-BF16 the tile unit's products,
//     rows_amx); the row kernels below serve the rest;
//   - reads x from a 64-byte aligned copy (on AVX-512 interleaved by 32-column block, so a
//     register group of rows is one pointer);
//   - gives bit-identical results for a row whatever the number of rows T (see below), so
//     speculative verification sees exactly the logits of plain decoding;
//   - uses AVX-512F, else AVX2 + FMA, when the CPU has them (runtime check with
//     __builtin_cpu_supports; the library itself is compiled for baseline x86-64) and
//     portable C++ otherwise (each call's `max_isa`, from the caller's kernel policy, caps
//     the choice);
//   - splits the output features over a small persistent thread pool (all cores by default;
//     `cpu_qmm_set_threads`, called by mlx-core's settings, overrides; a call's `threads`,
//     when positive, overrides that for the call).
//
// Format (mlx.core.quantize, affine mode): `w [N, K * bits / 32]` uint32, element j of a word
// in bits [j * bits, (j + 1) * bits) (little end first); `scales`, `biases` `[N, K / gs]`;
// the weight is `scale * q + bias`. Supported: bits 4 and 8, group sizes 32, 64, 128,
// float32 activations, scales and biases. Output float32 `[..., N]`.
//
// Evaluation follows MLX 0.32's CPU primitives: `eval_cpu` runs on the thread that called
// eval, allocates the output and hands the work to the stream's command encoder
// (`cpu::get_command_encoder(stream()).dispatch(...)`), which runs it on the stream thread in
// order with every other CPU op. MLX keeps the input buffers alive until the task has run.
#include "mlx-sys/src/shim.h"
#include "mlx-sys/src/kernels.h"
#include "mlx-sys/src/lib.rs.h"
#include "mlx-sys/src/pool.h"

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <sys/mman.h>
#ifdef MLXSYS_X86
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <unordered_map>

namespace mlxsys {
namespace mx = mlx::core;

namespace {

// ---------------------------------------------------------------------------------------
// Kernels. `x [M, K]`, `w [N, K * bits / 32]`, `s`, `b` `[N, K / gs]`, `out [M, N]`; each
// call computes the output columns n in [n0, n1). Bits 32 (kDense) means dense float32
// weights (`w` holds their bits), no scales or biases; `gs` is then 32, a loop unit only.

constexpr int kDense = kernels::kDenseBits;

// Products of more activation rows than this (prompt chunks) do not prefetch (kPrefetchBytes);
// verify windows do.
constexpr int kPrefetchMaxRows = 16;

// Products of at most this many activation rows (verify windows, batched decode steps, short
// prompts) give every row the bits of its one-row product; longer ones (prompt chunks) take
// the GEMM (rows_gemm on AVX-512, rows_gemm_avx2 on AVX2) in f32 precision. mlx-core's
// `cpu_quant::WINDOW_MAX_ROWS`; dense weights: kDenseWindowMaxRows, mlx-core's
// `cpu_quant::DENSE_MAX_ROWS` (their longer products went to BLAS before the GEMM, and still
// do off AVX-512).
constexpr int kWindowMaxRows = 256;
constexpr int kDenseWindowMaxRows = 32;

struct Panels;

struct Problem {
  const float* x;
  const uint32_t* w;
  const float* s;
  const float* b;
  float* out;
  int m, n, k, gs, bits;
  // Whether the register kernels prefetch the weight rows (see kPrefetchBytes): the whole
  // product's rows (not a register group's) are at most kPrefetchMaxRows.
  bool prefetch() const { return total_m <= kPrefetchMaxRows; }
  int total_m = 0;  // set with m; `rows` keeps it
  // bf16 precision only: x rounded to bf16, each 32-block in the lane order of the weights'
  // chunk pairs (4 bits: `permute_x4`'s), row stride K (`prepare_bf16`).
  const uint16_t* xb = nullptr;
  // int8 precision only (`prepare_int8_row`): x quantized to int8 per block of 32, row stride
  // k64() bytes (zeros past K); each block's scale d (row stride blocks(), zeros past K).
  // int8 precision and f32 products on panels (rows_panels, rows_panels_avx2): the f32 sum of each
  // scale group of x (`group_sum`), row stride groups().
  const int8_t* xq = nullptr;
  const float* xd = nullptr;
  const float* xs = nullptr;
  // f32 products of 4-bit matrices on AVX2 panels (rows_panels_avx2), where exact
  // (shift_exact): x times 2^-t for each half of a lane (shift_x_row), row stride 2K.
  const float* xt = nullptr;
  // Prompt chunks on the GEMM (rows_gemm, rows_gemm_avx2) only: x in the micro-kernels' order (gemm_pack_x).
  const float* xg = nullptr;
  // Prompt chunks on AMX (rows_amx) only: x split into three bf16 parts, stored tile by
  // tile, and each group's sum [padded M][groups()] (amx_split_x).
  const uint16_t* xa = nullptr;
  const float* xa_sums = nullptr;
  // The AVX-512 f32 register kernels only (rows_avx512_regs): x with each register group's
  // rows (`register_groups`) interleaved by 32-column block (`interleave_x`), so a group's
  // loads are one pointer plus constants: the group of rows [m0, m0 + M) at xi + m0 * K, its
  // block j of row m0 + r at + 32 * (j * M + r).
  const float* xi = nullptr;
  // 4- and 8-bit weights in f32 precision on AVX-512, at most kWindowMaxRows rows: the
  // matrix repacked into panels of 32 features (rows_panels reads it instead of w, s, b).
  const Panels* panels = nullptr;
  // Products with panels of more than one row only: x in blocks of kPanelXRows rows, each
  // block column by column (panel_pack_x).
  const float* xp = nullptr;

  int words() const { return k * bits / 32; }  // packed words per weight row
  int groups() const { return k / gs; }        // scale groups per weight row
  int k64() const { return (k + 63) / 64 * 64; }  // K rounded up to whole 64-chunks
  int blocks() const { return k64() / 32; }        // int8: blocks of 32 activations a row
  // The same product restricted to the activation rows [m0, m0 + count).
  Problem rows(int m0, int count) const {
    Problem q = *this;
    q.m = count;
    q.x = x + static_cast<size_t>(m0) * k;
    q.out = out + static_cast<size_t>(m0) * n;
    if (xb) q.xb = xb + static_cast<size_t>(m0) * k;
    if (xi) q.xi = xi + static_cast<size_t>(m0) * k;
    if (xq) {
      q.xq = xq + static_cast<size_t>(m0) * k64();
      q.xd = xd + static_cast<size_t>(m0) * blocks();
    }
    if (xs) q.xs = xs + static_cast<size_t>(m0) * groups();
    if (xt) q.xt = xt + static_cast<size_t>(2) * m0 * k;
    return q;
  }
  // Packed words, scales and biases of weight row n.
  const uint32_t* w_row(int n) const { return w + static_cast<size_t>(n) * words(); }
  const float* s_row(int n) const { return s + static_cast<size_t>(n) * groups(); }
  const float* b_row(int n) const { return b + static_cast<size_t>(n) * groups(); }
};

// `buf` resized to hold `n` elements from its first 64-byte aligned one, which it returns
// (the kernels' copies of x: a 64-byte load that straddles two cache lines costs two).
template <typename T>
T* aligned64(std::vector<T>& buf, size_t n) {
  constexpr size_t kLanes = 64 / sizeof(T);
  buf.resize(n + kLanes);
  return buf.data() + (kLanes - reinterpret_cast<uintptr_t>(buf.data()) / sizeof(T) % kLanes) % kLanes;
}

// ---------------------------------------------------------------------------------------
// Panel layout: a 4- or 8-bit matrix repacked for the broadcast form of the product
// (rows_panels, rows_panels_avx2), in panels of kPanelCols = 32 output features. Panel q holds features
// [32q, 32q + 32) as K / 4 quads of columns, 16 * bits bytes each:
//   4 bits: quad i is 16 words, and nibble e (bits [4e, 4e + 4)) of word j is the weight of
//      feature 32q + j + 16 (e % 2) at column 4i + e / 2, so a shift by 4 (2 kk + h) puts the
//      weights of column 4i + kk, features 16h .. 16h + 15, in the low nibbles of the 16
//      lanes (`vpermps` reads only an index's low 4 bits);
//   8 bits: byte 32 kk + l of quad i is the weight of feature 32q + l at column 4i + kk;
//   s, b: K / gs groups of 32 values, the scales and biases of the panel's features, stored
//      as f16 or bf16 where every scale and bias of the matrix converts to it exactly (models
//      stored in f16 or bf16, which load to f32 as MLX's 4-bit SmolLM2 and Qwen2.5 do: the
//      same values; a one-token step reads 17% fewer bytes at 4 bits and group size 32), else as f32
//      (`GroupFormat`; panel_group turns a group back into f32).
// 16 codes of one column then take one shift and one permute (8 bits: one widening load
// and one conversion), and each is multiplied with one broadcast activation (the scales and
// biases apply per group, rows_panels): no horizontal reduction, and the
// weights of consecutive columns are consecutive in memory (one long stream per panel where
// the row kernels read 2 rows of K * bits / 8 bytes). Built once per matrix from MLX's rows
// (build_panels) and kept with the matrix's data (PanelCache).
constexpr int kPanelCols = 32;
// The bit offset t of the 4-bit codes of column kk of a quad in half h of a panel lane.
constexpr int code_shift(int kk, int h) { return 4 * (2 * kk + h); }

// Uninitialized memory for a repacked matrix (anonymous pages, 64-byte aligned), first
// touched by the pool's threads in build_panels. A zero-filled std::vector had one thread
// fault in and clear every page first: repacking Qwen2.5-1.5B's 0.87 GB made a 37-token
// prompt's prefill 1.5-2.3 s slower, a third of it the kernel clearing pages. Huge pages
// (`madvise(MADV_HUGEPAGE)`) were tried: the first touch of 1 GB ran at 0.4-6 GB/s from run
// to run (the kernel compacting memory for them) against ~2.3 GB/s with 4 KB pages.
class PanelMemory {
 public:
  explicit PanelMemory(size_t bytes) : size_(bytes) {
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    base_ = static_cast<uint8_t*>(p);
  }
  ~PanelMemory() { munmap(base_, size_); }
  PanelMemory(const PanelMemory&) = delete;
  PanelMemory& operator=(const PanelMemory&) = delete;
  uint8_t* data() const { return base_; }  // page-aligned

 private:
  uint8_t* base_;
  size_t size_;
};

// How a panel copy stores its scales and biases (see the layout above).
enum class GroupFormat { kF32, kF16, kBf16 };

struct Panels {
  int n, k, gs, bits;
  GroupFormat format;
  const float *from_s, *from_b;  // the MLX scales and biases it was built from
  std::unique_ptr<PanelMemory> memory;  // w, then s, then b
  const uint8_t* w = nullptr;
  const uint8_t* s = nullptr;  // values of `format`
  const uint8_t* b = nullptr;
  size_t quad_bytes() const { return static_cast<size_t>(16) * bits; }
  size_t value_bytes() const { return format == GroupFormat::kF32 ? 4 : 2; }
  const uint8_t* panel_w(int q) const { return w + static_cast<size_t>(q) * (k / 4) * quad_bytes(); }
  // The 32 scales (biases) of panel q's features in group g.
  const uint8_t* group_s(int q, int g) const { return s + (static_cast<size_t>(q) * (k / gs) + g) * kPanelCols * value_bytes(); }
  const uint8_t* group_b(int q, int g) const { return b + (static_cast<size_t>(q) * (k / gs) + g) * kPanelCols * value_bytes(); }
};

// Whether a matrix of `n` features, `k` columns and group size `gs` can be repacked.
bool panel_shape(int bits, int n, int k, int gs) {
  return (bits == 4 || bits == 8) && n > 0 && n % kPanelCols == 0 && gs % 4 == 0 && k % gs == 0 && 256 % gs == 0;
}

// `v` as an IEEE binary16 when that is the same value (zeros, normal and subnormal halves);
// false otherwise (more mantissa bits, out of range, infinities, NaN).
bool f16_exact(float v, uint16_t* h) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const int e = static_cast<int>((u >> 23) & 0xFFu) - 127;
  const uint32_t mantissa = u & 0x7FFFFFu;
  if ((u & 0x7FFFFFFFu) == 0) return *h = sign, true;
  if (e >= -14 && e <= 15) {  // normal half: the low 13 mantissa bits must be zero
    if (mantissa & 0x1FFFu) return false;
    return *h = static_cast<uint16_t>(sign | (e + 15) << 10 | mantissa >> 13), true;
  }
  if (e >= -24 && e < -14) {  // subnormal half: (1.mantissa) 2^e = h 2^-24
    const uint32_t full = 0x800000u | mantissa;
    const int shift = -(e + 1);  // 14 .. 23
    if (full & ((1u << shift) - 1)) return false;
    return *h = static_cast<uint16_t>(sign | full >> shift), true;
  }
  return false;
}

// `v` as a bfloat16 when that is the same value (its low 16 bits are zero; not NaN).
bool bf16_exact(float v, uint16_t* h) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0xFFFFu) != 0 || std::isnan(v)) return false;
  return *h = static_cast<uint16_t>(u >> 16), true;
}

// The smallest format that holds every one of `count` scales and biases exactly.
GroupFormat group_format(const float* s, const float* b, size_t count) {
  auto all = [&](bool (*exact)(float, uint16_t*)) {
    uint16_t h;
    for (size_t i = 0; i < count; ++i) {
      if (!exact(s[i], &h) || !exact(b[i], &h)) return false;
    }
    return true;
  };
  return all(f16_exact) ? GroupFormat::kF16 : all(bf16_exact) ? GroupFormat::kBf16 : GroupFormat::kF32;
}

// MLX's rows (w [N, K * bits / 32] words, s, b [N, K / gs]) -> the panel layout, panels
// split over the pool.
std::unique_ptr<Panels> build_panels(const uint32_t* w, const float* s, const float* b, int n, int k, int gs,
                                     int bits, int threads) {
  auto out = std::make_unique<Panels>();
  out->n = n;
  out->k = k;
  out->gs = gs;
  out->bits = bits;
  out->from_s = s;
  out->from_b = b;
  const size_t groups = static_cast<size_t>(k / gs), words = static_cast<size_t>(k) * bits / 32;
  out->format = group_format(s, b, static_cast<size_t>(n) * groups);
  const size_t w_bytes = static_cast<size_t>(n) * k * bits / 8,
               sb_bytes = static_cast<size_t>(n) * groups * out->value_bytes();
  out->memory = std::make_unique<PanelMemory>(w_bytes + 2 * sb_bytes);
  out->w = out->memory->data();  // w_bytes and sb_bytes are multiples of 64 (n of 32)
  out->s = out->w + w_bytes;
  out->b = out->w + w_bytes + sb_bytes;
  // Value `v` (exact in the chosen format) at index `at` of s or b's copy.
  auto put = [&out](const uint8_t* to, size_t at, float v) {
    uint8_t* dst = const_cast<uint8_t*>(to);
    uint16_t h = 0;
    switch (out->format) {
      case GroupFormat::kF32: return std::memcpy(dst + 4 * at, &v, 4), void();
      case GroupFormat::kF16: f16_exact(v, &h); break;
      case GroupFormat::kBf16: bf16_exact(v, &h); break;
    }
    std::memcpy(dst + 2 * at, &h, 2);
  };
  // Nibble t of x at bits [8t, 8t + 4).
  auto spread = [](uint32_t x) {
    return (x & 0xFu) | (x & 0xF0u) << 4 | (x & 0xF00u) << 8 | (x & 0xF000u) << 12;
  };
  auto panel = [&](int q) {
    uint8_t* quad = const_cast<uint8_t*>(out->panel_w(q));
    const uint32_t* rows = w + static_cast<size_t>(kPanelCols) * q * words;  // the panel's 32 rows
    for (int i = 0; i < k / 4; ++i, quad += out->quad_bytes()) {
      if (bits == 8) {  // columns 4i .. 4i + 3 of a row: word i
        for (int l = 0; l < kPanelCols; ++l) {
          const uint32_t four = rows[l * words + i];
          for (int kk = 0; kk < 4; ++kk) quad[kPanelCols * kk + l] = static_cast<uint8_t>(four >> (8 * kk));
        }
        continue;
      }
      // 4 bits: columns 4i .. 4i + 3 of a row are 16 bits of its word i / 2; features j and
      // j + 16 interleave nibble by nibble.
      for (int j = 0; j < 16; ++j) {
        const uint32_t a = (rows[j * words + i / 2] >> (16 * (i % 2))) & 0xFFFFu;
        const uint32_t c = (rows[(j + 16) * words + i / 2] >> (16 * (i % 2))) & 0xFFFFu;
        const uint32_t word = spread(a) | spread(c) << 4;
        std::memcpy(quad + 4 * j, &word, 4);
      }
    }
    for (size_t g = 0; g < groups; ++g) {
      for (int l = 0; l < kPanelCols; ++l) {
        const size_t f = static_cast<size_t>(kPanelCols) * q + l, at = (q * groups + g) * kPanelCols + l;
        put(out->s, at, s[f * groups + g]);
        put(out->b, at, b[f * groups + g]);
      }
    }
  };
  Pool::get().run(n / kPanelCols, panel, Pool::Linger::kShort, threads);
  return out;
}

// The panels of every matrix that products have repacked, keyed by the weights' address and
// shape and valid while the MLX data that holds them lives (Matrix::owner): a new matrix
// allocated where a freed one was is repacked anew. Expired entries are dropped when a
// matrix is added. Weights stay in MLX's rows too (the other kernels, precisions and
// instruction sets read those).
class PanelCache {
 public:
  static PanelCache& get() {
    static PanelCache* cache = new PanelCache();  // never destroyed, as the pool
    return *cache;
  }

  // The panels of `m` (K columns, group size gs), repacked on first use (again when its
  // scales or biases are other buffers); null when `m` has no owner (a copy of a view) or its
  // owner is gone.
  const Panels* find(const kernels::Matrix& m, int k, int gs, int bits, int threads) {
    if (m.owner.expired()) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(m.w);
    if (it != map_.end() && !it->second.owner.expired() && !it->second.owner.owner_before(m.owner) &&
        !m.owner.owner_before(it->second.owner) && it->second.panels->n == m.n && it->second.panels->k == k &&
        it->second.panels->gs == gs && it->second.panels->bits == bits && it->second.panels->from_s == m.s &&
        it->second.panels->from_b == m.b) {
      return it->second.panels.get();
    }
    for (auto e = map_.begin(); e != map_.end();) e = e->second.owner.expired() ? map_.erase(e) : std::next(e);
    Entry entry{m.owner, build_panels(m.w, m.s, m.b, m.n, k, gs, bits, threads)};
    const Panels* panels = entry.panels.get();
    map_[m.w] = std::move(entry);
    return panels;
  }

 private:
  struct Entry {
    std::weak_ptr<const void> owner;
    std::unique_ptr<Panels> panels;
  };
  std::mutex mu_;
  std::unordered_map<const void*, Entry> map_;
};

// Software prefetch distance of the register kernels' weight streams. A decode step reads
// every weight from memory (a model's weights do not fit in the caches), and the hardware
// prefetcher alone left a one-token product of Qwen2.5-1.5B's 117 MB LM head at 16 GB/s;
// asking for the line 4 KB ahead of the one being decoded brings it to 35-38 GB/s (2.2x,
// `qmm_profile 1 151936x1536x4g64`; Qwen2.5-1.5B 4-bit decodes 1.6x faster, SmolLM2 1.2x).
// Windows prefetch too: on the AMD Zen 4 machine it slowed SmolLM2's 11-row windows by
// 10-20%, but on the Intel Xeon of 2026-12-05 a window without it waited on memory
// (`window_profile`, alternating runs, f32: SmolLM2 t(2) 16.6 -> 12.0 ms at t(1) 10.7,
// t(11) 39.4 -> 34.6; Qwen2.5-1.5B t(2) 137 -> 77 ms at t(1) 57, t(11) 282 -> 267; bf16 and
// int8 alike); the tiled paths (AVX2 windows, dense weights) do not, nor do prompt chunks
// (products of more than kPrefetchMaxRows rows: no gain at 32 rows, `qmm_profile 32`).
constexpr int kPrefetchBytes = 4096;
#ifdef MLXSYS_X86
__attribute__((always_inline)) inline void prefetch_ahead(const uint32_t* at) {
  _mm_prefetch(reinterpret_cast<const char*>(at) + kPrefetchBytes, _MM_HINT_T0);
}
#endif

// Portable: dequantize the row into `row`, then one dot product per activation row.
void rows_portable(const Problem& p, int n0, int n1, std::vector<float>& row) {
  const int groups = p.k / p.gs, per_word = 32 / p.bits;
  const uint32_t mask = p.bits == kDense ? ~0u : (1u << p.bits) - 1;
  row.resize(p.k);
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = p.w_row(n);
    for (int g = 0; g < groups && p.bits != kDense; ++g) {
      float sc = p.s_row(n)[g], bi = p.b_row(n)[g];
      for (int i = g * p.gs; i < (g + 1) * p.gs; ++i) {
        uint32_t q = (wr[i / per_word] >> ((i % per_word) * p.bits)) & mask;
        row[i] = sc * static_cast<float>(q) + bi;
      }
    }
    if (p.bits == kDense) std::memcpy(row.data(), wr, p.k * sizeof(float));
    for (int m = 0; m < p.m; ++m) {
      const float* xr = p.x + static_cast<size_t>(m) * p.k;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int i = 0; i < p.k; i += 8) {
        for (int j = 0; j < 8; ++j) acc[j] += row[i + j] * xr[i + j];
      }
      p.out[static_cast<size_t>(m) * p.n + n] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    }
  }
}

#ifdef MLXSYS_X86
using simd::hsum8;

// The 8 weights q[8c .. 8c+8) of a packed row, as floats.
template <int BITS>
AVX2_FN_ALWAYS __m256 decode8(const uint32_t* wr, int c) {
  if constexpr (BITS == kDense) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(wr) + 8 * c);
  } else if constexpr (BITS == 4) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(wr[c])), shifts);
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xF)));
  } else {
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wr + 2 * c));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  }
}

// `scale * q + bias` of a chunk's group, or the stored floats of dense weights; `sc`/`bi`
// are the group's scale and bias broadcast (`group8`), unused for dense weights.
template <int BITS>
AVX2_FN_ALWAYS __m256 affine8(__m256 q, __m256 sc, __m256 bi) {
  if constexpr (BITS == kDense) return q;
  else return _mm256_fmadd_ps(q, sc, bi);
}
template <int BITS>
AVX2_FN_ALWAYS void group8(const Problem& p, int n, int g, __m256& sc, __m256& bi) {
  if constexpr (BITS != kDense) {
    sc = _mm256_set1_ps(p.s_row(n)[g]);
    bi = _mm256_set1_ps(p.b_row(n)[g]);
  } else {
    sc = bi = _mm256_setzero_ps();
  }
}

// Every output element is computed by the same sequence of float operations whatever the
// number of activation rows T, so a verify window's logits equal one-token steps' logits bit
// for bit (greedy speculative output cannot drift from plain decode through rounding):
//   w_c   = fma(decode(q_c), scale_g, bias_g)           8 weights of chunk c (group g)
//   acc_u = fma(w_c, x_c, acc_u)  for c = u, u+4, ...    4 accumulators, in chunk order
//   y     = hsum8((acc_0 + acc_1) + (acc_2 + acc_3))
// T = 1 decodes straight from registers; T >= 2 dequantizes each weight row once into an L1
// buffer (same w_c values) and applies it to 3 activation rows at a time.
constexpr int kAcc = 4;

AVX2_FN_ALWAYS float finish(const __m256* acc) {
  return hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

template <int BITS>
AVX2_FN void rows_avx2_one(const Problem& p, int n0, int n1) {
  const int groups = p.k / p.gs, chunks_per_group = p.gs / 8;
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = p.w_row(n);
    __m256 acc[kAcc];
    _Pragma("GCC unroll 4") for (int u = 0; u < kAcc; ++u) acc[u] = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
      __m256 sc, bi;
      group8<BITS>(p, n, g, sc, bi);
      const int c0 = g * chunks_per_group;  // a multiple of 4: chunk c feeds acc[c % 4]
      prefetch_ahead(wr + c0 * BITS / 4);   // 8 weights a chunk: BITS / 4 words
      for (int c = c0; c < c0 + chunks_per_group; c += kAcc) {
        _Pragma("GCC unroll 4") for (int u = 0; u < kAcc; ++u) {
          __m256 wv = affine8<BITS>(decode8<BITS>(wr, c + u), sc, bi);
          acc[u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(p.x + 8 * (c + u)), acc[u]);
        }
      }
    }
    p.out[n] = finish(acc);
  }
}

// Verify windows (M <= kTiledMaxRows) over long rows: the x rows of a K-block stay in L1
// while a tile of kTileRows weight rows is applied to them, with the partial sums of each
// (weight row, x row) kept in `acc` (32 floats: the 4 accumulators) between blocks. Each
// accumulator sees the same FMAs in the same order as above, so the results are the same
// bits; only the memory traffic changes (x is read from L2 once per tile, not once per row).
constexpr int kTiledMaxRows = 32;
constexpr int kTileRows = 16;
constexpr int kBlockK = 512;  // a multiple of every group size and of 32

// The tiled driver for an instruction set `T` (Avx2Tiles, Avx512DenseTiles): output rows
// [n0, n1) of a product with p.m <= kTiledMaxRows activation rows.
template <class T>
void rows_tiled(const Problem& p, int n0, int n1) {
  thread_local std::vector<float> row, acc;
  row.resize(kBlockK);
  acc.resize(static_cast<size_t>(32) * kTileRows * p.m);
  const size_t xs = static_cast<size_t>(p.k), per_row = static_cast<size_t>(32) * p.m;
  for (int t0 = n0; t0 < n1; t0 += kTileRows) {
    const int t1 = std::min(n1, t0 + kTileRows);
    std::fill(acc.begin(), acc.begin() + per_row * (t1 - t0), 0.f);
    for (int k0 = 0; k0 < p.k; k0 += kBlockK) {
      const int len = std::min(p.k, k0 + kBlockK) - k0;
      for (int n = t0; n < t1; ++n) {
        T::dequant(p, n, k0, len, row.data());
        T::dot(row.data(), p.x + k0, xs, len, p.m, acc.data() + per_row * (n - t0));
      }
    }
    for (int n = t0; n < t1; ++n) {
      for (int m = 0; m < p.m; ++m) p.out[m * static_cast<size_t>(p.n) + n] = T::finish(&acc[per_row * (n - t0) + 32 * m]);
    }
  }
}

template <int R>
AVX2_FN_ALWAYS void dot_rows_acc(const float* row, const float* x, size_t xs, int len, float* acc) {
  __m256 a[R][kAcc];
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int u = 0; u < kAcc; ++u) a[r][u] = _mm256_loadu_ps(acc + 32 * r + 8 * u);
  for (int i = 0; i < len; i += 8 * kAcc) {
    _Pragma("GCC unroll 4") for (int u = 0; u < kAcc; ++u) {
      __m256 wv = _mm256_loadu_ps(row + i + 8 * u);
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
        a[r][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * xs + i + 8 * u), a[r][u]);
      }
    }
  }
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 4") for (int u = 0; u < kAcc; ++u) _mm256_storeu_ps(acc + 32 * r + 8 * u, a[r][u]);
}

// What the shared tiled driver (`rows_tiled`, below) needs from an instruction set.
template <int BITS>
struct Avx2Tiles {
  // row[0, len) = the dequantized weights [k0, k0 + len) of row n (k0 and len whole groups:
  // kBlockK is a multiple of every group size). Group by group, so that no chunk divides to
  // find its group (two integer divisions per 8 weights made a 2-row window 3-6x slower than
  // one row, `qmm_profile 1,2`).
  static AVX2_FN void dequant(const Problem& p, int n, int k0, int len, float* row) {
    const int chunks_per_group = p.gs / 8;
    const uint32_t* wr = p.w_row(n);
    const float *s = BITS == kDense ? nullptr : p.s_row(n), *b = BITS == kDense ? nullptr : p.b_row(n);
    __m256 sc = _mm256_setzero_ps(), bi = sc;
    for (int g = k0 / p.gs, c = k0 / 8; c < (k0 + len) / 8; ++g) {
      if constexpr (BITS != kDense) sc = _mm256_set1_ps(s[g]), bi = _mm256_set1_ps(b[g]);
      for (const int end = c + chunks_per_group; c < end; ++c) {
        _mm256_storeu_ps(row + 8 * c - k0, affine8<BITS>(decode8<BITS>(wr, c), sc, bi));
      }
    }
  }
  // Adds row . x_r over [0, len) to the partial sums acc[32 r, 32 r + 32) of x rows r < m.
  static AVX2_FN void dot(const float* row, const float* x, size_t xs, int len, int m, float* acc) {
    int r = 0;
    for (; r + 3 <= m; r += 3) dot_rows_acc<3>(row, x + r * xs, xs, len, acc + 32 * r);
    if (m - r == 2) dot_rows_acc<2>(row, x + r * xs, xs, len, acc + 32 * r);
    if (m - r == 1) dot_rows_acc<1>(row, x + r * xs, xs, len, acc + 32 * r);
  }
  // The output from one (weight row, x row)'s partial sums, as rows_avx2_one finishes.
  static AVX2_FN float finish(const float* a) {
    __m256 v[kAcc] = {_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8), _mm256_loadu_ps(a + 16), _mm256_loadu_ps(a + 24)};
    return mlxsys::finish(v);
  }
};

// Output rows [n0, n1) for M <= kTiledMaxRows activation rows (run_rows splits longer inputs).
template <int BITS>
void rows_avx2(const Problem& p, int n0, int n1) {
  if (p.m == 1) return rows_avx2_one<BITS>(p, n0, n1);
  rows_tiled<Avx2Tiles<BITS>>(p, n0, n1);
}

bool cpu_has_avx2() { return simd::has_avx2_fma(); }

// ---------------------------------------------------------------------------------------
// AVX-512F: chunks of 16 weights and two accumulators, same structure as above:
//   w_c   = fma(decode16(q_c), scale_g, bias_g)   (4 bits: the same value by table, table16)
//   acc_u = fma(w_c, x'_c, acc_u)   u = c % 2, in chunk order
//   y     = reduce_add(acc_0 + acc_1)
// For 4 bits, chunks come in pairs from the 16 bytes (32 weights) of 4 packed words: chunk
// 2j holds the low nibbles of those bytes (weights 0, 2, .., 30 of the block), chunk 2j + 1
// the high nibbles (weights 1, 3, .., 31); `x'` is x with each 32-block reordered the same
// way (`permute_x4`), so the products pair the right elements. 8 bits: lane j = byte j.
// One-token steps decode two weight rows at a time (each row's FMAs unchanged), sharing the
// loads of x.
#define AVX512_FN __attribute__((target("avx512f,avx2,fma"))) inline
#define AVX512_FN_ALWAYS __attribute__((target("avx512f,avx2,fma"), always_inline)) inline

template <int BITS>
AVX512_FN_ALWAYS __m512 decode16(const uint32_t* wr, int c) {
  if constexpr (BITS == kDense) return _mm512_loadu_ps(reinterpret_cast<const float*>(wr) + 16 * c);
  __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 4 * (BITS == 4 ? c / 2 : c))));
  if constexpr (BITS == 4) v = (c % 2 == 0) ? _mm512_and_si512(v, _mm512_set1_epi32(0xF)) : _mm512_srli_epi32(v, 4);
  return _mm512_cvtepi32_ps(v);
}

// The element of a 32-block of x that lane j of the block holds in the weights' lane order:
// for 4 bits the even elements, then the odd ones (the chunk pairs above); else j itself.
constexpr int lane_source(int j, bool permute4) { return !permute4 ? j : j < 16 ? 2 * j : 2 * (j - 16) + 1; }
// The lane of a 32-block that holds element e (lane_source's inverse).
constexpr int lane_of(int e, bool permute4) { return !permute4 ? e : e % 2 == 0 ? e / 2 : 16 + e / 2; }

// x [M, K] -> x' [M, K]: each 32-block in the 4-bit lane order (lane_source).
void permute_x4(const float* x, int m, int k, float* out) {
  for (size_t i = 0; i < static_cast<size_t>(m) * k; i += 32) {
    for (int j = 0; j < 32; ++j) out[i + j] = x[i + lane_source(j, true)];
  }
}

// Weight chunks c and c + 1 (c even) of one row, each as its own 16 floats (8 bits, dense;
// 4 bits go by table, lookup_pair4).
template <int BITS>
AVX512_FN_ALWAYS void decode_pair(const uint32_t* wr, int c, __m512& w0, __m512& w1) {
  w0 = decode16<BITS>(wr, c);
  w1 = decode16<BITS>(wr, c + 1);
}

// 4 bits by table: the 16 values a group's weights can take, fma(q, scale, bias) for q =
// 0..15 (the same fma affine16 computes, so the same bits), looked up by each lane's nibble
// (`vpermps` reads only an index's low 4 bits, so no mask is needed). Two permutes replace two
// conversions and two FMAs per 32 weights.
AVX512_FN_ALWAYS __m512 table16(__m512 sc, __m512 bi) {
  return _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), sc, bi);
}
// Dequantized 4-bit chunks c and c + 1 (c even) of one row from its group's table.
AVX512_FN_ALWAYS void lookup_pair4(const uint32_t* wr, int c, __m512 table, __m512& w0, __m512& w1) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + 4 * (c / 2))));
  w0 = _mm512_permutexvar_ps(v, table);
  w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
}

// As affine8/group8, 16 lanes.
template <int BITS>
AVX512_FN_ALWAYS __m512 affine16(__m512 q, __m512 sc, __m512 bi) {
  if constexpr (BITS == kDense) return q;
  else return _mm512_fmadd_ps(q, sc, bi);
}
template <int BITS>
AVX512_FN_ALWAYS void group16(const Problem& p, int n, int g, __m512& sc, __m512& bi) {
  if constexpr (BITS != kDense) {
    sc = _mm512_set1_ps(p.s_row(n)[g]);
    bi = _mm512_set1_ps(p.b_row(n)[g]);
  } else {
    sc = bi = _mm512_setzero_ps();
  }
}

// Weight rows n .. n + R of M activation rows, straight from registers: each weight chunk is
// decoded once and applied to all M rows, and each (weight row, activation row) sees the FMAs
// of the one-row case in the same order, so windows give one-token steps' bits without the
// tiled path's dequantized copy. Windows of more than kRegisterRows rows (f32:
// kF32RegisterRows) go in balanced groups (bf16, int8: 11 -> 6 + 5; f32: 11 in one, 16 -> 8 + 8).
// The f32 kernels read x from Problem::xi, one pointer for a group's rows: 12 rows then fit
// the registers (24 accumulators) where 8 row pointers had exhausted the general registers,
// and 11-row windows decode each weight once instead of twice (`window_profile`, SmolLM2,
// alternating runs on the Xeon of 2026-12-05: t(11) 32.5-35.0 ms with 6 + 5 groups reading x
// by row, 28.7-29.1 reading xi, 23.1-26.3 in one group of 11). Every
// weight row reads all rows of its group, so a group's x must stay in L1/L2
// (kRegisterMaxXBytes): longer rows (a 1.5B model's MLP, K = 8960) go in blocks of groups
// [g0, g1), the accumulators kept in `carry` (R * M * 32 floats) between blocks, stored and
// reloaded exactly, so the FMAs and their order are those of a whole row.
constexpr int kRegisterRows = 8;
constexpr int kF32RegisterRows = 12;  // 24 accumulators, 2 weight vectors, the 4-bit table
constexpr size_t kRegisterMaxXBytes = 64 * 1024;

// m rows in the fewest parts of at most `most` rows, of balanced sizes (11 -> 11 for 12, 16
// -> 8 + 8, 70 -> 24 + 23 + 23 for 32): {parts, rows per part but the last}.
inline std::pair<int, int> balanced(int m, int most) {
  const int parts = (m + most - 1) / most;
  return {parts, (m + parts - 1) / parts};
}

// Calls f(m0, count) for each register group of the f32 AVX-512 windows of an M-row product,
// in order: prompt rows in blocks of at most kTiledMaxRows (run_rows), each block in groups
// of at most kF32RegisterRows (window_blocks).
template <class F>
void register_groups(int m, F f) {
  const auto [blocks, per] = balanced(m, kTiledMaxRows);
  for (int b0 = 0; b0 < m; b0 += per) {
    const int rows = std::min(per, m - b0);
    const auto [passes, group] = balanced(rows, kF32RegisterRows);
    for (int g0 = 0; g0 < rows; g0 += group) f(b0 + g0, std::min(group, rows - g0));
  }
}

// x [M, K] (K a multiple of 32) -> Problem::xi's order: the rows of each register group
// (register_groups) [m0, m0 + G) at out + m0 * K, block j of row m0 + r at + 32 * (j * G + r),
// each block in the weights' lane order (lane_source). For M = 1 this is permute_x4's (or
// x's) own layout.
void interleave_x(const float* x, int m, int k, bool permute4, float* out) {
  register_groups(m, [&](int m0, int count) {
    for (int r = 0; r < count; ++r) {
      for (int j = 0; j < k / 32; ++j) {
        const float* from = x + static_cast<size_t>(m0 + r) * k + 32 * j;
        float* to = out + static_cast<size_t>(m0) * k + static_cast<size_t>(32) * (static_cast<size_t>(j) * count + r);
        for (int l = 0; l < 32; ++l) to[l] = from[lane_source(l, permute4)];
      }
    }
  });
}

// The parameters of scale group g of weight rows n .. n + R: scale and bias, or for 4 bits
// the group's table in `sc` (table16).
template <int BITS, int R>
AVX512_FN_ALWAYS void group_params(const Problem& p, int n, int g, __m512* sc, __m512* bi) {
  _Pragma("GCC unroll 2") for (int r = 0; r < R; ++r) {
    group16<BITS>(p, n + r, g, sc[r], bi[r]);
    if constexpr (BITS == 4) sc[r] = table16(sc[r], bi[r]);
  }
}

// Dequantized chunks c and c + 1 (c even) of a packed row, from its group's parameters.
template <int BITS>
AVX512_FN_ALWAYS void dequant_pair(const uint32_t* wr, int c, __m512 sc, __m512 bi, __m512& w0, __m512& w1) {
  if constexpr (BITS == 4) {
    lookup_pair4(wr, c, sc, w0, w1);
  } else {
    decode_pair<BITS>(wr, c, w0, w1);
    w0 = affine16<BITS>(w0, sc, bi);
    w1 = affine16<BITS>(w1, sc, bi);
  }
}

// Where a register kernel keeps its accumulators between blocks of scale groups: two vectors
// (32 floats) per (weight row, activation row), those of weight row n of a tile at
// `base + 32 * M * (n - t0)`. Only blocked windows (window_blocks) read or write it.
struct Carry {
  float* base;
  int t0;
};

// A register kernel's accumulators for weight rows n .. n + R: zero at the first group, else
// reloaded from the carry; at the end either finished into the output by `finish` (a fixed
// reduction) or stored back.
template <int R, int M>
AVX512_FN_ALWAYS void carry_in(__m512 (&acc)[R][M][2], int n, int g0, Carry carry) {
  _Pragma("GCC unroll 2") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 16") for (int m = 0; m < M; ++m) {
      if (g0 == 0) {
        acc[r][m][0] = acc[r][m][1] = _mm512_setzero_ps();
      } else {
        const float* c = carry.base + 32 * (M * (n + r - carry.t0) + m);
        acc[r][m][0] = _mm512_loadu_ps(c);
        acc[r][m][1] = _mm512_loadu_ps(c + 16);
      }
    }
}
template <int R, int M, class Finish>
AVX512_FN_ALWAYS void carry_out(const __m512 (&acc)[R][M][2], const Problem& p, int n, bool last, Carry carry,
                                Finish finish) {
  _Pragma("GCC unroll 2") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 16") for (int m = 0; m < M; ++m) {
      if (last) {
        p.out[m * static_cast<size_t>(p.n) + n + r] = finish(_mm512_add_ps(acc[r][m][0], acc[r][m][1]));
      } else {
        float* c = carry.base + 32 * (M * (n + r - carry.t0) + m);
        _mm512_storeu_ps(c, acc[r][m][0]);
        _mm512_storeu_ps(c + 16, acc[r][m][1]);
      }
    }
}

// f(std::integral_constant<int, M>{}) for M = m, 1..Max (more counts as Max): a register
// group's or tile's row count as a template argument.
template <int Max, class F>
inline void with_count(int m, F f) {
  if constexpr (Max == 1) {
    return f(std::integral_constant<int, 1>{});
  } else {
    if (m >= Max) return f(std::integral_constant<int, Max>{});
    return with_count<Max - 1>(m, f);
  }
}
template <class F>
inline void with_rows(int m, F f) {
  with_count<kRegisterRows>(m, f);
}

// The f32 path's reduction of a row's two accumulators.
struct ReduceAdd {
  AVX512_FN_ALWAYS float operator()(__m512 v) const { return _mm512_reduce_add_ps(v); }
};

template <int BITS, int R, int M>
AVX512_FN_ALWAYS void rows_avx512_regs(const Problem& p, int n, int g0, int g1, Carry carry) {
  const int words = p.k * BITS / 32, groups = p.k / p.gs, pairs_per_group = p.gs / 32;
  // Walked by pointers: a chunk pair (32 weights) is BITS packed words; x's pair of this
  // register group's rows is one pointer for all M rows (Problem::xi).
  constexpr size_t pair_stride = static_cast<size_t>(32) * M;
  const uint32_t* wp = p.w_row(n) + static_cast<size_t>(g0) * pairs_per_group * BITS;
  const float* xp = p.xi + pair_stride * (static_cast<size_t>(g0) * pairs_per_group);
  const bool prefetch = p.prefetch();
  __m512 acc[R][M][2];
  carry_in<R, M>(acc, n, g0, carry);
  for (int g = g0; g < g1; ++g) {
    __m512 sc[R], bi[R];
    group_params<BITS, R>(p, n, g, sc, bi);
    for (int i = 0; i < pairs_per_group; ++i, wp += BITS, xp += pair_stride) {
      _Pragma("GCC unroll 2") for (int r = 0; r < R; ++r) {
        if (prefetch) prefetch_ahead(wp + r * words);
        __m512 w0, w1;
        dequant_pair<BITS>(wp + r * words, 0, sc[r], bi[r], w0, w1);  // chunk 0 feeds acc[.][.][0]
        _Pragma("GCC unroll 16") for (int m = 0; m < M; ++m) {
          acc[r][m][0] = _mm512_fmadd_ps(w0, _mm512_load_ps(xp + 32 * m), acc[r][m][0]);
          acc[r][m][1] = _mm512_fmadd_ps(w1, _mm512_load_ps(xp + 32 * m + 16), acc[r][m][1]);
        }
      }
    }
  }
  carry_out<R, M>(acc, p, n, g1 == groups, carry, ReduceAdd{});
}

// Output rows [n0, n1) for M activation rows over the groups [g0, g1): two weight rows at a
// time for one activation row (sharing the loads of x), one at a time for more.
template <int BITS, int M>
AVX512_FN void rows_avx512_small(const Problem& p, int n0, int n1, int g0, int g1, Carry carry) {
  int n = n0;
  if constexpr (M == 1) {
    for (; n + 2 <= n1; n += 2) rows_avx512_regs<BITS, 2, 1>(p, n, g0, g1, carry);
  }
  for (; n < n1; ++n) rows_avx512_regs<BITS, 1, M>(p, n, g0, g1, carry);
}

// Activation bytes of a register group per block when its whole rows do not fit
// kRegisterMaxXBytes: 24 KB (in L1) measured best against 64 and 12 (`qmm_profile`, Qwen's
// K = 8960: 32 rows 2x faster than the tiled path in f32, 1.4x in bf16; 11 rows 1.3x).
constexpr size_t kBlockXBytes = 24 * 1024;

// The activation rows of a window in balanced register groups of at most MaxGroup (8: 11 ->
// 6 + 5, 16 -> 8 + 8). When a group's whole rows fit kRegisterMaxXBytes (always for one
// row: a decode step's products keep their whole rows), each group is a pass
// over tiles of `tile_rows` weight rows; otherwise the scale groups of a row go in blocks
// whose activations stay in L1 (kBlockXBytes), over tiles of kTileRows weight rows applied
// block by block to every register group, so a tile's packed weights are read from memory
// once. `rows(q, t0, t1, g0, g1, carry)` computes rows [t0, t1) of the problem q (one register
// group) over the groups [g0, g1); `x_bytes` is an activation's size (4 for f32, 2 for bf16),
// `group_step` a block's multiple of groups.
template <int MaxGroup = kRegisterRows, class Rows>
void window_blocks(const Problem& p, int n0, int n1, size_t x_bytes, int group_step, int tile_rows, Rows rows) {
  const auto [passes, group] = balanced(p.m, MaxGroup);
  const int groups = p.k / p.gs;
  const bool whole = p.m == 1 || static_cast<size_t>(group) * p.k * x_bytes <= kRegisterMaxXBytes;
  const size_t fit = kBlockXBytes / (static_cast<size_t>(group) * p.gs * x_bytes);
  const int block = whole ? groups : std::max(group_step, static_cast<int>(fit) / group_step * group_step);
  const int tile = whole ? tile_rows : kTileRows;
  thread_local std::vector<float> carry;
  carry.resize(static_cast<size_t>(passes) * kTileRows * MaxGroup * 32);
  for (int t0 = n0; t0 < n1; t0 += tile) {
    const int t1 = std::min(n1, t0 + tile);
    for (int g0 = 0; g0 < groups; g0 += block) {
      const int g1 = std::min(groups, g0 + block);
      for (int pass = 0; pass < passes; ++pass) {
        const int m0 = pass * group;
        float* pass_carry = carry.data() + static_cast<size_t>(pass) * kTileRows * MaxGroup * 32;
        rows(p.rows(m0, std::min(group, p.m - m0)), t0, t1, g0, g1, Carry{pass_carry, t0});
      }
    }
  }
}

// rows_avx512_small for a register group of 1..kF32RegisterRows rows.
template <int BITS>
AVX512_FN void rows_avx512_group(const Problem& q, int t0, int t1, int g0, int g1, Carry carry) {
  with_count<kF32RegisterRows>(q.m, [&](auto m) { rows_avx512_small<BITS, decltype(m)::value>(q, t0, t1, g0, g1, carry); });
}

// The tiled small-M path of the AVX2 kernels (see there) with 16-lane chunks and the two
// accumulators of this instruction set (32 floats per weight row and x row, as there).
template <int R>
AVX512_FN_ALWAYS void dot_rows512_acc(const float* row, const float* x, size_t xs, int len, float* acc) {
  __m512 a[R][2];
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
    a[r][0] = _mm512_loadu_ps(acc + 32 * r);
    a[r][1] = _mm512_loadu_ps(acc + 32 * r + 16);
  }
  for (int i = 0; i < len; i += 32) {
    const __m512 w0 = _mm512_loadu_ps(row + i), w1 = _mm512_loadu_ps(row + i + 16);
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
      a[r][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * xs + i), a[r][0]);
      a[r][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * xs + i + 16), a[r][1]);
    }
  }
  _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + 32 * r, a[r][0]);
    _mm512_storeu_ps(acc + 32 * r + 16, a[r][1]);
  }
}

// The tiled path of dense weights (quantized weights take window_blocks): the row is a copy.
struct Avx512DenseTiles {
  static AVX512_FN void dequant(const Problem& p, int n, int k0, int len, float* row) {
    std::memcpy(row, reinterpret_cast<const float*>(p.w_row(n)) + k0, static_cast<size_t>(len) * sizeof(float));
  }
  static AVX512_FN void dot(const float* row, const float* x, size_t xs, int len, int m, float* acc) {
    int r = 0;
    for (; r + 6 <= m; r += 6) dot_rows512_acc<6>(row, x + r * xs, xs, len, acc + 32 * r);
    switch (m - r) {
      case 5: dot_rows512_acc<5>(row, x + r * xs, xs, len, acc + 32 * r); break;
      case 4: dot_rows512_acc<4>(row, x + r * xs, xs, len, acc + 32 * r); break;
      case 3: dot_rows512_acc<3>(row, x + r * xs, xs, len, acc + 32 * r); break;
      case 2: dot_rows512_acc<2>(row, x + r * xs, xs, len, acc + 32 * r); break;
      case 1: dot_rows512_acc<1>(row, x + r * xs, xs, len, acc + 32 * r); break;
      default: break;
    }
  }
  static AVX512_FN float finish(const float* a) {
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16)));
  }
};

// Output rows [n0, n1) for M <= kTiledMaxRows activation rows (run_rows splits longer inputs).
template <int BITS>
void rows_avx512(const Problem& p, int n0, int n1) {
  // Activation rows in as few register groups as fit, of balanced sizes (11 -> 11, 16 -> 8 + 8);
  // interleave_x packed Problem::xi by this split (register_groups): change both together.
  const auto [passes, group] = balanced(p.m, kF32RegisterRows);
  // Register groups over blocks of scale groups (window_blocks); a row's FMAs do not depend on
  // its register group or block. Dense weights are 4-8x the bytes of quantized ones: one pass
  // over them (the tiled path) beats one pass per register group.
  const bool one_group_fits = passes == 1 && static_cast<size_t>(group) * p.k * sizeof(float) <= kRegisterMaxXBytes;
  if (BITS != kDense || p.m == 1 || one_group_fits) {
    return window_blocks<kF32RegisterRows>(p, n0, n1, sizeof(float), 1, n1 - n0, rows_avx512_group<BITS>);
  }
  rows_tiled<Avx512DenseTiles>(p, n0, n1);
}

// ---------------------------------------------------------------------------------------
// Prompt chunks (f32 precision, AVX-512F, more than kWindowMaxRows activation rows): a GEMM.
// The register kernels above decode every weight once per register group of at most 8 rows
// and load one activation vector per FMA, so they stay at about a third of the cores' FMA
// rate whatever the number of rows (`qmm_profile 512`: ~85 G multiply-adds a second on two
// cores, where their AVX-512 FMA units reach ~225). This reaches 125-170 (K = 8960-1536);
// one core alone 74-83, ~75% of its peak. Here a weight is dequantized once
// per call into a panel of kGemmCols output features over kGemmDepth columns of K (transposed:
// 32 features of one k side by side), and a micro-kernel keeps a tile of kGemmRows activation
// rows x 32 features in 24 registers: per k two panel loads and 12 broadcasts feed 24 FMAs
// (the BLIS structure, with the activation rows as the broadcast side and the output in its
// natural [M, N] layout). Per output element: a sequential FMA chain over each kGemmDepth
// block of k, the blocks' sums added in order. That is another summation order than the
// register kernels', so a prompt chunk's row differs from the same row in a window in the last
// bits; rows of chunks equal each other for any M > kWindowMaxRows (the chain depends only
// on K). Callers that need a row to have one-token bits keep their products at most
// kWindowMaxRows rows (models' batched forward: `mlx_core::cpu_quant::WINDOW_MAX_ROWS`).
constexpr int kGemmRows = 12;
constexpr int kGemmCols = 32;
constexpr int kGemmDepth = 256;  // a multiple of every group size and of 32

// out[i, 0..32) (+)= x_i . panel over `depth` columns for the first `MR` rows of a packed tile
// of x (gemm_pack_x); `first` stores, else adds to what a previous block left; the
// masks keep the features of a panel that holds fewer than 32.
template <int MR>
AVX512_FN void gemm_tile(const float* x, const float* panel, int depth, float* out, size_t os,
                         bool first, __mmask16 mask0, __mmask16 mask1) {
  __m512 acc[MR][2];
  _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  _Pragma("GCC unroll 4") for (int k = 0; k < depth; ++k) {
    const __m512 w0 = _mm512_load_ps(panel + kGemmCols * k), w1 = _mm512_load_ps(panel + kGemmCols * k + 16);
    _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[kGemmRows * k + i]);
      acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  _Pragma("GCC unroll 16") for (int i = 0; i < MR; ++i) {
    float* o = out + i * os;
    if (!first) {
      acc[i][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(mask0, o), acc[i][0]);
      acc[i][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(mask1, o + 16), acc[i][1]);
    }
    _mm512_mask_storeu_ps(o, mask0, acc[i][0]);
    _mm512_mask_storeu_ps(o + 16, mask1, acc[i][1]);
  }
}

// r[j] (16 rows of 16) -> r[c] = column c: unpack pairs of rows, then pairs of pairs, then
// 128-bit blocks (r[4i + e] holds in block b rows 4i..4i+3 of column 4b + e before the last step).
AVX512_FN_ALWAYS void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  _Pragma("GCC unroll 4") for (int e = 0; e < 4; ++e) {
    const __m512 a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88), b = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    const __m512 c = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88), d = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    t[e] = _mm512_shuffle_f32x4(a, c, 0x88);
    t[8 + e] = _mm512_shuffle_f32x4(a, c, 0xDD);
    t[4 + e] = _mm512_shuffle_f32x4(b, d, 0x88);
    t[12 + e] = _mm512_shuffle_f32x4(b, d, 0xDD);
  }
  _Pragma("GCC unroll 16") for (int c = 0; c < 16; ++c) r[c] = t[c];
}

// panel[k, j] = weight (nb + j, k0 + k) for j < cols (in x's lane order: 4 bits' chunk pairs
// as `permute_x4` orders x; dense rows copied through the same code), 0 for the features past
// `cols`: 16 rows at a time dequantized
// into `rows` (scratch of 16 * depth floats), then transposed 16 x 16.
template <int BITS>
AVX512_FN void gemm_pack(const Problem& p, int nb, int cols, int k0, int depth, float* panel, float* rows) {
  const int chunks_per_group = p.gs / 16;
  for (int h = 0; h < kGemmCols; h += 16) {
    for (int j = 0; j < 16; ++j) {
      float* row = rows + static_cast<size_t>(j) * depth;
      if (h + j >= cols) {
        std::memset(row, 0, sizeof(float) * depth);
        continue;
      }
      const int n = nb + h + j;
      for (int c = k0 / 16; c < (k0 + depth) / 16; c += 2) {
        __m512 sc[1], bi[1], w0, w1;
        group_params<BITS, 1>(p, n, c / chunks_per_group, sc, bi);
        dequant_pair<BITS>(p.w_row(n), c, sc[0], bi[0], w0, w1);
        _mm512_storeu_ps(row + 16 * c - k0, w0);
        _mm512_storeu_ps(row + 16 * c + 16 - k0, w1);
      }
    }
    for (int k = 0; k < depth; k += 16) {
      __m512 r[16];
      _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(rows + static_cast<size_t>(j) * depth + k);
      transpose16(r);
      _Pragma("GCC unroll 16") for (int c = 0; c < 16; ++c) _mm512_store_ps(panel + kGemmCols * (k + c) + h, r[c]);
    }
  }
}

// The q of features 16h .. 16h + 15 of a panel at column kk of a quad as floats (4 bits: the
// quad's 64 bytes in `v`; 8 bits: read from `quad`).
template <int BITS>
AVX512_FN_ALWAYS __m512 panel_q(__m512i v, const uint8_t* quad, int kk, int h) {
  if constexpr (BITS == 4) {
    return _mm512_permutexvar_ps(_mm512_srli_epi32(v, code_shift(kk, h)),
                                 _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(quad + kPanelCols * kk + 16 * h))));
  }
}

// Those weights dequantized by the affine FMA with the group's scales and biases of those
// features: MLX's values.
template <int BITS>
AVX512_FN_ALWAYS __m512 panel_weights(__m512i v, const uint8_t* quad, int kk, int h, __m512 sc, __m512 bi) {
  return _mm512_fmadd_ps(panel_q<BITS>(v, quad, kk, h), sc, bi);
}

// 16 scales or biases of a panel copy's `format` at `at` as f32 (the same values).
AVX512_FN_ALWAYS __m512 panel_values(GroupFormat format, const uint8_t* at) {
  if (format == GroupFormat::kF32) return _mm512_load_ps(reinterpret_cast<const float*>(at));
  const __m256i h = _mm256_load_si256(reinterpret_cast<const __m256i*>(at));
  if (format == GroupFormat::kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Panel q's scales and biases of group g in f32: sb[0 | 1] the scales of features 0-15 | 16-31,
// sb[2 | 3] their biases (the kernels convert a group once, then read it from L1).
AVX512_FN_ALWAYS void panel_group(const Panels& pn, int q, int g, float (&sb)[4][16]) {
  const size_t half = 16 * pn.value_bytes();
  _mm512_store_ps(sb[0], panel_values(pn.format, pn.group_s(q, g)));
  _mm512_store_ps(sb[1], panel_values(pn.format, pn.group_s(q, g) + half));
  _mm512_store_ps(sb[2], panel_values(pn.format, pn.group_b(q, g)));
  _mm512_store_ps(sb[3], panel_values(pn.format, pn.group_b(q, g) + half));
}

// gemm_pack's panel from the matrix's repacked copy (Panels, panel q = nb / 32): the same
// weights (the affine FMA on the same q, scale and bias) in the same panel rows, read as one
// stream of 32 features per column instead of 16 rows of K at once and transposed. Column
// k0 + e goes to the panel row lane_of(e) (x's order, gemm_pack_x). A Qwen
// prefill spent ~5.5% of its samples in gemm_pack, most of them waiting on the rows' loads.
template <int BITS>
AVX512_FN void gemm_pack_panels(const Panels& pn, int q, int k0, int depth, bool permute4, float* panel) {
  const uint8_t* wq = pn.panel_w(q) + static_cast<size_t>(k0 / 4) * pn.quad_bytes();
  alignas(64) float sb[4][16];
  for (int i = 0; i < depth / 4; ++i, wq += pn.quad_bytes()) {
    if ((4 * i) % pn.gs == 0) panel_group(pn, q, (k0 + 4 * i) / pn.gs, sb);  // k0 starts a group
    const __m512 sc[2] = {_mm512_load_ps(sb[0]), _mm512_load_ps(sb[1])};
    const __m512 bi[2] = {_mm512_load_ps(sb[2]), _mm512_load_ps(sb[3])};
    const __m512i v = BITS == 4 ? _mm512_load_si512(wq) : _mm512_setzero_si512();
    _Pragma("GCC unroll 4") for (int kk = 0; kk < 4; ++kk) {
      const int e = 4 * i + kk;  // column k0 + e
      float* to = panel + kGemmCols * (e / 32 * 32 + lane_of(e % 32, permute4));
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
        _mm512_store_ps(to + 16 * h, panel_weights<BITS>(v, wq, kk, h, sc[h], bi[h]));
      }
    }
  }
}

// The store masks of a block of 32 features of which the first `cols` exist: features 0-15
// and 16-31.
inline std::pair<__mmask16, __mmask16> panel_masks(int cols) {
  return {static_cast<__mmask16>(cols >= 16 ? 0xFFFF : (1u << cols) - 1),
          static_cast<__mmask16>(cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1)};
}

// M rounded up to whole tiles of kGemmRows.
inline size_t gemm_padded_rows(int m) { return static_cast<size_t>(m + kGemmRows - 1) / kGemmRows * kGemmRows; }

// x [M, K] (as the caller passed it) -> the micro-kernel's order: per block of kGemmDepth
// columns (at k0 * padded), per tile of kGemmRows rows (at m0 * depth), column by column the
// tile's 12 values, rows past M zero, each 32-block in the weights' lane order
// (lane_source); `out` holds gemm_padded_rows(M) * K floats. The kernels' aligned
// copy of x is not made for the GEMM: this is its only copy. One stream of broadcasts per
// tile instead of 12 rows' (`qmm_profile 512`: within the noise of reading x in place on the
// Xeon of 2026-12-05; it keeps one L1 stream per tile). The blocks of kGemmDepth columns are
// split over the pool (`threads` as compute() has them): on the calling thread alone this
// copy was ~2.5% of a Qwen 1.5B prefill's samples while the other core waited.
void gemm_pack_x(const float* x, int m, int k, bool permute4, float* out, int threads) {
  const size_t padded = gemm_padded_rows(m);
  int from[32];  // lane j of a 32-block holds element from[j] of the block
  for (int j = 0; j < 32; ++j) from[j] = lane_source(j, permute4);
  auto block = [&](int b) {
    const int k0 = b * kGemmDepth, depth = std::min(kGemmDepth, k - k0);  // k0, depth multiples of 32
    for (size_t m0 = 0; m0 < padded; m0 += kGemmRows) {
      float* tile = out + static_cast<size_t>(k0) * padded + m0 * depth;
      for (int i = 0; i < kGemmRows; ++i) {
        const size_t r = m0 + i;
        if (r >= static_cast<size_t>(m)) {
          for (int c = 0; c < depth; ++c) tile[kGemmRows * c + i] = 0.f;
          continue;
        }
        const float* row = x + r * k + k0;
        for (int c0 = 0; c0 < depth; c0 += 32)
          for (int j = 0; j < 32; ++j) tile[kGemmRows * (c0 + j) + i] = row[c0 + from[j]];
      }
    }
  };
  Pool::get().run((k + kGemmDepth - 1) / kGemmDepth, block, Pool::Linger::kLong, threads);
}

// Output rows [n0, n1) of a prompt chunk: per block of kGemmDepth columns of K (whose x, all
// M rows, stays in L2), per panel of 32 features (in L1), every tile of kGemmRows x rows.
template <int BITS>
AVX512_FN void rows_gemm(const Problem& p, int n0, int n1) {
  thread_local std::vector<float> panel_buf, rows;
  float* panel = aligned64(panel_buf, kGemmCols * kGemmDepth);
  rows.resize(16 * kGemmDepth);
  const size_t os = static_cast<size_t>(p.n), padded = gemm_padded_rows(p.m);
  for (int k0 = 0; k0 < p.k; k0 += kGemmDepth) {
    const int depth = std::min(kGemmDepth, p.k - k0);
    for (int nb = n0; nb < n1; nb += kGemmCols) {
      const int cols = std::min(kGemmCols, n1 - nb);
      const auto [mask0, mask1] = panel_masks(cols);
      if constexpr (BITS == 4 || BITS == 8) {
        if (p.panels) gemm_pack_panels<BITS>(*p.panels, nb / kPanelCols, k0, depth, BITS == 4, panel);
        else gemm_pack<BITS>(p, nb, cols, k0, depth, panel, rows.data());
      } else {
        gemm_pack<BITS>(p, nb, cols, k0, depth, panel, rows.data());
      }
      for (int m0 = 0; m0 < p.m; m0 += kGemmRows) {
        with_count<kGemmRows>(p.m - m0, [&](auto mr) {
          gemm_tile<decltype(mr)::value>(p.xg + static_cast<size_t>(k0) * padded + static_cast<size_t>(m0) * depth,
                                         panel, depth, p.out + m0 * os + nb, os, k0 == 0, mask0, mask1);
        });
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Products on the panel layout (f32 precision, AVX-512F, 4- and 8-bit matrices with panels,
// at most kWindowMaxRows rows: one-token steps, verify windows, batched steps, short
// prompts). MLX's own quantized dot (`qdot` in its Metal kernels): per output element and
// scale group g, in order, one sequential FMA chain over the group's columns from zero on
// the integer codes, then the group's affine terms,
//   d   = fma(x[m, k], q[n, k], d)            k in g, in order, d from 0
//   acc = fma(d, scale_g, acc);  acc = fma(bias_g, xsum[m, g], acc)     acc from 0
// with xsum the group's f32 sum of x (`group_sum`, Problem::xs), whatever M: a row has the
// same bits in any window. The broadcast form of the prompt GEMM's micro-kernel on the codes
// in registers: per column the 32 codes of a panel cost two shifts and two permutes (8 bits:
// two widening loads and two conversions), and each activation row two FMAs on one broadcast
// (a tile of up to 12 rows keeps 24 chains); the affine FMA per weight of the earlier
// `acc = fma(x, scale * q + bias, acc)` is gone (2026-12-07, `docs/measurements/
// 2026-12-07-zen4/`: one-row products 1.1-1.3x, windows of 2-4 rows 1.2x). One-token steps
// run one panel at a time: on a Zen 4 a step that read 4 panels' streams at once (and their
// scales' and biases') drew ~27 GB/s from memory, one panel's ~34 (the LM head 5.5 -> 4.3
// ms; Qwen2.5-1.5B's step 1.2x). `qmm_profile`, two cores, 11 rows, before: SmolLM2's
// 576 x 1536 119-122 G multiply-adds a second (the row kernels 82), Qwen2.5-1.5B's
// 8960 x 1536 151-173 (102-103) (`docs/measurements/2026-12-05-panels/`).

// Prefetch distance of a panel's weight stream.
constexpr int kPanelPrefetchBytes = 1024;

// acc + w * x (one FMA, the bits of _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc)) with x
// broadcast from memory inside the instruction. GCC otherwise broadcasts a tile's 12
// activations into registers ahead of their FMAs, and with 24 accumulators live spills them
// to the stack (`perf annotate` of the 11-row tile).
AVX512_FN_ALWAYS __m512 fma_broadcast(const float* x, __m512 w, __m512 acc) {
  asm("vfmadd231ps %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(*x), "v"(w));
  return acc;
}

// out[m, 32 (q0 + p) + j] for p < P, m < M: the sums of P panels from q0 for M activation
// rows, the activation of row m at column c at x[XS * c + m], the group sums of row m's x
// at xs + m * xs_stride (Problem::xs). Per group the dot of the codes with x is one FMA
// chain in registers; the output's accumulator (in L1: 2 P M more vectors would not fit the
// registers beside the chains of a wide tile) takes it at the group's end.
template <int BITS, int P, int M, int XS>
AVX512_FN_ALWAYS void panel_chains(const Panels& pn, int q0, const float* x, const float* xs, size_t xs_stride,
                                   float* out, size_t os) {
  const int quads = pn.gs / 4, groups = pn.k / pn.gs;
  alignas(64) float acc[P][M][kPanelCols] = {};
  const uint8_t* wp[P];
  _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p) wp[p] = pn.panel_w(q0 + p);
  alignas(64) float sb[P][4][16];
  for (int g = 0; g < groups; ++g) {
    const float* xp = x + static_cast<size_t>(XS) * g * pn.gs;
    __m512 dot[P][M][2];
    _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p)
      _Pragma("GCC unroll 12") for (int m = 0; m < M; ++m) dot[p][m][0] = dot[p][m][1] = _mm512_setzero_ps();
    for (int i = 0; i < quads; ++i, xp += 4 * XS) {
      __m512i v[P];
      _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p) {
        v[p] = BITS == 4 ? _mm512_load_si512(wp[p]) : _mm512_setzero_si512();
        _Pragma("GCC unroll 2") for (int line = 0; line < BITS / 4; ++line) {
          _mm_prefetch(reinterpret_cast<const char*>(wp[p]) + 64 * line + kPanelPrefetchBytes, _MM_HINT_T0);
        }
      }
      _Pragma("GCC unroll 4") for (int kk = 0; kk < 4; ++kk)
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
          _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p) {
            const __m512 q = panel_q<BITS>(v[p], wp[p], kk, h);
            _Pragma("GCC unroll 12") for (int m = 0; m < M; ++m) {
              dot[p][m][h] = fma_broadcast(xp + XS * kk + m, q, dot[p][m][h]);
            }
          }
      _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p) wp[p] += 16 * BITS;
    }
    _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p) {
      panel_group(pn, q0 + p, g, sb[p]);
      _Pragma("GCC unroll 12") for (int m = 0; m < M; ++m)
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
          __m512 a = _mm512_fmadd_ps(dot[p][m][h], _mm512_load_ps(sb[p][h]), _mm512_load_ps(acc[p][m] + 16 * h));
          a = _mm512_fmadd_ps(_mm512_load_ps(sb[p][2 + h]), _mm512_set1_ps(xs[m * xs_stride + g]), a);
          _mm512_store_ps(acc[p][m] + 16 * h, a);
        }
    }
  }
  _Pragma("GCC unroll 4") for (int p = 0; p < P; ++p)
    _Pragma("GCC unroll 12") for (int m = 0; m < M; ++m) {
      float* o = out + m * os + kPanelCols * p;
      _mm512_storeu_ps(o, _mm512_load_ps(acc[p][m]));
      _mm512_storeu_ps(o + 16, _mm512_load_ps(acc[p][m] + 16));
    }
}

// Panels [q, q1) for a tile of M rows (x, xs and their strides as panel_chains takes them),
// P at a time (the rest one by one).
template <int BITS, int P, int M, int XS>
AVX512_FN void panel_run(const Panels& pn, int q, int q1, const float* x, const float* xs, size_t xs_stride, float* out,
                         size_t os) {
  for (; q + P <= q1; q += P) panel_chains<BITS, P, M, XS>(pn, q, x, xs, xs_stride, out + kPanelCols * q, os);
  for (; q < q1; ++q) panel_chains<BITS, 1, M, XS>(pn, q, x, xs, xs_stride, out + kPanelCols * q, os);
}

// x [M, K] (K a multiple of 16) -> Problem::xp: per block of kPanelXRows rows (at
// b * kPanelXRows * K) column by column, the block's 16 values of column k at 16 k, rows
// past M zero; 16 x 16 register transposes of columns [c0, c1) (multiples of 16) of block b.
// The pool takes blocks, and a window of one block (up to 16 rows: every verify window) in
// column ranges, one a thread: a whole block on the calling thread left the other core
// spinning through four packs a layer.
constexpr int kPanelXRows = 16;
AVX512_FN void panel_pack_block(const float* x, int m, int k, int b, int c0, int c1, float* out) {
  const int r0 = b * kPanelXRows, rows = std::min(kPanelXRows, m - r0);
  float* to = out + static_cast<size_t>(r0) * k;
  for (int c = c0; c < c1; c += 16) {
    __m512 r[16];
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) {
      r[i] = i < rows ? _mm512_loadu_ps(x + static_cast<size_t>(r0 + i) * k + c) : _mm512_setzero_ps();
    }
    transpose16(r);
    _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j) _mm512_store_ps(to + static_cast<size_t>(16) * (c + j), r[j]);
  }
}
void panel_pack_x(const float* x, int m, int k, float* out, int threads) {
  const int blocks = (m + kPanelXRows - 1) / kPanelXRows, workers = Pool::get().threads(threads);
  if (blocks >= workers) {
    Pool::get().run(blocks, [&](int b) { panel_pack_block(x, m, k, b, 0, k, out); }, Pool::Linger::kLong, threads);
    return;
  }
  const int units = k / 16, parts = std::min(workers, units);  // column ranges of one block
  Pool::get().run(parts, [&](int i) { panel_pack_block(x, m, k, 0, 16 * (units * i / parts), 16 * (units * (i + 1) / parts), out); },
                  Pool::Linger::kLong, threads);
}

// Panels per block of rows_panels: 4 of Qwen2.5-1.5B's MLP down projection (K = 8960) are
// 573 KB, well inside a core's L2.
constexpr int kPanelBlock = 4;

// Output rows [n0, n1) (multiples of kPanelCols) of a product with panels: one row reads x
// as given, more rows Problem::xp, each block of kPanelXRows rows in balanced tiles of at
// most kGemmRows (11 -> 11, 16 -> 8 + 8).
template <int BITS>
AVX512_FN void rows_panels(const Problem& p, int n0, int n1) {
  const Panels& pn = *p.panels;
  const size_t os = static_cast<size_t>(p.n);
  const int q0 = n0 / kPanelCols, q1 = n1 / kPanelCols;
  const size_t groups = static_cast<size_t>(p.groups());
  if (p.m == 1) return panel_run<BITS, 1, 1, 1>(pn, q0, q1, p.x, p.xs, groups, p.out, os);
  // Blocks of kPanelBlock panels, each applied to every tile while its weights are in L2 (a
  // tile-outer loop reads a thread's panels from memory once per tile).
  for (int qb = q0; qb < q1; qb += kPanelBlock) {
    const int qe = std::min(q1, qb + kPanelBlock);
    for (int r0 = 0; r0 < p.m; r0 += kPanelXRows) {
      const int rows = std::min(kPanelXRows, p.m - r0);
      const auto [tiles, per] = balanced(rows, kGemmRows);
      for (int t0 = 0; t0 < rows; t0 += per) {
        const float* xb = p.xp + static_cast<size_t>(r0) * p.k + t0;
        const float* xs = p.xs + (r0 + t0) * groups;
        with_count<kGemmRows>(std::min(per, rows - t0), [&](auto tile) {
          constexpr int M = decltype(tile)::value;
          panel_run<BITS, (M <= 4 ? 2 : 1), M, kPanelXRows>(pn, qb, qe, xb, xs, groups, p.out + (r0 + t0) * os, os);
        });
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// AVX2 + FMA on the panels (CPUs without AVX-512), 8 features a vector, with the arithmetic
// of AVX-512's panel_chains (MLX's per-group dot): per output and scale group one FMA chain
// over the group's codes from zero, d = fma(x_k, q_k, d), then acc = fma(d, scale_g, acc)
// and acc = fma(bias_g, xsum_g, acc) with xsum_g the group's sum of x (Problem::xs). Every
// instruction set therefore gives the same bits, and a row's result does not depend on the
// window. The scales and biases of 16-bit panel copies convert with F16C (every AVX2 CPU
// has it; uses_panels checks).
#define PANEL2_FN __attribute__((target("avx2,fma,f16c"))) inline
#define PANEL2_FN_ALWAYS __attribute__((target("avx2,fma,f16c"), always_inline)) inline

bool cpu_has_f16c() {
  static const bool yes = cpu_has_avx2() && __builtin_cpu_supports("f16c");
  return yes;
}

// 8 scales or biases of a panel copy's `format` at `at` (32-byte aligned f32, 16-byte
// aligned 16-bit values) as f32: the same values.
PANEL2_FN_ALWAYS __m256 panel_values8(GroupFormat format, const uint8_t* at) {
  if (format == GroupFormat::kF32) return _mm256_load_ps(reinterpret_cast<const float*>(at));
  const __m128i h = _mm_load_si128(reinterpret_cast<const __m128i*>(at));
  if (format == GroupFormat::kF16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The 8 scales (`biases` false) or biases of features f .. f + 7 of panel q's group g, as f32.
PANEL2_FN_ALWAYS __m256 panel_group8(const Panels& pn, int q, int g, int f, bool biases) {
  return panel_values8(pn.format, (biases ? pn.group_b(q, g) : pn.group_s(q, g)) + f * pn.value_bytes());
}

// The q of features 16h + 8v .. + 7 of a panel at column kk of a quad, as floats (4 bits:
// the quad's two 32-byte halves in `half[v]`, words 8v .. 8v + 7).
template <int BITS>
PANEL2_FN_ALWAYS __m256 panel_q8(const __m256i (&half)[2], const uint8_t* quad, int kk, int h, int v) {
  if constexpr (BITS == 4) {
    const __m256i codes = _mm256_and_si256(_mm256_srli_epi32(half[v], code_shift(kk, h)), _mm256_set1_epi32(0xF));
    return _mm256_cvtepi32_ps(codes);
  } else {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(quad + kPanelCols * kk + 16 * h + 8 * v));
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  }
}

// x for the SHIFT form of panel_chains_avx2 (Problem::xt): row r as two rows of K, for the
// halves h = 0, 1 of a lane, column c of row h x_c 2^-t with t = code_shift(c % 4, h) (t =
// 28: x_c itself, those codes are shifted down), so a pass over one half of the panel reads
// one of them. Exact where shift_exact holds.
void shift_x_row(const float* x, int k, int r, float* xt) {
  const float* xr = x + static_cast<size_t>(r) * k;
  for (int h = 0; h < 2; ++h) {
    float* to = xt + (static_cast<size_t>(2) * r + h) * k;
    float factor[4];  // 2^-t, exact products where shift_exact holds
    for (int kk = 0; kk < 4; ++kk) factor[kk] = code_shift(kk, h) == 28 ? 1.0f : std::ldexp(1.0f, -code_shift(kk, h));
    for (int c = 0; c < k; c += 4)
      for (int kk = 0; kk < 4; ++kk) to[c + kk] = xr[c + kk] * factor[kk];
  }
}

// Whether every x_c 2^-t of shift_x_row is exact: zero, not finite, or |x_c| >= 2^-102 (so no
// product with a power of two down to 2^-24 is subnormal).
bool shift_exact(const float* x, size_t len) {
  return std::all_of(x, x + len, [](float v) { return v == 0.0f || !std::isfinite(v) || std::fabs(v) >= 0x1p-102f; });
}

// out[m, 32q + 16h + j] for the halves h in [H0, H0 + H) of panel q, j < 16, m < M: the sums
// of M activation rows, row m's activations at x + m * x_stride (SHIFT: Problem::xt's, half
// h's at + h K), its group sums at xs + m * xs_stride. The chains of a group are in registers; the
// outputs' accumulators in L1 take them at the group's end.
//
// SHIFT (4 bits): the code at bits [t, t + 4) of a lane is taken as the integer c 2^t (one
// AND, no shift: 2^t c has at most 4 significant bits, so it converts to float exactly) and
// multiplied with x 2^-t (shift_x_row; exact where shift_exact holds). The FMA's product
// c 2^t * x 2^-t is then exactly c x, so d = fma(c 2^t, x 2^-t, d) has the bits of fma(x, c,
// d): one vector operation fewer per 8 weights (3 per row and 8 weights without it).
template <int BITS, int M, int H0, int H, bool SHIFT>
PANEL2_FN_ALWAYS void panel_chains_avx2(const Panels& pn, int q, const float* x, size_t x_stride, const float* xs,
                                        size_t xs_stride, float* out, size_t os) {
  static_assert(!SHIFT || BITS == 4);
  alignas(32) float acc[M][H][16] = {};
  const uint8_t* wq = pn.panel_w(q);
  const float* xk = x;
  for (int g = 0; g < pn.k / pn.gs; ++g) {
    __m256 dot[M][H][2];
    _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
      _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) dot[m][h][0] = dot[m][h][1] = _mm256_setzero_ps();
    for (int i = 0; i < pn.gs / 4; ++i, wq += pn.quad_bytes(), xk += 4) {
      _Pragma("GCC unroll 2") for (int line = 0; line < BITS / 4; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(wq) + 64 * line + kPanelPrefetchBytes, _MM_HINT_T0);
      }
      __m256i half[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      if constexpr (BITS == 4) {
        half[0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq));
        half[1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq + 32));
      }
      _Pragma("GCC unroll 4") for (int kk = 0; kk < 4; ++kk)
        _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) {
          __m256 c[2];
          _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
            if constexpr (SHIFT) {
              const int t = code_shift(kk, H0 + h);
              c[v] = _mm256_cvtepi32_ps(t == 28 ? _mm256_srli_epi32(half[v], 28)
                                                : _mm256_and_si256(half[v], _mm256_set1_epi32(0xF << t)));
            } else {
              c[v] = panel_q8<BITS>(half, wq, kk, H0 + h, v);
            }
          }
          const size_t at = SHIFT ? static_cast<size_t>(H0 + h) * pn.k + kk : kk;
          _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
            const __m256 xv = _mm256_broadcast_ss(xk + m * x_stride + at);
            dot[m][h][0] = _mm256_fmadd_ps(xv, c[0], dot[m][h][0]);
            dot[m][h][1] = _mm256_fmadd_ps(xv, c[1], dot[m][h][1]);
          }
        }
    }
    _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h)
      _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
        const __m256 sc = panel_group8(pn, q, g, 16 * (H0 + h) + 8 * v, false);
        const __m256 bi = panel_group8(pn, q, g, 16 * (H0 + h) + 8 * v, true);
        _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
          __m256 a = _mm256_fmadd_ps(dot[m][h][v], sc, _mm256_load_ps(acc[m][h] + 8 * v));
          a = _mm256_fmadd_ps(bi, _mm256_set1_ps(xs[m * xs_stride + g]), a);
          _mm256_store_ps(acc[m][h] + 8 * v, a);
        }
      }
  }
  _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
    _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) {
      float* o = out + m * os + kPanelCols * q + 16 * (H0 + h);
      _mm256_storeu_ps(o, _mm256_load_ps(acc[m][h]));
      _mm256_storeu_ps(o + 8, _mm256_load_ps(acc[m][h] + 8));
    }
}

// Activation rows a pass of panel_chains_avx2 takes: up to 2 rows with both halves of the
// panel at once (4 or 8 chains), 3-4 rows one half at a time (6 or 8): 16 registers.
constexpr int kPanel2Rows = 4;

// Output rows [n0, n1) (whole panels) of a product with panels for at most kTiledMaxRows
// activation rows (run_rows splits longer prompts), x rows as given (4 bits with
// Problem::xt: the SHIFT form); each panel in turn for every group of rows (11 -> 4 + 4 +
// 3), while it is in L1/L2.
template <int BITS, bool SHIFT>
PANEL2_FN void rows_panels_avx2(const Problem& p, int n0, int n1) {
  const Panels& pn = *p.panels;
  const size_t x_stride = static_cast<size_t>(p.k) * (SHIFT ? 2 : 1), os = static_cast<size_t>(p.n),
               xs_stride = static_cast<size_t>(p.groups());
  const auto [parts, per] = balanced(p.m, kPanel2Rows);
  for (int q = n0 / kPanelCols; q < n1 / kPanelCols; ++q) {
    for (int m0 = 0; m0 < p.m; m0 += per) {
      const float* x = (SHIFT ? p.xt : p.x) + m0 * x_stride;
      const float* xs = p.xs + m0 * xs_stride;
      float* out = p.out + m0 * os;
      switch (std::min(per, p.m - m0)) {
        case 1: panel_chains_avx2<BITS, 1, 0, 2, SHIFT>(pn, q, x, x_stride, xs, xs_stride, out, os); break;
        case 2: panel_chains_avx2<BITS, 2, 0, 2, SHIFT>(pn, q, x, x_stride, xs, xs_stride, out, os); break;
        case 3:
          panel_chains_avx2<BITS, 3, 0, 1, SHIFT>(pn, q, x, x_stride, xs, xs_stride, out, os);
          panel_chains_avx2<BITS, 3, 1, 1, SHIFT>(pn, q, x, x_stride, xs, xs_stride, out, os);
          break;
        default:
          panel_chains_avx2<BITS, 4, 0, 1, SHIFT>(pn, q, x, x_stride, xs, xs_stride, out, os);
          panel_chains_avx2<BITS, 4, 1, 1, SHIFT>(pn, q, x, x_stride, xs, xs_stride, out, os);
          break;
      }
    }
  }
  (void)parts;
}

// ---------------------------------------------------------------------------------------
// Prompt chunks on AVX2 + FMA (f32 precision, 4- and 8-bit matrices, more than
// kWindowMaxRows activation rows): rows_gemm's GEMM in 8-lane vectors. The window
// kernels above spend 2 of every 10 FMAs of a prompt block dequantizing (each 4-row pass of
// panel_chains_avx2 dequantizes the panel again) and hold 8 accumulators; here the panel is
// dequantized once per call, as for AVX-512, into the same panel layout (gemm_pack's: 32
// features side by side per column of a block of kGemmDepth columns, 4 bits in the lane
// order of gemm_pack_x's copy of x), and a micro-kernel keeps kGemm2Rows activation rows x
// 16 features in 12 of the 16 registers: per column two panel loads and 6 broadcasts feed 12
// FMAs. Per output element the float operations are rows_gemm's (a sequential FMA chain over
// a block's panel rows from zero, the blocks' sums added in order), so a chunk's rows have
// the AVX-512 GEMM's bits.
constexpr int kGemm2Rows = 6;

// out[i, 0..cols) (+)= x_i . panel half over `depth` columns for the first MR rows at x (a
// row offset into a packed tile of x, gemm_pack_x: row i of column k at x[kGemmRows k + i]);
// `panel` points at the half's 16 features of the first column; `first` stores, else adds
// to what a previous block left; only the first `cols` (<= 16) features are written.
template <int MR>
AVX2_FN void gemm_tile_avx2(const float* x, const float* panel, int depth, float* out, size_t os, bool first, int cols) {
  __m256 acc[MR][2];
  _Pragma("GCC unroll 6") for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  _Pragma("GCC unroll 4") for (int k = 0; k < depth; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + kGemmCols * k), w1 = _mm256_load_ps(panel + kGemmCols * k + 8);
    _Pragma("GCC unroll 6") for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + kGemmRows * k + i);
      acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask[2] = {_mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane),
                           _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane)};
  _Pragma("GCC unroll 6") for (int i = 0; i < MR; ++i) {
    _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
      float* o = out + i * os + 8 * v;
      if (cols >= 16) {
        if (!first) acc[i][v] = _mm256_add_ps(_mm256_loadu_ps(o), acc[i][v]);
        _mm256_storeu_ps(o, acc[i][v]);
      } else {
        if (!first) acc[i][v] = _mm256_add_ps(_mm256_maskload_ps(o, mask[v]), acc[i][v]);
        _mm256_maskstore_ps(o, mask[v], acc[i][v]);
      }
    }
  }
}

// gemm_pack_panels in 8-lane vectors: the same weights (the affine FMA on the same q, scale
// and bias) in the same panel rows.
template <int BITS>
PANEL2_FN void gemm_pack_panels_avx2(const Panels& pn, int q, int k0, int depth, bool permute4, float* panel) {
  const uint8_t* wq = pn.panel_w(q) + static_cast<size_t>(k0 / 4) * pn.quad_bytes();
  __m256 sc[2][2], bi[2][2];
  for (int i = 0; i < depth / 4; ++i, wq += pn.quad_bytes()) {
    if ((4 * i) % pn.gs == 0) {  // k0 starts a group
      const int g = (k0 + 4 * i) / pn.gs;
      for (int h = 0; h < 2; ++h)
        for (int v = 0; v < 2; ++v) {
          sc[h][v] = panel_group8(pn, q, g, 16 * h + 8 * v, false);
          bi[h][v] = panel_group8(pn, q, g, 16 * h + 8 * v, true);
        }
    }
    __m256i half[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    if constexpr (BITS == 4) {
      half[0] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq));
      half[1] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq + 32));
    }
    _Pragma("GCC unroll 4") for (int kk = 0; kk < 4; ++kk) {
      const int e = 4 * i + kk;  // column k0 + e
      float* to = panel + kGemmCols * (e / 32 * 32 + lane_of(e % 32, permute4));
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h)
        _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
          _mm256_store_ps(to + 16 * h + 8 * v, _mm256_fmadd_ps(panel_q8<BITS>(half, wq, kk, h, v), sc[h][v], bi[h][v]));
        }
    }
  }
}

// gemm_pack from MLX's rows (matrices without panels): each weight row's
// chunks of 8 dequantized as the row kernels do (decode8, affine8), then each weight stored
// to its panel row (column k0 + e at lane_of(e)); the features past `cols` are zeros.
template <int BITS>
AVX2_FN void gemm_pack_rows_avx2(const Problem& p, int nb, int cols, int k0, int depth, bool permute4, float* panel) {
  int row_of[32];
  for (int e = 0; e < 32; ++e) row_of[e] = lane_of(e, permute4);
  for (int j = 0; j < kGemmCols; ++j) {
    if (j >= cols) {
      for (int r = 0; r < depth; ++r) panel[kGemmCols * r + j] = 0.f;
      continue;
    }
    const int n = nb + j;
    const uint32_t* wr = p.w_row(n);
    for (int c = k0 / 8; c < (k0 + depth) / 8; ++c) {
      __m256 sc, bi;
      group8<BITS>(p, n, 8 * c / p.gs, sc, bi);
      alignas(32) float w[8];
      _mm256_store_ps(w, affine8<BITS>(decode8<BITS>(wr, c), sc, bi));
      for (int l = 0; l < 8; ++l) {
        const int e = 8 * c + l - k0;
        panel[kGemmCols * (e / 32 * 32 + row_of[e % 32]) + j] = w[l];
      }
    }
  }
}

// Output rows [n0, n1) of a prompt chunk on AVX2: per block of kGemmDepth columns of K, per
// panel of 32 features (packed once, 32 KB), per tile of kGemmRows x rows (gemm_pack_x's
// tiles), each half of the panel for both halves of the tile.
template <int BITS>
AVX2_FN void rows_gemm_avx2(const Problem& p, int n0, int n1) {
  thread_local std::vector<float> panel_buf;
  float* panel = aligned64(panel_buf, kGemmCols * kGemmDepth);
  const size_t os = static_cast<size_t>(p.n), padded = gemm_padded_rows(p.m);
  constexpr bool permute4 = BITS == 4;
  for (int k0 = 0; k0 < p.k; k0 += kGemmDepth) {
    const int depth = std::min(kGemmDepth, p.k - k0);
    for (int nb = n0; nb < n1; nb += kGemmCols) {
      const int cols = std::min(kGemmCols, n1 - nb);
      if (p.panels) gemm_pack_panels_avx2<BITS>(*p.panels, nb / kPanelCols, k0, depth, permute4, panel);
      else gemm_pack_rows_avx2<BITS>(p, nb, cols, k0, depth, permute4, panel);
      for (int m0 = 0; m0 < p.m; m0 += kGemmRows) {
        const float* tile = p.xg + static_cast<size_t>(k0) * padded + static_cast<size_t>(m0) * depth;
        for (int h = 0; h < 2 && 16 * h < cols; ++h) {
          for (int i0 = 0; i0 < kGemmRows && m0 + i0 < p.m; i0 += kGemm2Rows) {
            with_count<kGemm2Rows>(p.m - m0 - i0, [&](auto mr) {
              gemm_tile_avx2<decltype(mr)::value>(tile + i0, panel + 16 * h, depth,
                                                  p.out + static_cast<size_t>(m0 + i0) * os + nb + 16 * h, os, k0 == 0,
                                                  std::min(16, cols - 16 * h));
            });
          }
        }
      }
    }
  }
}

// The vector part of swiglu_rows: whole vectors of 8 in [n0, n1); returns where it stopped.
AVX2_FN int swiglu_avx2(const float* gate, const float* up, float* out, int n0, int n1) {
  int i = n0;
  for (; i + 8 <= n1; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_mul_ps(simd::silu8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
  }
  return i;
}

bool cpu_has_avx512() {
  static const bool yes = cpu_has_avx2() && __builtin_cpu_supports("avx512f");
  return yes;
}
#else
bool cpu_has_avx2() { return false; }
bool cpu_has_avx512() { return false; }
#endif

#ifdef MLXSYS_X86
// ---------------------------------------------------------------------------------------
// Prompt chunks of 4- and 8-bit matrices on AMX (Intel's tile unit, Sapphire Rapids and
// later; f32 precision, the same products as rows_gemm). A tile product (TDPBF16PS) takes
// bf16 inputs and accumulates in f32; on this kind of core it does ~500 G multiply-adds a
// second, ~6x the FMA units (`qmm_profile 512`). Two facts make it exact enough for f32:
//   - a weight's q (0..15, 0..255) is an integer of at most 8 bits: a bf16 holds it exactly;
//   - x splits into three bf16 without loss: hi = x with its low 16 bits cleared, mid the
//     same of x - hi, lo = x - hi - mid (each difference exact; lo has at most 8 significant
//     bits), and a bf16 x bf16 product is exact in f32.
// So per group g of gs columns, per output element, the tile unit sums
//   c_g = sum_k (hi_k + mid_k + lo_k) * q_k   (f32 accumulation, the tile unit's order)
// and the vector units finish the group with MLX's affine weight s_g * q + b_g:
//   out += fma(c_g, s_g, xsum_g * b_g),   xsum_g = sum of x over the group (f32),
// groups in order from zero (Intel SDM vol. 1 ch. 18, TDPBF16PS: input and output denormals
// flushed, round to nearest even). That is another summation order than rows_gemm's, with
// the same f32 rounding per step; a row's result depends on K only, not on M (tile rows are
// independent, and the column blocking below depends on K alone).
//
// Blocking: per block of kAmxDepth columns of K, per block of rows whose split x fits in
// L2 (kAmxRowBlockBytes), per panel of 32 features: the panel's q as bf16 tile rows (pairs
// of columns interleaved, TDPBF16PS's B layout) and its scales and biases, then per tile of
// 16 rows and per group two accumulator tiles (features 0-15, 16-31), three x tiles and two
// weight tiles.
#define AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx2,fma"))) inline

constexpr int kAmxRows = 16;   // activation rows of a tile
constexpr int kAmxStep = 32;   // columns of K per tile product (16 rows of bf16 pairs)
constexpr int kAmxDepth = 1536;  // columns per block: a multiple of every group size; K of a 1.5B model in one
constexpr size_t kAmxRowBlockBytes = size_t{3} << 19;  // split x per row block: 1.5 MiB of a 2 MiB L2

// Whether AMX-BF16 is present and Linux lets this process use it (the tile data state is
// off until asked for: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), kernel >= 5.16).
bool cpu_has_amx_bf16() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!cpu_has_avx512() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1u, bf16 = (d >> 22) & 1u;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return yes;
}

// Rows padded to whole tiles.
inline size_t amx_padded_rows(int m) { return static_cast<size_t>(m + kAmxRows - 1) / kAmxRows * kAmxRows; }

// Row r of x [M, K] -> its three bf16 parts in the tiles' layout (amx_split_x; `to` = the
// row's first row of tile values) and its groups' f32 sums (16-lane partial sums in column
// order, then _mm512_reduce_add_ps).
AVX512_FN void amx_split_row(const float* xr, int k, int gs, uint16_t* to, float* sum) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int g = 0; g < k / gs; ++g) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = g * gs; c < (g + 1) * gs; c += 16) {
      const __m512 v = _mm512_loadu_ps(xr + c);
      acc = _mm512_add_ps(acc, v);
      const __m512 h = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
      const __m512 r1 = _mm512_sub_ps(v, h);
      const __m512 md = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), top));
      const __m512 part[3] = {h, md, _mm512_sub_ps(r1, md)};
      for (int p = 0; p < 3; ++p) {
        const __m256i b16 = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(part[p]), 16));
        uint16_t* tile = to + (static_cast<size_t>(c / kAmxStep) * 3 + p) * (kAmxRows * kAmxStep);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + c % kAmxStep), b16);
      }
    }
    sum[g] = _mm512_reduce_add_ps(acc);
  }
}

// x [M, K] -> its three bf16 parts (hi, mid, lo as above; rows past M zero) as tiles, one
// stream per tile of rows: the tile of rows t, columns 32s .. 32s + 31, part p (16 rows of
// 32 values) at parts + ((t * K / 32 + s) * 3 + p) * 512; and sums [padded M][K / gs]. Rows
// split over the pool.
void amx_split_x(const float* x, int m, int k, int gs, uint16_t* parts, float* sums, int threads) {
  const size_t padded = amx_padded_rows(m);
  const int groups = k / gs;
  auto row = [&](int r) {
    uint16_t* to = parts + static_cast<size_t>(r / kAmxRows) * k * 3 * kAmxRows + (r % kAmxRows) * kAmxStep;
    float* sum = sums + static_cast<size_t>(r) * groups;
    if (r < m) return amx_split_row(x + static_cast<size_t>(r) * k, k, gs, to, sum);
    for (int s = 0; s < 3 * k / kAmxStep; ++s) std::memset(to + s * kAmxRows * kAmxStep, 0, sizeof(uint16_t) * kAmxStep);
    std::fill(sum, sum + groups, 0.f);
  };
  Pool::get().run(static_cast<int>(padded), row, Pool::Linger::kLong, threads);
}

// bf16 bits of the integer-valued floats in `q`, two columns' lanes interleaved: dword j =
// (column a's feature j) | (column b's feature j) << 16 — a row of TDPBF16PS's B tile.
AMX_FN __m512i amx_pair(__m512 qa, __m512 qb) {
  return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(qa), 16),
                         _mm512_and_si512(_mm512_castps_si512(qb), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The weight tiles of features nb .. nb + 31 over columns [k0, k0 + depth): tile (s, h) at
// tiles + (2s + h) * 512 holds columns k0 + 32s .. + 31 of features 16h .. 16h + 15 (row i:
// columns 2i, 2i + 1 interleaved); and per group of the block the scales (sb[g][0..1]) and
// biases (sb[g][2..3]) of the 32 features as f32. From the repacked copy where the matrix has
// one, else from MLX's rows (features past n1 zero): the same values.
template <int BITS>
AMX_FN void amx_pack_panel(const Problem& p, int nb, int n1, int k0, int depth, uint16_t* tiles, float (*sb)[4][16]) {
  const int groups = depth / p.gs, g0 = k0 / p.gs;
  if (p.panels) {
    const Panels& pn = *p.panels;
    const int q = nb / kPanelCols;
    for (int g = 0; g < groups; ++g) panel_group(pn, q, g0 + g, sb[g]);
    const uint8_t* wq = pn.panel_w(q) + static_cast<size_t>(k0 / 4) * pn.quad_bytes();
    for (int i = 0; i < depth / 4; ++i, wq += pn.quad_bytes()) {  // quad i: columns 4i .. 4i + 3
      const __m512i v = BITS == 4 ? _mm512_load_si512(wq) : _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        __m512 col[4];
        for (int kk = 0; kk < 4; ++kk) col[kk] = panel_q<BITS>(v, wq, kk, h);
        const int e = 4 * i, s = e / kAmxStep, row = (e % kAmxStep) / 2;
        uint16_t* t = tiles + (2 * s + h) * 512 + row * 32;
        _mm512_store_si512(t, amx_pair(col[0], col[1]));
        _mm512_store_si512(t + 32, amx_pair(col[2], col[3]));
      }
    }
    return;
  }
  const int per_word = 32 / BITS;
  const uint32_t mask = (1u << BITS) - 1;
  for (int j = 0; j < kPanelCols; ++j) {
    const int n = nb + j, h = j / 16, lane = j % 16;
    for (int g = 0; g < groups; ++g) {
      sb[g][h][lane] = n < n1 ? p.s_row(n)[g0 + g] : 0.f;
      sb[g][2 + h][lane] = n < n1 ? p.b_row(n)[g0 + g] : 0.f;
    }
    for (int e = 0; e < depth; ++e) {
      const int kc = k0 + e;
      const uint32_t q = n < n1 ? (p.w_row(n)[kc / per_word] >> (BITS * (kc % per_word))) & mask : 0;
      const float f = static_cast<float>(q);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);
      tiles[(2 * (e / kAmxStep) + h) * 512 + (e % kAmxStep) / 2 * 32 + 2 * lane + e % 2] = static_cast<uint16_t>(bits >> 16);
    }
  }
}

struct AmxTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Output rows [n0, n1) of a prompt chunk on AMX (see above). Tiles: 0, 1 the group's sums of
// features 0-15 and 16-31; 2, 3, 4 x's hi, mid and lo; 5, 6 the weights of the two halves.
template <int BITS>
AMX_FN void rows_amx(const Problem& p, int n0, int n1) {
  AmxTileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kAmxRows;
  }
  _tile_loadconfig(&config);
  thread_local std::vector<uint16_t> tile_buf;
  thread_local std::vector<float> sb_buf;
  const int depth_max = std::min(kAmxDepth, p.k);
  uint16_t* tiles = aligned64(tile_buf, static_cast<size_t>(depth_max) * kPanelCols);
  auto* sb = reinterpret_cast<float (*)[4][16]>(aligned64(sb_buf, static_cast<size_t>(depth_max / p.gs) * 64));
  alignas(64) float c[kAmxRows][kPanelCols];
  const size_t os = static_cast<size_t>(p.n), padded = amx_padded_rows(p.m);
  constexpr int kTile = kAmxRows * kAmxStep;  // values of a tile
  const int groups = p.groups(), steps = p.gs / kAmxStep;
  for (int k0 = 0; k0 < p.k; k0 += kAmxDepth) {
    const int depth = std::min(kAmxDepth, p.k - k0);
    // Balanced row blocks of at most `fit` tiles (x's three parts: 6 bytes a value).
    const size_t fit = std::max<size_t>(1, kAmxRowBlockBytes / (static_cast<size_t>(depth) * 6 * kAmxRows));
    const size_t all = padded / kAmxRows, blocks = (all + fit - 1) / fit, block_tiles = (all + blocks - 1) / blocks;
    for (size_t mb = 0; mb < padded; mb += block_tiles * kAmxRows) {
      const size_t mb1 = std::min(padded, mb + block_tiles * kAmxRows);
      for (int nb = n0; nb < n1; nb += kPanelCols) {
        const int cols = std::min(kPanelCols, n1 - nb);
        const auto [mask0, mask1] = panel_masks(cols);
        amx_pack_panel<BITS>(p, nb, n1, k0, depth, tiles, sb);
        asm volatile("" ::: "memory");  // GCC's tile loads do not say they read memory
        for (size_t m0 = mb; m0 < mb1; m0 += kAmxRows) {
          const int valid = std::min(kAmxRows, p.m - static_cast<int>(m0));
          if (valid <= 0) break;
          const uint16_t* x0 = p.xa + (m0 * p.k + static_cast<size_t>(k0) * kAmxRows) * 3;
          for (int g = 0; g < depth / p.gs; ++g) {
            _tile_zero(0);
            _tile_zero(1);
            for (int s = g * steps; s < (g + 1) * steps; ++s) {
              const uint16_t* xs = x0 + static_cast<size_t>(s) * 3 * kTile;
              _tile_loadd(5, tiles + 2 * s * kTile, 64);
              _tile_loadd(6, tiles + (2 * s + 1) * kTile, 64);
              _tile_loadd(2, xs, 64);
              _tile_dpbf16ps(0, 2, 5);
              _tile_dpbf16ps(1, 2, 6);
              _tile_loadd(3, xs + kTile, 64);
              _tile_dpbf16ps(0, 3, 5);
              _tile_dpbf16ps(1, 3, 6);
              _tile_loadd(4, xs + 2 * kTile, 64);
              _tile_dpbf16ps(0, 4, 5);
              _tile_dpbf16ps(1, 4, 6);
            }
            _tile_stored(0, &c[0][0], sizeof c[0]);
            _tile_stored(1, &c[0][16], sizeof c[0]);
            const int ga = k0 / p.gs + g;
            const __m512 s0 = _mm512_load_ps(sb[g][0]), s1 = _mm512_load_ps(sb[g][1]);
            const __m512 b0 = _mm512_load_ps(sb[g][2]), b1 = _mm512_load_ps(sb[g][3]);
            for (int i = 0; i < valid; ++i) {
              float* o = p.out + (m0 + i) * os + nb;
              const __m512 xsum = _mm512_set1_ps(p.xa_sums[(m0 + i) * groups + ga]);
              __m512 r0 = _mm512_fmadd_ps(_mm512_load_ps(c[i]), s0, _mm512_mul_ps(xsum, b0));
              __m512 r1 = _mm512_fmadd_ps(_mm512_load_ps(c[i] + 16), s1, _mm512_mul_ps(xsum, b1));
              if (ga > 0) {
                r0 = _mm512_add_ps(_mm512_maskz_loadu_ps(mask0, o), r0);
                r1 = _mm512_add_ps(_mm512_maskz_loadu_ps(mask1, o + 16), r1);
              }
              _mm512_mask_storeu_ps(o, mask0, r0);
              _mm512_mask_storeu_ps(o + 16, mask1, r1);
            }
          }
        }
      }
    }
  }
  _tile_release();
}

#else
bool cpu_has_amx_bf16() { return false; }
#endif

// ---------------------------------------------------------------------------------------
// bf16 precision (opt-in; mlx-core's `Precision::Bf16`). The weights of each chunk pair (32
// weights: chunks c and c + 1, c even) are dequantized to the f32 values of f32 precision and
// rounded to bf16; the activations are rounded to bf16 once per call (`prepare_bf16`); the
// products are bf16 dot products accumulated in f32, 32 multiply-adds an instruction
// (`vdpbf16ps`, AVX512_BF16) where the f32 path's FMA does 16. Per output element:
//   wb_P  = bf16(w of chunk pair P)          32 weights in the f32 AVX-512 path's lane order
//   acc_u = dpbf16(acc_u, wb_P, xb_P)        u = P % 2, in pair order
//   y     = reduce16(acc_0 + acc_1)
// dpbf16 is, per f32 lane j, two round-to-nearest FMAs, element 2j + 1 first, then 2j, with
// denormal inputs read as zero and denormal results flushed to zero (Intel SDM, VDPBF16PS);
// bf16(v) rounds to nearest even, denormals to zero (VCVTNEPS2BF16); reduce16 is one fixed
// tree. `rows_bf16_portable` does the same operations in scalar C++: every instruction set
// gives the same bits, and a row's result does not depend on the number of rows (window rows
// equal one-token rows, so speculation stays lossless against this precision's plain decode).
constexpr int kF32 = 0;
constexpr int kBf16 = 1;

// VCVTNEPS2BF16 of one value.
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t exponent = u & 0x7F800000u;
  if (exponent == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);  // zero, denormal
  if (exponent == 0x7F800000u) {                                           // inf, NaN (quiet)
    return static_cast<uint16_t>((u >> 16) | ((u & 0x007FFFFFu) ? 0x40u : 0u));
  }
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One lane of dpbf16: acc + a1 * b1, then + a0 * b0 (products of bf16 values are exact in f32).
float dot_pair_bf16(float acc, uint16_t a0, uint16_t b0, uint16_t a1, uint16_t b1) {
  auto flush = [](float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.f, v) : v; };
  acc = flush(std::fma(from_bf16(a1), from_bf16(b1), acc));
  return flush(std::fma(from_bf16(a0), from_bf16(b0), acc));
}

// The fixed reduction of 16 lanes: lanes i + 8, then i + 4, i + 2, i + 1 (reduce16 below).
float reduce16_portable(const float* v) {
  float s[8], t[4];
  for (int i = 0; i < 8; ++i) s[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) t[i] = s[i] + s[i + 4];
  return (t[0] + t[2]) + (t[1] + t[3]);
}

// Weight j (0..31) of chunk pair P's lane order: 4 bits, even weights of the 32-block, then
// odd (permute_x4's order); 8 bits, as stored.
int pair_index(int bits, int p, int j) {
  return 32 * p + (bits == 4 ? (j < 16 ? 2 * j : 2 * (j - 16) + 1) : j);
}

// x [M, K] -> bf16 in chunk-pair lane order, row stride K.
void prepare_bf16_portable(const float* x, int m, int k, int bits, uint16_t* out) {
  for (int r = 0; r < m; ++r) {
    for (int p = 0; p < k / 32; ++p) {
      for (int j = 0; j < 32; ++j) {
        out[static_cast<size_t>(r) * k + 32 * p + j] = to_bf16(x[static_cast<size_t>(r) * k + pair_index(bits, p, j)]);
      }
    }
  }
}

void rows_bf16_portable(const Problem& p, int n0, int n1) {
  const int per_word = 32 / p.bits;
  const uint32_t mask = (1u << p.bits) - 1;
  thread_local std::vector<uint16_t> wb;
  wb.resize(p.k);
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = p.w_row(n);
    for (int pp = 0; pp < p.k / 32; ++pp) {
      for (int j = 0; j < 32; ++j) {
        const int i = pair_index(p.bits, pp, j), g = i / p.gs;
        const uint32_t q = (wr[i / per_word] >> ((i % per_word) * p.bits)) & mask;
        wb[32 * pp + j] = to_bf16(std::fma(static_cast<float>(q), p.s_row(n)[g], p.b_row(n)[g]));
      }
    }
    for (int m = 0; m < p.m; ++m) {
      const uint16_t* xr = p.xb + static_cast<size_t>(m) * p.k;
      float acc[2][16] = {};
      for (int pp = 0; pp < p.k / 32; ++pp) {
        float* a = acc[pp % 2];
        for (int j = 0; j < 16; ++j) {
          const int e = 32 * pp + 2 * j;
          a[j] = dot_pair_bf16(a[j], wb[e], xr[e], wb[e + 1], xr[e + 1]);
        }
      }
      float v[16];
      for (int j = 0; j < 16; ++j) v[j] = acc[0][j] + acc[1][j];
      p.out[static_cast<size_t>(m) * p.n + n] = reduce16_portable(v);
    }
  }
}

#ifdef MLXSYS_X86
#define BF16_FN __attribute__((target("avx512f,avx512bf16,avx2,fma"))) inline
#define BF16_FN_ALWAYS __attribute__((target("avx512f,avx512bf16,avx2,fma"), always_inline)) inline

bool cpu_has_avx512_bf16() {
  static const bool yes = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return yes;
}

// reduce16_portable's tree with vector adds.
AVX512_FN_ALWAYS float reduce16(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 s = _mm256_add_ps(lo, hi);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}

struct Reduce16 {
  AVX512_FN_ALWAYS float operator()(__m512 v) const { return reduce16(v); }
};

// prepare_bf16_portable with VCVTNE2PS2BF16 (the same rounding).
BF16_FN void prepare_bf16(const float* x, int m, int k, int bits, uint16_t* out) {
  thread_local std::vector<float> permuted;
  if (bits == 4) {
    permuted.resize(static_cast<size_t>(m) * k);
    permute_x4(x, m, k, permuted.data());
    x = permuted.data();
  }
  for (size_t i = 0; i < static_cast<size_t>(m) * k; i += 32) {
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i, reinterpret_cast<const __m512i&>(v));
  }
}

// Weight rows n .. n + R of M activation rows, as rows_avx512_regs (one decode of each chunk
// pair for all M rows, two weight rows at a time for one activation row). The group size is a
// template argument so that each pair's accumulator (pair index mod 2) is known at compile
// time and the accumulators stay in registers.
template <int BITS, int GS, int R, int M>
BF16_FN_ALWAYS void rows_bf16_regs(const Problem& p, int n, int g_begin, int g_end, Carry carry) {
  constexpr int kPairsPerGroup = GS / 32;
  constexpr int kGroupsPerStep = GS == 32 ? 2 : 1;  // a step covers an even number of pairs
  const int words = p.k * BITS / 32, groups = p.k / GS;
  const uint32_t* wr = p.w_row(n);
  const size_t xs = static_cast<size_t>(p.k);
  __m512 acc[R][M][2];
  carry_in<R, M>(acc, n, g_begin, carry);
  for (int g0 = g_begin; g0 < g_end; g0 += kGroupsPerStep) {  // g_begin is a multiple of the step
    _Pragma("GCC unroll 2") for (int gg = 0; gg < kGroupsPerStep; ++gg) {
      const int g = g0 + gg;
      if (kGroupsPerStep > 1 && g >= g_end) break;
      __m512 sc[R], bi[R];
      group_params<BITS, R>(p, n, g, sc, bi);
      _Pragma("GCC unroll 4") for (int j = 0; j < kPairsPerGroup; ++j) {
        const int c = 2 * (g * kPairsPerGroup + j), u = (gg * kPairsPerGroup + j) % 2;
        _Pragma("GCC unroll 2") for (int r = 0; r < R; ++r) {
          if (p.prefetch()) prefetch_ahead(wr + r * words + c * BITS / 2);
          __m512 w0, w1;
          dequant_pair<BITS>(wr + r * words, c, sc[r], bi[r], w0, w1);
          const __m512bh wb = _mm512_cvtne2ps_pbh(w1, w0);
          _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) {
            const __m512bh xv = (__m512bh)_mm512_load_si512(p.xb + m * xs + 16 * c);
            acc[r][m][u] = _mm512_dpbf16_ps(acc[r][m][u], wb, xv);
          }
        }
      }
    }
  }
  carry_out<R, M>(acc, p, n, g_end == groups, carry, Reduce16{});
}

template <int BITS, int GS, int M>
BF16_FN void rows_bf16_small(const Problem& p, int n0, int n1, int g0, int g1, Carry carry) {
  int n = n0;
  if constexpr (M == 1) {
    for (; n + 2 <= n1; n += 2) rows_bf16_regs<BITS, GS, 2, 1>(p, n, g0, g1, carry);
  }
  for (; n < n1; ++n) rows_bf16_regs<BITS, GS, 1, M>(p, n, g0, g1, carry);
}

template <int BITS, int GS>
BF16_FN void rows_bf16_group(const Problem& q, int t0, int t1, int g0, int g1, Carry carry) {
  with_rows(q.m, [&](auto m) { rows_bf16_small<BITS, GS, decltype(m)::value>(q, t0, t1, g0, g1, carry); });
}

// Output rows [n0, n1) for M <= kTiledMaxRows activation rows, as the f32 path's windows
// (window_blocks; blocks of an even number of groups for group size 32, whose pairs alternate
// accumulators across groups).
template <int BITS, int GS>
BF16_FN void rows_bf16_gs(const Problem& p, int n0, int n1) {
  // One row (a decode step): one pass over all rows, as the f32 path; windows: tiles of 16.
  const int tile_rows = p.m == 1 ? n1 - n0 : kTileRows;
  window_blocks(p, n0, n1, sizeof(uint16_t), GS == 32 ? 2 : 1, tile_rows, rows_bf16_group<BITS, GS>);
}

template <int BITS>
BF16_FN void rows_bf16(const Problem& p, int n0, int n1) {
  if (p.gs == 32) return rows_bf16_gs<BITS, 32>(p, n0, n1);
  if (p.gs == 64) return rows_bf16_gs<BITS, 64>(p, n0, n1);
  rows_bf16_gs<BITS, 128>(p, n0, n1);
}
#else
bool cpu_has_avx512_bf16() { return false; }
#endif

// ---------------------------------------------------------------------------------------
// int8 precision (opt-in; mlx-core's `Precision::Int8`): llama.cpp's arithmetic on MLX's
// weights. Each block of 32 activations is quantized to int8 with its own scale (llama.cpp's
// Q8_0: d = amax / 127, q = round(x / d), ties to even), once per call (`prepare_int8_row`),
// and each block's product with the 4- or 8-bit weight codes is an exact integer dot product
// (`vpdpbusd`, AVX512_VNNI: 64 multiply-adds an instruction). With `w = scale_g * q + bias_g`,
// output element (m, n) is, in f32, one accumulator over the row's groups g in order:
//   for each block b of 32 columns in g, in order:
//     i   = sum_{k in b} q[n, k] * xq[m, k]          exact int32 (any order gives it)
//     acc = fma(f32(i) * d[m, b], scale_g, acc)
//   acc = fma(bias_g, xsum[m, g], acc)                xsum: the f32 sum of x over g (group_sum)
// where the bias term needs no rounding of x. Since the integer sums are exact, every layout
// of the weights gives the same bits: the repacked copy (Panels: 16 output features a vector,
// 4 columns a lane, `rows_int8_panels`), MLX's rows (`rows_int8`) and the scalar
// `rows_int8_portable`; and a row's result does not depend on the number of rows.
constexpr int kInt8 = 2;

// One block of 32 activations quantized: d = amax / 127, codes round(x / d) (ties to even).
float quantize_block(const float* x, int8_t* q) {
  float amax = 0;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.f, id = d != 0 ? 1.f / d : 0.f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * id), -127.f, 127.f));
  return d;
}

// The f32 sum of a scale group of x: element i into lane i % 16 in order, then
// reduce16_portable (the vector path's order).
float group_sum(const float* x, int gs) {
  float lanes[16] = {};
  for (int i = 0; i < gs; ++i) lanes[i % 16] += x[i];
  return reduce16_portable(lanes);
}

#ifdef MLXSYS_X86
// quantize_block and group_sum with AVX-512 (the same operations: the maximum is exact,
// VCVTPS2DQ rounds to nearest even as nearbyint does, the codes lie in [-127, 127]).
AVX512_FN float quantize_block_avx512(const float* x, int8_t* q) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float d = amax / 127.f, id = d != 0 ? 1.f / d : 0.f;
  const __m512 v = _mm512_set1_ps(id);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, v))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, v))));
  return d;
}
AVX512_FN float group_sum_avx512(const float* x, int gs) {
  __m512 acc = _mm512_setzero_ps();
  for (int i = 0; i < gs; i += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + i));
  return reduce16(acc);
}
#endif

// Row r of p's x -> its scale groups' sums, Problem::xs (see there) at xs + r * groups().
// Every instruction set gives the same bits.
void group_sums_row(const Problem& p, int r, bool vector, float* xs) {
  const float* xr = p.x + static_cast<size_t>(r) * p.k;
  float* sums = xs + static_cast<size_t>(r) * p.groups();
  for (int g = 0; g < p.groups(); ++g) {
#ifdef MLXSYS_X86
    if (vector) {
      sums[g] = group_sum_avx512(xr + g * p.gs, p.gs);
      continue;
    }
#endif
    sums[g] = group_sum(xr + g * p.gs, p.gs);
  }
  (void)vector;
}

// Row r of p's x -> its Problem::xq / xd / xs (see there; codes and scales past K zero).
// Every instruction set gives the same bits.
void prepare_int8_row(const Problem& p, int r, bool vector, int8_t* xq, float* xd, float* xs) {
  const int blocks = p.k / 32;
  const float* xr = p.x + static_cast<size_t>(r) * p.k;
  int8_t* qr = xq + static_cast<size_t>(r) * p.k64();
  float* dr = xd + static_cast<size_t>(r) * p.blocks();
  std::fill(qr + 32 * blocks, qr + p.k64(), 0);
  std::fill(dr + blocks, dr + p.blocks(), 0.f);
  for (int b = 0; b < blocks; ++b) {
#ifdef MLXSYS_X86
    if (vector) {
      dr[b] = quantize_block_avx512(xr + 32 * b, qr + 32 * b);
      continue;
    }
#endif
    dr[b] = quantize_block(xr + 32 * b, qr + 32 * b);
  }
  group_sums_row(p, r, vector, xs);
}

// The f32 step of one block (the definition above), shared by the row kernels (the panel
// kernel does the same two operations on 16 features at once).
inline float int8_block_step(int32_t dot, float d, float scale, float acc) {
  const float t = static_cast<float>(dot) * d;
  return std::fma(t, scale, acc);
}

void rows_int8_portable(const Problem& p, int n0, int n1) {
  const int per_word = 32 / p.bits, blocks_per_group = p.gs / 32;
  const uint32_t mask = (1u << p.bits) - 1;
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = p.w_row(n);
    for (int m = 0; m < p.m; ++m) {
      const int8_t* xq = p.xq + static_cast<size_t>(m) * p.k64();
      const float* xd = p.xd + static_cast<size_t>(m) * p.blocks();
      const float* xs = p.xs + static_cast<size_t>(m) * p.groups();
      float acc = 0;
      for (int g = 0; g < p.groups(); ++g) {
        for (int b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
          int32_t dot = 0;
          for (int i = 32 * b; i < 32 * b + 32; ++i) {
            dot += static_cast<int32_t>((wr[i / per_word] >> ((i % per_word) * p.bits)) & mask) * xq[i];
          }
          acc = int8_block_step(dot, xd[b], p.s_row(n)[g], acc);
        }
        acc = std::fma(p.b_row(n)[g], xs[g], acc);
      }
      p.out[static_cast<size_t>(m) * p.n + n] = acc;
    }
  }
}

#ifdef MLXSYS_X86
#define INT8_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"))) inline
#define INT8_FN_ALWAYS __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"), always_inline)) inline

bool cpu_has_avx512_vnni() {
  static const bool yes = cpu_has_avx512() && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return yes;
}
// The 8-bit panels' byte permutation (VPERMT2B) is AVX512_VBMI.
bool cpu_has_avx512_vbmi() {
  static const bool yes = cpu_has_avx512_vnni() && __builtin_cpu_supports("avx512vbmi");
  return yes;
}

// The 32 codes of block b (32 columns) of a packed weight row, as bytes in column order.
template <int BITS>
AVX2_FN_ALWAYS __m256i block_codes(const uint32_t* wr, int b) {
  const uint8_t* at = reinterpret_cast<const uint8_t*>(wr);
  if constexpr (BITS == 4) {  // byte j holds columns 2j (low nibble) and 2j + 1
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16 * b));
    const __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    return _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * b));
  }
}

// The exact integer dot product of 32 codes with 32 activation codes.
INT8_FN_ALWAYS int32_t block_dot(__m256i w, const int8_t* xq) {
  const __m256i dots = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
  const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(dots), _mm256_extracti128_si256(dots, 1));
  const __m128i two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
  return _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 1)));
}

// Output rows [n0, n1) from MLX's rows (matrices without a repacked copy): each block's
// codes decoded once for all activation rows (at most kTiledMaxRows, run_rows).
template <int BITS>
INT8_FN void rows_int8(const Problem& p, int n0, int n1) {
  const int blocks_per_group = p.gs / 32;
  float acc[kTiledMaxRows];
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = p.w_row(n);
    std::fill(acc, acc + p.m, 0.f);
    for (int g = 0; g < p.groups(); ++g) {
      const float scale = p.s_row(n)[g], bias = p.b_row(n)[g];
      for (int b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const __m256i w = block_codes<BITS>(wr, b);
        for (int m = 0; m < p.m; ++m) {
          const int32_t dot = block_dot(w, p.xq + static_cast<size_t>(m) * p.k64() + 32 * b);
          acc[m] = int8_block_step(dot, p.xd[static_cast<size_t>(m) * p.blocks() + b], scale, acc[m]);
        }
      }
      for (int m = 0; m < p.m; ++m) acc[m] = std::fma(bias, p.xs[static_cast<size_t>(m) * p.groups() + g], acc[m]);
    }
    for (int m = 0; m < p.m; ++m) p.out[static_cast<size_t>(m) * p.n + n] = acc[m];
  }
}

// The exact integer dot product of one block's 32 codes, widened to 16 bits (`w0`: columns
// 0-15, `w1`: 16-31), with 32 activation codes, on AVX2 (CPUs without AVX512_VNNI):
// VPMADDWD multiplies the 16-bit pairs into 32-bit sums (a code times an activation code is at
// most 255 * 127 in magnitude, a pair twice that), so the sum is exact as VPDPBUSD's.
AVX2_FN_ALWAYS int32_t block_dot_avx2(__m256i w0, __m256i w1, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  const __m256i x0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(x)), x1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(x, 1));
  const __m256i dots = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
  const __m128i four = _mm_add_epi32(_mm256_castsi256_si128(dots), _mm256_extracti128_si256(dots, 1));
  const __m128i two = _mm_add_epi32(four, _mm_unpackhi_epi64(four, four));
  return _mm_cvtsi128_si32(_mm_add_epi32(two, _mm_shuffle_epi32(two, 1)));
}

// One activation row: R weight rows at a time, their accumulators in registers (a single
// row's chain of f32 steps through memory left a one-token product latency-bound).
template <int BITS, int R>
AVX2_FN_ALWAYS void rows_int8_avx2_one(const Problem& p, int n) {
  const int blocks_per_group = p.gs / 32, groups = p.groups();
  float acc[R] = {};
  for (int g = 0; g < groups; ++g) {
    for (int b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
      _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
        const __m256i w = block_codes<BITS>(p.w_row(n + r), b);
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)), w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
        acc[r] = int8_block_step(block_dot_avx2(w0, w1, p.xq + 32 * b), p.xd[b], p.s_row(n + r)[g], acc[r]);
      }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) acc[r] = std::fma(p.b_row(n + r)[g], p.xs[g], acc[r]);
  }
  _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) p.out[n + r] = acc[r];
}

// rows_int8 on AVX2: each block's codes decoded and widened once for all activation rows (at
// most kTiledMaxRows, run_rows), the same integer sums and f32 steps, so the same bits.
template <int BITS>
AVX2_FN void rows_int8_avx2(const Problem& p, int n0, int n1) {
  if (p.m == 1) {
    int n = n0;
    for (; n + 4 <= n1; n += 4) rows_int8_avx2_one<BITS, 4>(p, n);
    for (; n < n1; ++n) rows_int8_avx2_one<BITS, 1>(p, n);
    return;
  }
  const int blocks_per_group = p.gs / 32;
  float acc[kTiledMaxRows];
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wr = p.w_row(n);
    const float *s = p.s_row(n), *bias = p.b_row(n);
    std::fill(acc, acc + p.m, 0.f);
    for (int g = 0; g < p.groups(); ++g) {
      for (int b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        const __m256i w = block_codes<BITS>(wr, b);
        const __m256i w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(w)), w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(w, 1));
        for (int m = 0; m < p.m; ++m) {
          const int32_t dot = block_dot_avx2(w0, w1, p.xq + static_cast<size_t>(m) * p.k64() + 32 * b);
          acc[m] = int8_block_step(dot, p.xd[static_cast<size_t>(m) * p.blocks() + b], s[g], acc[m]);
        }
      }
      for (int m = 0; m < p.m; ++m) acc[m] = std::fma(bias[g], p.xs[static_cast<size_t>(m) * p.groups() + g], acc[m]);
    }
    for (int m = 0; m < p.m; ++m) p.out[static_cast<size_t>(m) * p.n + n] = acc[m];
  }
}

// int8 precision on AVX2 from a 4-bit matrix's repacked copy (CPUs without AVX512_VNNI, with
// F16C): the broadcast form of int8_panel. Byte c of panel word j holds the codes of features
// j (low nibble) and j + 16 (high nibble) at column 4i + c, so one AND (and a shift for the
// high nibbles) leaves in each 32-bit lane the 4 codes of one feature, and VPMADDUBSW with the
// row's 4 activation codes broadcast gives two 16-bit pair sums per feature. A code is at most
// 15 and an activation code at most 127 in magnitude, so a pair sum is at most 3,810 and the 8
// quads of a block at most 30,480: the block's sums stay exact in 16 bits, and one VPMADDWD
// per block makes them the exact int32 dot products. The f32 steps are int8_panel's, so the
// bits are those of every other int8 path. Panel q, halves [H0, H0 + H), rows m0 .. m0 + M - 1.
template <int M, int H0, int H>
PANEL2_FN_ALWAYS void int8_panel_avx2(const Problem& p, int q, int m0) {
  const Panels& pn = *p.panels;
  const size_t k64 = static_cast<size_t>(p.k64()), nb = static_cast<size_t>(p.blocks());
  const int8_t* xq = p.xq + m0 * k64;
  const float* xd = p.xd + m0 * nb;
  const float* xs = p.xs + static_cast<size_t>(m0) * p.groups();
  const uint8_t* wq = pn.panel_w(q);
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[M][H][2];
  _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
    _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) acc[m][h][0] = acc[m][h][1] = _mm256_setzero_ps();
  for (int g = 0, b = 0; g < p.groups(); ++g) {
    for (int bg = 0; bg < p.gs / 32; ++bg, ++b) {
      __m256i dot[M][H][2];
      _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
        _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) dot[m][h][0] = dot[m][h][1] = _mm256_setzero_si256();
      _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i, wq += pn.quad_bytes()) {
        _mm_prefetch(reinterpret_cast<const char*>(wq) + kPanelPrefetchBytes, _MM_HINT_T0);
        __m256i codes[H][2];
        _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
          const __m256i half = _mm256_load_si256(reinterpret_cast<const __m256i*>(wq + 32 * v));
          _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) {
            codes[h][v] = _mm256_and_si256(H0 + h == 0 ? half : _mm256_srli_epi32(half, 4), nibble);
          }
        }
        _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
          int32_t four;
          std::memcpy(&four, xq + m * k64 + 32 * b + 4 * i, sizeof four);
          const __m256i xb = _mm256_set1_epi32(four);
          _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h)
            _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
              dot[m][h][v] = _mm256_add_epi16(dot[m][h][v], _mm256_maddubs_epi16(codes[h][v], xb));
            }
        }
      }
      _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h)
        _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
          const __m256 sc = panel_group8(pn, q, g, 16 * (H0 + h) + 8 * v, false);
          _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
            const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[m][h][v], ones));
            acc[m][h][v] = _mm256_fmadd_ps(_mm256_mul_ps(sums, _mm256_set1_ps(xd[m * nb + b])), sc, acc[m][h][v]);
          }
        }
    }
    _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h)
      _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
        const __m256 bi = panel_group8(pn, q, g, 16 * (H0 + h) + 8 * v, true);
        _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
          acc[m][h][v] = _mm256_fmadd_ps(bi, _mm256_set1_ps(xs[static_cast<size_t>(m) * p.groups() + g]), acc[m][h][v]);
        }
      }
  }
  _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
    _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) {
      float* out = p.out + static_cast<size_t>(m0 + m) * p.n + kPanelCols * q + 16 * (H0 + h);
      _mm256_storeu_ps(out, acc[m][h][0]);
      _mm256_storeu_ps(out + 8, acc[m][h][1]);
    }
}

// The sum of a block's 32 activation codes (VPSADBW on the codes + 128, less 32 * 128).
AVX2_FN_ALWAYS int32_t block_code_sum(const int8_t* xq) {
  const __m256i biased = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)), _mm256_set1_epi8(-128));
  const __m256i sums = _mm256_sad_epu8(biased, _mm256_setzero_si256());
  const __m128i two = _mm_add_epi64(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
  return _mm_cvtsi128_si32(_mm_add_epi64(two, _mm_unpackhi_epi64(two, two))) - 32 * 128;
}

// int8 precision on AVX2 from an 8-bit matrix's repacked copy (CPUs without AVX512_VNNI, with
// F16C). Quad i holds column 4i + c of the panel's 32 features at bytes 32c .. 32c + 31; byte
// unpacks of columns (0, 1) and (2, 3), then word unpacks of the two, leave in each 32-bit lane
// the 4 codes of one feature (what VPERMT2B does on AVX-512): from the low bytes (h = 0) or the
// high ones (h = 1), t[h][0] holds features 8h + 0..3 | 16 + 8h + 0..3 and t[h][1] features
// 8h + 4..7 | 16 + 8h + 4..7. A code c (up to 255) times an activation code a (|a| <= 127)
// would saturate VPMADDUBSW's 16-bit pair sums, so the kernel takes c' = c - 128 (the code XOR
// 0x80 as a signed byte) and multiplies |c'| (at most 128, unsigned) with a * sign(c')
// (VPSIGNB): a pair sum is at most 2 * 128 * 127 = 32,512, exact, VPMADDWD with ones widens
// the two pairs of a lane to an exact int32, and the block's dot product is
// sum c' a + 128 * sum a (block_code_sum): exact, as VPDPBUSD's. The f32 steps are
// int8_panel's, so the bits are those of every other int8 path. Halves [H0, H0 + H) (features
// 8h .. 8h + 7 and 16 + 8h .. 16 + 8h + 7), rows m0 .. m0 + M - 1.
template <int M, int H0, int H>
PANEL2_FN_ALWAYS void int8_panel8_avx2(const Problem& p, int q, int m0) {
  const Panels& pn = *p.panels;
  const size_t k64 = static_cast<size_t>(p.k64()), nb = static_cast<size_t>(p.blocks());
  const int8_t* xq = p.xq + m0 * k64;
  const float* xd = p.xd + m0 * nb;
  const float* xs = p.xs + static_cast<size_t>(m0) * p.groups();
  const uint8_t* wq = pn.panel_w(q);
  const __m256i flip = _mm256_set1_epi8(-128), ones = _mm256_set1_epi16(1);
  __m256 acc[M][H][2];  // [h][v]: features 8 (H0 + h) + 16 v .. + 7
  _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
    _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) acc[m][h][0] = acc[m][h][1] = _mm256_setzero_ps();
  for (int g = 0, b = 0; g < p.groups(); ++g) {
    for (int bg = 0; bg < p.gs / 32; ++bg, ++b) {
      __m256i dot[M][H][2];
      _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
        _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) dot[m][h][0] = dot[m][h][1] = _mm256_setzero_si256();
      _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i, wq += pn.quad_bytes()) {
        _mm_prefetch(reinterpret_cast<const char*>(wq) + kPanelPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wq) + kPanelPrefetchBytes + 64, _MM_HINT_T0);
        __m256i c[4];
        _Pragma("GCC unroll 4") for (int kk = 0; kk < 4; ++kk) {
          c[kk] = _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(wq + kPanelCols * kk)), flip);
        }
        __m256i t[H][2], mag[H][2];
        _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h) {
          const __m256i c01 = H0 + h == 0 ? _mm256_unpacklo_epi8(c[0], c[1]) : _mm256_unpackhi_epi8(c[0], c[1]);
          const __m256i c23 = H0 + h == 0 ? _mm256_unpacklo_epi8(c[2], c[3]) : _mm256_unpackhi_epi8(c[2], c[3]);
          t[h][0] = _mm256_unpacklo_epi16(c01, c23);
          t[h][1] = _mm256_unpackhi_epi16(c01, c23);
          mag[h][0] = _mm256_abs_epi8(t[h][0]);
          mag[h][1] = _mm256_abs_epi8(t[h][1]);
        }
        _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
          int32_t four;
          std::memcpy(&four, xq + m * k64 + 32 * b + 4 * i, sizeof four);
          const __m256i xb = _mm256_set1_epi32(four);
          _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h)
            _Pragma("GCC unroll 2") for (int j = 0; j < 2; ++j) {
              const __m256i pairs = _mm256_maddubs_epi16(mag[h][j], _mm256_sign_epi8(xb, t[h][j]));
              dot[m][h][j] = _mm256_add_epi32(dot[m][h][j], _mm256_madd_epi16(pairs, ones));
            }
        }
      }
      _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
        const __m256i shift = _mm256_set1_epi32(128 * block_code_sum(xq + m * k64 + 32 * b));
        const __m256 d = _mm256_set1_ps(xd[m * nb + b]);
        _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h)
          _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
            const __m256i lanes = _mm256_permute2x128_si256(dot[m][h][0], dot[m][h][1], v == 0 ? 0x20 : 0x31);
            const __m256 sums = _mm256_cvtepi32_ps(_mm256_add_epi32(lanes, shift));
            const __m256 sc = panel_group8(pn, q, g, 8 * (H0 + h) + 16 * v, false);
            acc[m][h][v] = _mm256_fmadd_ps(_mm256_mul_ps(sums, d), sc, acc[m][h][v]);
          }
      }
    }
    _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h)
      _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
        const __m256 bi = panel_group8(pn, q, g, 8 * (H0 + h) + 16 * v, true);
        _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m) {
          acc[m][h][v] = _mm256_fmadd_ps(bi, _mm256_set1_ps(xs[static_cast<size_t>(m) * p.groups() + g]), acc[m][h][v]);
        }
      }
  }
  _Pragma("GCC unroll 4") for (int m = 0; m < M; ++m)
    _Pragma("GCC unroll 2") for (int h = 0; h < H; ++h)
      _Pragma("GCC unroll 2") for (int v = 0; v < 2; ++v) {
        _mm256_storeu_ps(p.out + static_cast<size_t>(m0 + m) * p.n + kPanelCols * q + 8 * (H0 + h) + 16 * v, acc[m][h][v]);
      }
}

// Panel q of a 4- or 8-bit product in int8 precision on AVX2, halves [H0, H0 + H), rows
// m0 .. m0 + M - 1.
template <int BITS, int M, int H0, int H>
PANEL2_FN_ALWAYS void int8_panel_pass_avx2(const Problem& p, int q, int m0) {
  if constexpr (BITS == 4) int8_panel_avx2<M, H0, H>(p, q, m0);
  else int8_panel8_avx2<M, H0, H>(p, q, m0);
}

// Output rows [n0, n1) (whole panels) of a 4- or 8-bit product in int8 precision on AVX2: one
// activation row over the whole panel (8 accumulators, 4 of them integer), more rows two at a
// time, a half panel at a time (16 registers); 8-bit ones four rows a pass first (each quad's
// unpacks then serve four rows: `qmm_profile 4,11 49152x576x8g32`: 4 rows 0.72-0.79x, 11
// rows 0.84-0.90x the time of two-row passes).
template <int BITS>
PANEL2_FN void rows_int8_panels_avx2(const Problem& p, int n0, int n1) {
  for (int q = n0 / kPanelCols; q < n1 / kPanelCols; ++q) {
    if (p.m == 1) {
      int8_panel_pass_avx2<BITS, 1, 0, 2>(p, q, 0);
      continue;
    }
    int m0 = 0;
    if constexpr (BITS == 8) {
      for (; m0 + 4 <= p.m; m0 += 4) {
        int8_panel_pass_avx2<BITS, 4, 0, 1>(p, q, m0);
        int8_panel_pass_avx2<BITS, 4, 1, 1>(p, q, m0);
      }
    }
    for (; m0 + 2 <= p.m; m0 += 2) {
      int8_panel_pass_avx2<BITS, 2, 0, 1>(p, q, m0);
      int8_panel_pass_avx2<BITS, 2, 1, 1>(p, q, m0);
    }
    if (m0 < p.m) int8_panel_pass_avx2<BITS, 1, 0, 2>(p, q, m0);
  }
}

// VPERMT2B (AVX512_VBMI): byte i of the result is byte idx[i] % 128 of the 128 bytes a, b. As
// assembly, so that the kernels need no VBMI target: only 8-bit panels run it, on CPUs that
// have it (uses_panels).
INT8_FN_ALWAYS __m512i permute_bytes(__m512i a, __m512i idx, __m512i b) {
  asm("vpermt2b %2, %1, %0" : "+v"(a) : "v"(idx), "v"(b));
  return a;
}

// The codes of one quad (4 columns) of a panel as VPDPBUSD operands: lane j of `lo` | `hi`
// holds the 4 columns' codes of feature j | 16 + j, column order.
template <int BITS>
INT8_FN_ALWAYS void panel_codes(const uint8_t* quad, __m512i& lo, __m512i& hi) {
  if constexpr (BITS == 4) {  // byte c of word j: feature j (low nibble), j + 16, column c
    const __m512i v = _mm512_load_si512(quad), nibble = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(v, nibble);
    hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble);
  } else {  // byte 32c + l: feature l, column c; byte 4j + c of a lane <- 32c + j (+ 16)
    alignas(64) static constexpr uint8_t kLo[64] = {
        0,  32, 64, 96,  1,  33, 65, 97,  2,  34, 66, 98,  3,  35, 67, 99,  4,  36, 68, 100, 5,  37,
        69, 101, 6,  38, 70, 102, 7,  39, 71, 103, 8,  40, 72, 104, 9,  41, 73, 105, 10, 42, 74, 106,
        11, 43, 75, 107, 12, 44, 76, 108, 13, 45, 77, 109, 14, 46, 78, 110, 15, 47, 79, 111};
    const __m512i a = _mm512_load_si512(quad), b = _mm512_load_si512(quad + 64);
    const __m512i idx = _mm512_load_si512(kLo);
    lo = permute_bytes(a, idx, b);
    hi = permute_bytes(a, _mm512_add_epi8(idx, _mm512_set1_epi8(16)), b);
  }
}

// Panel q (features 32q .. 32q + 31) for the M activation rows from m0: per block, the
// integer dot products of all 32 features in two vectors per row, then the f32 steps.
template <int BITS, int M>
INT8_FN_ALWAYS void int8_panel(const Problem& p, int q, int m0) {
  const Panels& pn = *p.panels;
  const size_t k64 = static_cast<size_t>(p.k64()), nb = static_cast<size_t>(p.blocks()), half = 16 * pn.value_bytes();
  const int8_t* xq = p.xq + m0 * k64;
  const float* xd = p.xd + m0 * nb;
  const float* xs = p.xs + static_cast<size_t>(m0) * p.groups();
  const bool prefetch = p.prefetch();
  const uint8_t* wq = pn.panel_w(q);
  __m512 acc[M][2];
  _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int g = 0, b = 0; g < p.groups(); ++g) {
    const __m512 sc[2] = {panel_values(pn.format, pn.group_s(q, g)), panel_values(pn.format, pn.group_s(q, g) + half)};
    for (int bg = 0; bg < p.gs / 32; ++bg, ++b) {
      __m512i dot[M][2];
      _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
      _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i, wq += pn.quad_bytes()) {
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wq) + kPrefetchBytes, _MM_HINT_T0);
        __m512i lo, hi;
        panel_codes<BITS>(wq, lo, hi);
        _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) {
          int32_t four;
          std::memcpy(&four, xq + m * k64 + 32 * b + 4 * i, sizeof four);
          const __m512i xb = _mm512_set1_epi32(four);
          dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], lo, xb);
          dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], hi, xb);
        }
      }
      _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) {
        const __m512 d = _mm512_set1_ps(xd[m * nb + b]);
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) {
          acc[m][h] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][h]), d), sc[h], acc[m][h]);
        }
      }
    }
    const __m512 bi[2] = {panel_values(pn.format, pn.group_b(q, g)), panel_values(pn.format, pn.group_b(q, g) + half)};
    _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) {
      const __m512 xsum = _mm512_set1_ps(xs[static_cast<size_t>(m) * p.groups() + g]);
      _Pragma("GCC unroll 2") for (int h = 0; h < 2; ++h) acc[m][h] = _mm512_fmadd_ps(bi[h], xsum, acc[m][h]);
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < M; ++m) {
    float* out = p.out + static_cast<size_t>(m0 + m) * p.n + kPanelCols * q;
    _mm512_storeu_ps(out, acc[m][0]);
    _mm512_storeu_ps(out + 16, acc[m][1]);
  }
}

// Activation rows a pass of int8_panel takes (4 accumulators each, 2 of them integer).
constexpr int kInt8PanelRows = 6;

// Output rows [n0, n1) (whole panels) from the repacked copy, the activation rows in
// balanced groups of at most kInt8PanelRows (11 -> 6 + 5), each group over the panel.
template <int BITS>
INT8_FN void rows_int8_panels(const Problem& p, int n0, int n1) {
  const auto [parts, per] = balanced(p.m, kInt8PanelRows);
  for (int q = n0 / kPanelCols; q < n1 / kPanelCols; ++q) {
    for (int m0 = 0; m0 < p.m; m0 += per) {
      switch (std::min(per, p.m - m0)) {
        case 1: int8_panel<BITS, 1>(p, q, m0); break;
        case 2: int8_panel<BITS, 2>(p, q, m0); break;
        case 3: int8_panel<BITS, 3>(p, q, m0); break;
        case 4: int8_panel<BITS, 4>(p, q, m0); break;
        case 5: int8_panel<BITS, 5>(p, q, m0); break;
        default: int8_panel<BITS, 6>(p, q, m0); break;
      }
    }
  }
  (void)parts;
}
#else
bool cpu_has_avx512_vnni() { return false; }
bool cpu_has_avx512_vbmi() { return false; }
#endif

// Instruction sets, best last; each call's `max_isa` caps the choice (tests compare them).
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"portable", "avx2+fma", "avx512f"};

std::atomic<uint64_t> g_calls{0};

// The best instruction set the CPU has, capped at `max_isa` (the caller's kernel policy).
int isa(int max_isa) {
  int best = cpu_has_avx512() ? kAvx512 : cpu_has_avx2() ? kAvx2 : kPortable;
  return std::clamp(std::min(best, max_isa), static_cast<int>(kPortable), static_cast<int>(kAvx512));
}

// Whether bf16 precision runs on the AVX512_BF16 kernels at instruction-set level `level`
// (else on rows_bf16_portable: the same bits, slower).
bool bf16_vector(int level) { return level == kAvx512 && cpu_has_avx512_bf16(); }

// Whether int8 precision runs on the AVX512_VNNI kernels at level `level` (else on
// rows_int8_avx2 from AVX2 up, rows_int8_portable below: the same bits, slower).
bool int8_vector(int level) { return level == kAvx512 && cpu_has_avx512_vnni(); }

// Whether a product goes to the GEMM (rows_gemm, rows_gemm_avx2): prompt chunks in f32
// precision on AVX-512, of 4- and 8-bit matrices on AVX2 + FMA (dense ones go to BLAS there:
// OpenBLAS has AVX2 kernels for the CPUs that have AVX2 and no AVX-512, and its sgemm beat
// this GEMM's dense path, `qmm_profile 512 ..x32g32`: 85 against 74 G multiply-adds a second).
bool uses_gemm(const Problem& p, int level, int precision) {
#ifdef MLXSYS_X86
  if (level == kAvx2 && p.bits == kDense) return false;
  return level >= kAvx2 && precision == kF32 && p.m > (p.bits == kDense ? kDenseWindowMaxRows : kWindowMaxRows);
#else
  return false;
#endif
}

// Whether a prompt chunk on the GEMM takes AMX's tile products (rows_amx): 4- and 8-bit
// matrices on a CPU with AMX-BF16, at level AVX-512.
bool uses_amx(const Problem& p, int level, int precision) {
  return level == kAvx512 && uses_gemm(p, level, precision) && (p.bits == 4 || p.bits == 8) && cpu_has_amx_bf16();
}

// Whether a product reads its matrix's panels: 4- and 8-bit matrices of whole panels on
// AVX-512, in f32 precision computed on them (rows_panels) or, prompt chunks, packed from them
// for the GEMM (gemm_pack_panels); in int8 precision with VNNI (8 bits: and VBMI), computed on
// them (rows_int8_panels; group sizes 32, 64, 128); on AVX2 with F16C in f32 precision,
// computed on them (rows_panels_avx2), and in int8 precision without VNNI
// (rows_int8_panels_avx2; group sizes 32, 64, 128).
bool uses_panels(const Problem& p, int level, int precision) {
#ifdef MLXSYS_X86
  if (!panel_shape(p.bits, p.n, p.k, p.gs)) return false;
  if (precision == kInt8 && level >= kAvx2 && !int8_vector(level)) {  // rows_int8_panels_avx2
    return p.gs % 32 == 0 && cpu_has_f16c();
  }
  if (level == kAvx2) return precision == kF32 && cpu_has_f16c();
  if (level != kAvx512) return false;
  const bool int8 = int8_vector(level) && p.gs % 32 == 0 && (p.bits == 4 || cpu_has_avx512_vbmi());
  return precision == kF32 || (precision == kInt8 && int8);
#else
  return false;
#endif
}

void run_rows(const Problem& p, int n0, int n1, int level, int precision) {
  if (precision == kBf16 && !bf16_vector(level)) return rows_bf16_portable(p, n0, n1);
  if (precision == kInt8 && level < kAvx2) return rows_int8_portable(p, n0, n1);
  thread_local std::vector<float> row;
#ifdef MLXSYS_X86
  if (uses_gemm(p, level, precision)) {
    if (level == kAvx2) return p.bits == 4 ? rows_gemm_avx2<4>(p, n0, n1) : rows_gemm_avx2<8>(p, n0, n1);
    if (p.xa) return p.bits == 4 ? rows_amx<4>(p, n0, n1) : rows_amx<8>(p, n0, n1);
    switch (p.bits) {
      case 4: return rows_gemm<4>(p, n0, n1);
      case 8: return rows_gemm<8>(p, n0, n1);
      default: return rows_gemm<kDense>(p, n0, n1);
    }
  }
  if (p.panels && precision == kF32 && level == kAvx512) return p.bits == 4 ? rows_panels<4>(p, n0, n1) : rows_panels<8>(p, n0, n1);
  if (level >= kAvx2 && p.m > kTiledMaxRows) {
    // Prompt prefill: activation rows in balanced blocks of at most kTiledMaxRows (512 ->
    // 16 x 32), each a window on the register or tiled paths, whose x stays in L1/L2 while
    // the thread's weight rows (re-read per block, from L2) stream past it: 3-4x faster for
    // 512 rows than one pass of each weight row over all rows, which reads x from memory once
    // per weight row (`qmm_profile`). A row's FMAs do not depend on its block. Problem::xi
    // was packed by this split (register_groups): change both together.
    const auto [blocks, per] = balanced(p.m, kTiledMaxRows);
    for (int m0 = 0; m0 < p.m; m0 += per) run_rows(p.rows(m0, std::min(per, p.m - m0)), n0, n1, level, precision);
    return;
  }
  if (p.panels && precision == kF32) {
    if (p.bits == 8) return rows_panels_avx2<8, false>(p, n0, n1);
    return p.xt ? rows_panels_avx2<4, true>(p, n0, n1) : rows_panels_avx2<4, false>(p, n0, n1);
  }
  if (precision == kBf16) return p.bits == 4 ? rows_bf16<4>(p, n0, n1) : rows_bf16<8>(p, n0, n1);
  if (precision == kInt8 && !int8_vector(level)) {
    if (p.panels) return p.bits == 4 ? rows_int8_panels_avx2<4>(p, n0, n1) : rows_int8_panels_avx2<8>(p, n0, n1);
    return p.bits == 4 ? rows_int8_avx2<4>(p, n0, n1) : rows_int8_avx2<8>(p, n0, n1);
  }
  if (precision == kInt8 && p.panels) return p.bits == 4 ? rows_int8_panels<4>(p, n0, n1) : rows_int8_panels<8>(p, n0, n1);
  if (precision == kInt8) return p.bits == 4 ? rows_int8<4>(p, n0, n1) : rows_int8<8>(p, n0, n1);
  if (level == kAvx512) {
    switch (p.bits) {
      case 4: return rows_avx512<4>(p, n0, n1);
      case 8: return rows_avx512<8>(p, n0, n1);
      default: return rows_avx512<kDense>(p, n0, n1);
    }
  }
  if (level == kAvx2) {
    switch (p.bits) {
      case 4: return rows_avx2<4>(p, n0, n1);
      case 8: return rows_avx2<8>(p, n0, n1);
      default: return rows_avx2<kDense>(p, n0, n1);
    }
  }
#endif
  rows_portable(p, n0, n1, row);
}

// Weights per task below which one thread does the whole product.
constexpr size_t kParallelMinWeights = 1 << 15;

// Runs `rows(j, n0, n1)` over the output rows [0, n_rows[j]) of products j = 0.., split into
// chunks of a multiple of `align` rows (about 4 per thread) over the pool unless the work is
// small. A row is always computed whole by one call, so results do not depend on the split.
// `wanted` threads (0: the pool's count).
void split_rows(const std::vector<int>& n_rows, size_t work, const std::function<void(int, int, int)>& rows,
                int wanted, int align) {
  const int threads = Pool::get().threads(wanted);
  int total = 0;
  for (int n : n_rows) total += n;
  if (threads <= 1 || work < kParallelMinWeights || total < 16) {
    for (int j = 0; j < static_cast<int>(n_rows.size()); ++j) {
      if (n_rows[j] > 0) rows(j, 0, n_rows[j]);
    }
    return;
  }
  const int per = std::max(align, (total + 4 * threads - 1) / (4 * threads) + align - 1) / align * align;
  std::vector<std::array<int, 3>> chunks;
  for (int j = 0; j < static_cast<int>(n_rows.size()); ++j) {
    for (int n0 = 0; n0 < n_rows[j]; n0 += per) chunks.push_back({j, n0, std::min(n_rows[j], n0 + per)});
  }
  Pool::get().run(
      static_cast<int>(chunks.size()), [&](int i) { rows(chunks[i][0], chunks[i][1], chunks[i][2]); },
      Pool::Linger::kLong, threads);
}

// How the products of one call are returned: each as its own output, or (SwiGLU, two
// products `gate` and `up`) as the single output silu(gate) * up.
enum class Combine { kNone = 0, kSwiglu = 1 };

// out[m, n] = silu(gate[m, n]) * up[m, n] for n in [n0, n1), every m. Whole vectors of 8 from
// n0, then scalars: chunk bounds are multiples of 8, so an element takes the same path
// whatever the split or the number of rows.
void swiglu_rows(const float* gate, const float* up, float* out, int m, int n, int n0, int n1, int level) {
  for (int r = 0; r < m; ++r) {
    const size_t base = static_cast<size_t>(r) * n;
    int i = n0;
#ifdef MLXSYS_X86
    if (level >= kAvx2) i = swiglu_avx2(gate + base, up + base, out + base, n0, n1);
#endif
    for (; i < n1; ++i) out[base + i] = simd::silu(gate[base + i]) * up[base + i];
  }
}

// Products of one x [M, K] with matrices ps[j] (same K, bits and group size).
void compute(std::vector<Problem>& ps, Combine combine, float* combined_out, int level, int precision,
             int threads) {
  const Problem& p0 = ps[0];
  if (precision == kBf16) {
    // Activations rounded to bf16 once, in chunk-pair lane order, 64-byte aligned.
    thread_local std::vector<uint16_t> xb;
    uint16_t* aligned = aligned64(xb, static_cast<size_t>(p0.m) * p0.k);
#ifdef MLXSYS_X86
    if (bf16_vector(level)) prepare_bf16(p0.x, p0.m, p0.k, p0.bits, aligned);
    else
#endif
      prepare_bf16_portable(p0.x, p0.m, p0.k, p0.bits, aligned);
    for (auto& p : ps) p.xb = aligned;
  }
  if (precision == kInt8) {
    // Activations quantized once, 64-byte aligned (rows of k64 bytes and k64 / 4 floats).
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> xd, xs;
    int8_t* q = aligned64(xq, p0.m * static_cast<size_t>(p0.k64()));
    float* d = aligned64(xd, p0.m * static_cast<size_t>(p0.blocks()));
    xs.resize(static_cast<size_t>(p0.m) * p0.groups());
    // Rows go to the pool's threads: pass this thread's buffers, not the names of thread_locals.
    const bool vector = int8_vector(level);
    float* sums = xs.data();
    auto rows = [&p0, vector, q, d, sums](int r) { prepare_int8_row(p0, r, vector, q, d, sums); };
    if (p0.m >= 8) {
      Pool::get().run(p0.m, rows, Pool::Linger::kLong, threads);
    } else {
      for (int r = 0; r < p0.m; ++r) rows(r);
    }
    for (auto& p : ps) {
      p.xq = q;
      p.xd = d;
      p.xs = sums;
    }
  }
  // The SIMD kernels read x from a 64-byte aligned copy: a 16-lane load that straddles two
  // cache lines costs two, and x is read once per weight row (measured, interleaved runs: windows
  // of 11 rows 1.25x faster; one-row products unchanged).
  // Only the x86 kernels use it: elsewhere `level` is always kPortable.
  const bool panels = std::any_of(ps.begin(), ps.end(), [](const Problem& p) { return p.panels; });
#ifdef MLXSYS_X86
  const bool rows = std::any_of(ps.begin(), ps.end(), [](const Problem& p) { return !p.panels; });
  thread_local std::vector<float> x_copy, x_blocks;
  const bool windows = level >= kAvx2 && precision == kF32 && !uses_gemm(p0, level, precision);
  const size_t len = static_cast<size_t>(p0.m) * p0.k;
  if (windows && level == kAvx512 && rows) {
    // The register kernels' copy (Problem::xi).
    float* aligned = aligned64(x_blocks, len);
    interleave_x(p0.x, p0.m, p0.k, p0.bits == 4, aligned);
    for (auto& p : ps) p.xi = aligned;
  }
  if (windows && (level == kAvx2 || (p0.bits == kDense && p0.m > 1))) {
    // The tiled paths' copy (AVX2 windows, dense weights' windows on AVX-512), rows as given.
    float* aligned = aligned64(x_copy, len);
    std::memcpy(aligned, p0.x, len * sizeof(float));
    for (auto& p : ps) p.x = aligned;
  }
  if (uses_amx(p0, level, precision)) {
    thread_local std::vector<uint16_t> xa;
    thread_local std::vector<float> sums;
    const size_t padded = amx_padded_rows(p0.m);
    uint16_t* parts = aligned64(xa, 3 * padded * p0.k);
    sums.resize(padded * p0.groups());
    amx_split_x(p0.x, p0.m, p0.k, p0.gs, parts, sums.data(), threads);
    for (auto& p : ps) {
      p.xa = parts;
      p.xa_sums = sums.data();
    }
  } else if (uses_gemm(p0, level, precision)) {
    thread_local std::vector<float> xg;
    float* aligned = aligned64(xg, gemm_padded_rows(p0.m) * p0.k);
    gemm_pack_x(p0.x, p0.m, p0.k, p0.bits == 4, aligned, threads);
    for (auto& p : ps) p.xg = aligned;
  }
  if (panels && windows) {  // rows_panels' and rows_panels_avx2's group sums (Problem::xs)
    thread_local std::vector<float> xs;
    xs.resize(static_cast<size_t>(p0.m) * p0.groups());
    for (int r = 0; r < p0.m; ++r) group_sums_row(p0, r, level == kAvx512, xs.data());
    for (auto& p : ps) p.xs = xs.data();
  }
  if (panels && windows && level == kAvx2 && p0.bits == 4 && shift_exact(p0.x, len)) {  // Problem::xt
    thread_local std::vector<float> xt;
    float* aligned = aligned64(xt, 2 * len);
    for (int r = 0; r < p0.m; ++r) shift_x_row(p0.x, p0.k, r, aligned);
    for (auto& p : ps) p.xt = aligned;
  }
  if (panels && windows && level == kAvx512 && p0.m > 1) {  // rows_panels' copy (Problem::xp)
    thread_local std::vector<float> xp;
    const size_t blocks = (p0.m + kPanelXRows - 1) / kPanelXRows;
    float* aligned = aligned64(xp, blocks * kPanelXRows * p0.k);
    panel_pack_x(p0.x, p0.m, p0.k, aligned, threads);
    for (auto& p : ps) p.xp = aligned;
  }
#endif
  // Chunks of whole panels where any product has them (a product without panels takes
  // chunks of 32 as well as of 8).
  const int align = panels ? kPanelCols : 8;
  std::vector<int> n_rows;
  size_t work = 0;
  for (const auto& p : ps) {
    n_rows.push_back(p.n);
    work += static_cast<size_t>(p.n) * p.k * std::max(1, p.m / 4);
  }
  if (combine == Combine::kNone) {
    split_rows(n_rows, work, [&](int j, int n0, int n1) { run_rows(ps[j], n0, n1, level, precision); }, threads,
               align);
    return;
  }
  split_rows({p0.n}, work, [&](int, int n0, int n1) {
    run_rows(ps[0], n0, n1, level, precision);
    run_rows(ps[1], n0, n1, level, precision);
    swiglu_rows(ps[0].out, ps[1].out, combined_out, p0.m, p0.n, n0, n1, level);
  }, threads, align);
}

}  // namespace

void kernels::products(const float* x, int m, int k, const std::vector<Matrix>& mats, const std::vector<float*>& outs,
                       bool swiglu, int gs, int bits, int max_isa, int precision, int threads) {
  if (m <= 0 || k <= 0) return;
  // SwiGLU: gate and up go to scratch rows, their combination to outs[0]. The scratch is the
  // calling thread's and kept between calls: a prompt chunk's gate and up (18 MB each for
  // 512 x 8960) were allocated, zeroed and page-faulted on every call, on one thread.
  thread_local std::vector<float> scratch[2];
  const int level = isa(max_isa);
  std::vector<Problem> ps;
  for (size_t j = 0; j < mats.size(); ++j) {
    float* out;
    if (swiglu) {
      const size_t len = static_cast<size_t>(m) * mats[j].n;
      if (scratch[j].size() < len) scratch[j].resize(len);
      out = scratch[j].data();
    } else {
      out = outs[j];
    }
    ps.push_back(Problem{x, mats[j].w, mats[j].s, mats[j].b, out, m, mats[j].n, k, gs, bits});
    ps.back().total_m = m;
    if (uses_panels(ps.back(), level, precision)) ps.back().panels = PanelCache::get().find(mats[j], k, gs, bits, threads);
  }
  compute(ps, swiglu ? Combine::kSwiglu : Combine::kNone, swiglu ? outs[0] : nullptr, level, precision, threads);
}

namespace {
// A row-contiguous copy of `a` (float32 or uint32 elements), for inputs that are strided views.
template <typename T>
void gather(const mx::array& a, std::vector<T>& dst) {
  dst.resize(a.size());
  const T* src = a.data<T>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  int nd = static_cast<int>(shape.size());
  std::vector<int> idx(nd, 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) off += static_cast<int64_t>(idx[d]) * strides[d];
    dst[i] = src[off];
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

// Data of `a`, or of a row-contiguous copy kept in `tmp` when `a` is a strided view.
template <typename T>
const T* contiguous(const mx::array& a, std::vector<T>& tmp) {
  if (a.flags().row_contiguous) return a.data<T>();
  gather(a, tmp);
  return tmp.data();
}

}  // namespace

const float* kernels::contiguous_f32(const mx::array& a, std::vector<float>& tmp) { return contiguous(a, tmp); }
std::vector<std::weak_ptr<const void>> kernels::owners(const std::vector<mx::array>& inputs) {
  std::vector<std::weak_ptr<const void>> out;
  for (const auto& in : inputs) out.emplace_back(in.data_shared_ptr());
  return out;
}

std::weak_ptr<const void> kernels::owner(const mx::array& w, const mx::array& s, const mx::array& b,
                                        const std::weak_ptr<const void>& data) {
  // Views are copied per call (contiguous): no panels for those.
  const bool whole = w.flags().row_contiguous && s.flags().row_contiguous && b.flags().row_contiguous;
  return whole ? data : std::weak_ptr<const void>();
}

const uint32_t* kernels::contiguous_u32(const mx::array& a, std::vector<uint32_t>& tmp) {
  return contiguous(a, tmp);
}

namespace {
using kernels::weight_inputs;

// Inputs: x [..., K], then (w, scales, biases) per product, or w alone for dense float32
// weights (bits kDense). Outputs: one [..., N_j] per product, or one [..., N] for
// Combine::kSwiglu.
class QuantizedMatmulCpu : public mx::Primitive {
 public:
  QuantizedMatmulCpu(mx::Stream stream, int group_size, int bits, Combine combine, int max_isa, int precision,
                     int threads)
      : mx::Primitive(stream),
        group_size_(group_size),
        bits_(bits),
        combine_(combine),
        max_isa_(max_isa),
        precision_(precision),
        threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) enc.set_input_array(in);
    std::vector<mx::array> ins, outs;
    for (auto& in : inputs) ins.push_back(mx::array::unsafe_weak_copy(in));
    for (auto& out : outputs) {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      enc.set_output_array(out);
      outs.push_back(mx::array::unsafe_weak_copy(out));
    }
    enc.dispatch([ins = std::move(ins), outs = std::move(outs), owners = kernels::owners(inputs), gs = group_size_,
                  bits = bits_,
                  combine = combine_, max_isa = max_isa_, precision = precision_, threads = threads_]() mutable {
      const int per = weight_inputs(bits), products = static_cast<int>(ins.size() - 1) / per;
      const int k = ins[0].shape(-1);
      const int m = static_cast<int>(ins[0].size() / std::max(k, 1));
      std::vector<float> xc;
      std::vector<std::vector<float>> tmp_f(2 * products);
      std::vector<std::vector<uint32_t>> tmp_w(products);
      std::vector<kernels::Matrix> mats;
      std::vector<float*> out_data;
      for (int j = 0; j < products; ++j) {
        const mx::array& w = ins[1 + per * j];
        if (bits == kDense) {
          mats.push_back({reinterpret_cast<const uint32_t*>(contiguous(w, tmp_f[2 * j])), nullptr, nullptr, w.shape(0)});
        } else {
          mats.push_back({contiguous(w, tmp_w[j]), contiguous(ins[2 + 3 * j], tmp_f[2 * j]),
                          contiguous(ins[3 + 3 * j], tmp_f[2 * j + 1]), w.shape(0),
                          kernels::owner(w, ins[2 + 3 * j], ins[3 + 3 * j], owners[1 + per * j])});
        }
      }
      for (auto& out : outs) out_data.push_back(out.data<float>());
      kernels::products(contiguous(ins[0], xc), m, k, mats, out_data, combine == Combine::kSwiglu, gs, bits,
                        max_isa, precision, threads);
      g_calls.fetch_add(1, std::memory_order_relaxed);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[QuantizedMatmulCpu] has no GPU evaluation; use quantized_matmul on the GPU");
  }

  const char* name() const override { return "QuantizedMatmulCpu"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const QuantizedMatmulCpu*>(&other);
    return o && o->group_size_ == group_size_ && o->bits_ == bits_ && o->combine_ == combine_ && o->max_isa_ == max_isa_ &&
           o->precision_ == precision_ && o->threads_ == threads_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes;
    for (size_t j = 1; j < inputs.size(); j += weight_inputs(bits_)) {
      auto shape = inputs[0].shape();
      shape.back() = inputs[j].shape(0);
      shapes.push_back(shape);
      if (combine_ == Combine::kSwiglu) break;
    }
    return shapes;
  }

 private:
  int group_size_;
  int bits_;
  Combine combine_;
  int max_isa_;
  int precision_;
  int threads_;
};

std::string shape_str(const mx::Shape& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + ")";
}
}  // namespace

namespace {
void check_x(const std::string& op, const mx::array& x, int k) {
  if (x.ndim() < 1 || x.shape(-1) != k) {
    throw std::invalid_argument(op + "x " + shape_str(x.shape()) + " must end in K = " + std::to_string(k));
  }
}

// Checks one (w, scales, biases) triple against the call's bits, group size and x; returns N.
int check_matrix(const std::string& op, const mx::array& x, const mx::array& w, const mx::array& scales,
                 const mx::array& biases, int32_t group_size, int32_t bits) {
  if (scales.dtype() != mx::float32 || biases.dtype() != mx::float32) {
    throw std::invalid_argument(op + "scales and biases must be float32");
  }
  if (w.dtype() != mx::uint32 || w.ndim() != 2) throw std::invalid_argument(op + "w must be a 2-D uint32 array");
  int n = w.shape(0);
  int k = w.shape(1) * 32 / bits;
  if (scales.shape() != mx::Shape{n, k / group_size} || biases.shape() != scales.shape()) {
    throw std::invalid_argument(op + "w " + shape_str(w.shape()) + " with bits " + std::to_string(bits) +
                                " and group_size " + std::to_string(group_size) + " needs scales and biases (" +
                                std::to_string(n) + "," + std::to_string(k / group_size) + "), got " +
                                shape_str(scales.shape()) + " and " + shape_str(biases.shape()));
  }
  check_x(op, x, k);
  return n;
}

// Checks a dense float32 weight [N, K] (K a multiple of 32) against x; returns N.
int check_dense(const std::string& op, const mx::array& x, const mx::array& w) {
  if (w.dtype() != mx::float32 || w.ndim() != 2) throw std::invalid_argument(op + "w must be a 2-D float32 array");
  if (w.shape(1) % 32 != 0) {
    throw std::invalid_argument(op + "w " + shape_str(w.shape()) + ": K must be a multiple of 32");
  }
  check_x(op, x, w.shape(1));
  return w.shape(0);
}

std::unique_ptr<ArrayList> as_list(std::vector<mx::array> arrays) {
  auto list = std::make_unique<ArrayList>();
  list->items = std::move(arrays);
  return list;
}

// The lazy outputs of products of x with the triples (w, scales, biases) of `mats`.
std::vector<mx::array> build(const std::string& op, const mx::array& x, const std::vector<mx::array>& mats,
                             int32_t group_size, int32_t bits, Combine combine, int32_t max_isa,
                             int32_t precision, int32_t threads) {
  if (bits != 4 && bits != 8 && bits != kDense) {
    throw std::invalid_argument(op + "bits must be 4 or 8, got " + std::to_string(bits));
  }
  if (bits == kDense) group_size = 32;
  if (precision != kF32 && precision != kBf16 && precision != kInt8) {
    throw std::invalid_argument(op + "precision must be 0 (f32), 1 (bf16) or 2 (int8), got " + std::to_string(precision));
  }
  if (precision != kF32 && bits == kDense) {
    throw std::invalid_argument(op + (precision == kBf16 ? "bf16" : "int8") + " precision needs 4- or 8-bit weights");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument(op + "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  }
  if (x.dtype() != mx::float32) throw std::invalid_argument(op + "x must be float32");
  const size_t per = weight_inputs(bits);
  if (mats.empty() || mats.size() % per != 0) {
    throw std::invalid_argument(op + (bits == kDense ? "needs at least one weight" : "needs (w, scales, biases) triples"));
  }
  std::vector<mx::Shape> shapes;
  for (size_t j = 0; j < mats.size(); j += per) {
    auto shape = x.shape();
    shape.back() = bits == kDense ? check_dense(op, x, mats[j])
                                  : check_matrix(op, x, mats[j], mats[j + 1], mats[j + 2], group_size, bits);
    shapes.push_back(shape);
  }
  if (combine == Combine::kSwiglu) {
    if (shapes.size() != 2 || shapes[0] != shapes[1]) {
      throw std::invalid_argument(op + "SwiGLU needs two matrices (gate, up) with the same number of rows");
    }
    shapes.resize(1);
  }
  auto dev = mx::default_device();
  if (dev != mx::Device(mx::Device::cpu)) throw std::invalid_argument(op + "the default device is not the CPU");
  std::vector<mx::array> inputs{x};
  inputs.insert(inputs.end(), mats.begin(), mats.end());
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  auto prim = std::make_shared<QuantizedMatmulCpu>(mx::default_stream(dev), group_size, bits, combine, max_isa,
                                                   precision, threads);
  return mx::array::make_arrays(std::move(shapes), dtypes, prim, inputs);
}
}  // namespace

std::unique_ptr<ArrayList> cpu_dense_matmuls(const array& x, const ArrayList& weights, bool swiglu, int32_t max_isa,
                                             int32_t threads) {
  return as_list(build(swiglu ? "[cpu_dense_swiglu] " : "[cpu_dense_matmuls] ", x, weights.items, 0, kDense,
                       swiglu ? Combine::kSwiglu : Combine::kNone, max_isa, kF32, threads));
}

std::unique_ptr<mx::array> cpu_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                                const mx::array& biases, int32_t group_size, int32_t bits,
                                                int32_t max_isa, int32_t precision, int32_t threads) {
  auto out = build("[cpu_quantized_matmul] ", x, {w, scales, biases}, group_size, bits, Combine::kNone, max_isa,
                   precision, threads);
  return std::make_unique<mx::array>(out[0]);
}

std::unique_ptr<ArrayList> cpu_quantized_matmuls(const array& x, const ArrayList& mats, int32_t group_size,
                                                 int32_t bits, bool swiglu, int32_t max_isa, int32_t precision,
                                                 int32_t threads) {
  return as_list(build(swiglu ? "[cpu_quantized_swiglu] " : "[cpu_quantized_matmuls] ", x, mats.items, group_size,
                       bits, swiglu ? Combine::kSwiglu : Combine::kNone, max_isa, precision, threads));
}

rust::String cpu_qmm_isa(int32_t max_isa, int32_t precision) {
  if (precision == kBf16) return rust::String(bf16_vector(isa(max_isa)) ? "avx512f+avx512bf16 (bf16)" : "portable (bf16)");
  if (precision == kInt8) {
    const int level = isa(max_isa);
    return rust::String(int8_vector(level) ? "avx512f+avx512vnni (int8)" : level >= kAvx2 ? "avx2+fma (int8)" : "portable (int8)");
  }
  return rust::String(kIsaNames[isa(max_isa)]);
}

uint64_t cpu_qmm_calls() { return g_calls.load(std::memory_order_relaxed); }

int32_t cpu_qmm_threads() { return Pool::get().threads(); }

void cpu_qmm_set_threads(int32_t n) { Pool::get().set_threads(n); }

int32_t cpu_pool_spin_us() { return Pool::get().spin_us(); }

void cpu_pool_set_spin_us(int32_t us) { Pool::get().set_spin_us(us); }
}  // namespace mlxsys
