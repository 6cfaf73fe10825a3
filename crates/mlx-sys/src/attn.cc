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
// AVX-512F when the CPU has it and D = Dv = 64 or 128; else AVX2 + FMA when
// the CPU has them and D, Dv are multiples of 8 (runtime checks); portable C++ otherwise. The
// vector paths take the keys in segments (kSegmentKeys), merged in order. Rows and segments
// are split over the shared pool (pool.h) when the work is large enough. A row's bits depend
// on the path (the CPU and the head dims), never on the window, the tasks or the threads.
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

// Keys per block: the K (or V) rows of a block (16 KB at D = 64) stay in L1 while every query
// row of a task uses them, so a KV head's cache is read from memory once per task instead of
// once per query row (a decode step's query heads of one GQA group; a window's or a prompt
// chunk's rows). A multiple of 8.
constexpr int kKeyBlock = 64;

// Keys per segment. A row's keys go in segments [0, S), [S, 2S), .. of absolute key index;
// each segment's softmax is taken over its own keys (its maximum m_s, its sum l_s and its
// unnormalized weighted values o_s) and the segments are then merged in order (flash
// decoding): m = max m_s, o = sum o_s exp(m_s - m), l = sum l_s exp(m_s - m), out = o / l.
// A segment is a task of its own, so a decode step over a long cache keeps every core
// streaming keys (SmolLM2's 3 KV heads on 2 cores went 2 + 1 before) and each segment's keys
// and values are read back to back. The segments depend only on the key count, so a window's
// row still gives a one-token step's bits; with one segment (up to S keys) the merge is
// exact (exp(0) = 1), the plain softmax's bits. A multiple of kKeyBlock.
constexpr int kSegmentKeys = 512;

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

// Query rows per tile of the tiled value loop (Isa::values_tile; Isa::kValueTiles).
constexpr int kValueTileRows = 12;

// The AVX2 kernel's two inner loops, over keys [j0, j1) of one query row: its scores into
// `sr` (indexed by key), and its weighted values into the accumulators `a` (Dv floats). D, Dv
// multiples of 8. Scores: one dot product per key (two accumulators over D), 8 keys at a
// time reduced together (hsum8x8: the same additions as hsum8, so the same bits as one at a
// time), the rest one by one. Values: the products summed key by key, Dv in chunks of up to
// 8 vectors kept in registers. `lead` (the first row of a task) prefetches the next block's
// keys or values up to `last`.
struct Avx2Attn {
  static constexpr int kScoreStep = 8;
  static constexpr int kScoreRows = 3;
  static constexpr int kQueryPad = 1;
  static constexpr bool kValueTiles = false;

  // Where element d of query row r goes in the task's scaled queries: row by row.
  static size_t q_at(int r, int d, int d_len) { return static_cast<size_t>(r) * d_len + d; }

  // Up to kScoreRows rows (`rows`, their scaled queries at q + i * D): their scores into
  // sr_row[i]. One row: 8 keys at a time (key_dot each). Two or three rows share each key's
  // loads (scores_rows).
  static AVX2_FN void scores(const AttnProblem& p, int b, int kvh, const float* q, int rows, int j0, int j1,
                             float* const* sr_row, bool lead, int last) {
    if (rows == 2) return scores_rows<2>(p, b, kvh, q, j0, j1, sr_row, lead, last);
    if (rows == 3) return scores_rows<3>(p, b, kvh, q, j0, j1, sr_row, lead, last);
    float* sr = sr_row[0];
    int j = j0;
    for (; j + 8 <= j1; j += 8) {
      if (lead && j + kKeyBlock + 8 <= last) prefetch_rows(p.k, b, kvh, j + kKeyBlock, 8, p.d);
      __m256 dots[8];
      _Pragma("GCC unroll 8") for (int u = 0; u < 8; ++u) dots[u] = key_dot(q, p.k.row(b, kvh, j + u), p.d);
      _mm256_storeu_ps(sr + j, hsum8x8(dots));
    }
    for (; j < j1; ++j) sr[j] = hsum8(key_dot(q, p.k.row(b, kvh, j), p.d));
  }

