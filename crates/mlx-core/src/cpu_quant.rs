//! A fast CPU kernel for affine quantized matmul (`x @ dequantize(W)^T`), for the MLX CPU
//! backend, where the wheel's own `quantized_matmul` is scalar SSE2 code (about 1 GB/s of
//! weights) whose cost grows linearly with the number of activation rows.
//!
//! The kernel is an MLX custom primitive written in C++ (`crates/mlx-sys/src/qmm.cc`): a
//! lazy node of the graph like any other op, evaluated on the CPU stream. It reads each
//! packed weight row once per call for all activation rows (a verify window of `T` tokens
//! costs a fraction of `T` one-token steps; a prompt chunk of more than
//! [`WINDOW_MAX_ROWS`] rows goes to a GEMM on AVX-512 and AVX2, shorter inputs in blocks of
//! at most 32 rows whose activations stay in cache, each such a window), uses AVX-512F or AVX2 + FMA
//! when the CPU has them (checked at run time; a portable path otherwise; the caller's
//! [`KernelPolicy`] caps the choice, see [`KernelPolicy::isa`]) and splits the output
//! features over all cores (process-wide: `MLX_SPEC_QMM_THREADS` or [`set_threads`]).
//!
//! The same kernels take dense float32 weights ([`dense_matmuls_t`], [`dense_swiglu_t`]):
//! MLX sends those products to BLAS (`sgemv` for one row through mlx-sys's routing, `sgemm`
//! for windows), and OpenBLAS on a CPU it does not recognise (generic kernels) streams a
//! one-row product at about half the memory bandwidth that two cores reach here; SmolLM2-135M
//! f32 decode runs about 2x faster this way (`cargo xtask bench-decode`). Prompt prefill
//! (more than [`DENSE_MAX_ROWS`] rows) takes the kernel's prompt GEMM on AVX-512 and BLAS
//! elsewhere (OpenBLAS has AVX2 kernels for the CPUs without AVX-512, and its `sgemm` beat the
//! kernel's dense GEMM on a Zen 3 CPU).
//!
//! Supported: [`QuantSpec`] with `bits` 4 or 8 and any supported group size (32, 64, 128),
//! float32 activations, scales and biases (load models with `dtype = Float32`, the fast
//! choice on this backend anyway). [`supports`] says whether a matrix and input qualify;
//! callers fall back to [`crate::quant::quantized_matmul`] otherwise. The dispatching calls
//! ([`QuantizedMatrix::matmul_t_auto`], [`dense_matmul_t_auto`]) follow the
//! [`KernelPolicy`] they are given; every node built through a policy counts in its
//! [`KernelPolicy::calls`].
//!
//! Results equal MLX's `quantized_matmul` up to float rounding (another summation order):
//! the tests allow `|Δ| <= 1e-5 * Σ_k |x_k * w_k| + 1e-6` per output element. That is the
//! default [`crate::Precision::F32`]; a policy with [`crate::Precision::Bf16`] (opt-in) rounds
//! the dequantized weights and the activations to bf16 and sums bf16 dot products in f32
//! (`tests/cpu_quant_precision.rs`: within `1e-5 * Σ|x w|` of an f64 product of the rounded
//! operands, `2^-7 * Σ|x w|` of f32); one with [`crate::Precision::Int8`] (opt-in) quantizes
//! the activations per block of 32 to int8 (llama.cpp's Q8_0) and takes integer dot products
//! with the weight codes (same test: within `1e-5 * Σ|x w|` of an f64 reference of that
//! arithmetic, and within half a quantization step per activation of f32). In all three, a
//! row's result does not depend on the number of rows.
use mlx_sys::ffi;

use crate::array::{list, wrap};
use crate::quant::{QuantSpec, QuantizedMatrix};
use crate::settings::{Kernel, KernelPolicy};
use crate::{Array, Dtype, Result};

/// Bit widths the kernel handles.
pub const KERNEL_BITS: [i32; 2] = [4, 8];

