// RMS norm and rotary position embedding (RoPE) as single MLX custom primitives on the CPU
// backend (`RmsNormCpu`, `RopeCpu`).
//
// Why: the `mlx-cpu` wheel has no CPU evaluation of `fast::rms_norm` and `fast::rope`; both
// fall back to their reference graphs (rms_norm: square, mean, add, rsqrt and two multiplies;
// rope: positions, inverse frequencies, exp, cos, sin, slices, four multiplies, two
// subtract/adds and a concatenate). A decode step of a 30-layer model builds, dispatches and
// evaluates some 1,700 such nodes, each costing more than its arithmetic. Each primitive here
// is one node and computes the same formulas (MLX's `fast.cpp` fallbacks, mlx 0.32):
//   rms_norm: y = w * (x * (1 / sqrt(mean(x^2) + eps)))       per row of the last axis
//   rope:     p = (offset + l) * scale (l: index on axis -2; or positions[l] * scale when given),
//             inv_i = base^(-i / (dims / 2))
//             or 1 / freqs_i, theta = p * inv_i; rotate the pairs (x_i, x_{i + dims/2})
//             (traditional: (x_{2i}, x_{2i+1})) by theta; features past `dims` are copied.
// Both give the fallbacks' bits: RoPE's exp, sin and cos are MLX's own element functions
// (`mlx/backend/cpu/simd/math.h`, what its CPU unary ops call), the norm sums its squares in
// the order of MLX's reduction on this build and multiplies by 1 / H as `mean` does, and every
// product and sum is rounded on its own as in the separate ops (no FMA contraction: the build
// passes -ffp-contract=off). A row's result does not depend on how many rows the call has, so
// verify windows see exactly the values of one-token steps.
//
// Inputs: float32, any strides (strided views are read in place); outputs row-contiguous
// float32 of the input's shape.
#include "mlx-sys/src/shim.h"
#include "mlx-sys/src/kernels.h"
#include "mlx-sys/src/lib.rs.h"
#include "mlx-sys/src/simd.h"

#include <mlx/backend/cpu/encoder.h>
// MLX's own element functions (a header; its comparisons mix signedness).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
#include <mlx/backend/cpu/simd/simd.h>
#pragma GCC diagnostic pop
#include <mlx/primitives.h>

#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace mlxsys {
namespace mx = mlx::core;

namespace {

std::atomic<uint64_t> g_fast_calls{0};

// MLX's CPU exp, sin and cos of one float (its unary ops' element functions).
float mlx_exp(float v) { return mx::simd::exp(mx::simd::Simd<float, 1>(v)).value; }
float mlx_sin(float v) { return mx::simd::sin(mx::simd::Simd<float, 1>(v)).value; }
float mlx_cos(float v) { return mx::simd::cos(mx::simd::Simd<float, 1>(v)).value; }

// Offset of row r (all axes but the last, row-major order) of `a`.
int64_t row_offset(const mx::array& a, int64_t r) {
  int64_t off = 0;
  for (int d = static_cast<int>(a.ndim()) - 2; d >= 0; --d) {
    off += (r % a.shape(d)) * a.strides()[d];
    r /= a.shape(d);
  }
  return off;
}

// Rows of the last axis and their length.
int64_t rows_of(const mx::array& a) { return a.ndim() == 0 || a.shape(-1) == 0 ? 0 : a.size() / a.shape(-1); }

// The common part of both primitives' evaluation: allocate the output, register the
// arrays with the stream's encoder, run `fn(inputs, out)` on the stream thread.
template <class Fn>
void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out, Fn fn) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> ins;
  for (auto& in : inputs) {
    enc.set_input_array(in);
    ins.push_back(mx::array::unsafe_weak_copy(in));
  }
  enc.set_output_array(out);
  enc.dispatch([ins = std::move(ins), out = mx::array::unsafe_weak_copy(out), fn]() mutable {
    fn(ins, out);
    g_fast_calls.fetch_add(1, std::memory_order_relaxed);
  });
}

// What both primitives share: parameters (compared by is_equivalent), CPU evaluation only,
// an output shaped like the first input.
template <class Params>
class SameShapeCpu : public mx::UnaryPrimitive {
 public:
  SameShapeCpu(mx::Stream stream, Params p) : mx::UnaryPrimitive(stream), p_(p) {}

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no GPU evaluation; use the mlx::core::fast op");
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const SameShapeCpu*>(&other);
    return o && o->p_ == p_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 protected:
  Params p_;
};

struct RmsNormParams {
  float eps;
  bool operator==(const RmsNormParams&) const = default;
};

