//! Safe Rust over MLX: the array type, its ops and fast kernels, affine quantization,
//! random numbers with explicit keys, and safetensors/GGUF IO, for the models, quantizer
//! and speculative decoder built on top of it.
//!
//! # Model of use
//! - [`Array`] is an RAII handle to a lazy `mlx::core::array`: ops build a graph, [`eval`]
//!   (or reading data) computes it, `Drop` releases it, `Clone` shares it.
//! - Every fallible call returns [`Result`] with a typed [`Error`] that names the operation
//!   or file; an MLX C++ exception never aborts the process.
//! - **One MLX thread.** `Array` is `!Send`/`!Sync` because MLX 0.32 has per-thread default
//!   streams: build and evaluate every graph on the thread that owns the weights and caches,
//!   and talk to other threads with plain data.
//! - On the Linux CPU backend f32 is the fast dtype, and f32 matmuls go to OpenBLAS when it
//!   is installed ([`blas_info`]); matrix-vector shapes go to its sgemv
//!   ([`set_gemv_routing`]), 4/8-bit quantized matmuls have a fast kernel
//!   ([`cpu_quant`]), attention over short query windows is one fused node
//!   ([`cpu_attention`]), and so are RMS norm and RoPE ([`cpu_fast`]). Which of these
//!   kernels a model uses is a [`KernelPolicy`] value it carries; the environment only seeds
//!   the default ([`settings`]).
//!
//! ```
//! use mlx_core::{Array, Dtype, fast, quant::{self, QuantSpec}};
//! # fn main() -> mlx_core::Result<()> {
//! let a = Array::from_slice(&[1f32, 2., 3., 4.], &[2, 2])?;
//! let b = a.matmul(&a.t()?)?;
//! assert_eq!(b.to_vec::<f32>()?, vec![5., 11., 11., 25.]);
//!
//! let w = Array::from_slice(&vec![0.5f32; 64 * 128], &[64, 128])?; // [N, K]
//! let x = Array::ones(&[1, 128], Dtype::Float32)?; // [1, K]
//! let q = quant::quantize(&w, QuantSpec::new(64, 4)?)?; // as mlx.core.quantize
//! let y = fast::rms_norm(&q.matmul_t(&x)?, None, 1e-5, &mlx_core::KernelPolicy::default())?; // [1, N]
//! assert_eq!(y.shape(), vec![1, 64]);
//! # Ok(())
//! # }
//! ```

mod array;
pub mod autograd;
pub mod cpu_attention;
pub mod cpu_fast;
pub mod cpu_layer;
pub mod cpu_quant;
mod dtype;
mod error;
pub mod fast;
pub mod io;
mod ops;
pub mod quant;
pub mod random;
mod runtime;
pub mod settings;

pub use array::Array;
pub use dtype::{Dtype, Element};
pub use error::{Error, Result};
pub use half::{bf16, f16};
pub use ops::{concatenate, stack};
pub use runtime::{
    Backend, Blas, RuntimeInfo, async_eval, backend, blas_gemv_calls, blas_info, blas_sgemm_calls, default_device,
    eval, info, memory, select_blas, set_gemv_routing, version,
};
pub use settings::{KernelPolicy, LayerNodes, Precision, Projection, Settings};
