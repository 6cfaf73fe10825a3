// A llama-style decoder layer (llama, SmolLM2, Qwen2, Qwen3) as MLX custom primitives on the
// CPU backend:
//
//   LayerInCpu   x -> rms_norm -> q, k, v products (+ biases) -> per-head q/k norms
//                  -> RoPE -> q [B, Hq, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D]
//   (the caller appends k, v to its cache and passes the cache's keys and values)
//   LayerOutCpu  attention(q, keys, values) -> o product (+ bias) -> h = x + o
//                  -> rms_norm -> SwiGLU gate/up products -> down product -> h + down
//   LayerCpu     both halves and the cache write between them as one node: it takes the
//                cache's whole key and value buffers [B, Hkv, capacity, D], writes the new
//                rows at positions offset .. offset + L (in place when the caller says no
//                copy of the cache shares them, p.in_place; else into a copy) and returns y
//                and the two buffers.
//
// Why one node: MLX 0.32 queues at most MAX_ACTIVE_TASKS = 10 tasks of DISPATCHES_PER_TASK
// = 10 dispatches (two per CPU node) ahead of the stream thread, so a step of more than ~50
// nodes keeps the thread that builds the next step in lock-step with the one running this
// one. LayerInCpu + cache write + LayerOutCpu is six nodes a layer (~190 for SmolLM2's 30
// layers); LayerCpu is one (~35).
//
// Why: on the CPU a decode step of SmolLM2-135M spends about as long outside the products as
// in them, most of it building, dispatching and allocating some 23 graph nodes per layer
// (norms, three products, reshapes, transposes, two RoPEs, the cache writes, attention, the
// output transpose, adds). The two nodes here do the same work with six nodes per layer.
//
// Bits: every step calls the function the single node calls (kernels.h: the products, RMS
// norm rows, RoPE table and rows, attention) on the same values in the same order, and the
// adds are the single float additions MLX's add makes (the build passes -ffp-contract=off),
// so the outputs equal the chain of single nodes bit for bit, at any window length.
//
// Inputs: float32 activations, norm weights and biases; weights as (w, scales, biases)
// triples of one bits (4, 8) and group size, or dense float32 `w` alone (bits 32).
#include "mlx-sys/src/shim.h"
#include "mlx-sys/src/kernels.h"
#include "mlx-sys/src/lib.rs.h"
#include "mlx-sys/src/pool.h"

#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