  // R rows' scores, 8 keys at a time in pairs: per pair of keys and chunk pair of D, 4 key
  // loads feed 4R FMAs (4R of the 16 registers accumulate), where one row at a time loaded
  // its query and the key for every FMA. Each (row, key) keeps key_dot's two chains (even
  // and odd chunks) and its sum a0 + a1, reduced by hsum8x8 as for one row: the same bits.
  template <int R>
  static AVX2_FN void scores_rows(const AttnProblem& p, int b, int kvh, const float* q, int j0, int j1,
                                  float* const* sr_row, bool lead, int last) {
    const int d_len = p.d;
    int j = j0;
    for (; j + 8 <= j1; j += 8) {
      if (lead && j + kKeyBlock + 8 <= last) prefetch_rows(p.k, b, kvh, j + kKeyBlock, 8, p.d);
      __m256 dots[R][8];
      for (int u = 0; u < 8; u += 2) {
        const float* k0 = p.k.row(b, kvh, j + u);
        const float* k1 = p.k.row(b, kvh, j + u + 1);
        __m256 a0[R][2], a1[R][2];
        _Pragma("GCC unroll 3") for (int i = 0; i < R; ++i) a0[i][0] = a0[i][1] = a1[i][0] = a1[i][1] = _mm256_setzero_ps();
        int d = 0;
        for (; d + 16 <= d_len; d += 16) {
          const __m256 ka = _mm256_loadu_ps(k0 + d), kb = _mm256_loadu_ps(k1 + d);
          const __m256 kc = _mm256_loadu_ps(k0 + d + 8), kd = _mm256_loadu_ps(k1 + d + 8);
          _Pragma("GCC unroll 3") for (int i = 0; i < R; ++i) {
            const float* qi = q + static_cast<size_t>(i) * d_len + d;
            a0[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qi), ka, a0[i][0]);
            a0[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qi), kb, a0[i][1]);
            a1[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 8), kc, a1[i][0]);
            a1[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qi + 8), kd, a1[i][1]);
          }
        }
        if (d < d_len) {
          const __m256 ka = _mm256_loadu_ps(k0 + d), kb = _mm256_loadu_ps(k1 + d);
          _Pragma("GCC unroll 3") for (int i = 0; i < R; ++i) {
            const float* qi = q + static_cast<size_t>(i) * d_len + d;
            a0[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qi), ka, a0[i][0]);
            a0[i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qi), kb, a0[i][1]);
          }
        }
        _Pragma("GCC unroll 3") for (int i = 0; i < R; ++i) {
          dots[i][u] = _mm256_add_ps(a0[i][0], a1[i][0]);
          dots[i][u + 1] = _mm256_add_ps(a0[i][1], a1[i][1]);
        }
      }
      _Pragma("GCC unroll 3") for (int i = 0; i < R; ++i) _mm256_storeu_ps(sr_row[i] + j, hsum8x8(dots[i]));
    }
    for (; j < j1; ++j) {
      _Pragma("GCC unroll 3") for (int i = 0; i < R; ++i) {
        sr_row[i][j] = hsum8(key_dot(q + static_cast<size_t>(i) * d_len, p.k.row(b, kvh, j), d_len));
      }
    }
  }

  // Rows 0 and 1 (keys [j0, j1_0) and [j0, j1_1)): together over the keys both see (each
  // value row's loads serve both), then the one that sees more alone.
  static AVX2_FN void values2(const AttnProblem& p, int b, int kvh, const float* sr0, const float* sr1, int j0,
                              int j1_0, int j1_1, float* a0, float* a1, bool lead, int last) {
    const float* sr[2] = {sr0, sr1};
    float* a[2] = {a0, a1};
    const int both = std::min(j1_0, j1_1);
    values_rows<2>(p, b, kvh, sr, j0, both, a, lead, last);
    if (both < j1_0) values(p, b, kvh, sr0, both, j1_0, a0, false, last);
    if (both < j1_1) values(p, b, kvh, sr1, both, j1_1, a1, false, last);
  }

  static AVX2_FN void values(const AttnProblem& p, int b, int kvh, const float* sr, int j0, int j1, float* a, bool lead,
                             int last) {
    values_rows<1>(p, b, kvh, &sr, j0, j1, &a, lead, last);
  }

  // R rows' weighted values over keys [j0, j1), Dv in passes of 8 / R vectors a row (8
  // accumulators), each value row's loads serving all R rows. Each lane sums its row's keys
  // in order, continuing what `a` holds: the same bits for any R and any split of the keys.
  template <int R>
  static AVX2_FN void values_rows(const AttnProblem& p, int b, int kvh, const float* const* sr, int j0, int j1,
                                  float* const* a, bool lead, int last) {
    constexpr int kChunks = 8 / R;
    for (int d0 = 0; d0 < p.dv; d0 += 8 * kChunks) {
      const int chunks = std::min(kChunks, (p.dv - d0) / 8);
      __m256 ac[R][kChunks];
      _Pragma("GCC unroll 2") for (int i = 0; i < R; ++i)
        _Pragma("GCC unroll 8") for (int c = 0; c < kChunks; ++c) {
          if (c < chunks) ac[i][c] = _mm256_loadu_ps(a[i] + d0 + 8 * c);
        }
      for (int j = j0; j < j1; ++j) {
        if (lead && d0 == 0 && j + kKeyBlock < last) prefetch_rows(p.v, b, kvh, j + kKeyBlock, 1, p.dv);
        const float* vr = p.v.row(b, kvh, j) + d0;
        _Pragma("GCC unroll 8") for (int c = 0; c < kChunks; ++c) {
          if (c < chunks) {
            const __m256 v = _mm256_loadu_ps(vr + 8 * c);
            _Pragma("GCC unroll 2") for (int i = 0; i < R; ++i) {
              ac[i][c] = _mm256_fmadd_ps(_mm256_set1_ps(sr[i][j]), v, ac[i][c]);
            }
          }
        }
      }
      _Pragma("GCC unroll 2") for (int i = 0; i < R; ++i)
        _Pragma("GCC unroll 8") for (int c = 0; c < kChunks; ++c) {
          if (c < chunks) _mm256_storeu_ps(a[i] + d0 + 8 * c, ac[i][c]);
        }
    }
  }
};

