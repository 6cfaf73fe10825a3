// Fused scaled-dot-product attention for short query windows on the CPU backend, as an MLX
// custom primitive (`AttentionCpu`).
//
// Why: on the CPU, `mlx.core.fast.scaled_dot_product_attention` falls back to separate ops
// (scale, q @ k^T per head through BLAS, mask, softmax, p @ v), about ten graph nodes and two
// BLAS calls per head and layer. For a decode step (one query) or a verify window (a few
// queries) the arithmetic is tiny and those nodes and BLAS calls are most of the cost. This
// primitive does the whole attention of a layer in one node:
//   for each batch b, query head h (KV head h / (Hq / Hkv)), query row i:
//     n     = causal ? Lk - Lq + i + 1 : Lk                      (keys the row sees)
//     s_j   = dot(q_i * scale, k_j)            j < n
//     p_j   = exp(s_j - max_j s_j)
//     out_i = (sum_j p_j v_j) / (sum_j p_j)
// A row's result is computed by the same float operations whatever Lq is (row i of a verify
// window at absolute position P sees exactly the keys a one-token step at P sees, in the same
// order), so speculative verification reproduces plain decoding's attention bit for bit.
//
// Inputs: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], float32, any strides
// (KV-cache slices are strided views); output [B, Hq, Lq, Dv] float32, row-contiguous.
// AVX2 + FMA when the CPU has them and D, Dv are multiples of 8 (runtime check), portable
// C++ otherwise. Heads are split over the shared pool (pool.h) when the work is large enough.
#include "mlx-sys/src/shim.h"
#include "mlx-sys/src/kernels.h"
#include "mlx-sys/src/lib.rs.h"
#include "mlx-sys/src/pool.h"
#include "mlx-sys/src/simd.h"

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace mlxsys {
namespace mx = mlx::core;

namespace {

using kernels::View4;

struct AttnProblem {
  View4 q, k, v;
  float* out;
  int b, hq, hkv, lq, lk, d, dv;
  float scale;
  bool causal;

  // The output row of batch b, head h, query i.
  float* out_row(int b, int h, int i) const { return out + ((static_cast<int64_t>(b) * hq + h) * lq + i) * dv; }
};

// Keys query row i sees (at least 1: Lk >= 1, and Lq <= Lk when causal).
int keys_for(const AttnProblem& p, int i) { return p.causal ? p.lk - p.lq + i + 1 : p.lk; }

// The query rows of one KV head, numbered query-major: row t is query t / G of query head
// kvh * G + t % G (G = Hq / Hkv, the heads sharing the KV head), so consecutive rows see the
// same keys or one more. A task takes the rows [t0, t1).
struct Rows {
  const AttnProblem& p;
  int kvh, t0, t1;
  int group() const { return p.hq / p.hkv; }
  int count() const { return t1 - t0; }
  int head(int r) const { return kvh * group() + (t0 + r) % group(); }
  int query(int r) const { return (t0 + r) / group(); }
  int keys(int r) const { return keys_for(p, query(r)); }
};

// Portable: one head (b, h), its query rows [i0, i1).
void head_portable(const AttnProblem& p, int b, int h, int i0, int i1, std::vector<float>& s, std::vector<float>& qs) {
  const int kvh = h / (p.hq / p.hkv);
  s.resize(p.lk);
  qs.resize(p.d);
  for (int i = i0; i < i1; ++i) {
    const int n = keys_for(p, i);
    float* o = p.out_row(b, h, i);
    const float* qr = p.q.row(b, h, i);
    for (int d = 0; d < p.d; ++d) qs[d] = qr[d] * p.scale;
    float mx = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < n; ++j) {
      const float* kr = p.k.row(b, kvh, j);
      float acc = 0.f;
      for (int d = 0; d < p.d; ++d) acc += qs[d] * kr[d];
      s[j] = acc;
      mx = std::max(mx, acc);
    }
    float sum = 0.f;
    for (int j = 0; j < n; ++j) {
      s[j] = std::exp(s[j] - mx);
      sum += s[j];
    }
    for (int d = 0; d < p.dv; ++d) o[d] = 0.f;
    for (int j = 0; j < n; ++j) {
      const float* vr = p.v.row(b, kvh, j);
      for (int d = 0; d < p.dv; ++d) o[d] += s[j] * vr[d];
    }
    for (int d = 0; d < p.dv; ++d) o[d] /= sum;
  }
}

#ifdef MLXSYS_X86
using simd::exp_nonpositive;
using simd::hmax8;
using simd::hsum8;

// The 8 partial sums of q . k over D (a multiple of 8), two accumulators: a0 takes chunks
// 0, 2, 4, .., a1 chunks 1, 3, ..; returns a0 + a1 (hsum8 of it is the dot product).
AVX2_FN_ALWAYS __m256 key_dot(const float* q, const float* k, int d_len) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int d = 0;
  for (; d + 16 <= d_len; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
  }
  if (d < d_len) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
  return _mm256_add_ps(a0, a1);
}