namespace mlxsys {
namespace mx = mlx::core;

namespace {

std::atomic<uint64_t> g_layer_calls{0};

using kernels::weight_inputs;
using Owners = std::vector<std::weak_ptr<const void>>;

// Registers the inputs and the outputs with the stream's encoder and runs `fn(inputs,
// outputs, owners)` on the stream thread (owners: kernels::owners of the inputs). Output i
// takes over input donors[i]'s buffer when donors[i] >= 0 (fn sees equal data pointers),
// else gets a fresh one.
template <class Fn>
void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs, Fn fn,
              const std::vector<int>& donors = {}) {
  auto& enc = mx::cpu::get_command_encoder(stream);
  std::vector<mx::array> ins, outs;
  for (auto& in : inputs) {
    enc.set_input_array(in);
    ins.push_back(mx::array::unsafe_weak_copy(in));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto& out = outputs[i];
    const int donor = i < donors.size() ? donors[i] : -1;
    if (donor >= 0) {
      out.copy_shared_buffer(inputs[donor]);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    enc.set_output_array(out);
    outs.push_back(mx::array::unsafe_weak_copy(out));
  }
  enc.dispatch([ins = std::move(ins), outs = std::move(outs), owners = kernels::owners(inputs), fn]() mutable {
    fn(ins, outs, owners);
    g_layer_calls.fetch_add(1, std::memory_order_relaxed);
  });
}

// The weight matrices of `count` products starting at input `at`, made row-contiguous in
// `tmp_w` / `tmp_f` when they are views.
struct Weights {
  std::vector<kernels::Matrix> mats;
  std::vector<std::vector<uint32_t>> tmp_w;
  std::vector<std::vector<float>> tmp_f;

  Weights(const std::vector<mx::array>& in, const Owners& owners, size_t at, int count, int bits)
      : tmp_w(count), tmp_f(3 * static_cast<size_t>(count)) {
    const int per = weight_inputs(bits);
    for (int j = 0; j < count; ++j) {
      const mx::array& w = in[at + per * j];
      if (bits == kernels::kDenseBits) {
        const float* f = kernels::contiguous_f32(w, tmp_f[3 * j]);
        mats.push_back({reinterpret_cast<const uint32_t*>(f), nullptr, nullptr, w.shape(0)});
      } else {
        mats.push_back({kernels::contiguous_u32(w, tmp_w[j]), kernels::contiguous_f32(in[at + per * j + 1], tmp_f[3 * j + 1]),
                        kernels::contiguous_f32(in[at + per * j + 2], tmp_f[3 * j + 2]), w.shape(0),
                        kernels::owner(w, in[at + per * j + 1], in[at + per * j + 2], owners[at + per * j])});
      }
    }
  }
};

// The products' settings shared by both primitives.
void run_products(const LayerParams& p, const float* x, int m, int k, const Weights& w, size_t first, size_t count,
                  const std::vector<float*>& outs, bool swiglu, int precision) {
  std::vector<kernels::Matrix> mats(w.mats.begin() + first, w.mats.begin() + first + count);
  const int gs = p.bits == kernels::kDenseBits ? 32 : p.group_size;  // dense: a loop unit
  kernels::products(x, m, k, mats, outs, swiglu, gs, p.bits, p.max_isa, precision, p.threads);
}

// fn(i0, i1) over [0, n): for a window (m > 1 rows) one range per pool thread, for one row on
// the calling thread alone. The element-wise parts of a layer (RoPE, the transposes, residual
// adds, norms) are each a few microseconds of a window's layer; run on the calling thread
// they left the other core spinning for about a tenth of a window. An item's arithmetic does
// not depend on the range it falls in, so the bits are those of one thread.
template <class Fn>
void split_items(int m, int n, int threads, Fn fn) {
  const int parts = m > 1 ? std::min(Pool::get().threads(threads), n) : 1;
  if (parts <= 1) return fn(0, n);
  Pool::get().run(parts, [&](int i) { fn(static_cast<int64_t>(n) * i / parts, static_cast<int64_t>(n) * (i + 1) / parts); },
                  Pool::Linger::kLong, threads);
}

// RoPE's cos and sin table for `l` rows from `offset` (kernels::rope_table), kept between
// calls on this thread: every layer of a forward asks for the same one (a window's 11 rows of
// 32 frequencies cost ~700 cos/sin evaluations a layer).
struct RopeTable {
  kernels::RopeSpec spec{};
  std::vector<float> freqs, cs, sn;
  int offset = -1, l = -1;

  const RopeTable& at(const kernels::RopeSpec& want, int want_offset, int want_l) {
    const int half = want.dims / 2;
    bool same = want_offset == offset && want_l == l && want.dims == spec.dims &&
                want.traditional == spec.traditional && want.base == spec.base && want.scale == spec.scale &&
                (want.freqs == nullptr) == (spec.freqs == nullptr);
    for (int i = 0; same && want.freqs && i < half; ++i) same = want.freqs[i * want.freqs_stride] == freqs[i];
    if (same) return *this;
    kernels::rope_table(want, want_offset, nullptr, 0, want_l, cs, sn);
    spec = want;
    freqs.clear();
    for (int i = 0; want.freqs && i < half; ++i) freqs.push_back(want.freqs[i * want.freqs_stride]);
    spec.freqs = want.freqs ? freqs.data() : nullptr;  // compared by value, never read through
    spec.freqs_stride = 1;
    offset = want_offset;
    l = want_l;
    return *this;
  }
};

// y[r, j] = y[r, j] + bias[j] over m rows of n (MLX's add of a broadcast bias).
void add_bias(float* y, const float* bias, int m, int n) {
  for (int r = 0; r < m; ++r) {
    for (int j = 0; j < n; ++j) y[static_cast<size_t>(r) * n + j] = y[static_cast<size_t>(r) * n + j] + bias[j];
  }
}

// The first half of the layer: q [B, Hq, L, D], k and v [B, Hkv, L, D] (contiguous, into
// out[0..3]) for the LayerInCpu inputs at the front of `in` (x, norm, q/k/v weights, then
// the optional biases, q/k norms and RoPE freqs), the first row at position p.offset.
void attention_in(const LayerParams& p, const std::vector<mx::array>& in, const Owners& owners, float* const out[3]) {
  const mx::array& x = in[0];
  const int b = x.shape(0), l = x.shape(1), h = x.shape(2), m = b * l, d = p.head_dim;
  const int nh[3] = {p.n_heads, p.n_kv_heads, p.n_kv_heads};
  thread_local std::vector<float> xc, nc, xn, y[3], vec_tmp[5];
  thread_local RopeTable rope;
  const float* xs = kernels::contiguous_f32(x, xc);
  const float* norm = kernels::contiguous_f32(in[1], nc);
  xn.resize(static_cast<size_t>(m) * h);
  float* const xnd = xn.data();  // the pool's threads see their own thread_locals, not these
  split_items(m, m, p.threads, [&](int64_t r0, int64_t r1) {
    kernels::rms_norm_rows(xs + r0 * h, static_cast<int>(r1 - r0), h, p.norm_eps, norm, xnd + r0 * h);
  });
  const Weights w(in, owners, 2, 3, p.bits);
  for (int j = 0; j < 3; ++j) y[j].resize(static_cast<size_t>(m) * nh[j] * d);
  run_products(p, xn.data(), m, h, w, 0, 3, {y[0].data(), y[1].data(), y[2].data()}, false, p.precision_qkv);
  size_t at = 2 + 3 * weight_inputs(p.bits);
  if (p.has_qkv_bias) {
    for (int j = 0; j < 3; ++j) add_bias(y[j].data(), kernels::contiguous_f32(in[at + j], vec_tmp[j]), m, nh[j] * d);
    at += 3;
  }
  const float* qk_norm[2] = {nullptr, nullptr};
  if (p.has_qk_norm) {
    qk_norm[0] = kernels::contiguous_f32(in[at], vec_tmp[3]);
    qk_norm[1] = kernels::contiguous_f32(in[at + 1], vec_tmp[4]);
    at += 2;
  }
  const kernels::RopeSpec spec{p.rope_dims, p.rope_traditional, p.rope_base, p.rope_scale,
                               p.rope_has_base ? nullptr : in[at].data<float>(),
                               p.rope_has_base ? 0 : in[at].strides().back()};
  const RopeTable& table = rope.at(spec, p.offset, l);
  const int half = p.rope_dims / 2;
  // Row (b, l) of projection j, head hd -> out[j] [b, hd, l, :]: normed (q, k when
  // configured), roped (q, k) or copied (v); item i of the m * (Hq + 2 Hkv) rows is head
  // i % nh of row i / nh of the projection it falls in.
  const int per_row = nh[0] + nh[1] + nh[2];
  const float* const yd[3] = {y[0].data(), y[1].data(), y[2].data()};
  split_items(m, m * per_row, p.threads, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> tmp;
    tmp.resize(d);
    for (int64_t i = i0; i < i1; ++i) {
      int j = 0;
      int64_t at_j = i;  // the item's index within projection j's m * nh[j] rows
      for (; at_j >= static_cast<int64_t>(m) * nh[j]; ++j) at_j -= static_cast<int64_t>(m) * nh[j];
      const int r = static_cast<int>(at_j / nh[j]), hd = static_cast<int>(at_j % nh[j]), bi = r / l, li = r % l;
      const float* src = yd[j] + (static_cast<size_t>(r) * nh[j] + hd) * d;
      float* row = out[j] + ((static_cast<size_t>(bi) * nh[j] + hd) * l + li) * d;
      if (j == 2) {
        std::copy(src, src + d, row);
        continue;
      }
      if (qk_norm[j]) {
        kernels::rms_norm_row(src, 1, d, p.qk_norm_eps, qk_norm[j], 1, tmp.data());
        src = tmp.data();
      }
      kernels::rope_row(spec, src, 1, d, table.cs.data() + static_cast<size_t>(li) * half,
                        table.sn.data() + static_cast<size_t>(li) * half, row);
    }
  });
}

// The second half of the layer: y [B, L, H] (contiguous) for the residual stream x, queries
// q [B, Hq, L, D] and the first t keys and values [B, Hkv, t, D], with the o weights, its
// bias when has_o_bias, the post-attention norm and the gate, up and down weights at
// in[o_at ...] (LayerOutCpu's order).
void attention_out(const LayerParams& p, const std::vector<mx::array>& in, const Owners& owners, const mx::array& x,
                   const kernels::View4& q, const kernels::View4& k, const kernels::View4& v, int t, size_t o_at,
                   float* y) {
  const int b = x.shape(0), l = x.shape(1), h = x.shape(2), m = b * l, d = p.head_dim, hq = p.n_heads;
  const int qd = hq * d;
  thread_local std::vector<float> xc, attn, ao, o, ob, h1, nc, hn, s, dn;
  attn.resize(static_cast<size_t>(m) * qd);
  kernels::attention(q, k, v, attn.data(), b, hq, p.n_kv_heads, l, t, d, d, p.scale, l > 1);
  // [B, Hq, L, D] -> [B, L, Hq * D], the o product's rows.
  ao.resize(attn.size());
  const float* const attn_d = attn.data();
  float* const ao_d = ao.data();
  split_items(m, m, p.threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bi = r / l, li = r % l;
      for (int hd = 0; hd < hq; ++hd) {
        const float* src = attn_d + ((bi * hq + hd) * l + li) * d;
        std::copy(src, src + d, ao_d + r * qd + static_cast<int64_t>(hd) * d);
      }
    }
  });
  const int per = weight_inputs(p.bits);
  const size_t norm_at = o_at + per + (p.has_o_bias ? 1 : 0), mlp_at = norm_at + 1;
  const Weights wo(in, owners, o_at, 1, p.bits), wm(in, owners, mlp_at, 3, p.bits);
  o.resize(static_cast<size_t>(m) * h);
  run_products(p, ao.data(), m, qd, wo, 0, 1, {o.data()}, false, p.precision_o);
  if (p.has_o_bias) add_bias(o.data(), kernels::contiguous_f32(in[o_at + per], ob), m, h);
  const float* xs = kernels::contiguous_f32(x, xc);
  h1.resize(o.size());
  const float* norm = kernels::contiguous_f32(in[norm_at], nc);
  hn.resize(h1.size());
  float* const h1_d = h1.data();
  float* const hn_d = hn.data();
  const float* const o_d = o.data();
  split_items(m, m, p.threads, [&](int64_t r0, int64_t r1) {
    kernels::add(xs + r0 * h, o_d + r0 * h, static_cast<size_t>(r1 - r0) * h, h1_d + r0 * h);
    kernels::rms_norm_rows(h1_d + r0 * h, static_cast<int>(r1 - r0), h, p.norm_eps, norm, hn_d + r0 * h);
  });
  const int inter = wm.mats[0].n;
  s.resize(static_cast<size_t>(m) * inter);
  run_products(p, hn.data(), m, h, wm, 0, 2, {s.data()}, true, p.precision);
  dn.resize(h1.size());
  run_products(p, s.data(), m, inter, wm, 2, 1, {dn.data()}, false, p.precision_down);
  const float* const dn_d = dn.data();
  split_items(m, m, p.threads, [&](int64_t r0, int64_t r1) {
    kernels::add(h1_d + r0 * h, dn_d + r0 * h, static_cast<size_t>(r1 - r0) * h, y + r0 * h);
  });
}

