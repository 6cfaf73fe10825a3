//! Fused scaled-dot-product attention for decode steps, verify windows and prompt prefill on
//! the MLX CPU backend, where `fast::scaled_dot_product_attention` falls back to about ten
//! separate ops per layer (two BLAS calls per head among them): their dispatch costs more than
//! the arithmetic of a short query window, and for a prompt chunk MLX's softmax runs on one
//! thread, scalar (it made prefill of a 1,872-token prompt 13x slower, 45 against 590 tokens/s
//! on SmolLM2-135M 4-bit, `docs/measurements/2026-12-02/`).
//!
//! The kernel is an MLX custom primitive written in C++ (`crates/mlx-sys/src/attn.cc`): one
//! lazy graph node per layer, evaluated on the CPU stream, AVX2 + FMA when the CPU has them
//! (portable C++ otherwise). Work is split over the shared thread pool in tasks of query rows
//! of one KV head (a GQA group's heads, a window's or prompt chunk's neighbouring rows) that
//! share each block of keys and values while it is in L1.
//! Each query row is computed by the same float operations whatever the window length, so a
//! verify window's attention equals one-token steps' bit for bit.
//!
//! [`crate::fast::scaled_dot_product_attention`] uses it on its own when [`applies`]: CPU
//! backend, float32, no mask or the causal mask, any number of query rows. Results equal MLX's
//! attention up to float rounding (another summation order and exp): the tests allow
//! `|Δ| <= 1e-5` relative to the largest value. Off: [`KernelPolicy::sdpa`] `false`
//! (`MLX_SPEC_SDPA=mlx` for the default policy).
use mlx_sys::ffi;

use crate::array::wrap;
use crate::settings::KernelPolicy;
use crate::{Array, Dtype, Result};

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
/// [`attention`] under `policy`: [`KernelPolicy::uses_sdpa`], all float32, 4-D (and for
/// `causal` no more query rows than keys).
pub fn applies(q: &Array, k: &Array, v: &Array, causal: bool, policy: &KernelPolicy) -> bool {
    let (lq, lk) = (q.shape().get(2).copied(), k.shape().get(2).copied());
    policy.uses_sdpa()
        && [q, k, v].iter().all(|a| a.dtype() == Dtype::Float32 && a.ndim() == 4)
        && (!causal || lq <= lk)
}

/// How many attention nodes the kernel has evaluated in this process, under any policy (one
/// policy's nodes: [`KernelPolicy::calls`]).
pub fn calls() -> u64 {
    ffi::cpu_attention_calls()
}
