//! Evaluation, memory statistics, and what this process runs on (MLX version, device,
//! backend, BLAS).
use std::fmt;

use mlx_sys::ffi;

use crate::array::list;
use crate::{Array, Error, Result};

/// Evaluates several arrays together (shared subgraphs are computed once).
///
/// # Errors
/// [`Error::Mlx`] when a kernel or a lazy load throws.
pub fn eval(arrays: &[&Array]) -> Result<()> {
    crate::settings::apply_process();
    ffi::eval(&list(arrays.iter().copied())).map_err(|e| Error::mlx("eval", e))
}

/// Starts evaluating in the background and returns at once (mlx-lm overlaps building step
/// `t+1`'s graph with computing step `t`). Reading data later waits for completion.
///
/// # Errors
/// [`Error::Mlx`] when scheduling fails.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    crate::settings::apply_process();
    ffi::async_eval(&list(arrays.iter().copied())).map_err(|e| Error::mlx("async_eval", e))
}

/// MLX allocator statistics and controls. All sizes are in bytes.
pub mod memory {
    use mlx_sys::ffi;

    /// Bytes held by live arrays.
    pub fn active() -> usize {
        ffi::active_memory()
    }
    /// Highest [`active`] since start or the last [`reset_peak`].
    pub fn peak() -> usize {
        ffi::peak_memory()
    }
    /// Bytes freed by arrays but kept by the allocator for reuse.
    pub fn cache() -> usize {
        ffi::cache_memory()
    }
    /// Resets [`peak`] to the current [`active`].
    pub fn reset_peak() {
        ffi::reset_peak_memory()
    }
    /// Returns cached buffers to the system.
    pub fn clear_cache() {
        ffi::clear_cache()
    }
    /// Caps the allocator cache at `limit` bytes; returns the previous limit.
    pub fn set_cache_limit(limit: usize) -> usize {
        ffi::set_cache_limit(limit)
    }
}

/// The compute backend libmlx was built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// CPU only (the `mlx-cpu` wheel on Linux).
    Cpu,
    /// Apple GPU through Metal (macOS).
    Metal,
    /// NVIDIA GPU through CUDA (the `mlx-cuda-*` wheels).
    Cuda,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Cpu => "cpu",
            Backend::Metal => "metal",
            Backend::Cuda => "cuda",
        })
    }
}

/// The backend in use: a GPU backend when libmlx has one and a GPU is present, else CPU.
pub fn backend() -> Backend {
    if ffi::metal_available() {
        Backend::Metal
    } else if ffi::cuda_available() {
        Backend::Cuda
    } else {
        Backend::Cpu
    }
}

/// MLX's version string (`0.32.4`).
pub fn version() -> String {
    ffi::version()
}

/// The default device MLX runs ops on, e.g. `Device(cpu, 0)`.
pub fn default_device() -> String {
    ffi::default_device()
}

/// Which library computes f32 matrix products (`cblas_sgemm`) on the CPU backend, e.g.
/// `openblas (/usr/lib/x86_64-linux-gnu/libopenblas.so.0) OpenBLAS 0.3.21 ... threads=2`
/// or `reference (.../mlx_cpu.libs/libblas-bd8a282c.so.3.10.0)`. When the switch chose
/// OpenBLAS's kernel family itself (OpenBLAS detected a generic pre-AVX2 core on a CPU with
/// AVX2 or AVX-512), a note follows: `(kernels SkylakeX chosen from the CPU's features;
/// OpenBLAS detected Prescott)`.
pub fn blas_info() -> String {
    crate::settings::apply_process();
    ffi::blas_info()
}

/// How many `cblas_sgemm` calls MLX has made through the BLAS switch in this process
/// (always 0 without the switch). Proves that MLX's f32 matmuls reach the selected BLAS.
pub fn blas_sgemm_calls() -> u64 {
    ffi::blas_sgemm_calls()
}

/// How many of the [`blas_sgemm_calls`] had `M = 1` or `N = 1` and were answered by one
/// `cblas_sgemv` of the same provider (the matrix-vector rewrite; see
/// [`set_gemv_routing`]). Always 0 without the BLAS switch.
pub fn blas_gemv_calls() -> u64 {
    ffi::blas_gemv_calls()
}

/// Turns the matrix-vector rewrite of the BLAS switch on (the default) or off and returns
/// the previous setting. With it on, an f32 product whose left operand has one row
/// (`[1, K] @ [K, N]`, one token's activations times a weight) or whose right operand has
/// one column goes to `cblas_sgemv` instead of `cblas_sgemm` (OpenBLAS 0.3.21 packs the
/// whole matrix in sgemm for those shapes: 3-4x slower on decode-sized matrices). Results
/// agree to float rounding (different summation order). No effect without the switch.
pub fn set_gemv_routing(on: bool) -> bool {
    crate::settings::apply_process();
    ffi::blas_set_gemv_routing(on)
}

/// A CBLAS provider for MLX's CPU matmuls (Linux wheels only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blas {
    /// `libopenblas.so.0` (Debian: `libopenblas0-pthread`). The default when present.
    OpenBlas,
    /// The netlib reference CBLAS bundled with the wheel (about 5 GFLOP/s).
    Reference,
}

/// Routes MLX's `cblas_sgemm` to `blas` from now on, process-wide (for benchmarks and A/B
/// checks; `MLX_SPEC_BLAS=openblas|reference|/path/lib.so` sets the default, see
/// [`crate::settings`]).
///
/// # Errors
/// [`Error::Invalid`] when the library cannot be loaded or this build has no BLAS switch
/// (macOS, where libmlx uses Accelerate).
pub fn select_blas(blas: Blas) -> Result<()> {
    crate::settings::apply_process();
    let name = match blas {
        Blas::OpenBlas => "openblas",
        Blas::Reference => "reference",
    };
    if !mlx_sys::HAS_BLAS_SWITCH || !ffi::blas_select(name) {
        return Err(Error::Invalid {
            op: "select_blas",
            message: format!("{name} BLAS cannot be loaded in this build/process"),
        });
    }
    Ok(())
}

/// Everything `mlx-spec info` prints.
#[derive(Debug, Clone)]
pub struct RuntimeInfo {
    /// MLX version.
    pub mlx_version: String,
    /// Default device.
    pub device: String,
    /// Backend in use.
    pub backend: Backend,
    /// BLAS in use for f32 matmul on the CPU.
    pub blas: String,
    /// The MLX installation this binary was built against.
    pub mlx_root: &'static str,
}

/// Collects [`RuntimeInfo`].
pub fn info() -> RuntimeInfo {
    RuntimeInfo {
        mlx_version: version(),
        device: default_device(),
        backend: backend(),
        blas: blas_info(),
        mlx_root: mlx_sys::MLX_ROOT,
    }
}