// Inputs: x [B, L, H], norm [H], the q, k, v weights (weight_inputs(bits) inputs each), then
// when has_qkv_bias the q, k, v biases, when has_qk_norm the q and k norm weights [D], when
// !rope_has_base the RoPE freqs [dims / 2]. Outputs q [B, Hq, L, D], k and v [B, Hkv, L, D].
class LayerInCpu : public mx::Primitive {
 public:
  LayerInCpu(mx::Stream stream, LayerParams p) : mx::Primitive(stream), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    dispatch(stream(), inputs, outputs, [p = p_](std::vector<mx::array>& in, std::vector<mx::array>& out,
                                                 const Owners& owners) {
      float* const qkv[3] = {out[0].data<float>(), out[1].data<float>(), out[2].data<float>()};
      attention_in(p, in, owners, qkv);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[LayerInCpu] has no GPU evaluation");
  }
  const char* name() const override { return "LayerInCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const LayerInCpu*>(&other);
    return o && o->p_ == p_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& x = inputs[0];
    return {{x.shape(0), p_.n_heads, x.shape(1), p_.head_dim},
            {x.shape(0), p_.n_kv_heads, x.shape(1), p_.head_dim},
            {x.shape(0), p_.n_kv_heads, x.shape(1), p_.head_dim}};
  }

 private:
  LayerParams p_;
};

// Inputs: x [B, L, H] (the residual stream), q [B, Hq, L, D], keys and values [B, Hkv, T, D]
// (T >= L: the cache with the new rows), the o weights, its bias when has_o_bias, the
// post-attention norm [H], the gate, up and down weights. Output [B, L, H].
class LayerOutCpu : public mx::UnaryPrimitive {
 public:
  LayerOutCpu(mx::Stream stream, LayerParams p) : mx::UnaryPrimitive(stream), p_(p) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& output) override {
    std::vector<mx::array> outputs{output};
    dispatch(stream(), inputs, outputs, [p = p_](std::vector<mx::array>& in, std::vector<mx::array>& out,
                                                 const Owners& owners) {
      thread_local std::vector<float> qt, kt, vt;
      const kernels::View4 q = kernels::view4(in[1], qt), k = kernels::view4(in[2], kt), v = kernels::view4(in[3], vt);
      attention_out(p, in, owners, in[0], q, k, v, in[2].shape(2), 4, out[0].data<float>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("[LayerOutCpu] has no GPU evaluation");
  }
  const char* name() const override { return "LayerOutCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const LayerOutCpu*>(&other);
    return o && o->p_ == p_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  LayerParams p_;
};

// Inputs: LayerInCpu's (n_in of them), the cache's key and value buffers [B, Hkv, C, D]
// (C >= offset + L), then LayerOutCpu's weights (from the o weights on). Outputs y
// [B, L, H] and the two buffers with rows offset .. offset + L replaced by this window's
// keys and values: the input buffers themselves, written in place, when p.in_place; else
// copies of their first offset rows (the rows past offset + L unset: a cache never reads
// past its offset).
class LayerCpu : public mx::Primitive {
 public:
  LayerCpu(mx::Stream stream, LayerParams p, size_t n_in) : mx::Primitive(stream), p_(p), n_in_(n_in) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int kv_at = static_cast<int>(n_in_);
    auto fn = [p = p_, kv_at](std::vector<mx::array>& in, std::vector<mx::array>& out, const Owners& owners) {
      const mx::array& x = in[0];
      const int b = x.shape(0), l = x.shape(1), hkv = p.n_kv_heads, d = p.head_dim, prev = p.offset;
      const int cap = out[1].shape(2);
      thread_local std::vector<float> q, kn, vn, copy_tmp;
      q.resize(static_cast<size_t>(b) * p.n_heads * l * d);
      kn.resize(static_cast<size_t>(b) * hkv * l * d);
      vn.resize(kn.size());
      float* const qkv[3] = {q.data(), kn.data(), vn.data()};
      attention_in(p, in, owners, qkv);
      const kernels::View4 q_view{q.data(), static_cast<int64_t>(p.n_heads) * l * d, static_cast<int64_t>(l) * d, d};
      kernels::View4 cache[2];
      for (int j = 0; j < 2; ++j) {
        float* buf = out[1 + j].data<float>();
        const mx::array& src = in[kv_at + j];
        if (src.data<float>() != buf && prev > 0) {
          const kernels::View4 old = kernels::view4(src, copy_tmp);
          for (int bi = 0; bi < b; ++bi) {
            for (int hd = 0; hd < hkv; ++hd) {
              for (int pos = 0; pos < prev; ++pos) {
                const float* row = old.row(bi, hd, pos);
                std::copy(row, row + d, buf + ((static_cast<size_t>(bi) * hkv + hd) * cap + pos) * d);
              }
            }
          }
        }
        const float* fresh = j == 0 ? kn.data() : vn.data();
        for (int bi = 0; bi < b; ++bi) {
          for (int hd = 0; hd < hkv; ++hd) {
            const float* rows = fresh + (static_cast<size_t>(bi) * hkv + hd) * l * d;
            std::copy(rows, rows + static_cast<size_t>(l) * d, buf + ((static_cast<size_t>(bi) * hkv + hd) * cap + prev) * d);
          }
        }
        cache[j] = {buf, static_cast<int64_t>(hkv) * cap * d, static_cast<int64_t>(cap) * d, d};
      }
      attention_out(p, in, owners, x, q_view, cache[0], cache[1], prev + l, kv_at + 2, out[0].data<float>());
    };
    // In place only when the caller says nothing else reads the buffers (p.in_place: MLX's
    // own donation test never passes here, as each of a node's outputs holds its inputs)
    // and they have the outputs' layout (not the broadcast zeros of a new cache).
    std::vector<int> donors{-1, -1, -1};
    for (int j = 0; j < 2; ++j) {
      const mx::array &in = inputs[kv_at + j], &out = outputs[1 + j];
      if (p_.in_place && in.flags().row_contiguous && in.dtype() == out.dtype() && in.shape() == out.shape()) {
        donors[1 + j] = kv_at + j;
      }
    }
    dispatch(stream(), inputs, outputs, fn, donors);
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[LayerCpu] has no GPU evaluation");
  }
  const char* name() const override { return "LayerCpu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const LayerCpu*>(&other);
    return o && o->p_ == p_ && o->n_in_ == n_in_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape(), inputs[n_in_].shape(), inputs[n_in_ + 1].shape()};
  }

 private:
  LayerParams p_;
  size_t n_in_;
};

std::string shape_str(const mx::Shape& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? "," : "") + std::to_string(s[i]);
  return r + ")";
}

std::string shape_of(const mx::array& a) { return shape_str(a.shape()); }

// Checks one product's weights (at `at` in `in`) for an input of k features; returns N.
int check_weight(const std::string& op, const std::string& name, const std::vector<mx::array>& in, size_t at, int k,
                 const LayerParams& p) {
  const mx::array& w = in.at(at);
  const std::string where = op + name + " ";
  if (p.bits == kernels::kDenseBits) {
    if (w.dtype() != mx::float32 || w.ndim() != 2 || w.shape(1) != k) {
      throw std::invalid_argument(where + "must be float32 [N, " + std::to_string(k) + "], got " + shape_of(w));
    }
    return w.shape(0);
  }
  const mx::array &s = in.at(at + 1), &b = in.at(at + 2);
  if (w.dtype() != mx::uint32 || w.ndim() != 2 || w.shape(1) * 32 / p.bits != k) {
    throw std::invalid_argument(where + "must be uint32 [N, " + std::to_string(k * p.bits / 32) + "] for K = " +
                                std::to_string(k) + " at " + std::to_string(p.bits) + " bits, got " + shape_of(w));
  }
  const mx::Shape groups{w.shape(0), k / p.group_size};
  if (s.dtype() != mx::float32 || b.dtype() != mx::float32 || s.shape() != groups || b.shape() != groups) {
    throw std::invalid_argument(where + "needs float32 scales and biases (" + std::to_string(groups[0]) + "," +
                                std::to_string(groups[1]) + "), got " + shape_of(s) + " and " + shape_of(b));
  }
  return w.shape(0);
}

void check_vector(const std::string& op, const std::string& name, const mx::array& a, int n) {
  if (a.dtype() != mx::float32 || a.ndim() != 1 || a.shape(0) != n) {
    throw std::invalid_argument(op + name + " must be float32 [" + std::to_string(n) + "], got " + shape_of(a));
  }
}

void check_params(const std::string& op, const mx::array& x, const LayerParams& p) {
  if (x.dtype() != mx::float32 || x.ndim() != 3) {
    throw std::invalid_argument(op + "x must be float32 [B, L, H], got " + shape_of(x));
  }
  if (p.bits != 4 && p.bits != 8 && p.bits != kernels::kDenseBits) {
    throw std::invalid_argument(op + "bits must be 4, 8 or 32 (dense), got " + std::to_string(p.bits));
  }
  if (p.bits != kernels::kDenseBits && p.group_size != 32 && p.group_size != 64 && p.group_size != 128) {
    throw std::invalid_argument(op + "group_size must be 32, 64 or 128, got " + std::to_string(p.group_size));
  }
  for (const auto& [name, precision] : {std::pair{"precision", p.precision}, std::pair{"precision_qkv", p.precision_qkv},
                                        std::pair{"precision_o", p.precision_o}, std::pair{"precision_down", p.precision_down}}) {
    if (precision < 0 || precision > 2) {
      throw std::invalid_argument(op + name + " must be 0 (f32), 1 (bf16) or 2 (int8), got " + std::to_string(precision));
    }
    if (p.bits == kernels::kDenseBits && precision != 0) {
      throw std::invalid_argument(op + "bf16 and int8 precision need 4- or 8-bit weights");
    }
  }
  if (p.n_heads <= 0 || p.n_kv_heads <= 0 || p.n_heads % p.n_kv_heads != 0 || p.head_dim <= 0) {
    throw std::invalid_argument(op + "heads " + std::to_string(p.n_heads) + " / " + std::to_string(p.n_kv_heads) +
                                " of " + std::to_string(p.head_dim) + " features do not form a GQA layer");
  }
  if (mx::default_device() != mx::Device(mx::Device::cpu)) {
    throw std::invalid_argument(op + "the default device is not the CPU");
  }
}
// LayerInCpu's inputs, checked.
std::vector<mx::array> layer_in_inputs(const std::string& op, const array& x, const array& norm, const ArrayList& qkv,
                                       const ArrayList& qkv_bias, const ArrayList& qk_norms, const ArrayList& freqs,
                                       const LayerParams& p) {
  check_params(op, x, p);
  const int h = x.shape(2), d = p.head_dim, per = weight_inputs(p.bits);
  if (p.rope_dims <= 0 || p.rope_dims % 2 != 0 || p.rope_dims > d) {
    throw std::invalid_argument(op + "rope dims must be even and in (0, " + std::to_string(d) + "], got " +
                                std::to_string(p.rope_dims));
  }
  check_vector(op, "norm", norm, h);
  std::vector<mx::array> in{x, norm};
  if (static_cast<int>(qkv.items.size()) != 3 * per) {
    throw std::invalid_argument(op + "needs the q, k and v weights (" + std::to_string(3 * per) + " arrays), got " +
                                std::to_string(qkv.items.size()));
  }
  in.insert(in.end(), qkv.items.begin(), qkv.items.end());
  const int n[3] = {p.n_heads * d, p.n_kv_heads * d, p.n_kv_heads * d};
  const char* names[3] = {"q_proj", "k_proj", "v_proj"};
  for (int j = 0; j < 3; ++j) {
    if (check_weight(op, names[j], in, 2 + per * j, h, p) != n[j]) {
      throw std::invalid_argument(op + names[j] + " must have " + std::to_string(n[j]) + " rows");
    }
  }
  if (p.has_qkv_bias != !qkv_bias.items.empty() || (p.has_qkv_bias && qkv_bias.items.size() != 3)) {
    throw std::invalid_argument(op + "has_qkv_bias needs exactly the three biases");
  }
  for (size_t j = 0; j < qkv_bias.items.size(); ++j) check_vector(op, std::string(names[j]) + " bias", qkv_bias.items[j], n[j]);
  if (p.has_qk_norm != !qk_norms.items.empty() || (p.has_qk_norm && qk_norms.items.size() != 2)) {
    throw std::invalid_argument(op + "has_qk_norm needs exactly the q and k norm weights");
  }
  for (const auto& w : qk_norms.items) check_vector(op, "q/k norm", w, d);
  if (p.rope_has_base == !freqs.items.empty()) throw std::invalid_argument(op + "give exactly one of base and freqs");
  if (!freqs.items.empty()) check_vector(op, "freqs", freqs.items[0], p.rope_dims / 2);
  in.insert(in.end(), qkv_bias.items.begin(), qkv_bias.items.end());
  in.insert(in.end(), qk_norms.items.begin(), qk_norms.items.end());
  in.insert(in.end(), freqs.items.begin(), freqs.items.end());
  return in;
}

// Checks that keys and values are float32 [B, Hkv, T, D] of one shape with T >= min_t.
void check_kv(const std::string& op, const array& x, const array& keys, const array& values, int min_t,
              const LayerParams& p) {
  const int b = x.shape(0), d = p.head_dim;
  for (const auto* kv : {&keys, &values}) {
    if (kv->dtype() != mx::float32 || kv->ndim() != 4 || kv->shape(0) != b || kv->shape(1) != p.n_kv_heads ||
        kv->shape(2) < min_t || kv->shape(3) != d || kv->shape() != keys.shape()) {
      throw std::invalid_argument(op + "keys and values must be float32 [" + std::to_string(b) + ", " +
                                  std::to_string(p.n_kv_heads) + ", T >= " + std::to_string(min_t) + ", " +
                                  std::to_string(d) + "], got " + shape_of(keys) + " and " + shape_of(values));
    }
  }
}

// Appends LayerOutCpu's weights (the o weights, its bias, the post-attention norm, the gate,
// up and down weights) to `in`, checked.
void append_out_weights(const std::string& op, std::vector<mx::array>& in, const array& x, const ArrayList& o,
                        const ArrayList& o_bias, const array& norm, const ArrayList& mlp, const LayerParams& p) {
  const int h = x.shape(2), d = p.head_dim, per = weight_inputs(p.bits);
  if (static_cast<int>(o.items.size()) != per || static_cast<int>(mlp.items.size()) != 3 * per) {
    throw std::invalid_argument(op + "needs the o weights and the gate, up and down weights");
  }
  if (p.has_o_bias != !o_bias.items.empty() || o_bias.items.size() > 1) {
    throw std::invalid_argument(op + "has_o_bias needs exactly the o bias");
  }
  check_vector(op, "norm", norm, h);
  const size_t o_at = in.size();
  in.insert(in.end(), o.items.begin(), o.items.end());
  in.insert(in.end(), o_bias.items.begin(), o_bias.items.end());
  in.push_back(norm);
  in.insert(in.end(), mlp.items.begin(), mlp.items.end());
  if (check_weight(op, "o_proj", in, o_at, p.n_heads * d, p) != h) {
    throw std::invalid_argument(op + "o_proj must have " + std::to_string(h) + " rows");
  }
  if (p.has_o_bias) check_vector(op, "o_proj bias", o_bias.items[0], h);
  const size_t mlp_at = o_at + per + o_bias.items.size() + 1;
  const int inter = check_weight(op, "gate_proj", in, mlp_at, h, p);
  if (check_weight(op, "up_proj", in, mlp_at + per, h, p) != inter ||
      check_weight(op, "down_proj", in, mlp_at + 2 * per, inter, p) != h) {
    throw std::invalid_argument(op + "gate_proj, up_proj [I, H] and down_proj [H, I] do not fit H = " +
                                std::to_string(h));
  }
}
}  // namespace