// The same two loops with AVX-512F, for D = Dv = 64 or 128 (Avx512Attn::fits): scores for
// up to four quads of query rows at once, each lane one row's FMA chain over a quarter of D fed
// by a broadcast of four of a key's elements (scores_quads: one load per FMA at most and three
// vector operations per four keys' reduction, where one row at a time took a reduction of 16
// lanes per key). Values: tiles of 3 to 12 rows (values_tile), then two rows at a time share
// each value row's loads and keep twice the FMA chains in flight (one row's D / 16 chains wait
// on the FMA latency); each row still sums its keys in order.
#define AVX512_FN __attribute__((target("avx512f,avx2,fma"))) inline
#define AVX512_FN_ALWAYS __attribute__((target("avx512f,avx2,fma"), always_inline)) inline

// Scores of keys [j0, j1) of NQ quads of query rows (up to 4 NQ; `rows` of them real), U keys
// at a time (a multiple of 4), S = D / 4. A quad's scaled queries are packed by
// Avx512Attn::q_at: vector s holds elements 4s .. 4s + 3 of each row, row i in lanes 4i .. 4i + 3,
// so one 128-bit broadcast of a key's elements 4s .. 4s + 3 feeds all four rows of every quad:
// lane 4i + c sums q_i[4s + c] k[4s + c] over s in one FMA chain from zero, and a key's score
// for row i is (c0 + c2) + (c1 + c3) of its four lanes, taken for four keys at once by two
// transposing add steps (lane 4i + u of the result: key j + u, row i). NQ x U accumulators:
// with two or more quads 8 to 16 independent FMA chains (two FMAs a cycle of four cycles'
// latency; a window's rows one quad at a time kept half of them waiting), and a key's
// broadcast serves NQ quads (`attn_profile`, 11-token window over 400 keys: 0.85-0.88x the
// time of one quad at a time, arms alternated). The same operations
// in the same order whatever the other rows, quads, the window or the task: a row's bits. Keys
// past j1 in the last group of U repeat the last key; their scores land past every row's keys
// (segment_softmax pads over them; the score rows are padded to kScoreStep).
template <int S, int NQ, int U>
AVX512_FN void scores_quads(const AttnProblem& p, int b, int kvh, const float* qp, int rows, int j0, int j1,
                            float* const* sr, bool lead, int last) {
  constexpr size_t kQuad = 16 * S;  // floats of a quad's packed queries (4 rows of D)
  for (int j = j0; j < j1; j += U) {
    if (lead && j + kKeyBlock + U <= last) prefetch_rows(p.k, b, kvh, j + kKeyBlock, U, p.d);
    const float* kr[U];
    _Pragma("GCC unroll 8") for (int u = 0; u < U; ++u) kr[u] = p.k.row(b, kvh, std::min(j + u, j1 - 1));
    __m512 acc[NQ][U];
    _Pragma("GCC unroll 4") for (int g = 0; g < NQ; ++g)
      _Pragma("GCC unroll 8") for (int u = 0; u < U; ++u) acc[g][u] = _mm512_setzero_ps();
    _Pragma("GCC unroll 16") for (int st = 0; st < S; ++st) {
      __m512 kb[U];
      _Pragma("GCC unroll 8") for (int u = 0; u < U; ++u) kb[u] = _mm512_broadcast_f32x4(_mm_loadu_ps(kr[u] + 4 * st));
      _Pragma("GCC unroll 4") for (int g = 0; g < NQ; ++g) {
        const __m512 q = _mm512_loadu_ps(qp + kQuad * g + 16 * st);
        _Pragma("GCC unroll 8") for (int u = 0; u < U; ++u) acc[g][u] = _mm512_fmadd_ps(q, kb[u], acc[g][u]);
      }
    }
    // Per 128-bit lane i: [c0 + c2, c1 + c3] of keys u, u + 1, then their sum per key.
    _Pragma("GCC unroll 4") for (int g = 0; g < NQ; ++g)
      _Pragma("GCC unroll 2") for (int u = 0; u < U; u += 4) {
        const __m512 u01 = _mm512_add_ps(_mm512_shuffle_ps(acc[g][u], acc[g][u + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                         _mm512_shuffle_ps(acc[g][u], acc[g][u + 1], _MM_SHUFFLE(3, 2, 3, 2)));
        const __m512 u23 = _mm512_add_ps(_mm512_shuffle_ps(acc[g][u + 2], acc[g][u + 3], _MM_SHUFFLE(1, 0, 1, 0)),
                                         _mm512_shuffle_ps(acc[g][u + 2], acc[g][u + 3], _MM_SHUFFLE(3, 2, 3, 2)));
        const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
        const int row = 4 * g;
        if (row < rows) _mm_storeu_ps(sr[row] + j + u, _mm512_castps512_ps128(r));
        if (row + 1 < rows) _mm_storeu_ps(sr[row + 1] + j + u, _mm512_extractf32x4_ps(r, 1));
        if (row + 2 < rows) _mm_storeu_ps(sr[row + 2] + j + u, _mm512_extractf32x4_ps(r, 2));
        if (row + 3 < rows) _mm_storeu_ps(sr[row + 3] + j + u, _mm512_extractf32x4_ps(r, 3));
      }
  }
}

// scores_quads for up to 16 rows, four keys at a time (a lone quad, one-token steps, was
// measured eight keys at a time too: no faster, its keys stream from memory).
template <int S>
void scores_rows(const AttnProblem& p, int b, int kvh, const float* qp, int rows, int j0, int j1, float* const* sr,
                 bool lead, int last) {
  switch ((rows + 3) / 4) {
    case 1: return scores_quads<S, 1, 4>(p, b, kvh, qp, rows, j0, j1, sr, lead, last);
    case 2: return scores_quads<S, 2, 4>(p, b, kvh, qp, rows, j0, j1, sr, lead, last);
    case 3: return scores_quads<S, 3, 4>(p, b, kvh, qp, rows, j0, j1, sr, lead, last);
    default: return scores_quads<S, 4, 4>(p, b, kvh, qp, rows, j0, j1, sr, lead, last);
  }
}

// Weighted values of keys [j0, j1) for R query rows (scores sr[r], accumulators a[r]).
template <int C, int R>
AVX512_FN void values512(const AttnProblem& p, int b, int kvh, const float* const* sr, int j0, int j1, float* const* a,
                         bool lead, int last) {
  __m512 ac[R][C];
  _Pragma("GCC unroll 2") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) ac[r][c] = _mm512_loadu_ps(a[r] + 16 * c);
  for (int j = j0; j < j1; ++j) {
    if (lead && j + kKeyBlock < last) prefetch_rows(p.v, b, kvh, j + kKeyBlock, 1, p.dv);
    const float* vr = p.v.row(b, kvh, j);
    _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) {
      const __m512 v = _mm512_loadu_ps(vr + 16 * c);
      _Pragma("GCC unroll 2") for (int r = 0; r < R; ++r) ac[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(sr[r][j]), v, ac[r][c]);
    }
  }
  _Pragma("GCC unroll 2") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 8") for (int c = 0; c < C; ++c) _mm512_storeu_ps(a[r] + 16 * c, ac[r][c]);
}

