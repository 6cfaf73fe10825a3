//! A llama-style decoder layer (mlx-lm's `TransformerBlock` of `models/llama.py`, `qwen2.py`,
//! `qwen3.py`) as one graph node on the MLX CPU backend, or two around the KV cache write:
//!
//! ```text
//! layer_in:  x -> rms_norm -> q, k, v = x W^T (+ b) -> per-head q/k norms -> RoPE
//!            -> q [B, Hq, L, D], k [B, Hkv, L, D], v [B, Hkv, L, D]
//! (the caller appends k, v to its cache; keys, values [B, Hkv, T, D] are the cache's)
//! layer_out: attention(q, keys, values) -> o W^T (+ b) -> h = x + o
//!            -> h + down(silu(gate(rms_norm(h))) * up(rms_norm(h)))   [B, L, H]
//! layer:     layer_in, the write of k, v into the cache's buffers, layer_out: one node
//! ```
//!
//! A decode step builds and dispatches some 23 nodes per layer through the separate kernels
//! ([`crate::cpu_quant`], [`crate::cpu_fast`], [`crate::cpu_attention`]) plus reshapes,
//! transposes and adds; six with [`layer_in`] and [`layer_out`] (the two nodes, the cache's
//! two writes and two slices); one with [`layer`]. The nodes (`crates/mlx-sys/src/layer.cc`)
//! call the separate kernels' own functions in the same order, so their outputs equal the
//! separate nodes' bit for bit at any window length (tested in
//! `crates/models/tests/fused_layer.rs`); a policy counts them in [`KernelPolicy::calls`] as
//! the separate nodes they replace (four products, the norms and RoPEs, one attention).
//!
//! Used by `models` when [`KernelPolicy::uses_layer`] (`MLX_SPEC_LAYER`: [`crate::LayerNodes`]),
//! the activations are float32 and every projection is quantized with one [`QuantSpec`] the
//! kernel takes ([`crate::cpu_quant::supports`]): [`layer`] for a full KV cache, the two
//! nodes for other caches (a rotating window's) and under `MLX_SPEC_LAYER=split`.
use mlx_sys::ffi;

use crate::array::{list, wrap};
use crate::cpu_quant::same_spec;
use crate::fast::Rope;
use crate::quant::{QuantSpec, QuantizedMatrix};
use crate::settings::{Kernel, KernelPolicy, Projection};
use crate::{Array, Result};

/// The attention geometry and norms of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerShape {
    /// Query heads `Hq`.
    pub n_heads: i32,
    /// Key/value heads `Hkv` (`Hq % Hkv == 0`).
    pub n_kv_heads: i32,
    /// Per-head width `D`.
    pub head_dim: i32,
    /// Softmax scale (`D^-0.5`).
    pub scale: f32,
    /// Epsilon added to the mean square in the input and post-attention RMS norms.
    pub norm_eps: f32,
    /// Epsilon of the per-head q/k norms (Qwen3); unused without them.
    pub qk_norm_eps: f32,
}