std::unique_ptr<ArrayList> cpu_layer_in(const array& x, const array& norm, const ArrayList& qkv,
                                        const ArrayList& qkv_bias, const ArrayList& qk_norms, const ArrayList& freqs,
                                        const LayerParams& p) {
  auto in = layer_in_inputs("[cpu_layer_in] ", x, norm, qkv, qkv_bias, qk_norms, freqs, p);
  auto prim = std::make_shared<LayerInCpu>(mx::default_stream(mx::default_device()), p);
  auto shapes = prim->output_shapes(in);
  auto list = std::make_unique<ArrayList>();
  list->items = mx::array::make_arrays(std::move(shapes), {mx::float32, mx::float32, mx::float32}, prim, in);
  return list;
}

std::unique_ptr<array> cpu_layer_out(const array& x, const array& q, const array& keys, const array& values,
                                     const ArrayList& o, const ArrayList& o_bias, const array& norm,
                                     const ArrayList& mlp, const LayerParams& p) {
  const std::string op = "[cpu_layer_out] ";
  check_params(op, x, p);
  const int b = x.shape(0), l = x.shape(1);
  const mx::Shape qs{b, p.n_heads, l, p.head_dim};
  if (q.dtype() != mx::float32 || q.shape() != qs) {
    throw std::invalid_argument(op + "q must be float32 " + shape_str(qs) + ", got " + shape_of(q));
  }
  check_kv(op, x, keys, values, l, p);
  std::vector<mx::array> in{x, q, keys, values};
  append_out_weights(op, in, x, o, o_bias, norm, mlp, p);
  return std::make_unique<mx::array>(x.shape(), mx::float32,
                                     std::make_shared<LayerOutCpu>(mx::default_stream(mx::default_device()), p),
                                     std::move(in));
}