// [hsum8(v[0]), .., hsum8(v[7])] with hsum8's additions in hsum8's order: lanes l and l + 4,
// then lanes 0 + 2 and 1 + 3 of that, then 0 + 1 (IEEE addition is commutative, so only
// the pairing matters). Three transposing add steps instead of eight reductions.
AVX2_FN_ALWAYS __m256 hsum8x8(const __m256* v) {
  __m256 w[4];  // w[i] = [v[2i].lo + v[2i].hi | v[2i+1].lo + v[2i+1].hi]
  _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) {
    w[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  }
  // u01 lanes: [u0_0 u0_1 u2_0 u2_1 | u1_0 u1_1 u3_0 u3_1], u_j = (w_j[0] + w_j[2], w_j[1] + w_j[3])
  const __m256 u01 = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 u45 = _mm256_add_ps(_mm256_shuffle_ps(w[2], w[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(w[2], w[3], _MM_SHUFFLE(3, 2, 3, 2)));
  // [s0 s2 s4 s6 | s1 s3 s5 s7], s_j = u_j[0] + u_j[1]
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(u01, u45, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(u01, u45, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Keys per block: the K (or V) rows of a block (16 KB at D = 64) stay in L1 while every query
// row of a task uses them, so a KV head's cache is read from memory once per task instead of
// once per query row (a decode step's query heads of one GQA group; a window's or a prompt
// chunk's rows). A multiple of 8.
constexpr int kKeyBlock = 64;

// Asks for the `width` floats of rows [j, j + n) of `view` (batch b, head h) ahead of use:
// a long prompt's cache streams from memory once per step, and with the hardware prefetcher
// alone each key block's first loads waited on it (decode after a 1,872-token prompt: 9%
// faster, interleaved runs).
AVX2_FN_ALWAYS void prefetch_rows(const View4& view, int b, int h, int j, int n, int width) {
  for (int i = j; i < j + n; ++i) {
    const char* row = reinterpret_cast<const char*>(view.row(b, h, i));
    for (int off = 0; off < width * static_cast<int>(sizeof(float)); off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
  }
}

// The query rows [t0, t1) of KV head `kvh` of batch `b` (see Rows); D and Dv multiples of 8.
// Each row's result comes from the same float operations as it would alone, in the same order
// (scores of 8 keys at a time reduced together, the rest one by one; max; exp and sum in
// chunks of 8; the weighted values summed key by key, the accumulators kept in `acc` between
// key blocks): the grouping only shares loads. `s` holds each row's scores padded to a
// multiple of 8 with -inf (whose exp is 0), so every vector op sees whole chunks.
AVX2_FN void rows_avx2(const AttnProblem& p, int b, int kvh, int t0, int t1, std::vector<float>& s,
                       std::vector<float>& qs, std::vector<float>& acc) {
  const Rows rows{p, kvh, t0, t1};
  const int stride = (p.lk + 7) / 8 * 8;
  s.resize(static_cast<size_t>(rows.count()) * stride);
  qs.resize(static_cast<size_t>(rows.count()) * p.d);
  acc.resize(static_cast<size_t>(rows.count()) * (p.dv + 8));  // Dv accumulators and 1 / sum
  const __m256 scale = _mm256_set1_ps(p.scale);
  for (int r = 0; r < rows.count(); ++r) {
    const float* qr = p.q.row(b, rows.head(r), rows.query(r));
    for (int d = 0; d < p.d; d += 8) _mm256_storeu_ps(&qs[r * p.d + d], _mm256_mul_ps(_mm256_loadu_ps(qr + d), scale));
  }
  const int last = rows.keys(rows.count() - 1);  // the most keys any row sees
  // Scores: one dot product per key (two accumulators over D), 8 keys at a time reduced
  // together (hsum8x8: the same additions as hsum8, so the same bits as one at a time).
  for (int j0 = 0; j0 < last; j0 += kKeyBlock) {
    for (int r = 0; r < rows.count(); ++r) {
      const int j1 = std::min(j0 + kKeyBlock, rows.keys(r));
      const float* q = &qs[r * p.d];
      float* sr = &s[static_cast<size_t>(r) * stride];
      int j = j0;
      for (; j + 8 <= j1; j += 8) {
        if (r == 0 && j + kKeyBlock + 8 <= last) prefetch_rows(p.k, b, kvh, j + kKeyBlock, 8, p.d);
        __m256 dots[8];
        _Pragma("GCC unroll 8") for (int u = 0; u < 8; ++u) dots[u] = key_dot(q, p.k.row(b, kvh, j + u), p.d);
        _mm256_storeu_ps(sr + j, hsum8x8(dots));
      }
      for (; j < j1; ++j) sr[j] = hsum8(key_dot(q, p.k.row(b, kvh, j), p.d));
    }
  }
  // Softmax weights, row by row.
  for (int r = 0; r < rows.count(); ++r) {
    float* sr = &s[static_cast<size_t>(r) * stride];
    const int n = rows.keys(r), padded = (n + 7) / 8 * 8;
    for (int j = n; j < padded; ++j) sr[j] = -std::numeric_limits<float>::infinity();
    __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int j = 0; j < padded; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sr + j));
    const __m256 mx = _mm256_set1_ps(hmax8(vmax));
    __m256 vsum = _mm256_setzero_ps();
    for (int j = 0; j < padded; j += 8) {
      __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mx));
      _mm256_storeu_ps(sr + j, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    float* a = &acc[static_cast<size_t>(r) * (p.dv + 8)];
    std::fill(a, a + p.dv, 0.f);
    a[p.dv] = 1.f / hsum8(vsum);
  }
  // Weighted values, Dv in chunks of up to 8 vectors kept in registers within a key block.
  for (int j0 = 0; j0 < last; j0 += kKeyBlock) {
    for (int r = 0; r < rows.count(); ++r) {
      const int j1 = std::min(j0 + kKeyBlock, rows.keys(r));
      const float* sr = &s[static_cast<size_t>(r) * stride];
      float* a = &acc[static_cast<size_t>(r) * (p.dv + 8)];
      for (int d0 = 0; d0 < p.dv; d0 += 64) {
        const int chunks = std::min(8, (p.dv - d0) / 8);
        __m256 ac[8];
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c) {
          if (c < chunks) ac[c] = _mm256_loadu_ps(a + d0 + 8 * c);
        }
        for (int j = j0; j < j1; ++j) {
          if (r == 0 && d0 == 0 && j + kKeyBlock < last) prefetch_rows(p.v, b, kvh, j + kKeyBlock, 1, p.dv);
          const __m256 pj = _mm256_set1_ps(sr[j]);
          const float* vr = p.v.row(b, kvh, j) + d0;
          _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c) {
            if (c < chunks) ac[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * c), ac[c]);
          }
        }
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; ++c) {
          if (c < chunks) _mm256_storeu_ps(a + d0 + 8 * c, ac[c]);
        }
      }
    }
  }
  for (int r = 0; r < rows.count(); ++r) {
    const float* a = &acc[static_cast<size_t>(r) * (p.dv + 8)];
    const __m256 inv = _mm256_set1_ps(a[p.dv]);
    float* o = p.out_row(b, rows.head(r), rows.query(r));
    for (int d = 0; d < p.dv; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(a + d), inv));
  }
}

