// Implementation of the wrappers declared in shim.h. Each function is one MLX call plus the
// conversions between cxx types and mlx::core types; nothing here keeps state.
#include "mlx-sys/src/shim.h"
#include "mlx-sys/src/lib.rs.h"

#include <mlx/backend/cuda/cuda.h>
#include <mlx/backend/gpu/device_info.h>
#include <mlx/backend/metal/metal.h>

#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>

namespace mx = mlx::core;

namespace mlxsys {
namespace {

std::unique_ptr<array> box(array a) { return std::make_unique<array>(std::move(a)); }

mx::Shape to_shape(rust::Slice<const int32_t> s) { return mx::Shape(s.begin(), s.end()); }
std::vector<int> to_ints(rust::Slice<const int32_t> s) { return std::vector<int>(s.begin(), s.end()); }

std::optional<array> opt(const ArrayList& l) {
  if (l.items.size() > 1) throw std::invalid_argument("optional argument given more than one array");
  if (l.items.empty()) return std::nullopt;
  return l.items[0];
}

mx::Dtype to_mx(Dtype d) {
  switch (d) {
    case Dtype::Bool: return mx::bool_;
    case Dtype::Uint8: return mx::uint8;
    case Dtype::Uint16: return mx::uint16;
    case Dtype::Uint32: return mx::uint32;
    case Dtype::Uint64: return mx::uint64;
    case Dtype::Int8: return mx::int8;
    case Dtype::Int16: return mx::int16;
    case Dtype::Int32: return mx::int32;
    case Dtype::Int64: return mx::int64;
    case Dtype::Float16: return mx::float16;
    case Dtype::Float32: return mx::float32;
    case Dtype::Float64: return mx::float64;
    case Dtype::Bfloat16: return mx::bfloat16;
    case Dtype::Complex64: return mx::complex64;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(static_cast<int>(d)));
}

Dtype from_mx(mx::Dtype d) {
  switch (d.val()) {
    case mx::Dtype::Val::bool_: return Dtype::Bool;
    case mx::Dtype::Val::uint8: return Dtype::Uint8;
    case mx::Dtype::Val::uint16: return Dtype::Uint16;
    case mx::Dtype::Val::uint32: return Dtype::Uint32;
    case mx::Dtype::Val::uint64: return Dtype::Uint64;
    case mx::Dtype::Val::int8: return Dtype::Int8;
    case mx::Dtype::Val::int16: return Dtype::Int16;
    case mx::Dtype::Val::int32: return Dtype::Int32;
    case mx::Dtype::Val::int64: return Dtype::Int64;
    case mx::Dtype::Val::float16: return Dtype::Float16;
    case mx::Dtype::Val::float32: return Dtype::Float32;
    case mx::Dtype::Val::float64: return Dtype::Float64;
    case mx::Dtype::Val::bfloat16: return Dtype::Bfloat16;
    case mx::Dtype::Val::complex64: return Dtype::Complex64;
  }
  return Dtype::Float32;
}

size_t numel(const mx::Shape& s) {
  size_t n = 1;
  for (auto d : s) {
    if (d < 0) throw std::invalid_argument("negative dimension in shape");
    n *= static_cast<size_t>(d);
  }
  return n;
}

// A safetensors load is lazy in MLX: run it on the caller's stream now so that a
// truncated or corrupt file surfaces as an error here, not at some later eval.
void eval_all(const std::unordered_map<std::string, array>& m) {
  std::vector<array> v;
  v.reserve(m.size());
  for (auto& [_, a] : m) v.push_back(a);
  mx::eval(v);
}
}  // namespace

// --- lists and maps
std::unique_ptr<ArrayList> list_new() { return std::make_unique<ArrayList>(); }
void list_push(ArrayList& l, const array& a) { l.items.push_back(a); }
size_t list_len(const ArrayList& l) { return l.items.size(); }
std::unique_ptr<array> list_get(const ArrayList& l, size_t i) { return box(l.items.at(i)); }
std::unique_ptr<ArrayMap> map_new() { return std::make_unique<ArrayMap>(); }
void map_insert(ArrayMap& m, rust::Str name, const array& a) { m.arrays.insert_or_assign(std::string(name), a); }
void map_set_metadata(ArrayMap& m, rust::Str key, rust::Str value) {
  m.metadata.insert_or_assign(std::string(key), std::string(value));
}
rust::Vec<rust::String> map_keys(const ArrayMap& m) {
  rust::Vec<rust::String> v;
  for (auto& [k, _] : m.arrays) v.push_back(rust::String::lossy(k));
  return v;
}
std::unique_ptr<array> map_get(const ArrayMap& m, rust::Str name) {
  auto it = m.arrays.find(std::string(name));
  if (it == m.arrays.end()) throw std::out_of_range("no tensor named '" + std::string(name) + "'");
  return box(it->second);
}
rust::Vec<rust::String> map_metadata_keys(const ArrayMap& m) {
  rust::Vec<rust::String> v;
  for (auto& [k, _] : m.metadata) v.push_back(rust::String::lossy(k));
  return v;
}
rust::String map_metadata_get(const ArrayMap& m, rust::Str key) {
  auto it = m.metadata.find(std::string(key));
  if (it == m.metadata.end()) throw std::out_of_range("no metadata key '" + std::string(key) + "'");
  return rust::String::lossy(it->second);
}

// --- construction, inspection, copy-out
std::unique_ptr<array> from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, Dtype dtype) {
  auto sh = to_shape(shape);
  auto dt = to_mx(dtype);
  size_t want = numel(sh) * dt.size();
  if (want != data.size()) {
    throw std::invalid_argument("data has " + std::to_string(data.size()) + " bytes but shape and dtype need " +
                                std::to_string(want));
  }
  // Allocate an MLX buffer and copy the host bytes into it.
  array a(mx::allocator::malloc(want), sh, dt);
  if (want > 0) std::memcpy(a.data<uint8_t>(), data.data(), want);
  return box(std::move(a));
}
std::unique_ptr<array> full_f64(rust::Slice<const int32_t> shape, double value, Dtype dtype) {
  return box(mx::full(to_shape(shape), array(value, mx::float64), to_mx(dtype)));
}
std::unique_ptr<array> arange(double start, double stop, double step, Dtype dtype) {
  return box(mx::arange(start, stop, step, to_mx(dtype)));
}
std::unique_ptr<array> clone_array(const array& a) { return box(a); }
rust::Vec<int32_t> shape(const array& a) {
  rust::Vec<int32_t> v;
  for (auto d : a.shape()) v.push_back(d);
  return v;
}
Dtype dtype(const array& a) { return from_mx(a.dtype()); }
size_t nbytes(const array& a) { return a.nbytes(); }
void copy_to(const array& a, rust::Slice<uint8_t> out) {
  auto c = mx::contiguous(a, /*allow_col_major=*/false);
  c.eval();
  if (c.nbytes() != out.size()) {
    throw std::invalid_argument("output buffer has " + std::to_string(out.size()) + " bytes, array has " +
                                std::to_string(c.nbytes()));
  }
  if (out.size() > 0) std::memcpy(out.data(), c.data<uint8_t>(), out.size());
}
double item_f64(const array& a) {
  if (a.size() != 1) throw std::invalid_argument("item() needs an array of size 1");
  auto c = mx::astype(mx::reshape(a, {}), mx::float64);
  c.eval();
  return c.item<double>();
}