std::unique_ptr<ArrayList> cpu_layer(const array& x, const array& keys, const array& values, const array& norm,
                                     const ArrayList& qkv, const ArrayList& qkv_bias, const ArrayList& qk_norms,
                                     const ArrayList& freqs, const ArrayList& o, const ArrayList& o_bias,
                                     const array& post_norm, const ArrayList& mlp, const LayerParams& p) {
  const std::string op = "[cpu_layer] ";
  auto in = layer_in_inputs(op, x, norm, qkv, qkv_bias, qk_norms, freqs, p);
  if (p.offset < 0) throw std::invalid_argument(op + "offset must be >= 0, got " + std::to_string(p.offset));
  check_kv(op, x, keys, values, p.offset + x.shape(1), p);
  const size_t n_in = in.size();
  in.push_back(keys);
  in.push_back(values);
  append_out_weights(op, in, x, o, o_bias, post_norm, mlp, p);
  auto prim = std::make_shared<LayerCpu>(mx::default_stream(mx::default_device()), p, n_in);
  auto shapes = prim->output_shapes(in);
  auto list = std::make_unique<ArrayList>();
  list->items = mx::array::make_arrays(std::move(shapes), {mx::float32, mx::float32, mx::float32}, prim, in);
  return list;
}

uint64_t cpu_layer_calls() { return g_layer_calls.load(std::memory_order_relaxed); }
}  // namespace mlxsys