struct Avx512Attn {
  static constexpr int kScoreStep = 16;
  static constexpr int kScoreRows = 16;
  static constexpr int kQueryPad = 4;  // whole quads of scaled queries
  static constexpr bool kValueTiles = true;
  // Rows below which values2 beats a tile: two rows keep 8 FMA chains in flight in values512,
  // a two-row tile only 4.
  static constexpr int kMinTileRows = 3;

  // Where element d of query row r goes in the task's scaled queries: in quads of rows
  // (scores_quads), 4 (r / 4) D + 16 (d / 4) + 4 (r % 4) + d % 4.
  static size_t q_at(int r, int d, int d_len) {
    return static_cast<size_t>(r / 4) * 4 * d_len + 16 * (d / 4) + 4 * (r % 4) + d % 4;
  }

  // Weighted values of keys [j0, j1) for R query rows at once (R <= kValueTileRows; scores
  // sr[r] by key index, accumulators a[r]), as the prompt GEMM's micro-kernel (qmm.cc,
  // gemm_tile) runs: the rows' weights packed key by key into `w` ([key][R]), then per 32
  // columns of Dv an R x 32 tile of accumulators in 2R registers, fed per key by two value
  // loads and R broadcasts (12 rows: 14 loads per 24 FMAs; values512 with two rows: 10 per 16).
  // Each accumulator starts from the row's partial sum and adds the keys in order, one FMA
  // each: values512's bits. The first pass asks for the next block's value rows below `last`
  // (0: another tile of the task does).
  template <int R>
  static AVX512_FN void values_tile_of(const AttnProblem& p, int b, int kvh, const float* const* sr, int j0, int j1,
                                       float* const* a, float* w, int last) {
    const int n = j1 - j0;
    _Pragma("GCC unroll 12") for (int r = 0; r < R; ++r) {
      const float* from = sr[r] + j0;
      for (int j = 0; j < n; ++j) w[j * R + r] = from[j];
    }
    const int64_t vs = p.v.sl;
    for (int c0 = 0; c0 < p.dv; c0 += 32) {
      __m512 acc[R][2];
      _Pragma("GCC unroll 12") for (int r = 0; r < R; ++r) {
        acc[r][0] = _mm512_loadu_ps(a[r] + c0);
        acc[r][1] = _mm512_loadu_ps(a[r] + c0 + 16);
      }
      const float* vr = p.v.row(b, kvh, j0) + c0;
      const float* wj = w;
      _Pragma("GCC unroll 2") for (int j = 0; j < n; ++j, vr += vs, wj += R) {
        if (c0 == 0 && j0 + j + kKeyBlock < last) prefetch_rows(p.v, b, kvh, j0 + j + kKeyBlock, 1, p.dv);
        const __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
        _Pragma("GCC unroll 12") for (int r = 0; r < R; ++r) {
          const __m512 x = _mm512_set1_ps(wj[r]);
          acc[r][0] = _mm512_fmadd_ps(x, v0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(x, v1, acc[r][1]);
        }
      }
      _Pragma("GCC unroll 12") for (int r = 0; r < R; ++r) {
        _mm512_storeu_ps(a[r] + c0, acc[r][0]);
        _mm512_storeu_ps(a[r] + c0 + 16, acc[r][1]);
      }
    }
  }

  // values_tile_of for `rows` rows, kMinTileRows .. kValueTileRows.
  static void values_tile(const AttnProblem& p, int b, int kvh, int rows, const float* const* sr, int j0, int j1,
                          float* const* a, float* w, int last) {
    switch (rows) {
      case 3: return values_tile_of<3>(p, b, kvh, sr, j0, j1, a, w, last);
      case 4: return values_tile_of<4>(p, b, kvh, sr, j0, j1, a, w, last);
      case 5: return values_tile_of<5>(p, b, kvh, sr, j0, j1, a, w, last);
      case 6: return values_tile_of<6>(p, b, kvh, sr, j0, j1, a, w, last);
      case 7: return values_tile_of<7>(p, b, kvh, sr, j0, j1, a, w, last);
      case 8: return values_tile_of<8>(p, b, kvh, sr, j0, j1, a, w, last);
      case 9: return values_tile_of<9>(p, b, kvh, sr, j0, j1, a, w, last);
      case 10: return values_tile_of<10>(p, b, kvh, sr, j0, j1, a, w, last);
      case 11: return values_tile_of<11>(p, b, kvh, sr, j0, j1, a, w, last);
      default: return values_tile_of<kValueTileRows>(p, b, kvh, sr, j0, j1, a, w, last);
    }
  }

  static bool fits(const AttnProblem& p) { return (p.d == 64 || p.d == 128) && p.dv == p.d; }

  static void scores(const AttnProblem& p, int b, int kvh, const float* q, int rows, int j0, int j1, float* const* sr,
                     bool lead, int last) {
    (p.d == 64 ? scores_rows<16> : scores_rows<32>)(p, b, kvh, q, rows, j0, j1, sr, lead, last);
  }

  // Rows r0 and r1 (keys [j0, j1_0) and [j0, j1_1)): together over the keys both see, then the
  // one that sees more alone.
  static void values2(const AttnProblem& p, int b, int kvh, const float* sr0, const float* sr1, int j0, int j1_0,
                      int j1_1, float* a0, float* a1, bool lead, int last) {
    const float* sr[2] = {sr0, sr1};
    float* a[2] = {a0, a1};
    const int both = std::min(j1_0, j1_1);
    (p.d == 64 ? values512<4, 2> : values512<8, 2>)(p, b, kvh, sr, j0, both, a, lead, last);
    if (both < j1_0) values(p, b, kvh, sr0, both, j1_0, a0, false, last);
    if (both < j1_1) values(p, b, kvh, sr1, both, j1_1, a1, false, last);
  }

  static void values(const AttnProblem& p, int b, int kvh, const float* sr, int j0, int j1, float* a, bool lead,
                     int last) {
    (p.d == 64 ? values512<4, 1> : values512<8, 1>)(p, b, kvh, &sr, j0, j1, &a, lead, last);
  }
};

// Row r's softmax weights over its n keys of a segment, in place in `sr` (padded with -inf to a
// multiple of 8, whose exp is 0): m_s = max, exp(s - m_s), l_s = their sum (chunks of 8).
AVX2_FN void segment_softmax(float* sr, int n, float* m_out, float* l_out) {
  const int padded = (n + 7) / 8 * 8;
  for (int j = n; j < padded; ++j) sr[j] = -std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < padded; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sr + j));
  const float m = hmax8(vmax);
  const __m256 mx = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (int j = 0; j < padded; j += 8) {
    __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mx));
    _mm256_storeu_ps(sr + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  *m_out = m;
  *l_out = hsum8(vsum);
}

