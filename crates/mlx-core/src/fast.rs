//! Fused transformer kernels from `mlx::core::fast`: RMS norm, layer norm, rotary position
//! embedding and scaled dot-product attention.
use mlx_sys::ffi;

use crate::array::{list, wrap};
use crate::settings::{Kernel, KernelPolicy};
use crate::{Array, Result};

/// RMS norm over the last axis: `x / sqrt(mean(x^2) + eps) * weight`
/// (Zhang & Sennrich 2019; `mlx.core.fast.rms_norm`).
///
/// Shapes: `x [..., H]`, `weight [H]` (or `None` for no scaling); output like `x`. One CPU
/// node ([`crate::cpu_fast`]) when `policy` has it on and the inputs are f32.
///
/// # Errors
/// [`crate::Error::Mlx`] when `weight` is not `[H]`.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32, policy: &KernelPolicy) -> Result<Array> {
    if crate::cpu_fast::applies(&[Some(x), weight], policy) {
        policy.count(Kernel::Fast);
        return crate::cpu_fast::rms_norm_as("rms_norm", x, weight, eps);
    }
    wrap("rms_norm", ffi::rms_norm(x.raw(), &list(weight), eps))
}

/// Layer norm over the last axis: `(x - mean) / sqrt(var + eps) * weight + bias`
/// (Ba et al. 2016; `mlx.core.fast.layer_norm`). Shapes: `x [..., H]`, `weight`/`bias [H]`.
///
/// # Errors
/// [`crate::Error::Mlx`] when `weight` or `bias` is not `[H]`.
pub fn layer_norm(x: &Array, weight: Option<&Array>, bias: Option<&Array>, eps: f32) -> Result<Array> {
    wrap("layer_norm", ffi::layer_norm(x.raw(), &list(weight), &list(bias), eps))
}

/// Rotary position embedding (Su et al. 2021, RoFormer; `mlx.core.fast.rope`).
///
/// Rotates the first `dims` features of the last axis of `x [B, H, L, D]` (or any
/// `[..., L, D]`); position `p` of row `l` is `offset + l`, angle `p * scale * theta_i`
/// with `theta_i = base^(-2i/dims)` or, when `freqs` is given, `theta_i = 1 / freqs[i]`
/// (`freqs [dims/2]`, for Llama-3 / YaRN / proportional schedules).
/// `traditional = true` rotates adjacent pairs `(x[2i], x[2i+1])` (the GGUF/llama.cpp
/// layout); `false` rotates halves `(x[i], x[i + dims/2])` (the HF layout).
#[derive(Debug, Clone)]
pub struct Rope {
    /// Number of leading features of the last axis that are rotated (even).
    pub dims: i32,
    /// Pairing of rotated features, see the type docs.
    pub traditional: bool,
    /// Frequency base (e.g. 10000.0); ignored when `freqs` is set.
    pub base: f32,
    /// Position scale (1.0 for none; linear RoPE scaling uses `1/factor`).
    pub scale: f32,
    /// Custom per-pair wavelengths `[dims/2]`, f32; replaces `base`.
    pub freqs: Option<Array>,
}