bool attn_cpu_has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

std::atomic<uint64_t> g_attn_calls{0};

// Rows [t0, t1) (see Rows) of KV head bk % Hkv of batch bk / Hkv.
void run_rows(const AttnProblem& p, int bk, int t0, int t1) {
  thread_local std::vector<float> s, qs, acc;
  const int b = bk / p.hkv, kvh = bk % p.hkv;
#ifdef MLXSYS_X86
  if (attn_cpu_has_avx2() && p.d % 8 == 0 && p.dv % 8 == 0) return rows_avx2(p, b, kvh, t0, t1, s, qs, acc);
#endif
  const Rows rows{p, kvh, t0, t1};
  for (int r = 0; r < rows.count(); ++r) head_portable(p, b, rows.head(r), rows.query(r), rows.query(r) + 1, s, qs);
}

// Multiply-adds per call below which one thread does all heads.
constexpr int64_t kAttnParallelMin = 1 << 17;
// Query rows per task at most: enough to share each K/V block among a GQA group's heads and
// a prompt chunk's neighbouring rows, few enough to balance the threads.
constexpr int kRowsPerTaskMax = 24;

void compute_attention(const AttnProblem& p) {
  const int heads = p.b * p.hq;
  if (p.lk == 0) {  // softmax over no keys: NaN, as MLX gives
    std::fill(p.out, p.out + static_cast<int64_t>(heads) * p.lq * p.dv, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const int kv_heads = p.b * p.hkv, per_kv = p.lq * (p.hq / p.hkv);  // rows per KV head
  const int64_t work = static_cast<int64_t>(heads) * p.lq * p.lk * (p.d + p.dv);
  const int threads = Pool::get().threads();
  if (threads <= 1 || heads * p.lq < 2 || work < kAttnParallelMin) {
    for (int bk = 0; bk < kv_heads; ++bk) run_rows(p, bk, 0, per_kv);
    return;
  }
  // Tasks of balanced runs of at most kRowsPerTaskMax rows of one KV head, at least one task
  // per thread: a KV head's rows stay together where there are enough KV heads, so its keys
  // and values are read from memory once (a decode step of SmolLM2 over a 2,000-token cache:
  // 3 tasks of the 3 query heads of a KV head decode about 6% faster, interleaved runs, than
  // 6 tasks of 2 and 1 rows, which read each KV head twice). A row's result does not depend
  // on the split.
  const int chunks = std::max((threads + kv_heads - 1) / kv_heads, (per_kv + kRowsPerTaskMax - 1) / kRowsPerTaskMax);
  const int per = (per_kv + chunks - 1) / chunks;
  Pool::get().run(kv_heads * chunks, [&](int t) {
    const int t0 = (t % chunks) * per;
    if (t0 < per_kv) run_rows(p, t / chunks, t0, std::min(per_kv, t0 + per));
  }, Pool::Linger::kShort);
}

class AttentionCpu : public mx::UnaryPrimitive {
 public:
  AttentionCpu(mx::Stream stream, float scale, bool causal)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    enc.dispatch([q = mx::array::unsafe_weak_copy(inputs[0]), k = mx::array::unsafe_weak_copy(inputs[1]),
                  v = mx::array::unsafe_weak_copy(inputs[2]), out = mx::array::unsafe_weak_copy(out),
                  scale = scale_, causal = causal_]() mutable {
      std::vector<float> qt, kt, vt;
      AttnProblem p{kernels::view4(q, qt), kernels::view4(k, kt), kernels::view4(v, vt), out.data<float>(),
                    q.shape(0), q.shape(1), k.shape(1), q.shape(2), k.shape(2), q.shape(3), v.shape(3), scale, causal};
      if (out.size() > 0) compute_attention(p);
      g_attn_calls.fetch_add(1, std::memory_order_relaxed);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[AttentionCpu] has no GPU evaluation; use fast::scaled_dot_product_attention");
  }

  const char* name() const override { return "AttentionCpu"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const AttentionCpu*>(&other);
    return o && o->scale_ == scale_ && o->causal_ == causal_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape(3);
    return {shape};
  }

 private:
  float scale_;
  bool causal_;
};

std::string dims(const mx::array& a) {
  std::string r = "(";
  for (size_t i = 0; i < a.ndim(); ++i) r += (i ? "," : "") + std::to_string(a.shape(i));
  return r + ")";
}
}  // namespace

std::unique_ptr<mx::array> cpu_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                                         bool causal) {
  const std::string op = "[cpu_attention] ";
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32) {
    throw std::invalid_argument(op + "q, k and v must be float32");
  }
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    throw std::invalid_argument(op + "q, k, v must be 4-D [B, H, L, D], got " + dims(q) + ", " + dims(k) + ", " +
                                dims(v));
  }
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || k.shape(3) != q.shape(3) || v.shape(1) != k.shape(1) ||
      v.shape(2) != k.shape(2) || k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0) {
    throw std::invalid_argument(op + "q " + dims(q) + ", k " + dims(k) + ", v " + dims(v) +
                                " do not fit q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] with Hq % Hkv == 0");
  }
  if (causal && q.shape(2) > k.shape(2)) {
    throw std::invalid_argument(op + "a causal mask needs Lq <= Lk, got q " + dims(q) + " and k " + dims(k));
  }
  auto dev = mx::default_device();
  if (dev != mx::Device(mx::Device::cpu)) throw std::invalid_argument(op + "the default device is not the CPU");
  auto shape = q.shape();
  shape.back() = v.shape(3);
  return std::make_unique<mx::array>(shape, mx::float32,
                                     std::make_shared<AttentionCpu>(mx::default_stream(dev), scale, causal),
                                     std::vector<mx::array>{q, k, v});
}