class RmsNormCpu : public SameShapeCpu<RmsNormParams> {
 public:
  using SameShapeCpu::SameShapeCpu;
  const char* name() const override { return "RmsNormCpu"; }

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(stream(), inputs, out, [eps = p_.eps](std::vector<mx::array>& in, mx::array& out) {
      const mx::array& x = in[0];
      const bool has_w = in.size() > 1;
      const int n = x.shape(-1);
      const int64_t xs = x.strides().back();
      const float* w = has_w ? in[1].data<float>() : nullptr;
      const int64_t ws = has_w ? in[1].strides().back() : 0;
      float* y = out.data<float>();
      if (x.flags().row_contiguous && (!has_w || ws == 1) && rows_of(x) <= INT32_MAX) {
        // Whole rows side by side: the function the fused layer calls.
        kernels::rms_norm_rows(x.data<float>(), static_cast<int>(rows_of(x)), n, eps, w, y);
        return;
      }
      for (int64_t r = 0; r < rows_of(x); ++r) {
        kernels::rms_norm_row(x.data<float>() + row_offset(x, r), xs, n, eps, w, ws, y + r * n);
      }
    });
  }
};

struct RopeParams {
  int dims;
  bool traditional;
  float base;
  float scale;
  int offset;
  // Inputs after x: the freqs (when has_freqs), then int32 positions [L] (when
  // has_positions: row l sits at positions[l] instead of offset + l).
  bool has_freqs;
  bool has_positions;
  bool operator==(const RopeParams&) const = default;
};

class RopeCpu : public SameShapeCpu<RopeParams> {
 public:
  using SameShapeCpu::SameShapeCpu;
  const char* name() const override { return "RopeCpu"; }

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    dispatch(stream(), inputs, out, [p = p_](std::vector<mx::array>& in, mx::array& out) {
      const mx::array& x = in[0];
      const int d = x.shape(-1), l_len = x.ndim() >= 2 ? x.shape(-2) : 1, half = p.dims / 2;
      const kernels::RopeSpec spec{p.dims, p.traditional, p.base, p.scale,
                                   p.has_freqs ? in[1].data<float>() : nullptr,
                                   p.has_freqs ? in[1].strides().back() : 0};
      const mx::array* positions = p.has_positions ? &in.back() : nullptr;
      // cos/sin of every (position, frequency) of this call, shared by all heads.
      std::vector<float> cs, sn;
      kernels::rope_table(spec, p.offset, positions ? positions->data<int32_t>() : nullptr,
                          positions ? positions->strides().back() : 0, l_len, cs, sn);
      float* y = out.data<float>();
      for (int64_t r = 0; r < rows_of(x); ++r) {
        const size_t l = static_cast<size_t>(r % l_len);
        kernels::rope_row(spec, x.data<float>() + row_offset(x, r), x.strides().back(), d, cs.data() + l * half,
                          sn.data() + l * half, y + r * d);
      }
    });
  }
};

std::string dims_of(const mx::array& a) {
  std::string r = "(";
  for (size_t i = 0; i < a.ndim(); ++i) r += (i ? "," : "") + std::to_string(a.shape(i));
  return r + ")";
}

mx::Stream cpu_stream(const std::string& op) {
  auto dev = mx::default_device();
  if (dev != mx::Device(mx::Device::cpu)) throw std::invalid_argument(op + "the default device is not the CPU");
  return mx::default_stream(dev);
}
}  // namespace

namespace kernels {

namespace {
// The element-wise loops below in AVX2 where the CPU has it (runtime check): 8 lanes of the
// scalar loop's own operations (a multiply, an add or a subtract rounds each lane as the
// scalar one does; nothing is contracted into an FMA), so the bits are those of the scalar
// loop, which handles the tail. In an 11-token verify window of SmolLM2 these loops ran scalar
// (the captured pointers reloaded at every element): a layer's residual adds, norms and RoPE
// took ~68 us of a ~750 us layer on two cores, ~37 us in AVX2 (timed inside `window_profile`).
#ifdef MLXSYS_X86
using simd::has_avx2_fma;

// Rows r[0..8) -> r[c] = column c of the 8 x 8 block.
AVX2_FN_ALWAYS void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// ss[g] = sum of x[g n + i]^2 over i in [0, n8) (n8 a multiple of 8) for the g < rows <= 8
// rows from x, each row's chain in order of i in its own lane, 8 columns of the block at a
// time transposed into lanes.
AVX2_FN void sum_squares_avx2(const float* x, int rows, int n, int n8, float* ss) {
  __m256 acc = _mm256_setzero_ps();
  for (int i = 0; i < n8; i += 8) {
    __m256 r[8];
    for (int g = 0; g < 8; ++g) r[g] = g < rows ? _mm256_loadu_ps(x + static_cast<size_t>(g) * n + i) : _mm256_setzero_ps();
    transpose8(r);
    for (int c = 0; c < 8; ++c) acc = _mm256_add_ps(acc, _mm256_mul_ps(r[c], r[c]));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (int g = 0; g < rows; ++g) ss[g] = lanes[g];
}

// y[i] = w[i] * (x[i] * inv) (w null: x[i] * inv) for whole vectors from 0; returns where it stopped.
AVX2_FN int scale_avx2(const float* x, int n, const float* w, float inv, float* y) {
  const __m256 vi = _mm256_set1_ps(inv);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vi);
    _mm256_storeu_ps(y + i, w ? _mm256_mul_ps(_mm256_loadu_ps(w + i), v) : v);
  }
  return i;
}

// y[i] = a[i] + b[i] for whole vectors from 0; returns where it stopped.
AVX2_FN size_t add_avx2(const float* a, const float* b, size_t n, float* y) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  return i;
}

