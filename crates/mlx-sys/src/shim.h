// C++ side of the mlx-sys bridge: thin wrappers over mlx::core.
//
// Rules that every function here follows:
// - arrays go in as `const array&` and come out as `std::unique_ptr<array>` (Rust owns them
//   through cxx::UniquePtr, so dropping runs the C++ destructor);
// - optional and variadic array arguments travel as an `ArrayList` (0 or 1 entries = optional);
// - every function that can throw is declared `-> Result<..>` in src/lib.rs, so cxx catches
//   the std::exception and Rust receives Err with MLX's message instead of an abort.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <mlx/mlx.h>
#include "rust/cxx.h"

namespace mlxsys {
using mlx::core::array;

enum class Dtype : uint8_t;
enum class UnaryOp : uint8_t;
enum class BinaryOp : uint8_t;
enum class ReduceOp : uint8_t;
enum class ScanOp : uint8_t;
struct Quantized;
struct VjpOutputs;
struct LayerParams;
struct ArrayFn;

// An ordered list of arrays (inputs to concatenate/eval, optional arguments, split results).
struct ArrayList {
  std::vector<array> items;
};
// A name -> array map plus string metadata (safetensors).
struct ArrayMap {
  std::unordered_map<std::string, array> arrays;
  std::unordered_map<std::string, std::string> metadata;
};

// --- lists and maps
std::unique_ptr<ArrayList> list_new();
void list_push(ArrayList& l, const array& a);
size_t list_len(const ArrayList& l);
std::unique_ptr<array> list_get(const ArrayList& l, size_t i);
std::unique_ptr<ArrayMap> map_new();
void map_insert(ArrayMap& m, rust::Str name, const array& a);
void map_set_metadata(ArrayMap& m, rust::Str key, rust::Str value);
rust::Vec<rust::String> map_keys(const ArrayMap& m);
std::unique_ptr<array> map_get(const ArrayMap& m, rust::Str name);
rust::Vec<rust::String> map_metadata_keys(const ArrayMap& m);
rust::String map_metadata_get(const ArrayMap& m, rust::Str key);

// --- construction, inspection, copy-out
std::unique_ptr<array> from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape,
                                  Dtype dtype);
std::unique_ptr<array> full_f64(rust::Slice<const int32_t> shape, double value, Dtype dtype);
std::unique_ptr<array> arange(double start, double stop, double step, Dtype dtype);
std::unique_ptr<array> clone_array(const array& a);
rust::Vec<int32_t> shape(const array& a);
Dtype dtype(const array& a);
size_t nbytes(const array& a);
void copy_to(const array& a, rust::Slice<uint8_t> out);
double item_f64(const array& a);

// --- elementwise and structural ops
std::unique_ptr<array> unary(UnaryOp op, const array& a);
std::unique_ptr<array> binary(BinaryOp op, const array& a, const array& b);
std::unique_ptr<array> astype(const array& a, Dtype dtype);
std::unique_ptr<array> where_(const array& cond, const array& x, const array& y);
std::unique_ptr<array> clip(const array& a, const ArrayList& lo, const ArrayList& hi);
std::unique_ptr<array> matmul(const array& a, const array& b);
std::unique_ptr<array> addmm(const array& c, const array& a, const array& b, float alpha, float beta);
std::unique_ptr<array> reshape(const array& a, rust::Slice<const int32_t> shape);
std::unique_ptr<array> transpose(const array& a, rust::Slice<const int32_t> axes);
std::unique_ptr<array> swapaxes(const array& a, int32_t axis1, int32_t axis2);
std::unique_ptr<array> expand_dims(const array& a, rust::Slice<const int32_t> axes);
std::unique_ptr<array> squeeze(const array& a, rust::Slice<const int32_t> axes);
std::unique_ptr<array> broadcast_to(const array& a, rust::Slice<const int32_t> shape);
std::unique_ptr<array> slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop,
                             rust::Slice<const int32_t> strides);
std::unique_ptr<array> slice_update(const array& src, const array& update, rust::Slice<const int32_t> start,
                                    rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides);
std::unique_ptr<array> concatenate(const ArrayList& arrays, int32_t axis);
std::unique_ptr<array> stack(const ArrayList& arrays, int32_t axis);
std::unique_ptr<ArrayList> split_sections(const array& a, rust::Slice<const int32_t> indices, int32_t axis);
std::unique_ptr<array> take(const array& a, const array& indices, int32_t axis);
std::unique_ptr<array> take_along_axis(const array& a, const array& indices, int32_t axis);
std::unique_ptr<array> put_along_axis(const array& a, const array& indices, const array& values, int32_t axis);
std::unique_ptr<array> contiguous(const array& a);
std::unique_ptr<array> reduce(ReduceOp op, const array& a, rust::Slice<const int32_t> axes, bool keepdims);
std::unique_ptr<array> arg_reduce(ReduceOp op, const array& a, int32_t axis, bool keepdims);
std::unique_ptr<array> softmax(const array& a, rust::Slice<const int32_t> axes, bool precise);
std::unique_ptr<array> scan(ScanOp op, const array& a, int32_t axis, bool reverse, bool inclusive);
std::unique_ptr<array> sort(const array& a, int32_t axis);
std::unique_ptr<array> argsort(const array& a, int32_t axis);
std::unique_ptr<array> topk(const array& a, int32_t k, int32_t axis);
std::unique_ptr<array> argpartition(const array& a, int32_t kth, int32_t axis);
std::unique_ptr<array> tril(const array& a, int32_t k);
std::unique_ptr<array> triu(const array& a, int32_t k);

