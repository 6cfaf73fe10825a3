// The CPU kernels of qmm.cc, attn.cc and fast.cc as plain functions on raw float buffers, so
// that one MLX node can run several of them in a row (layer.cc: a decoder layer in two nodes)
// with exactly the arithmetic of the separate nodes. Each primitive's own evaluation calls the
// same function, so a fused node and the chain of single nodes give the same bits.
//
// Every function runs on the calling thread (the stream thread inside an MLX node) and
// splits its work over the shared pool (pool.h) as the single nodes do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace mlx::core {
class array;
}

namespace mlxsys::kernels {

// --- inputs ----------------------------------------------------------------------------

// The data of a float32 (uint32) array, or of a row-contiguous copy of it kept in `tmp` when
// it is a strided view (qmm.cc).
const float* contiguous_f32(const mlx::core::array& a, std::vector<float>& tmp);
const uint32_t* contiguous_u32(const mlx::core::array& a, std::vector<uint32_t>& tmp);

// The data of each of a node's inputs, taken in `eval_cpu` (the task's own copies of the
// inputs do not own their data), and Matrix::owner for weights `w` with scales `s` and
// biases `b`: w's data, or empty when any of the three is a view (then a per-call copy).
std::vector<std::weak_ptr<const void>> owners(const std::vector<mlx::core::array>& inputs);
std::weak_ptr<const void> owner(const mlx::core::array& w, const mlx::core::array& s, const mlx::core::array& b,
                                const std::weak_ptr<const void>& data);

// --- products (qmm.cc) -----------------------------------------------------------------

// Bits of a dense float32 weight (`Matrix::w` holds the floats' bits, no scales or biases).
constexpr int kDenseBits = 32;

// The arrays a product's weights take as node inputs: (w, scales, biases), or w alone (dense).
constexpr int weight_inputs(int bits) { return bits == kDenseBits ? 1 : 3; }

// One weight matrix of a product: packed 4- or 8-bit rows `w [N, K * bits / 32]` with float32
// `s`, `b [N, K / gs]` (MLX's affine format), or dense float32 rows `[N, K]` (bits
// kDenseBits; `s`, `b` null). Row-contiguous. `owner`: the MLX data that `w` points into
// when `w` is that array's own row-contiguous storage (empty for a copy): it keys the
// repacked copy of the weights that f32 products on AVX-512 read (qmm.cc, "Panel layout"),
// and its expiry says when that copy is stale.
struct Matrix {
  const uint32_t* w;
  const float* s;
  const float* b;
  int n;
  std::weak_ptr<const void> owner = {};
};

// outs[j] [M, N_j] = x [M, K] @ W_j^T for every matrix (one bits and group size), or with
// `swiglu` (two matrices, gate and up) outs[0] [M, N] = silu(x @ gate^T) * (x @ up^T).
// `max_isa` caps the instruction set (0 portable, 1 AVX2 + FMA, 2 AVX-512F), `precision` is
// 0 f32, 1 bf16, 2 int8, `threads` > 0 overrides the pool's count. A row's result does not
// depend on M, except that in f32 precision on AVX-512 products of more than 256 rows
// (kWindowMaxRows: prompt chunks) take a GEMM with another summation order (qmm.cc). The
// first f32 product of a 4- or 8-bit matrix with an `owner` and whole panels of 32 features
// on AVX-512 repacks it (qmm.cc, "Panel layout"; kept until the owner's data is freed):
// products of at most 256 rows compute on the copy, prompt chunks pack the GEMM's panels
// from it (the same bits as from MLX's rows).
void products(const float* x, int m, int k, const std::vector<Matrix>& mats, const std::vector<float*>& outs,
              bool swiglu, int gs, int bits, int max_isa, int precision, int threads);

// --- RMS norm and RoPE (fast.cc) -------------------------------------------------------

// One row of fast::rms_norm: y = w * (x * (1 / sqrt(mean(x^2) + eps))) over n features read
// with stride xs (weight: stride ws; none when w is null); y contiguous.
void rms_norm_row(const float* x, int64_t xs, int n, float eps, const float* w, int64_t ws, float* y);
// rms_norm_row over m contiguous rows of n (w contiguous or null), each row's bits as alone:
// several rows' sums of squares side by side.
void rms_norm_rows(const float* x, int m, int n, float eps, const float* w, float* y);
// y[i] = a[i] + b[i] for i < n: MLX's add of two float32 arrays of the same shape (y may be a or b).
void add(const float* a, const float* b, size_t n, float* y);

// fast::rope's rotation parameters.
struct RopeSpec {
  int dims;
  bool traditional;
  float base;
  float scale;
  // 1 / freqs_i replaces base^(-i / (dims / 2)) when not null (stride freqs_stride).
  const float* freqs;
  int64_t freqs_stride;
};

// cos and sin of every (row l < l_len, frequency i < dims / 2) at position offset + l (or
// positions[l * positions_stride] when positions is not null), times spec.scale:
// `cs`, `sn` [l_len, dims / 2].
void rope_table(const RopeSpec& spec, int offset, const int32_t* positions, int64_t positions_stride, int l_len,
                std::vector<float>& cs, std::vector<float>& sn);

// One row of d features (stride xs) rotated by the table row (c, s); y contiguous.
void rope_row(const RopeSpec& spec, const float* x, int64_t xs, int d, const float* c, const float* s, float* y);

// --- attention (attn.cc) ---------------------------------------------------------------

// A strided 4-D float view [B, H, L, D] with a contiguous last axis.
struct View4 {
  const float* data;
  int64_t sb, sh, sl;
  const float* row(int b, int h, int l) const { return data + b * sb + h * sh + l * sl; }
};

// The view of a 4-D float32 array; a last axis that is not contiguous is copied to `tmp`
// first (attn.cc).
View4 view4(const mlx::core::array& a, std::vector<float>& tmp);

// out [B, Hq, Lq, Dv] (contiguous) = softmax(q k^T * scale [+ causal mask aligned to the
// end]) v for q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv].
void attention(const View4& q, const View4& k, const View4& v, float* out, int b, int hq, int hkv, int lq, int lk,
               int d, int dv, float scale, bool causal);

}  // namespace mlxsys::kernels
