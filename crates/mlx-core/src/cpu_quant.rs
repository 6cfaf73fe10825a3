//! A fast CPU kernel for affine quantized matmul (`x @ dequantize(W)^T`), for the MLX CPU
//! backend, where the wheel's own `quantized_matmul` is scalar SSE2 code (about 1 GB/s of
//! weights) whose cost grows linearly with the number of activation rows.
//!
//! The kernel is an MLX custom primitive written in C++ (`crates/mlx-sys/src/qmm.cc`): a
//! lazy node of the graph like any other op, evaluated on the CPU stream. It reads each
//! packed weight row once per call for all activation rows (a verify window of `T` tokens
//! costs a fraction of `T` one-token steps), uses AVX-512F or AVX2 + FMA when the CPU has
//! them (checked at run time; a portable path otherwise; see [`isa`]) and splits the output
//! features over all cores (`MLX_SPEC_QMM_THREADS` or [`set_threads`]).
//!
//! The same kernels take dense float32 weights ([`dense_matmuls_t`], [`dense_swiglu_t`]):
//! MLX sends those products to BLAS (`sgemv` for one row through mlx-sys's routing, `sgemm`
//! for windows), and OpenBLAS on a CPU it does not recognise (generic kernels) streams a
//! one-row product at about half the memory bandwidth that two cores reach here; SmolLM2-135M
//! f32 decode runs about 2x faster this way (`cargo xtask bench-decode`). Prompt prefill
//! (more than [`DENSE_MAX_ROWS`] rows) stays with BLAS.
//!
//! Supported: [`QuantSpec`] with `bits` 4 or 8 and any supported group size (32, 64, 128),
//! float32 activations, scales and biases (load models with `dtype = Float32`, the fast
//! choice on this backend anyway). [`supports`] says whether a matrix and input qualify;
//! callers fall back to [`crate::quant::quantized_matmul`] otherwise.
//!
//! Results equal MLX's `quantized_matmul` up to float rounding (another summation order):
//! the tests allow `|Δ| <= 1e-5 * Σ_k |x_k * w_k| + 1e-6` per output element.
use mlx_sys::ffi;

use crate::array::{list, wrap};
use crate::quant::{QuantSpec, QuantizedMatrix};
use crate::runtime::CpuKernelSwitch;
use crate::{Array, Dtype, Result};

/// Bit widths the kernel handles.
pub const KERNEL_BITS: [i32; 2] = [4, 8];

/// `x [..., K]` (float32) times the transpose of the quantized `W [N, K]`: `[..., N]`
/// float32, lazy. `weight` uint32 `[N, K * bits / 32]`, `scales`/`biases` float32
/// `[N, K / group_size]` (mlx's affine layout).
///
/// # Errors
/// [`crate::Error::Mlx`] naming the problem when the spec is not 4/8-bit, a dtype is not
/// float32, the shapes disagree, or the default device is not the CPU.
pub fn quantized_matmul_t(x: &Array, weight: &Array, scales: &Array, biases: &Array, spec: QuantSpec) -> Result<Array> {
    wrap(
        "cpu_quantized_matmul",
        ffi::cpu_quantized_matmul(x.raw(), weight.raw(), scales.raw(), biases.raw(), spec.group_size, spec.bits),
    )
}

/// Several products `x @ dequantize(W_j)^T` of one input in one graph node and one pass of
/// the thread pool (a layer's q/k/v projections): one float32 `[..., N_j]` array per matrix,
/// each equal bit for bit to [`quantized_matmul_t`] of that matrix. The matrices must share
/// `K` and the [`QuantSpec`].
///
/// # Errors
/// [`crate::Error::Mlx`] as [`quantized_matmul_t`], and for matrices of different specs or
/// an empty list.
pub fn quantized_matmuls_t(x: &Array, mats: &[&QuantizedMatrix]) -> Result<Vec<Array>> {
    let spec = same_spec("cpu_quantized_matmuls", mats)?;
    let l = ffi::cpu_quantized_matmuls(x.raw(), &triples(mats), spec.group_size, spec.bits, false)
        .map_err(|e| crate::Error::mlx("cpu_quantized_matmuls", e))?;
    (0..ffi::list_len(&l)).map(|i| wrap("cpu_quantized_matmuls", ffi::list_get(&l, i))).collect()
}