// RoPE's rotation of the pairs (x[i], x[i + half]) for whole vectors of i from 0 (x, y
// contiguous); returns where it stopped.
AVX2_FN int rotate_avx2(const float* x, int half, const float* c, const float* s, float* y) {
  int i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + i + half);
    const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(y + i, _mm256_sub_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x2, sv)));
    _mm256_storeu_ps(y + i + half, _mm256_add_ps(_mm256_mul_ps(x1, sv), _mm256_mul_ps(x2, cv)));
  }
  return i;
}
#endif

// y = w * (x * inv) for the row's sum of squares ss (rms_norm_row's second half).
void rms_norm_finish(const float* x, int64_t xs, int n, float eps, const float* w, int64_t ws, float ss, float* y) {
  const float inv = 1.f / std::sqrt(ss * (1.f / static_cast<float>(n)) + eps);
  int i = 0;
#ifdef MLXSYS_X86
  if (xs == 1 && (ws == 1 || !w) && has_avx2_fma()) i = scale_avx2(x, n, w, inv, y);
#endif
  for (; i < n; ++i) {
    const float v = x[i * xs] * inv;
    y[i] = w ? w[i * ws] * v : v;
  }
}

// G contiguous rows at once: each row's sum of squares is its own chain in rms_norm_row's
// order, G chains side by side (one row's chain waits on the add latency at every element).
template <int G>
void rms_norm_group(const float* x, int n, float eps, const float* w, float* y) {
  float ss[G] = {};
  for (int i = 0; i < n; ++i) {
    for (int g = 0; g < G; ++g) ss[g] += x[static_cast<size_t>(g) * n + i] * x[static_cast<size_t>(g) * n + i];
  }
  for (int g = 0; g < G; ++g) {
    rms_norm_finish(x + static_cast<size_t>(g) * n, 1, n, eps, w, 1, ss[g], y + static_cast<size_t>(g) * n);
  }
}
}  // namespace

void rms_norm_row(const float* x, int64_t xs, int n, float eps, const float* w, int64_t ws, float* y) {
  float ss = 0.f;
  for (int i = 0; i < n; ++i) ss += x[i * xs] * x[i * xs];
  rms_norm_finish(x, xs, n, eps, w, ws, ss, y);
}

void rms_norm_rows(const float* x, int m, int n, float eps, const float* w, float* y) {
  const auto at = [n](int row) { return static_cast<size_t>(row) * n; };
  int r = 0;
#ifdef MLXSYS_X86
  if (has_avx2_fma() && m > 1) {
    // Up to 8 rows' chains in the lanes of one vector, then each row's tail and finish.
    const int n8 = n / 8 * 8;
    for (; r < m; r += 8) {
      const int rows = std::min(8, m - r);
      float ss[8];
      sum_squares_avx2(x + at(r), rows, n, n8, ss);
      for (int g = 0; g < rows; ++g) {
        const float* row = x + at(r + g);
        for (int i = n8; i < n; ++i) ss[g] += row[i] * row[i];
        rms_norm_finish(row, 1, n, eps, w, 1, ss[g], y + at(r + g));
      }
    }
    return;
  }
#endif
  for (; r + 8 <= m; r += 8) rms_norm_group<8>(x + at(r), n, eps, w, y + at(r));
  if (r + 4 <= m) rms_norm_group<4>(x + at(r), n, eps, w, y + at(r)), r += 4;
  if (r + 2 <= m) rms_norm_group<2>(x + at(r), n, eps, w, y + at(r)), r += 2;
  if (r < m) rms_norm_row(x + at(r), 1, n, eps, w, 1, y + at(r));
}

void add(const float* a, const float* b, size_t n, float* y) {
  size_t i = 0;
#ifdef MLXSYS_X86
  if (has_avx2_fma()) i = add_avx2(a, b, n, y);
#endif
  for (; i < n; ++i) y[i] = a[i] + b[i];
}