View4 kernels::view4(const mx::array& a, std::vector<float>& tmp) {
  const auto& st = a.strides();
  if (st[3] == 1 || a.shape(3) == 1) return View4{a.data<float>(), st[0], st[1], st[2]};
  const int n0 = a.shape(0), n1 = a.shape(1), n2 = a.shape(2), n3 = a.shape(3);
  tmp.resize(a.size());
  const float* src = a.data<float>();
  size_t i = 0;
  for (int x0 = 0; x0 < n0; ++x0)
    for (int x1 = 0; x1 < n1; ++x1)
      for (int x2 = 0; x2 < n2; ++x2)
        for (int x3 = 0; x3 < n3; ++x3) tmp[i++] = src[x0 * st[0] + x1 * st[1] + x2 * st[2] + x3 * st[3]];
  return View4{tmp.data(), static_cast<int64_t>(n1) * n2 * n3, static_cast<int64_t>(n2) * n3, n3};
}

void kernels::attention(const View4& q, const View4& k, const View4& v, float* out, int b, int hq, int hkv, int lq,
                        int lk, int d, int dv, float scale, bool causal) {
  compute_attention(AttnProblem{q, k, v, out, b, hq, hkv, lq, lk, d, dv, scale, causal});
}

uint64_t cpu_attention_calls() { return g_attn_calls.load(std::memory_order_relaxed); }
}  // namespace mlxsys