/// The SwiGLU of a llama-style MLP (Shazeer 2020, "GLU Variants Improve Transformer"; mlx-lm's
/// `nn.silu(gate(x)) * up(x)`), `silu(x @ gate^T) * (x @ up^T)` with `silu(g) = g *
/// sigmoid(g)`, in one graph node: `x [..., K]` float32 -> `[..., N]` float32, lazy. It
/// replaces five nodes (two products, sigmoid, two multiplies); the result equals them up to
/// float rounding (the kernel's own exp), and a row's result does not depend on the number of
/// rows.
///
/// # Errors
/// [`crate::Error::Mlx`] as [`quantized_matmul_t`], and when `gate` and `up` differ in shape
/// or spec.
pub fn swiglu_t(x: &Array, gate: &QuantizedMatrix, up: &QuantizedMatrix) -> Result<Array> {
    let spec = same_spec("cpu_quantized_swiglu", &[gate, up])?;
    let l = ffi::cpu_quantized_matmuls(x.raw(), &triples(&[gate, up]), spec.group_size, spec.bits, true)
        .map_err(|e| crate::Error::mlx("cpu_quantized_swiglu", e))?;
    wrap("cpu_quantized_swiglu", ffi::list_get(&l, 0))
}

/// Dense float32 weights through the same kernels (the weights read as they are, no scales):
/// `x [..., K]` float32 times the transpose of each `W_j [N_j, K]` float32 (`K` a multiple of
/// 32), one float32 `[..., N_j]` per weight, lazy, in one graph node. For one-token steps and
/// verify windows on the CPU, where MLX sends the product to BLAS `sgemm` (which packs the
/// whole matrix for a single row); a row's result does not depend on the number of rows.
///
/// # Errors
/// [`crate::Error::Mlx`] naming the problem when a dtype is not float32, `K` is not a
/// multiple of 32, the shapes disagree, the list is empty, or the default device is not the
/// CPU.
pub fn dense_matmuls_t(x: &Array, weights: &[&Array]) -> Result<Vec<Array>> {
    let l = ffi::cpu_dense_matmuls(x.raw(), &list(weights.iter().copied()), false)
        .map_err(|e| crate::Error::mlx("cpu_dense_matmuls", e))?;
    (0..ffi::list_len(&l)).map(|i| wrap("cpu_dense_matmuls", ffi::list_get(&l, i))).collect()
}

/// [`swiglu_t`] for dense float32 `gate` and `up` `[N, K]`: `x [..., K]` -> `[..., N]`.
///
/// # Errors
/// As [`dense_matmuls_t`], and when `gate` and `up` differ in shape.
pub fn dense_swiglu_t(x: &Array, gate: &Array, up: &Array) -> Result<Array> {
    let l = ffi::cpu_dense_matmuls(x.raw(), &list([gate, up]), true)
        .map_err(|e| crate::Error::mlx("cpu_dense_swiglu", e))?;
    wrap("cpu_dense_swiglu", ffi::list_get(&l, 0))
}

/// Activation rows up to which dense products go to this kernel ([`dense_applies`]); longer
/// inputs (prompt prefill) stay with BLAS `sgemm`, faster there.
pub const DENSE_MAX_ROWS: usize = 32;

/// Whether a dense layer should use [`dense_matmuls_t`] for `w [N, K]` and input `x`: the
/// switch is on ([`dense_enabled`]), both are float32, `K` is a multiple of 32 and `x` has at
/// most [`DENSE_MAX_ROWS`] rows.
pub fn dense_applies(w: &Array, x: &Array) -> bool {
    let (ws, xs) = (w.shape(), x.shape());
    let rows: usize = xs[..xs.len().saturating_sub(1)].iter().map(|&d| d as usize).product();
    dense_enabled()
        && w.dtype() == Dtype::Float32
        && x.dtype() == Dtype::Float32
        && ws.len() == 2
        && ws[1] % 32 == 0
        && xs.last() == Some(&ws[1])
        && rows <= DENSE_MAX_ROWS
}

/// `x [..., K] @ w^T` for a dense `w [N, K]`: `[..., N]` in `x`'s dtype, lazy, with the
/// fastest kernel for the input: [`dense_matmuls_t`] when [`dense_applies`], else MLX's
/// matmul (BLAS). The dense counterpart of [`QuantizedMatrix::matmul_t_auto`].
///
/// # Errors
/// [`crate::Error::Mlx`] when `x`'s last axis is not `K`.
pub fn dense_matmul_t_auto(x: &Array, w: &Array) -> Result<Array> {
    if dense_applies(w, x) {
        return Ok(dense_matmuls_t(x, &[w])?.remove(0));
    }
    x.matmul(&w.t()?)
}

/// Whether dense float32 layers should use this kernel for short inputs: on the CPU backend
/// unless turned off with [`set_dense_enabled`] or `MLX_SPEC_DENSE=mlx` (MLX's matmul and
/// BLAS then, for comparisons). Always `false` on Metal and CUDA.
pub fn dense_enabled() -> bool {
    DENSE_SWITCH.enabled()
}