// --- fast ops (mlx::core::fast)
std::unique_ptr<array> rms_norm(const array& x, const ArrayList& weight, float eps);
std::unique_ptr<array> layer_norm(const array& x, const ArrayList& weight, const ArrayList& bias, float eps);
std::unique_ptr<array> rope(const array& x, int32_t dims, bool traditional, float base, bool has_base, float scale,
                            int32_t offset, const ArrayList& freqs);
std::unique_ptr<array> sdpa(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode,
                            const ArrayList& mask);

// --- affine quantization
Quantized quantize(const array& w, int32_t group_size, int32_t bits, rust::Str mode);
std::unique_ptr<array> dequantize(const array& w, const array& scales, const ArrayList& biases, int32_t group_size,
                                  int32_t bits, rust::Str mode);
std::unique_ptr<array> quantized_matmul(const array& x, const array& w, const array& scales, const ArrayList& biases,
                                        bool transpose, int32_t group_size, int32_t bits, rust::Str mode);

// --- random (explicit keys)
std::unique_ptr<array> random_key(uint64_t seed);
std::unique_ptr<array> random_split(const array& key, int32_t num);
std::unique_ptr<array> random_uniform(const array& low, const array& high, rust::Slice<const int32_t> shape,
                                      Dtype dtype, const array& key);
std::unique_ptr<array> random_normal(rust::Slice<const int32_t> shape, Dtype dtype, float loc, float scale,
                                     const array& key);
std::unique_ptr<array> random_categorical(const array& logits, int32_t axis, const array& key);

// --- automatic differentiation
// mx::vjp over a Rust closure (`f`, called back through `call_array_fn` in src/lib.rs): the
// closure's outputs at `primals` and the vector-Jacobian products of `cotangents` (one per
// output) with respect to each primal. An error the closure returns arrives here as a thrown
// rust::Error and leaves through the same Result as MLX's own exceptions.
VjpOutputs vjp(ArrayFn& f, const ArrayList& primals, const ArrayList& cotangents);

// --- evaluation and memory
void eval(const ArrayList& arrays);
void async_eval(const ArrayList& arrays);
size_t active_memory();
size_t peak_memory();
size_t cache_memory();
void reset_peak_memory();
void clear_cache();
size_t set_cache_limit(size_t limit);

// --- IO
std::unique_ptr<ArrayMap> load_safetensors(rust::Str path);
void save_safetensors(rust::Str path, const ArrayMap& m);

// --- runtime information
rust::String version();
rust::String default_device();
bool gpu_available();
bool metal_available();
bool cuda_available();
rust::String blas_info();
bool blas_select(rust::Str which);
// --- fast CPU affine quantized matmul (src/qmm.cc)
// x [..., K] @ dequantize(w, scales, biases)^T -> [..., N] float32, as a lazy MLX array whose
// primitive (QuantizedMatmulCpu) runs an AVX-512, AVX2/FMA or portable kernel on the CPU stream.
// bits 4 or 8, group_size 32/64/128, float32 x/scales/biases, w [N, K*bits/32] uint32.
std::unique_ptr<array> cpu_quantized_matmul(const array& x, const array& w, const array& scales, const array& biases,
                                            int32_t group_size, int32_t bits, int32_t max_isa, int32_t precision,
                                            int32_t threads);
// `max_isa` caps the instruction set (0 portable, 1 AVX2 + FMA, 2 AVX-512F); `precision` 0 is
// f32 (MLX's results up to summation order), 1 bf16 (weights and activations rounded to bf16,
// f32 accumulation: AVX512_BF16 dot products, or portable code with the same bits); `threads`
// > 0 splits the call over that many threads instead of the pool's count.
// Several products of one x in one node: `mats` holds (w, scales, biases) triples with the
// same K, bits and group size. Returns one [..., N_j] array per triple, or with `swiglu` (two
// triples, gate and up) the single array silu(x @ gate^T) * (x @ up^T).
std::unique_ptr<ArrayList> cpu_quantized_matmuls(const array& x, const ArrayList& mats, int32_t group_size,
                                                 int32_t bits, bool swiglu, int32_t max_isa, int32_t precision,
                                                 int32_t threads);
// The same kernels for dense float32 weights: x [..., K] @ w_j^T for w_j [N_j, K] float32
// (K a multiple of 32), one [..., N_j] per weight, or with `swiglu` (gate, up) the single
// silu(x @ gate^T) * (x @ up^T).
std::unique_ptr<ArrayList> cpu_dense_matmuls(const array& x, const ArrayList& weights, bool swiglu, int32_t max_isa,
                                             int32_t threads);