// --- elementwise and structural ops
std::unique_ptr<array> unary(UnaryOp op, const array& a) {
  switch (op) {
    case UnaryOp::Abs: return box(mx::abs(a));
    case UnaryOp::Negative: return box(mx::negative(a));
    case UnaryOp::Exp: return box(mx::exp(a));
    case UnaryOp::Log: return box(mx::log(a));
    case UnaryOp::Log1p: return box(mx::log1p(a));
    case UnaryOp::Sqrt: return box(mx::sqrt(a));
    case UnaryOp::Rsqrt: return box(mx::rsqrt(a));
    case UnaryOp::Square: return box(mx::square(a));
    case UnaryOp::Reciprocal: return box(mx::reciprocal(a));
    case UnaryOp::Sin: return box(mx::sin(a));
    case UnaryOp::Cos: return box(mx::cos(a));
    case UnaryOp::Tanh: return box(mx::tanh(a));
    case UnaryOp::Sigmoid: return box(mx::sigmoid(a));
    case UnaryOp::Erf: return box(mx::erf(a));
    case UnaryOp::Floor: return box(mx::floor(a));
    case UnaryOp::Ceil: return box(mx::ceil(a));
    case UnaryOp::Round: return box(mx::round(a));
    case UnaryOp::Sign: return box(mx::sign(a));
    case UnaryOp::LogicalNot: return box(mx::logical_not(a));
    case UnaryOp::IsNan: return box(mx::isnan(a));
    case UnaryOp::IsInf: return box(mx::isinf(a));
    case UnaryOp::StopGradient: return box(mx::stop_gradient(a));
  }
  throw std::invalid_argument("unknown unary op");
}
std::unique_ptr<array> binary(BinaryOp op, const array& a, const array& b) {
  switch (op) {
    case BinaryOp::Add: return box(mx::add(a, b));
    case BinaryOp::Subtract: return box(mx::subtract(a, b));
    case BinaryOp::Multiply: return box(mx::multiply(a, b));
    case BinaryOp::Divide: return box(mx::divide(a, b));
    case BinaryOp::FloorDivide: return box(mx::floor_divide(a, b));
    case BinaryOp::Remainder: return box(mx::remainder(a, b));
    case BinaryOp::Power: return box(mx::power(a, b));
    case BinaryOp::Maximum: return box(mx::maximum(a, b));
    case BinaryOp::Minimum: return box(mx::minimum(a, b));
    case BinaryOp::Equal: return box(mx::equal(a, b));
    case BinaryOp::NotEqual: return box(mx::not_equal(a, b));
    case BinaryOp::Less: return box(mx::less(a, b));
    case BinaryOp::LessEqual: return box(mx::less_equal(a, b));
    case BinaryOp::Greater: return box(mx::greater(a, b));
    case BinaryOp::GreaterEqual: return box(mx::greater_equal(a, b));
    case BinaryOp::LogicalAnd: return box(mx::logical_and(a, b));
    case BinaryOp::LogicalOr: return box(mx::logical_or(a, b));
    case BinaryOp::LogAddExp: return box(mx::logaddexp(a, b));
  }
  throw std::invalid_argument("unknown binary op");
}
std::unique_ptr<array> astype(const array& a, Dtype dtype) { return box(mx::astype(a, to_mx(dtype))); }
std::unique_ptr<array> where_(const array& cond, const array& x, const array& y) { return box(mx::where(cond, x, y)); }
std::unique_ptr<array> clip(const array& a, const ArrayList& lo, const ArrayList& hi) {
  return box(mx::clip(a, opt(lo), opt(hi)));
}
std::unique_ptr<array> matmul(const array& a, const array& b) { return box(mx::matmul(a, b)); }
std::unique_ptr<array> addmm(const array& c, const array& a, const array& b, float alpha, float beta) {
  return box(mx::addmm(c, a, b, alpha, beta));
}
std::unique_ptr<array> reshape(const array& a, rust::Slice<const int32_t> shape) {
  return box(mx::reshape(a, to_shape(shape)));
}
std::unique_ptr<array> transpose(const array& a, rust::Slice<const int32_t> axes) {
  if (axes.empty()) return box(mx::transpose(a));
  return box(mx::transpose(a, to_ints(axes)));
}
std::unique_ptr<array> swapaxes(const array& a, int32_t axis1, int32_t axis2) {
  return box(mx::swapaxes(a, axis1, axis2));
}
std::unique_ptr<array> expand_dims(const array& a, rust::Slice<const int32_t> axes) {
  return box(mx::expand_dims(a, to_ints(axes)));
}
std::unique_ptr<array> squeeze(const array& a, rust::Slice<const int32_t> axes) {
  if (axes.empty()) return box(mx::squeeze(a));
  return box(mx::squeeze(a, to_ints(axes)));
}
std::unique_ptr<array> broadcast_to(const array& a, rust::Slice<const int32_t> shape) {
  return box(mx::broadcast_to(a, to_shape(shape)));
}
std::unique_ptr<array> slice(const array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop,
                             rust::Slice<const int32_t> strides) {
  return box(mx::slice(a, to_shape(start), to_shape(stop), to_shape(strides)));
}
std::unique_ptr<array> slice_update(const array& src, const array& update, rust::Slice<const int32_t> start,
                                    rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides) {
  return box(mx::slice_update(src, update, to_shape(start), to_shape(stop), to_shape(strides)));
}
std::unique_ptr<array> concatenate(const ArrayList& arrays, int32_t axis) {
  return box(mx::concatenate(arrays.items, axis));
}
std::unique_ptr<array> stack(const ArrayList& arrays, int32_t axis) { return box(mx::stack(arrays.items, axis)); }
std::unique_ptr<ArrayList> split_sections(const array& a, rust::Slice<const int32_t> indices, int32_t axis) {
  auto out = std::make_unique<ArrayList>();
  out->items = mx::split(a, to_shape(indices), axis);
  return out;
}
std::unique_ptr<array> take(const array& a, const array& indices, int32_t axis) {
  return box(mx::take(a, indices, axis));
}
std::unique_ptr<array> take_along_axis(const array& a, const array& indices, int32_t axis) {
  return box(mx::take_along_axis(a, indices, axis));
}
std::unique_ptr<array> put_along_axis(const array& a, const array& indices, const array& values, int32_t axis) {
  return box(mx::put_along_axis(a, indices, values, axis));
}
std::unique_ptr<array> contiguous(const array& a) { return box(mx::contiguous(a)); }
std::unique_ptr<array> reduce(ReduceOp op, const array& a, rust::Slice<const int32_t> axes, bool keepdims) {
  auto ax = to_ints(axes);
  if (ax.empty()) {
    for (int i = 0; i < static_cast<int>(a.ndim()); ++i) ax.push_back(i);
  }
  switch (op) {
    case ReduceOp::Sum: return box(mx::sum(a, ax, keepdims));
    case ReduceOp::Mean: return box(mx::mean(a, ax, keepdims));
    case ReduceOp::Max: return box(mx::max(a, ax, keepdims));
    case ReduceOp::Min: return box(mx::min(a, ax, keepdims));
    case ReduceOp::Prod: return box(mx::prod(a, ax, keepdims));
    case ReduceOp::All: return box(mx::all(a, ax, keepdims));
    case ReduceOp::Any: return box(mx::any(a, ax, keepdims));
    case ReduceOp::LogSumExp: return box(mx::logsumexp(a, ax, keepdims));
    default: break;
  }
  throw std::invalid_argument("reduce: op needs a single axis (use arg_reduce)");
}
std::unique_ptr<array> arg_reduce(ReduceOp op, const array& a, int32_t axis, bool keepdims) {
  switch (op) {
    case ReduceOp::ArgMax: return box(mx::argmax(a, axis, keepdims));
    case ReduceOp::ArgMin: return box(mx::argmin(a, axis, keepdims));
    default: break;
  }
  throw std::invalid_argument("arg_reduce: op must be ArgMax or ArgMin");
}
std::unique_ptr<array> softmax(const array& a, rust::Slice<const int32_t> axes, bool precise) {
  return box(mx::softmax(a, to_ints(axes), precise));
}
std::unique_ptr<array> scan(ScanOp op, const array& a, int32_t axis, bool reverse, bool inclusive) {
  switch (op) {
    case ScanOp::Sum: return box(mx::cumsum(a, axis, reverse, inclusive));
    case ScanOp::Prod: return box(mx::cumprod(a, axis, reverse, inclusive));
    case ScanOp::Max: return box(mx::cummax(a, axis, reverse, inclusive));
    case ScanOp::Min: return box(mx::cummin(a, axis, reverse, inclusive));
    case ScanOp::LogSumExp: return box(mx::logcumsumexp(a, axis, reverse, inclusive));
  }
  throw std::invalid_argument("unknown scan op");
}
std::unique_ptr<array> sort(const array& a, int32_t axis) { return box(mx::sort(a, axis)); }
std::unique_ptr<array> argsort(const array& a, int32_t axis) { return box(mx::argsort(a, axis)); }
std::unique_ptr<array> topk(const array& a, int32_t k, int32_t axis) { return box(mx::topk(a, k, axis)); }
std::unique_ptr<array> argpartition(const array& a, int32_t kth, int32_t axis) {
  return box(mx::argpartition(a, kth, axis));
}
std::unique_ptr<array> tril(const array& a, int32_t k) { return box(mx::tril(a, k)); }
std::unique_ptr<array> triu(const array& a, int32_t k) { return box(mx::triu(a, k)); }

