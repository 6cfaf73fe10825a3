//! RMS norm and rotary position embedding as one graph node each on the MLX CPU backend,
//! where the `mlx-cpu` wheel evaluates `fast::rms_norm` and `fast::rope` through their
//! reference graphs (about 7 and 22 nodes: square, mean, rsqrt, ...; positions, exp, cos,
//! sin, slices, products, concatenate). A decode step of a 30-layer model has 121 of these
//! calls, and building and dispatching their ~1,700 nodes cost more than their arithmetic.
//!
//! The primitives are written in C++ (`crates/mlx-sys/src/fast.cc`) and compute the
//! fallbacks' formulas (mlx 0.32 `mlx/fast.cpp`):
//! - RMS norm: `y = w * (x * (1 / sqrt(mean(x^2) + eps)))` over the last axis;
//! - RoPE: position `p = (offset + l) * scale` for row `l` of axis -2, inverse frequency
//!   `base^(-i / (dims/2))` (or `1 / freqs_i`), pairs `(x_i, x_{i+dims/2})` (traditional:
//!   `(x_2i, x_2i+1)`) rotated by `p * inv_i`, features past `dims` copied.
//!
//! Results are MLX's bits (tested over random shapes, strides and parameters): RoPE calls
//! MLX's own exp, sin and cos element functions, the norm reduces in MLX's order, and each
//! product and sum is rounded on its own as in the separate ops. A row's result does not
//! depend on the number of rows, so a verify window's values equal one-token steps'.
//!
//! [`crate::fast::rms_norm`] and [`crate::fast::Rope::apply`] use them on their own when
//! [`applies`]: the caller's [`KernelPolicy`] has them on (CPU backend), float32 input (and
//! weight / freqs). Off: [`KernelPolicy::fast_norm_rope`] `false` (`MLX_SPEC_FAST=mlx` for
//! the default policy).
use mlx_sys::ffi;

use crate::array::{list, wrap};
use crate::fast::Rope;
use crate::settings::KernelPolicy;
use crate::{Array, Dtype, Result};

/// RMS norm of `x [..., H]` (f32) with an optional f32 `weight [H]`, as one node.
///
/// # Errors
/// [`crate::Error::Mlx`] (op `cpu_rms_norm`) for another dtype, a weight that is not `[H]`,
/// or a default device other than the CPU.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    rms_norm_as("cpu_rms_norm", x, weight, eps)
}

/// [`rms_norm`] whose errors name `op` ([`crate::fast::rms_norm`] keeps its own name).
pub(crate) fn rms_norm_as(op: &'static str, x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    wrap(op, ffi::cpu_rms_norm(x.raw(), &list(weight), eps))
}

/// `rope.apply(x, offset)` for f32 `x [..., L, D]`, as one node.
///
/// # Errors
/// [`crate::Error::Mlx`] (op `cpu_rope`) for another dtype, `x` with fewer than 2 axes, odd
/// or too large `dims`, `freqs` not f32 `[dims / 2]`, or a default device other than the CPU.
pub fn rope(rope: &Rope, x: &Array, offset: i32) -> Result<Array> {
    rope_as("cpu_rope", rope, x, offset)
}

/// [`rope`] whose errors name `op` ([`crate::fast::Rope::apply`] keeps its own name).
pub(crate) fn rope_as(op: &'static str, rope: &Rope, x: &Array, offset: i32) -> Result<Array> {
    rope_node(op, rope, x, offset, None)
}

/// `rope.apply` for f32 `x [..., L, D]` whose row `l` sits at `positions[l]` (int32 `[L]`),
/// as one node: the values [`rope`] gives a row at that offset, bit for bit (the same
/// `cos`/`sin` of the same position).
///
/// # Errors
/// As [`rope`], and when `positions` is not int32 `[L]`.
pub fn rope_at(rope: &Rope, x: &Array, positions: &Array) -> Result<Array> {
    rope_node("cpu_rope", rope, x, 0, Some(positions))
}

fn rope_node(op: &'static str, rope: &Rope, x: &Array, offset: i32, positions: Option<&Array>) -> Result<Array> {
    wrap(
        op,
        ffi::cpu_rope(
            x.raw(),
            rope.dims,
            rope.traditional,
            rope.base,
            rope.freqs.is_none(),
            rope.scale,
            offset,
            &list(rope.freqs.as_ref()),
            &list(positions),
        ),
    )
}

/// Whether the fused nodes are used for these inputs under `policy`:
/// [`KernelPolicy::uses_fast_norm_rope`] and every array f32.
pub fn applies(arrays: &[Option<&Array>], policy: &KernelPolicy) -> bool {
    policy.uses_fast_norm_rope() && arrays.iter().flatten().all(|a| a.dtype() == Dtype::Float32)
}

/// RMS norm and RoPE evaluations by the kernels since the process started, under any policy
/// (one policy's nodes: [`KernelPolicy::calls`]).
pub fn calls() -> u64 {
    ffi::cpu_fast_calls()
}