// Segment [j_begin, j_end) of the query rows [t0, t1) of KV head `kvh` of batch `b` (see
// Rows), with the inner loops of `Isa` (Avx2Attn, Avx512Attn). Row r's partial result goes to
// `part + r * part_stride`: o_s (Dv floats), m_s, l_s (a row with no key in the segment: 0,
// -inf, 0). A key block's keys (then values) stay in L1 while every row of the task uses
// them; each row's result comes from the same float operations as it would alone, in the
// same order: the grouping only shares loads. `s` holds each row's scores.
template <class Isa>
void rows_segment(const AttnProblem& p, int b, int kvh, int t0, int t1, int j_begin, int j_end, float* part,
                  size_t part_stride, std::vector<float>& s, std::vector<float>& qs) {
  const Rows rows{p, kvh, t0, t1};
  constexpr int G = Isa::kScoreRows;
  const int stride = (j_end - j_begin + Isa::kScoreStep - 1) / Isa::kScoreStep * Isa::kScoreStep;
  s.resize(static_cast<size_t>(rows.count()) * stride);
  constexpr int pad = Isa::kQueryPad;
  qs.assign(static_cast<size_t>((rows.count() + pad - 1) / pad) * pad * p.d, 0.f);  // padding rows: zeros
  for (int r = 0; r < rows.count(); ++r) {
    const float* qr = p.q.row(b, rows.head(r), rows.query(r));
    for (int d = 0; d < p.d; ++d) qs[Isa::q_at(r, d, p.d)] = qr[d] * p.scale;
  }
  const int last = std::min(j_end, rows.keys(rows.count() - 1));  // the most keys any row sees
  auto row_end = [&](int r) { return std::min(j_end, rows.keys(r)); };
  auto scores_of = [&](int r) { return &s[static_cast<size_t>(r) * stride] - j_begin; };  // by key index
  // Scores G rows at a time (Isa::scores), over the keys the group's last row sees (the most);
  // an earlier row's scores past its own keys are not read.
  for (int j0 = j_begin; j0 < last; j0 += kKeyBlock) {
    for (int r = 0; r < rows.count(); r += G) {
      const int n = std::min(G, rows.count() - r);
      const int j1 = std::min(j0 + kKeyBlock, row_end(r + n - 1));
      float* sr[G];
      for (int i = 0; i < n; ++i) sr[i] = scores_of(r + i);
      if (j0 < j1) Isa::scores(p, b, kvh, &qs[Isa::q_at(r, 0, p.d)], n, j0, j1, sr, r == 0, last);
    }
  }
  for (int r = 0; r < rows.count(); ++r) {
    float* o = part + r * part_stride;
    std::fill(o, o + p.dv, 0.f);
    const int n = std::max(0, row_end(r) - j_begin);
    if (n == 0) {
      o[p.dv] = -std::numeric_limits<float>::infinity();
      o[p.dv + 1] = 0.f;
    } else {
      segment_softmax(scores_of(r) + j_begin, n, &o[p.dv], &o[p.dv + 1]);
    }
  }
  // Values in balanced tiles of Isa::kMinTileRows to kValueTileRows rows where the Isa has
  // them (over the keys all rows of the tile see, then each row alone over the rest; 17 rows:
  // 9 + 8), then two rows at a time (Isa::values2), an odd row alone.
  for (int j0 = j_begin; j0 < last; j0 += kKeyBlock) {
    auto end = [&](int r) { return std::max(j0, std::min(j0 + kKeyBlock, row_end(r))); };
    int r = 0;
    if constexpr (Isa::kValueTiles) {
      thread_local std::vector<float> w(kKeyBlock * kValueTileRows);
      const int tiles = (rows.count() + kValueTileRows - 1) / kValueTileRows;
      for (int t = 0; t < tiles && rows.count() - r >= Isa::kMinTileRows; ++t) {
        const int n = (rows.count() - r + tiles - t - 1) / (tiles - t);
        const float* sr[kValueTileRows];
        float* a[kValueTileRows];
        int all = j0 + kKeyBlock;
        for (int i = 0; i < n; ++i) {
          sr[i] = scores_of(r + i);
          a[i] = part + (r + i) * part_stride;
          all = std::min(all, end(r + i));
        }
        Isa::values_tile(p, b, kvh, n, sr, j0, all, a, w.data(), t == 0 ? last : 0);
        for (int i = 0; i < n; ++i) {
          if (all < end(r + i)) Isa::values(p, b, kvh, sr[i], all, end(r + i), a[i], false, last);
        }
        r += n;
      }
    }
    for (; r + 2 <= rows.count(); r += 2) {
      Isa::values2(p, b, kvh, scores_of(r), scores_of(r + 1), j0, end(r), end(r + 1), part + r * part_stride,
                   part + (r + 1) * part_stride, r == 0, last);
    }
    if (r < rows.count()) Isa::values(p, b, kvh, scores_of(r), j0, end(r), part + r * part_stride, r == 0, last);
  }
}