// --- fast ops
std::unique_ptr<array> rms_norm(const array& x, const ArrayList& weight, float eps) {
  return box(mx::fast::rms_norm(x, opt(weight), eps));
}
std::unique_ptr<array> layer_norm(const array& x, const ArrayList& weight, const ArrayList& bias, float eps) {
  return box(mx::fast::layer_norm(x, opt(weight), opt(bias), eps));
}
std::unique_ptr<array> rope(const array& x, int32_t dims, bool traditional, float base, bool has_base, float scale,
                            int32_t offset, const ArrayList& freqs) {
  std::optional<float> b = has_base ? std::optional<float>(base) : std::nullopt;
  return box(mx::fast::rope(x, dims, traditional, b, scale, offset, opt(freqs)));
}
std::unique_ptr<array> sdpa(const array& q, const array& k, const array& v, float scale, rust::Str mask_mode,
                            const ArrayList& mask) {
  return box(mx::fast::scaled_dot_product_attention(q, k, v, scale, std::string(mask_mode), opt(mask)));
}

// --- affine quantization
Quantized quantize(const array& w, int32_t group_size, int32_t bits, rust::Str mode) {
  auto q = mx::quantize(w, group_size, bits, std::string(mode));
  Quantized out;
  out.w = box(q.at(0));
  out.scales = box(q.at(1));
  out.biases = q.size() > 2 ? box(q.at(2)) : std::unique_ptr<array>();
  return out;
}
std::unique_ptr<array> dequantize(const array& w, const array& scales, const ArrayList& biases, int32_t group_size,
                                  int32_t bits, rust::Str mode) {
  return box(mx::dequantize(w, scales, opt(biases), group_size, bits, std::string(mode)));
}
std::unique_ptr<array> quantized_matmul(const array& x, const array& w, const array& scales, const ArrayList& biases,
                                        bool transpose, int32_t group_size, int32_t bits, rust::Str mode) {
  return box(mx::quantized_matmul(x, w, scales, opt(biases), transpose, group_size, bits, std::string(mode)));
}