impl Rope {
    /// Applies the rotation to `x [..., L, D]` with the first row at position `offset`
    /// (tokens already in the KV cache). One CPU node ([`crate::cpu_fast`]) when `policy`
    /// has it on and the inputs are f32.
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] when `dims` exceeds `D` or is odd, or `freqs` has the wrong size.
    pub fn apply(&self, x: &Array, offset: i32, policy: &KernelPolicy) -> Result<Array> {
        if crate::cpu_fast::applies(&[Some(x), self.freqs.as_ref()], policy) {
            policy.count(Kernel::Fast);
            return crate::cpu_fast::rope_as("rope", self, x, offset);
        }
        let has_base = self.freqs.is_none();
        wrap(
            "rope",
            ffi::rope(
                x.raw(),
                self.dims,
                self.traditional,
                self.base,
                has_base,
                self.scale,
                offset,
                &list(self.freqs.as_ref()),
            ),
        )
    }

    /// Applies the rotation to `x [..., L, D]` with row `l` at position `positions[l]`
    /// (int32 `[L]`): the rows of several requests, each from its own offset, in one CPU
    /// node ([`crate::cpu_fast::rope_at`]), each row as [`Rope::apply`] computes it at that
    /// offset. `None` when `policy` has the CPU node off or the inputs are not f32 (MLX's
    /// own rope takes one offset per call).
    ///
    /// # Errors
    /// As [`Rope::apply`], and when `positions` is not int32 `[L]`.
    pub fn apply_at(&self, x: &Array, positions: &Array, policy: &KernelPolicy) -> Result<Option<Array>> {
        if !crate::cpu_fast::applies(&[Some(x), self.freqs.as_ref()], policy) {
            return Ok(None);
        }
        policy.count(Kernel::Fast);
        crate::cpu_fast::rope_at(self, x, positions).map(Some)
    }

    /// The rotation of `x [..., L, D]` with row `l` at position `positions[l]` (`[L]`, any
    /// numeric dtype), from elementwise MLX ops: differentiable (for training) and for any
    /// positions and dtype. As transformers computes it (`rotate_half`; the angles, their cos
    /// and sin in f32, then cast to `x`'s dtype): `x * cos + rotate(x) * sin` on the first
    /// `dims` features, the rest unchanged. Equals [`Rope::apply`] up to rounding (MLX's
    /// kernel rounds the rotated pair once).
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] for `traditional` (adjacent pairs are not implemented here)
    /// or an odd `dims` above `D`; [`crate::Error::Mlx`] on shape problems.
    pub fn apply_positions(&self, x: &Array, positions: &Array) -> Result<Array> {
        let d = x.shape().last().copied().unwrap_or(0);
        if self.traditional || self.dims % 2 != 0 || self.dims > d {
            return Err(crate::Error::Invalid {
                op: "rope",
                message: format!(
                    "apply_positions rotates halves of an even dims <= D: dims {}, D {d}, traditional {}",
                    self.dims, self.traditional
                ),
            });
        }
        let half = self.dims / 2;
        let inv_freq = match &self.freqs {
            Some(f) => f.astype(crate::Dtype::Float32)?.reciprocal()?,
            None => {
                // transformers' `1 / base^(2i / dims)`, in f32
                let two_i = Array::arange(0.0, f64::from(self.dims), 2.0, crate::Dtype::Float32)?;
                Array::scalar(self.base).power(&two_i.divide(&Array::scalar(self.dims as f32))?)?.reciprocal()?
            }
        };
        let pos = positions.astype(crate::Dtype::Float32)?.multiply(&Array::scalar(self.scale))?;
        let angles = pos.expand_dims(&[-1])?.multiply(&inv_freq.expand_dims(&[0])?)?; // [L, half]
        let (cos, sin) = (angles.cos()?.astype(x.dtype())?, angles.sin()?.astype(x.dtype())?);
        let rot = x.slice_axis(-1, 0, self.dims)?;
        let (a, b) = (rot.slice_axis(-1, 0, half)?, rot.slice_axis(-1, half, self.dims)?);
        let first = a.multiply(&cos)?.subtract(&b.multiply(&sin)?)?;
        let second = b.multiply(&cos)?.add(&a.multiply(&sin)?)?;
        let mut parts = vec![first, second];
        if self.dims < d {
            parts.push(x.slice_axis(-1, self.dims, d)?);
        }
        crate::concatenate(&parts.iter().collect::<Vec<_>>(), -1)
    }
}

/// The mask of [`scaled_dot_product_attention`].
#[derive(Debug, Clone, Copy)]
pub enum AttentionMask<'a> {
    /// Every query sees every key.
    None,
    /// Query `i` of `Lq` sees keys `0 ..= Lk - Lq + i` (the causal mask aligned to the end,
    /// as with a KV cache holding `Lk - Lq` earlier tokens).
    Causal,
    /// An explicit mask broadcastable to `[B, Hq, Lq, Lk]`: bool (true = attend) or
    /// additive float (added to the scores; `-inf` blocks).
    Array(&'a Array),
}

/// `softmax(q @ k^T * scale + mask) @ v` (Vaswani et al. 2017;
/// `mlx.core.fast.scaled_dot_product_attention`).
///
/// Shapes: `q [B, Hq, Lq, D]`, `k [B, Hkv, Lk, D]`, `v [B, Hkv, Lk, Dv]`, output
/// `[B, Hq, Lq, Dv]`. Grouped-query attention when `Hq` is a multiple of `Hkv` (query
/// head `h` uses KV head `h / (Hq / Hkv)`).
///
/// On the CPU backend, when `policy` has the kernel on, float32 inputs without an explicit
/// mask go to the fused kernel of [`crate::cpu_attention`] (decode steps, verify windows
/// and prompt chunks alike).
///
/// # Errors
/// [`crate::Error::Mlx`] on mismatched shapes or head counts.
pub fn scaled_dot_product_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: AttentionMask<'_>,
    policy: &KernelPolicy,
) -> Result<Array> {
    let fused = |causal| {
        policy.count(Kernel::Sdpa);
        wrap("scaled_dot_product_attention", ffi::cpu_attention(q.raw(), k.raw(), v.raw(), scale, causal))
    };
    match mask {
        AttentionMask::None if crate::cpu_attention::applies(q, k, v, false, policy) => return fused(false),
        AttentionMask::Causal if crate::cpu_attention::applies(q, k, v, true, policy) => return fused(true),
        _ => {}
    }
    let (mode, arr) = match mask {
        AttentionMask::None => ("", None),
        AttentionMask::Causal => ("causal", None),
        AttentionMask::Array(a) => ("array", Some(a)),
    };
    wrap("scaled_dot_product_attention", ffi::sdpa(q.raw(), k.raw(), v.raw(), scale, mode, &list(arr)))
}