bool attn_cpu_has_avx2() { return simd::has_avx2_fma(); }
bool attn_cpu_has_avx512() {
  static const bool yes = attn_cpu_has_avx2() && __builtin_cpu_supports("avx512f");
  return yes;
}
#endif

std::atomic<uint64_t> g_attn_calls{0};

// Multiply-adds per call below which one thread does all heads.
constexpr int64_t kAttnParallelMin = 1 << 17;
// Query rows per task at most: enough to share each K/V block among a GQA group's heads and
// a window's or prompt chunk's neighbouring rows (SmolLM2's 11-token window over a long cache:
// its 33 rows of a KV head in one task read the keys and values once), few enough to balance
// the threads.
constexpr int kRowsPerTaskMax = 48;

// Rows per KV head (see Rows), segments per row (kSegmentKeys) and the floats of a row's
// partial result per segment (o_s, m_s, l_s).
struct Split {
  int per_kv, segments, part;
  Split(const AttnProblem& p)
      : per_kv(p.lq * (p.hq / p.hkv)), segments((p.lk + kSegmentKeys - 1) / kSegmentKeys), part(p.dv + 2) {}
  size_t at(int bk, int t, int seg) const { return ((static_cast<size_t>(bk) * per_kv + t) * segments + seg) * part; }
};