/// `x [..., K]` (float32) times the transpose of the quantized `W [N, K]`: `[..., N]`
/// float32, lazy. `weight` uint32 `[N, K * bits / 32]`, `scales`/`biases` float32
/// `[N, K / group_size]` (mlx's affine layout). Runs under `policy`'s instruction-set cap and
/// [`crate::Precision`] and counts in its [`KernelPolicy::calls`] (whatever its switches say).
///
/// # Errors
/// [`crate::Error::Mlx`] naming the problem when the spec is not 4/8-bit, a dtype is not
/// float32, the shapes disagree, or the default device is not the CPU.
pub fn quantized_matmul_t(
    x: &Array,
    weight: &Array,
    scales: &Array,
    biases: &Array,
    spec: QuantSpec,
    policy: &KernelPolicy,
) -> Result<Array> {
    policy.count(Kernel::Qmm);
    wrap(
        "cpu_quantized_matmul",
        ffi::cpu_quantized_matmul(
            x.raw(),
            weight.raw(),
            scales.raw(),
            biases.raw(),
            spec.group_size,
            spec.bits,
            policy.max_isa as i32,
            policy.precision as i32,
            policy.threads_arg(),
        ),
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
pub fn quantized_matmuls_t(x: &Array, mats: &[&QuantizedMatrix], policy: &KernelPolicy) -> Result<Vec<Array>> {
    let spec = same_spec("cpu_quantized_matmuls", mats)?;
    policy.count(Kernel::Qmm);
    let l = ffi::cpu_quantized_matmuls(
        x.raw(),
        &triples(mats),
        spec.group_size,
        spec.bits,
        false,
        policy.max_isa as i32,
        policy.precision as i32,
        policy.threads_arg(),
    )
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
pub fn swiglu_t(x: &Array, gate: &QuantizedMatrix, up: &QuantizedMatrix, policy: &KernelPolicy) -> Result<Array> {
    let spec = same_spec("cpu_quantized_swiglu", &[gate, up])?;
    policy.count(Kernel::Qmm);
    let l = ffi::cpu_quantized_matmuls(
        x.raw(),
        &triples(&[gate, up]),
        spec.group_size,
        spec.bits,
        true,
        policy.max_isa as i32,
        policy.precision as i32,
        policy.threads_arg(),
    )
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
pub fn dense_matmuls_t(x: &Array, weights: &[&Array], policy: &KernelPolicy) -> Result<Vec<Array>> {
    policy.count(Kernel::Dense);
    let l = ffi::cpu_dense_matmuls(
        x.raw(),
        &list(weights.iter().copied()),
        false,
        policy.max_isa as i32,
        policy.threads_arg(),
    )
    .map_err(|e| crate::Error::mlx("cpu_dense_matmuls", e))?;
    (0..ffi::list_len(&l)).map(|i| wrap("cpu_dense_matmuls", ffi::list_get(&l, i))).collect()
}

/// [`swiglu_t`] for dense float32 `gate` and `up` `[N, K]`: `x [..., K]` -> `[..., N]`.
///
/// # Errors
/// As [`dense_matmuls_t`], and when `gate` and `up` differ in shape.
pub fn dense_swiglu_t(x: &Array, gate: &Array, up: &Array, policy: &KernelPolicy) -> Result<Array> {
    policy.count(Kernel::Dense);
    let l = ffi::cpu_dense_matmuls(x.raw(), &list([gate, up]), true, policy.max_isa as i32, policy.threads_arg())
        .map_err(|e| crate::Error::mlx("cpu_dense_swiglu", e))?;
    wrap("cpu_dense_swiglu", ffi::list_get(&l, 0))
}

/// Activation rows up to which a quantized product computes every row with the float
/// operations of its one-row product (verify windows, batched decode steps, short prompts:
/// bit for bit the logits of one-token steps). Longer inputs (prompt chunks) take a GEMM in
/// f32 precision on AVX-512 (`rows_gemm` in `qmm.cc`: ~1.6x the multiply-adds a second at 512
/// rows) and, for 4- and 8-bit matrices, AVX2 + FMA (`rows_gemm_avx2`: the same operations,
/// so the same bits), whose rows round differently in the last bits and equal each other for
/// any longer row count. Callers that need one-token bits (batched forwards) keep products
/// at most this long; the value is `kWindowMaxRows` of `qmm.cc`, pinned by
/// `mlx-core/tests/cpu_quant.rs`.
pub const WINDOW_MAX_ROWS: usize = 256;

/// Activation rows up to which dense products give every row its one-row bits (the dense
/// counterpart of [`WINDOW_MAX_ROWS`]). Longer inputs (prompt prefill) take the kernel's
/// prompt GEMM on AVX-512 (`qmm.cc`'s `kDenseWindowMaxRows`), else BLAS `sgemm`
/// ([`dense_applies`]).
pub const DENSE_MAX_ROWS: usize = 32;

/// Whether a dense layer should use [`dense_matmuls_t`] for `w [N, K]` and input `x`:
/// `policy` has the dense kernel on ([`KernelPolicy::uses_dense`]: CPU backend), both are
/// float32, `K` is a multiple of 32 and `x` has at most [`DENSE_MAX_ROWS`] rows, or more on
/// AVX-512 (the prompt GEMM; BLAS `sgemm` elsewhere).
pub fn dense_applies(w: &Array, x: &Array, policy: &KernelPolicy) -> bool {
    let (ws, xs) = (w.shape(), x.shape());
    let rows: usize = xs[..xs.len().saturating_sub(1)].iter().map(|&d| d as usize).product();
    policy.uses_dense()
        && w.dtype() == Dtype::Float32
        && x.dtype() == Dtype::Float32
        && ws.len() == 2
        && ws[1] % 32 == 0
        && xs.last() == Some(&ws[1])
        && (rows <= DENSE_MAX_ROWS || prompt_gemm(policy))
}

/// Whether dense products longer than the windows run on the kernel's prompt GEMM under
/// `policy` (AVX-512F on this CPU within the policy's cap; f32 precision, the only one of
/// dense weights).
fn prompt_gemm(policy: &KernelPolicy) -> bool {
    ffi::cpu_qmm_isa(policy.max_isa as i32, 0) == "avx512f"
}

/// `x [..., K] @ w^T` for a dense `w [N, K]`: `[..., N]` in `x`'s dtype, lazy, with the
/// fastest kernel for the input under `policy`: [`dense_matmuls_t`] when [`dense_applies`],
/// else MLX's matmul (BLAS). The dense counterpart of [`QuantizedMatrix::matmul_t_auto`].
///
/// # Errors
/// [`crate::Error::Mlx`] when `x`'s last axis is not `K`.
pub fn dense_matmul_t_auto(x: &Array, w: &Array, policy: &KernelPolicy) -> Result<Array> {
    if dense_applies(w, x, policy) {
        return Ok(dense_matmuls_t(x, &[w], policy)?.remove(0));
    }
    x.matmul(&w.t()?)
}

/// The common spec of `mats`, or an error naming both specs.
pub(crate) fn same_spec(op: &'static str, mats: &[&QuantizedMatrix]) -> Result<QuantSpec> {
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

/// How many products the kernel has evaluated in this process, under any policy (the
/// count of one policy's nodes is [`KernelPolicy::calls`]).
pub fn calls() -> u64 {
    ffi::cpu_qmm_calls()
}

/// Threads the kernels split their work over (process-wide: one pool for all models).
pub fn threads() -> usize {
    crate::settings::apply_process();
    ffi::cpu_qmm_threads() as usize
}

/// Sets the kernels' thread count process-wide (clamped to 1..=cores), overriding
/// `MLX_SPEC_QMM_THREADS`.
pub fn set_threads(n: usize) {
    crate::settings::apply_process();
    ffi::cpu_qmm_set_threads(n.min(i32::MAX as usize) as i32);
}

impl QuantizedMatrix {
    /// `x @ W^T` with the fastest kernel for this backend under `policy`:
    /// [`quantized_matmul_t`] when [`KernelPolicy::uses_qmm`] and [`supports`] hold, else
    /// MLX's [`QuantizedMatrix::matmul_t`].
    ///
    /// # Errors
    /// As [`QuantizedMatrix::matmul_t`].
    pub fn matmul_t_auto(&self, x: &Array, policy: &KernelPolicy) -> Result<Array> {
        if policy.uses_qmm() && supports(self, x.dtype()) {
            quantized_matmul_t(x, &self.weight, &self.scales, &self.biases, self.spec, policy)
        } else {
            self.matmul_t(x)
        }
    }
}