/// The inputs of [`layer_in`] besides `x`: the input norm weight `[H]`, the q, k, v
/// projections (`[Hq * D, H]`, `[Hkv * D, H]` twice), their optional biases and the optional
/// per-head q and k norm weights `[D]`. Norms and biases float32; matrices 4- or 8-bit with
/// float32 scales and biases, one [`QuantSpec`].
#[derive(Debug, Clone, Copy)]
pub struct AttentionIn<'a> {
    /// `input_layernorm.weight`.
    pub norm: &'a Array,
    /// `q_proj`, `k_proj`, `v_proj`.
    pub qkv: [&'a QuantizedMatrix; 3],
    /// Their biases (Qwen2), all three or none.
    pub qkv_bias: Option<[&'a Array; 3]>,
    /// `q_norm.weight`, `k_norm.weight` (Qwen3).
    pub qk_norms: Option<[&'a Array; 2]>,
}

/// The inputs of [`layer_out`] besides the activations: the output projection `[H, Hq * D]`
/// and its optional bias, the post-attention norm weight `[H]` and the MLP's gate, up
/// (`[I, H]`) and down (`[H, I]`) projections. Dtypes as in [`AttentionIn`].
#[derive(Debug, Clone, Copy)]
pub struct AttentionOutMlp<'a> {
    /// `o_proj`.
    pub o: &'a QuantizedMatrix,
    /// `o_proj.bias`.
    pub o_bias: Option<&'a Array>,
    /// `post_attention_layernorm.weight`.
    pub norm: &'a Array,
    /// `gate_proj`, `up_proj`, `down_proj`.
    pub mlp: [&'a QuantizedMatrix; 3],
}

/// The node's settings; `rope` (with the first row's position) only for [`layer_in`].
fn params(
    shape: &LayerShape,
    rope: Option<(&Rope, i32)>,
    spec: QuantSpec,
    policy: &KernelPolicy,
    flags: (bool, bool, bool),
) -> ffi::LayerParams {
    let none = Rope { dims: 0, traditional: false, base: 0.0, scale: 1.0, freqs: None };
    let (rope, offset) = rope.unwrap_or((&none, 0));
    ffi::LayerParams {
        norm_eps: shape.norm_eps,
        qk_norm_eps: shape.qk_norm_eps,
        n_heads: shape.n_heads,
        n_kv_heads: shape.n_kv_heads,
        head_dim: shape.head_dim,
        rope_dims: rope.dims,
        rope_traditional: rope.traditional,
        rope_base: rope.base,
        rope_has_base: rope.freqs.is_none(),
        rope_scale: rope.scale,
        offset,
        scale: shape.scale,
        group_size: spec.group_size,
        bits: spec.bits,
        max_isa: policy.max_isa as i32,
        precision: policy.precision.of(Projection::Other) as i32,
        precision_qkv: policy.precision.of(Projection::Qkv) as i32,
        precision_o: policy.precision.of(Projection::Out) as i32,
        precision_down: policy.precision.of(Projection::Down) as i32,
        threads: policy.threads_arg(),
        has_qkv_bias: flags.0,
        has_qk_norm: flags.1,
        has_o_bias: flags.2,
        in_place: false,
    }
}

fn triples<'a>(mats: impl IntoIterator<Item = &'a QuantizedMatrix>) -> cxx::UniquePtr<ffi::ArrayList> {
    list(mats.into_iter().flat_map(|m| [&m.weight, &m.scales, &m.biases]))
}

/// Whether [`layer_in`] and [`layer_out`] take these weights for float32 activations under
/// `policy`: [`KernelPolicy::uses_layer`] and every matrix in one spec the quantized kernel
/// takes.
pub fn applies(mats: &[&QuantizedMatrix], policy: &KernelPolicy) -> bool {
    let Some(first) = mats.first() else { return false };
    policy.uses_layer()
        && mats.iter().all(|m| m.spec == first.spec && crate::cpu_quant::supports(m, crate::Dtype::Float32))
}

/// Queries `[B, Hq, L, D]`, keys and values `[B, Hkv, L, D]` of `x [B, L, H]` (float32) with
/// the first row at position `offset`: `rope(q_norm(x_n W_q^T + b_q))`,
/// `rope(k_norm(x_n W_k^T + b_k))`, `x_n W_v^T + b_v` with `x_n = rms_norm(x)`, as one node.
/// The values equal [`crate::fast::rms_norm`], [`crate::cpu_quant::quantized_matmuls_t`],
/// the bias adds, the per-head norms and [`Rope::apply`] chained.
///
/// # Errors
/// [`crate::Error::Mlx`] (op `cpu_layer_in`) naming the input whose shape or dtype does not
/// fit, for matrices of different specs, or off the CPU.
pub fn layer_in(
    x: &Array,
    w: &AttentionIn<'_>,
    shape: &LayerShape,
    rope: &Rope,
    offset: i32,
    policy: &KernelPolicy,
) -> Result<(Array, Array, Array)> {
    let spec = same_spec("cpu_layer_in", &w.qkv)?;
    let flags = (w.qkv_bias.is_some(), w.qk_norms.is_some(), false);
    let l = ffi::cpu_layer_in(
        x.raw(),
        w.norm.raw(),
        &triples(w.qkv),
        &list(w.qkv_bias.iter().flatten().copied()),
        &list(w.qk_norms.iter().flatten().copied()),
        &list(rope.freqs.as_ref()),
        &params(shape, Some((rope, offset)), spec, policy, flags),
    )
    .map_err(|e| crate::Error::mlx("cpu_layer_in", e))?;
    count_in(policy, flags.1);
    let get = |i| wrap("cpu_layer_in", ffi::list_get(&l, i));
    Ok((get(0)?, get(1)?, get(2)?))
}

/// `h + down(silu(gate(n)) * up(n))` with `h = x + attention(q, keys, values) W_o^T (+ b_o)`
/// and `n = rms_norm(h)`, `[B, L, H]`, as one node: the rest of the layer after the cache
/// write, for the residual stream `x [B, L, H]`, queries `[B, Hq, L, D]` (from [`layer_in`])
/// and the cache's keys and values `[B, Hkv, T, D]` (`T >= L`, the causal mask aligned to the
/// end when `L > 1`). Equals the separate nodes chained, bit for bit.
///
/// # Errors
/// [`crate::Error::Mlx`] (op `cpu_layer_out`) naming the input that does not fit, or off the
/// CPU.
pub fn layer_out(
    x: &Array,
    q: &Array,
    keys: &Array,
    values: &Array,
    w: &AttentionOutMlp<'_>,
    shape: &LayerShape,
    policy: &KernelPolicy,
) -> Result<Array> {
    let spec = same_spec("cpu_layer_out", &[w.o, w.mlp[0], w.mlp[1], w.mlp[2]])?;
    let out = wrap(
        "cpu_layer_out",
        ffi::cpu_layer_out(
            x.raw(),
            q.raw(),
            keys.raw(),
            values.raw(),
            &triples([w.o]),
            &list(w.o_bias),
            w.norm.raw(),
            &triples(w.mlp),
            &params(shape, None, spec, policy, (false, false, w.o_bias.is_some())),
        ),
    )?;
    count_out(policy);
    Ok(out)
}

/// The whole layer with its cache write as one node: [`layer_in`], the write of its keys and
/// values at positions `offset .. offset + L` of the cache's buffers `keys`, `values`
/// `[B, Hkv, C, D]` (float32, `C >= offset + L`), and [`layer_out`] over their first
/// `offset + L` positions. Returns `y [B, L, H]` and the two buffers after the write. With
/// `in_place` the returned buffers are the input buffers, written in place (when they are
/// row-contiguous): the caller promises that nothing else reads `keys` and `values` after
/// this node, as MLX's own donation would check if a node of several outputs could pass its
/// test. Otherwise they are copies of the first `offset` rows plus the new ones (rows past
/// `offset + L` unset). `y` equals [`layer_out`] after [`layer_in`] bit for bit.
///
/// One node instead of six a layer keeps a decode step under what MLX queues ahead of its
/// stream thread (`crates/mlx-sys/src/layer.cc`).
///
/// # Errors
/// [`crate::Error::Mlx`] (op `cpu_layer`) naming the input that does not fit, buffers too
/// short for `offset + L`, or off the CPU.
#[allow(clippy::too_many_arguments)]
pub fn layer(
    x: &Array,
    keys: &Array,
    values: &Array,
    offset: i32,
    in_place: bool,
    w_in: &AttentionIn<'_>,
    w_out: &AttentionOutMlp<'_>,
    shape: &LayerShape,
    rope: &Rope,
    policy: &KernelPolicy,
) -> Result<(Array, Array, Array)> {
    let spec = same_spec(
        "cpu_layer",
        &[w_in.qkv[0], w_in.qkv[1], w_in.qkv[2], w_out.o, w_out.mlp[0], w_out.mlp[1], w_out.mlp[2]],
    )?;
    let flags = (w_in.qkv_bias.is_some(), w_in.qk_norms.is_some(), w_out.o_bias.is_some());
    let l = ffi::cpu_layer(
        x.raw(),
        keys.raw(),
        values.raw(),
        w_in.norm.raw(),
        &triples(w_in.qkv),
        &list(w_in.qkv_bias.iter().flatten().copied()),
        &list(w_in.qk_norms.iter().flatten().copied()),
        &list(rope.freqs.as_ref()),
        &triples([w_out.o]),
        &list(w_out.o_bias),
        w_out.norm.raw(),
        &triples(w_out.mlp),
        &ffi::LayerParams { in_place, ..params(shape, Some((rope, offset)), spec, policy, flags) },
    )
    .map_err(|e| crate::Error::mlx("cpu_layer", e))?;
    count_in(policy, flags.1);
    count_out(policy);
    let get = |i| wrap("cpu_layer", ffi::list_get(&l, i));
    Ok((get(0)?, get(1)?, get(2)?))
}

/// [`layer_in`]'s share of [`KernelPolicy::calls`]: the nodes it replaces (one product node,
/// the input norm, two RoPEs, two head norms when `qk_norm`).
fn count_in(policy: &KernelPolicy, qk_norm: bool) {
    policy.count(Kernel::Qmm);
    let fast = 3 + if qk_norm { 2 } else { 0 };
    (0..fast).for_each(|_| policy.count(Kernel::Fast));
}

/// [`layer_out`]'s share of [`KernelPolicy::calls`]: the o, SwiGLU and down products, the
/// norm, the attention.
fn count_out(policy: &KernelPolicy) {
    (0..3).for_each(|_| policy.count(Kernel::Qmm));
    policy.count(Kernel::Fast);
    policy.count(Kernel::Sdpa);
}

/// Layer nodes (any kind) evaluated in this process, under any policy.
pub fn calls() -> u64 {
    ffi::cpu_layer_calls()
}