// --- random
std::unique_ptr<array> random_key(uint64_t seed) { return box(mx::random::key(seed)); }
std::unique_ptr<array> random_split(const array& key, int32_t num) { return box(mx::random::split(key, num)); }
std::unique_ptr<array> random_uniform(const array& low, const array& high, rust::Slice<const int32_t> shape,
                                      Dtype dtype, const array& key) {
  return box(mx::random::uniform(low, high, to_shape(shape), to_mx(dtype), key));
}
std::unique_ptr<array> random_normal(rust::Slice<const int32_t> shape, Dtype dtype, float loc, float scale,
                                     const array& key) {
  return box(mx::random::normal(to_shape(shape), to_mx(dtype), loc, scale, key));
}
std::unique_ptr<array> random_categorical(const array& logits, int32_t axis, const array& key) {
  return box(mx::random::categorical(logits, axis, key));
}

// --- automatic differentiation
VjpOutputs vjp(ArrayFn& f, const ArrayList& primals, const ArrayList& cotangents) {
  auto fun = [&f](const std::vector<array>& inputs) {
    ArrayList in;
    in.items = inputs;
    return call_array_fn(f, in)->items;
  };
  auto [outputs, grads] = mx::vjp(fun, primals.items, cotangents.items);
  VjpOutputs out;
  out.outputs = std::make_unique<ArrayList>();
  out.outputs->items = std::move(outputs);
  out.grads = std::make_unique<ArrayList>();
  out.grads->items = std::move(grads);
  return out;
}