void rope_table(const RopeSpec& spec, int offset, const int32_t* positions, int64_t positions_stride, int l_len,
                std::vector<float>& cs, std::vector<float>& sn) {
  const int half = spec.dims / 2;
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    inv[i] = spec.freqs ? 1.f / spec.freqs[i * spec.freqs_stride]
                        : mlx_exp(static_cast<float>(-i) * (std::log(spec.base) / static_cast<float>(half)));
  }
  cs.resize(static_cast<size_t>(l_len) * half);
  sn.resize(cs.size());
  for (int l = 0; l < l_len; ++l) {
    const int at = positions ? positions[l * positions_stride] : offset + l;
    const float pos = static_cast<float>(at) * spec.scale;
    for (int i = 0; i < half; ++i) {
      const float theta = pos * inv[i];
      cs[static_cast<size_t>(l) * half + i] = mlx_cos(theta);
      sn[static_cast<size_t>(l) * half + i] = mlx_sin(theta);
    }
  }
}

void rope_row(const RopeSpec& spec, const float* x, int64_t xs, int d, const float* c, const float* s, float* y) {
  const int half = spec.dims / 2;
  int i = 0;
#ifdef MLXSYS_X86
  if (!spec.traditional && xs == 1 && has_avx2_fma()) i = rotate_avx2(x, half, c, s, y);
#endif
  for (; i < half; ++i) {
    const int a = spec.traditional ? 2 * i : i, b = spec.traditional ? 2 * i + 1 : i + half;
    const float x1 = x[a * xs], x2 = x[b * xs];
    y[a] = x1 * c[i] - x2 * s[i];
    y[b] = x1 * s[i] + x2 * c[i];
  }
  for (int i = 2 * half; i < d; ++i) y[i] = x[i * xs];
}

}  // namespace kernels

std::unique_ptr<mx::array> cpu_rms_norm(const mx::array& x, const ArrayList& weight, float eps) {
  const std::string op = "[cpu_rms_norm] ";
  if (x.dtype() != mx::float32) throw std::invalid_argument(op + "x must be float32");
  if (x.ndim() < 1) throw std::invalid_argument(op + "x must have at least one axis");
  std::vector<mx::array> inputs{x};
  if (!weight.items.empty()) {
    const mx::array& w = weight.items[0];
    if (w.dtype() != mx::float32 || w.ndim() != 1 || w.shape(0) != x.shape(-1)) {
      throw std::invalid_argument(op + "weight must be float32 [" + std::to_string(x.shape(-1)) + "] for x " +
                                  dims_of(x) + ", got " + dims_of(w));
    }
    inputs.push_back(w);
  }
  auto prim = std::make_shared<RmsNormCpu>(cpu_stream(op), RmsNormParams{eps});
  return std::make_unique<mx::array>(x.shape(), mx::float32, std::move(prim), std::move(inputs));
}

std::unique_ptr<mx::array> cpu_rope(const mx::array& x, int32_t dims, bool traditional, float base, bool has_base,
                                    float scale, int32_t offset, const ArrayList& freqs, const ArrayList& positions) {
  const std::string op = "[cpu_rope] ";
  if (x.dtype() != mx::float32) throw std::invalid_argument(op + "x must be float32");
  if (x.ndim() < 2) throw std::invalid_argument(op + "x must be at least 2-D [..., L, D], got " + dims_of(x));
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) {
    throw std::invalid_argument(op + "dims must be even and in (0, " + std::to_string(x.shape(-1)) + "], got " +
                                std::to_string(dims));
  }
  if (has_base == !freqs.items.empty()) throw std::invalid_argument(op + "give exactly one of base and freqs");
  std::vector<mx::array> inputs{x};
  if (!has_base) {
    const mx::array& f = freqs.items[0];
    if (f.dtype() != mx::float32 || f.ndim() != 1 || f.shape(0) != dims / 2) {
      throw std::invalid_argument(op + "freqs must be float32 [" + std::to_string(dims / 2) + "], got " + dims_of(f));
    }
    inputs.push_back(f);
  }
  if (!positions.items.empty()) {
    const mx::array& pos = positions.items[0];
    if (pos.dtype() != mx::int32 || pos.ndim() != 1 || pos.shape(0) != x.shape(-2)) {
      throw std::invalid_argument(op + "positions must be int32 [" + std::to_string(x.shape(-2)) + "] for x " +
                                  dims_of(x) + ", got " + dims_of(pos));
    }
    inputs.push_back(pos);
  }
  RopeParams p{dims, traditional, has_base ? base : 0.f, scale, offset, !has_base, !positions.items.empty()};
  return std::make_unique<mx::array>(x.shape(), mx::float32, std::make_shared<RopeCpu>(cpu_stream(op), p),
                                     std::move(inputs));
}

uint64_t cpu_fast_calls() { return g_fast_calls.load(std::memory_order_relaxed); }
}  // namespace mlxsys