// Segment `seg` of rows [t0, t1) (see Rows) of KV head bk % Hkv of batch bk / Hkv: partial
// results into `parts` (Split::at). Only where `segmented`.
void run_segment(const AttnProblem& p, const Split& sp, float* parts, int bk, int t0, int t1, int seg) {
#ifdef MLXSYS_X86
  thread_local std::vector<float> s, qs;
  const int j_begin = seg * kSegmentKeys, j_end = std::min(p.lk, j_begin + kSegmentKeys);
  const auto rows = attn_cpu_has_avx512() && Avx512Attn::fits(p) ? rows_segment<Avx512Attn> : rows_segment<Avx2Attn>;
  rows(p, bk / p.hkv, bk % p.hkv, t0, t1, j_begin, j_end, parts + sp.at(bk, t0, seg), sp.at(0, 1, 0), s, qs);
#else
  (void)p, (void)sp, (void)parts, (void)bk, (void)t0, (void)t1, (void)seg;
#endif
}

// Merges row t of KV head bk's segments in order into its output row (see kSegmentKeys).
// Segment 0 always has keys; a later one without any of the row's keys (l_s = 0) is skipped.
void merge_segments(const AttnProblem& p, const Split& sp, const float* parts, int bk, int t) {
  const Rows rows{p, bk % p.hkv, t, t + 1};
  float m = parts[sp.at(bk, t, 0) + p.dv];
  for (int seg = 1; seg < sp.segments; ++seg) m = std::max(m, parts[sp.at(bk, t, seg) + p.dv]);
  float* o = p.out_row(bk / p.hkv, rows.head(0), rows.query(0));
  float l = 0.f;
  for (int seg = 0; seg < sp.segments; ++seg) {
    const float* part = parts + sp.at(bk, t, seg);
    if (seg > 0 && part[p.dv + 1] == 0.f) continue;
    const float w = std::exp(part[p.dv] - m);  // 1 exactly for the segment holding the maximum
    for (int d = 0; d < p.dv; ++d) o[d] = seg == 0 ? part[d] * w : o[d] + part[d] * w;
    l = seg == 0 ? part[p.dv + 1] * w : l + part[p.dv + 1] * w;
  }
  const float inv = 1.f / l;
  for (int d = 0; d < p.dv; ++d) o[d] *= inv;
}