/// Turns the dense path on or off process-wide; returns the previous [`dense_enabled`].
pub fn set_dense_enabled(on: bool) -> bool {
    DENSE_SWITCH.set(on)
}

static DENSE_SWITCH: CpuKernelSwitch = CpuKernelSwitch::new("MLX_SPEC_DENSE");

/// The common spec of `mats`, or an error naming both specs.
fn same_spec(op: &'static str, mats: &[&QuantizedMatrix]) -> Result<QuantSpec> {
    let first = mats.first().ok_or_else(|| crate::Error::Mlx { op, message: "no matrices".into() })?.spec;
    match mats.iter().find(|m| m.spec != first) {
        Some(other) => Err(crate::Error::Mlx {
            op,
            message: format!("matrices of one call need one spec, got {first:?} and {:?}", other.spec),
        }),
        None => Ok(first),
    }
}

/// `(weight, scales, biases)` of each matrix, in order.
fn triples(mats: &[&QuantizedMatrix]) -> cxx::UniquePtr<ffi::ArrayList> {
    list(mats.iter().flat_map(|m| [&m.weight, &m.scales, &m.biases]))
}

/// Whether [`quantized_matmul_t`] accepts `q` with an input of dtype `x`: 4 or 8 bits,
/// float32 scales and biases and activations.
pub fn supports(q: &QuantizedMatrix, x: Dtype) -> bool {
    KERNEL_BITS.contains(&q.spec.bits)
        && x == Dtype::Float32
        && q.scales.dtype() == Dtype::Float32
        && q.biases.dtype() == Dtype::Float32
        && q.weight.dtype() == Dtype::Uint32
}

/// Whether quantized layers should use this kernel: on the CPU backend unless turned off
/// with [`set_enabled`] or `MLX_SPEC_QMM=mlx` (which keeps MLX's own kernel, for
/// comparisons). Always `false` on Metal and CUDA.
pub fn enabled() -> bool {
    SWITCH.enabled()
}

/// Turns the kernel on or off for quantized layers process-wide (benchmarks compare both);
/// `true` has no effect off the CPU backend. Returns the previous [`enabled`].
pub fn set_enabled(on: bool) -> bool {
    SWITCH.set(on)
}

static SWITCH: CpuKernelSwitch = CpuKernelSwitch::new("MLX_SPEC_QMM");

/// The instruction sets of the kernel, from the portable C++ up; [`isa`] reports one.
pub const ISAS: [&str; 3] = ["portable", "avx2+fma", "avx512f"];

/// The instruction set the next evaluation uses: the best of [`ISAS`] that the CPU has,
/// under the cap of [`limit_isa`] (`MLX_SPEC_QMM_ISA` at start).
pub fn isa() -> String {
    ffi::cpu_qmm_isa()
}

/// Caps the instruction set at `name` (one of [`ISAS`]) process-wide, e.g. to test the
/// portable path on an AVX-512 machine; returns the previous cap. Each instruction set has
/// its own summation order, so results differ between them at rounding level; within one,
/// a row's result never depends on the number of rows.
///
/// # Errors
/// [`crate::Error::Mlx`] for a name not in [`ISAS`].
pub fn limit_isa(name: &str) -> Result<String> {
    ffi::cpu_qmm_limit_isa(name).map_err(|e| crate::Error::mlx("cpu_qmm_limit_isa", e))
}

/// How many products the kernel has evaluated in this process (proves a path uses it).
pub fn calls() -> u64 {
    ffi::cpu_qmm_calls()
}

/// Threads the kernel splits output features over.
pub fn threads() -> usize {
    ffi::cpu_qmm_threads() as usize
}

/// Sets the kernel's thread count (clamped to 1..=cores).
pub fn set_threads(n: usize) {
    ffi::cpu_qmm_set_threads(n.min(i32::MAX as usize) as i32);
}

impl QuantizedMatrix {
    /// `x @ W^T` with the fastest kernel for this backend: [`quantized_matmul_t`] when
    /// [`enabled`] and [`supports`] hold, else MLX's [`QuantizedMatrix::matmul_t`].
    ///
    /// # Errors
    /// As [`QuantizedMatrix::matmul_t`].
    pub fn matmul_t_auto(&self, x: &Array) -> Result<Array> {
        if enabled() && supports(self, x.dtype()) {
            quantized_matmul_t(x, &self.weight, &self.scales, &self.biases, self.spec)
        } else {
            self.matmul_t(x)
        }
    }
}