// "avx512f", "avx2+fma" or "portable": the kernel a call with this cap uses (0 portable,
// 1 AVX2 + FMA, 2 AVX-512F; the best the CPU has, at most the cap); with `precision` 1 (bf16)
// "avx512f+avx512bf16 (bf16)" or "portable (bf16)".
rust::String cpu_qmm_isa(int32_t max_isa, int32_t precision);
// Products the kernel has evaluated since the process started.
uint64_t cpu_qmm_calls();
// Threads the kernel splits output features over (default: all cores; process-wide).
int32_t cpu_qmm_threads();
void cpu_qmm_set_threads(int32_t n);
// Microseconds the pool's idle workers spin after a quantized matmul (default 5000).
int32_t cpu_pool_spin_us();
void cpu_pool_set_spin_us(int32_t us);
// --- fused CPU attention for short query windows (src/attn.cc)
// softmax(q k^T * scale [+ causal mask aligned to the end]) v for q [B, Hq, Lq, D],
// k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] float32 (any strides) -> [B, Hq, Lq, Dv] float32, as a
// lazy MLX array whose primitive (AttentionCpu) runs on the CPU stream.
std::unique_ptr<array> cpu_attention(const array& q, const array& k, const array& v, float scale, bool causal);
// Attention calls the primitive has evaluated since the process started.
uint64_t cpu_attention_calls();
// --- RMS norm and RoPE as single CPU primitives (src/fast.cc)
// fast::rms_norm's formula, w * (x * rsqrt(mean(x^2, -1) + eps)), for float32 x [..., H] (any
// strides) and an optional float32 weight [H] (empty list: none) -> [..., H] float32.
std::unique_ptr<array> cpu_rms_norm(const array& x, const ArrayList& weight, float eps);
// fast::rope's rotation of the first `dims` features of x [..., L, D] float32 at positions
// offset + l (scaled by `scale`), frequencies from `base` (has_base) or the float32
// `freqs [dims / 2]` -> float32, x's shape. With int32 `positions [L]` (a one-item list), row l
// sits at positions[l] instead (`offset` unused): several requests' rows roped in one node.
std::unique_ptr<array> cpu_rope(const array& x, int32_t dims, bool traditional, float base, bool has_base, float scale,
                                int32_t offset, const ArrayList& freqs, const ArrayList& positions);
// RMS norm and RoPE calls the primitives have evaluated since the process started.
uint64_t cpu_fast_calls();
// --- a llama-style decoder layer as CPU primitives (src/layer.cc)
// rms_norm(x) -> the q, k, v products (+ biases) -> per-head q/k norms -> RoPE: returns
// q [B, Hq, L, D], k and v [B, Hkv, L, D] for x [B, L, H] float32. `qkv`: the three
// (w, scales, biases) triples (or three dense float32 w when p.bits is 32); `qkv_bias`: none or
// the three biases; `qk_norms`: none or the q and k norm weights [D]; `freqs`: the RoPE
// frequencies [dims / 2] when !p.rope_has_base. Same values as the separate nodes, bit for bit.
std::unique_ptr<ArrayList> cpu_layer_in(const array& x, const array& norm, const ArrayList& qkv,
                                        const ArrayList& qkv_bias, const ArrayList& qk_norms, const ArrayList& freqs,
                                        const LayerParams& p);
// attention(q, keys, values) (causal when L > 1) -> the o product (+ bias) -> h = x + o ->
// rms_norm(h) -> silu(gate) * up -> down -> h + down: [B, L, H] for the residual stream x,
// q [B, Hq, L, D] and the cache's keys and values [B, Hkv, T, D]. `mlp`: the gate, up and down
// triples (or dense w).
std::unique_ptr<array> cpu_layer_out(const array& x, const array& q, const array& keys, const array& values,
                                     const ArrayList& o, const ArrayList& o_bias, const array& norm,
                                     const ArrayList& mlp, const LayerParams& p);
// Both of the above and the cache write between them as one node: returns y [B, L, H] and the
// key and value buffers [B, Hkv, C, D] (C >= p.offset + L) with rows p.offset .. p.offset + L
// replaced by this window's keys and values (the input buffers, written in place, when
// p.in_place: the caller's promise that nothing else reads them; else copies). The attention
// reads their first p.offset + L rows.
std::unique_ptr<ArrayList> cpu_layer(const array& x, const array& keys, const array& values, const array& norm,
                                     const ArrayList& qkv, const ArrayList& qkv_bias, const ArrayList& qk_norms,
                                     const ArrayList& freqs, const ArrayList& o, const ArrayList& o_bias,
                                     const array& post_norm, const ArrayList& mlp, const LayerParams& p);
// Layer nodes (any kind) evaluated since the process started.
uint64_t cpu_layer_calls();

// Calls of cblas_sgemm made by libmlx (all shapes) since the process started.
uint64_t blas_sgemm_calls();
// Of those, the calls with M = 1 or N = 1 that were answered by one cblas_sgemv.
uint64_t blas_gemv_calls();
// Turns the sgemv rewrite of matrix-vector products on or off; returns the previous setting.
bool blas_set_gemv_routing(bool on);
}  // namespace mlxsys
