//! Fused scaled-dot-product attention for decode steps and verify windows on the MLX CPU
//! backend, where `fast::scaled_dot_product_attention` falls back to about ten separate ops
//! per layer (two BLAS calls per head among them) whose dispatch costs more than the
//! arithmetic of a short query window.
//!
//! The kernel is an MLX custom primitive written in C++ (`crates/mlx-sys/src/attn.cc`): one
//! lazy graph node per layer, evaluated on the CPU stream, AVX2 + FMA when the CPU has them
//! (portable C++ otherwise), heads split over the shared thread pool for larger windows.
//! Each query row is computed by the same float operations whatever the window length, so a
//! verify window's attention equals one-token steps' bit for bit.
//!
//! [`crate::fast::scaled_dot_product_attention`] uses it on its own when [`applies`]: CPU
//! backend, float32, no mask or the causal mask, at most [`MAX_QUERIES`] query rows (longer
//! prompts keep MLX's BLAS path, which is faster for prefill). Results equal MLX's
//! attention up to float rounding (another summation order and exp): the tests allow
//! `|Δ| <= 1e-5` relative to the largest value. Off: [`KernelPolicy::sdpa`] `false`
//! (`MLX_SPEC_SDPA=mlx` for the default policy).
use mlx_sys::ffi;

use crate::array::wrap;
use crate::settings::KernelPolicy;
use crate::{Array, Dtype, Result};

/// Query rows (tokens of a decode step or verify window) up to which the fused kernel is
/// used; longer inputs (prompt prefill) go to MLX's BLAS-based attention.
pub const MAX_QUERIES: i32 = 32;

/// `softmax(q @ k^T * scale [+ causal mask]) @ v` in one node (Vaswani et al. 2017, eq. 1;
/// the semantics of `mlx.core.fast.scaled_dot_product_attention`). Shapes: `q [B, Hq, Lq, D]`,
/// `k [B, Hkv, Lk, D]`, `v [B, Hkv, Lk, Dv]` float32 (any strides), `Hq % Hkv == 0`; output
/// `[B, Hq, Lq, Dv]` float32. `causal`: query `i` sees keys `0 ..= Lk - Lq + i` (needs
/// `Lq <= Lk`). Lazy.
///
/// # Errors
/// [`crate::Error::Mlx`] naming the problem for other dtypes, ranks or mismatched shapes,
/// or when the default device is not the CPU.
pub fn attention(q: &Array, k: &Array, v: &Array, scale: f32, causal: bool) -> Result<Array> {
    wrap("cpu_attention", ffi::cpu_attention(q.raw(), k.raw(), v.raw(), scale, causal))
}

/// Whether [`crate::fast::scaled_dot_product_attention`] sends these inputs to
/// [`attention`] under `policy`: [`KernelPolicy::uses_sdpa`], all float32, 4-D, at most
/// [`MAX_QUERIES`] query rows (and for `causal` no more query rows than keys).
pub fn applies(q: &Array, k: &Array, v: &Array, causal: bool, policy: &KernelPolicy) -> bool {
    let (lq, lk) = (q.shape().get(2).copied(), k.shape().get(2).copied());
    policy.uses_sdpa()
        && [q, k, v].iter().all(|a| a.dtype() == Dtype::Float32 && a.ndim() == 4)
        && lq.is_some_and(|l| l <= MAX_QUERIES)
        && (!causal || lq <= lk)
}

/// How many attention nodes the kernel has evaluated in this process, under any policy (one
/// policy's nodes: [`KernelPolicy::calls`]).
pub fn calls() -> u64 {
    ffi::cpu_attention_calls()
}