// --- evaluation and memory
void eval(const ArrayList& arrays) { mx::eval(arrays.items); }
void async_eval(const ArrayList& arrays) { mx::async_eval(arrays.items); }
size_t active_memory() { return mx::get_active_memory(); }
size_t peak_memory() { return mx::get_peak_memory(); }
size_t cache_memory() { return mx::get_cache_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
void clear_cache() { mx::clear_cache(); }
size_t set_cache_limit(size_t limit) { return mx::set_cache_limit(limit); }

// --- IO
std::unique_ptr<ArrayMap> load_safetensors(rust::Str path) {
  auto loaded = mx::load_safetensors(std::string(path));
  eval_all(loaded.first);
  auto m = std::make_unique<ArrayMap>();
  m->arrays = std::move(loaded.first);
  m->metadata = std::move(loaded.second);
  return m;
}
void save_safetensors(rust::Str path, const ArrayMap& m) {
  mx::save_safetensors(std::string(path), m.arrays, m.metadata);
}

// --- runtime information
rust::String version() { return rust::String(mx::version()); }
rust::String default_device() {
  std::ostringstream o;
  o << mx::default_device();
  return rust::String(o.str());
}
bool gpu_available() { return mx::gpu::is_available(); }
bool metal_available() { return mx::metal::is_available(); }
bool cuda_available() { return mx::cu::is_available(); }

#ifndef MLXSYS_BLAS_SWITCH
rust::String blas_info() { return rust::String("the BLAS libmlx was built with (no runtime switch on this platform)"); }
bool blas_select(rust::Str) { return false; }
uint64_t blas_sgemm_calls() { return 0; }
uint64_t blas_gemv_calls() { return 0; }
bool blas_set_gemv_routing(bool) { return false; }
#endif
}  // namespace mlxsys
