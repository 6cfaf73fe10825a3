//! Affine group quantization, bit-compatible with `mlx.core.quantize` (and so with mlx-lm's
//! quantized checkpoints).
//!
//! A matrix `W [N, K]` is split along `K` into groups of `group_size`; each group stores
//! `scale` and `bias` (dtype of `W`), and each element `q = round((w - bias) / scale)` in
//! `bits` bits, packed little-endian into uint32 words: `weight [N, K * bits / 32]`,
//! `scales`/`biases [N, K / group_size]`. Dequantized: `w ≈ scale * q + bias`.
use mlx_sys::ffi;

use crate::array::{list, wrap};
use crate::{Array, Error, Result};

/// Bit widths MLX's affine mode supports.
pub const SUPPORTED_BITS: [i32; 6] = [2, 3, 4, 5, 6, 8];
/// Group sizes this project supports (mlx-lm's choices).
pub const SUPPORTED_GROUP_SIZES: [i32; 3] = [32, 64, 128];

/// How a matrix is quantized: affine mode with `bits` per weight and one scale/bias pair
/// per `group_size` consecutive weights of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    /// Weights per scale/bias group (32, 64 or 128).
    pub group_size: i32,
    /// Bits per weight (2, 3, 4, 5, 6 or 8).
    pub bits: i32,
}

impl QuantSpec {
    /// A validated spec.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `bits` or `group_size` is not supported.
    pub fn new(group_size: i32, bits: i32) -> Result<Self> {
        if !SUPPORTED_BITS.contains(&bits) {
            return Err(Error::Invalid {
                op: "quantize",
                message: format!("bits must be one of {SUPPORTED_BITS:?}, got {bits}"),
            });
        }
        if !SUPPORTED_GROUP_SIZES.contains(&group_size) {
            return Err(Error::Invalid {
                op: "quantize",
                message: format!("group_size must be one of {SUPPORTED_GROUP_SIZES:?}, got {group_size}"),
            });
        }
        Ok(Self { group_size, bits })
    }

    /// Storage cost per weight in bits, scales and biases included, for a `dtype` of the
    /// given byte size: `bits + 2 * 8 * scale_bytes / group_size` (4.5 for q4/g64/f16).
    pub fn bits_per_weight(&self, scale_bytes: usize) -> f64 {
        self.bits as f64 + 2.0 * 8.0 * scale_bytes as f64 / self.group_size as f64
    }
}

/// A quantized matrix: the three arrays of `mlx.core.quantize` plus its spec.
#[derive(Debug, Clone)]
pub struct QuantizedMatrix {
    /// Packed weights, uint32 `[N, K * bits / 32]`.
    pub weight: Array,
    /// Per-group scales `[N, K / group_size]`, dtype of the source matrix.
    pub scales: Array,
    /// Per-group biases `[N, K / group_size]`, dtype of the source matrix.
    pub biases: Array,
    /// The spec the arrays were made with.
    pub spec: QuantSpec,
}

/// Quantizes `w [..., N, K]` (f32/f16/bf16) along its last axis.
///
/// # Errors
/// [`Error::Invalid`] for an unsupported spec; [`Error::Mlx`] when `K` is not divisible by
/// `group_size` or `w` has fewer than 2 dimensions.
pub fn quantize(w: &Array, spec: QuantSpec) -> Result<QuantizedMatrix> {
    let spec = QuantSpec::new(spec.group_size, spec.bits)?;
    let q = ffi::quantize(w.raw(), spec.group_size, spec.bits, "affine").map_err(|e| Error::mlx("quantize", e))?;
    Ok(QuantizedMatrix {
        weight: Array::from_raw(q.w),
        scales: Array::from_raw(q.scales),
        biases: Array::from_raw(q.biases),
        spec,
    })
}

/// `scales * q + biases`, shape `[..., N, K]`, dtype of `scales`.
///
/// # Errors
/// [`Error::Mlx`] when the shapes do not fit the spec (e.g. `weight` not uint32).
pub fn dequantize(weight: &Array, scales: &Array, biases: &Array, spec: QuantSpec) -> Result<Array> {
    wrap(
        "dequantize",
        ffi::dequantize(weight.raw(), scales.raw(), &list([biases]), spec.group_size, spec.bits, "affine"),
    )
}

/// `x @ W^T` (`transpose = true`, `x [..., K]` -> `[..., N]`, the `Linear` layout) or
/// `x @ W` (`transpose = false`, `W` taken as `[K, N]`) with `W` quantized, without
/// materializing `W`.
///
/// # Errors
/// [`Error::Mlx`] when `x`'s last axis does not match `W`.
pub fn quantized_matmul(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    transpose: bool,
    spec: QuantSpec,
) -> Result<Array> {
    wrap(
        "quantized_matmul",
        ffi::quantized_matmul(
            x.raw(),
            weight.raw(),
            scales.raw(),
            &list([biases]),
            transpose,
            spec.group_size,
            spec.bits,
            "affine",
        ),
    )
}

impl QuantizedMatrix {
    /// The dequantized matrix `[N, K]`.
    ///
    /// # Errors
    /// As [`dequantize`].
    pub fn dequantize(&self) -> Result<Array> {
        dequantize(&self.weight, &self.scales, &self.biases, self.spec)
    }

    /// `x @ W^T`: `x [..., K]` -> `[..., N]`.
    ///
    /// # Errors
    /// As [`quantized_matmul`].
    pub fn matmul_t(&self, x: &Array) -> Result<Array> {
        quantized_matmul(x, &self.weight, &self.scales, &self.biases, true, self.spec)
    }
}