// Whether the AVX2 kernel (in segments) runs, else the portable one (each row over all its
// keys at once).
bool segmented(const AttnProblem& p) {
#ifdef MLXSYS_X86
  return attn_cpu_has_avx2() && p.d % 8 == 0 && p.dv % 8 == 0;
#else
  (void)p;
  return false;
#endif
}

void compute_attention(const AttnProblem& p) {
  const int heads = p.b * p.hq;
  if (p.lk == 0) {  // softmax over no keys: NaN, as MLX gives
    std::fill(p.out, p.out + static_cast<int64_t>(heads) * p.lq * p.dv, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const int kv_heads = p.b * p.hkv;
  if (!segmented(p)) {
    thread_local std::vector<float> s, qs;
    for (int bk = 0; bk < kv_heads; ++bk) {
      const Rows rows{p, bk % p.hkv, 0, p.lq * (p.hq / p.hkv)};
      for (int r = 0; r < rows.count(); ++r) {
        head_portable(p, bk / p.hkv, rows.head(r), rows.query(r), rows.query(r) + 1, s, qs);
      }
    }
    return;
  }
  const Split sp(p);
  thread_local std::vector<float> part_buf;  // the calling thread's; tasks get its address
  part_buf.resize(sp.at(kv_heads, 0, 0));
  float* parts = part_buf.data();
  const int64_t work = static_cast<int64_t>(heads) * p.lq * p.lk * (p.d + p.dv);
  const int threads = Pool::get().threads();
  // Tasks: balanced runs of at most kRowsPerTaskMax rows of one KV head, times the segments,
  // at least two tasks per thread (three KV heads on two threads would go 2 + 1). A KV head's
  // rows stay together where there are enough tasks, so a segment's keys and values
  // are read from memory once (a decode step of SmolLM2 over a 2,000-token cache: the 3 query
  // heads of a KV head in one task decoded about 6% faster, interleaved runs, than 2 + 1,
  // which read each KV head twice). A row's result depends on neither the tasks nor the threads.
  const int tasks_per_rows = kv_heads * sp.segments;
  const int chunks = std::max((2 * threads + tasks_per_rows - 1) / tasks_per_rows,
                              (sp.per_kv + kRowsPerTaskMax - 1) / kRowsPerTaskMax);
  const int per = (sp.per_kv + chunks - 1) / chunks;
  auto task = [&](int t) {
    const int seg = t % sp.segments, rest = t / sp.segments;
    const int bk = rest / chunks, t0 = (rest % chunks) * per;
    if (t0 < sp.per_kv) run_segment(p, sp, parts, bk, t0, std::min(sp.per_kv, t0 + per), seg);
  };
  const int n_tasks = tasks_per_rows * chunks;
  if (threads <= 1 || n_tasks < 2 || work < kAttnParallelMin) {
    for (int t = 0; t < n_tasks; ++t) task(t);
  } else {
    Pool::get().run(n_tasks, task, Pool::Linger::kShort);
  }
  for (int bk = 0; bk < kv_heads; ++bk)
    for (int t = 0; t < sp.per_kv; ++t) merge_segments(p, sp, parts, bk, t);
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
