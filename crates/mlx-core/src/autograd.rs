//! Reverse-mode automatic differentiation over Rust closures: MLX's `vjp` (and
//! `value_and_grad` built on it), as `mlx.core.vjp` / `mlx.core.value_and_grad` in Python.
//!
//! The closure is called once, with traced copies of the primals, and builds its graph from
//! ordinary [`Array`] ops; arrays it captures (data, frozen weights) are constants. Every MLX
//! op has a gradient rule; the CPU kernels of this project's [`KernelPolicy`] do not, so a
//! function to differentiate is built with [`KernelPolicy::mlx`] layers.
//!
//! ```
//! use mlx_core::{Array, autograd};
//! # fn main() -> mlx_core::Result<()> {
//! let w = Array::from_slice(&[1f32, -2., 3.], &[3])?;
//! // loss(w) = sum(w^2) has the gradient 2 w.
//! let (loss, grads) = autograd::value_and_grad(|p| p[0].square()?.sum(&[], false), &[w])?;
//! assert_eq!(loss.item()?, 14.0);
//! assert_eq!(grads[0].to_vec::<f32>()?, vec![2., -4., 6.]);
//! # Ok(())
//! # }
//! ```
//!
//! [`KernelPolicy`]: crate::KernelPolicy
//! [`KernelPolicy::mlx`]: crate::KernelPolicy::mlx
use mlx_sys::ffi;

use crate::array::{list, wrap};
use crate::{Array, Dtype, Error, Result};

/// The outputs of `f` at `primals` and, for each primal, the vector-Jacobian product
/// `Σ_o cotangent_o · ∂f_o/∂primal` (the gradient, shaped and typed like the primal).
///
/// `cotangents` holds one array per output of `f`, each of that output's shape. `f` may fail
/// with any error type that an mlx-core [`Error`] converts into (a model crate's own).
///
/// # Errors
/// The first error `f` returns, unchanged; [`Error::Invalid`] when `f` panics; [`Error::Mlx`]
/// (op `vjp`) when MLX rejects the call (a cotangent count or shape that does not match the
/// outputs, an op without a gradient rule such as this project's CPU kernels).
pub fn vjp<F, E>(mut f: F, primals: &[Array], cotangents: &[Array]) -> std::result::Result<(Vec<Array>, Vec<Array>), E>
where
    F: FnMut(&[Array]) -> std::result::Result<Vec<Array>, E>,
    E: From<Error> + std::fmt::Display,
{
    let mut failure: Option<E> = None;
    let mut call = |inputs: &ffi::ArrayList| -> std::result::Result<cxx::UniquePtr<ffi::ArrayList>, String> {
        let mut run = || -> std::result::Result<cxx::UniquePtr<ffi::ArrayList>, E> {
            let inputs = from_list("vjp", inputs)?;
            Ok(list(&f(&inputs)?))
        };
        run().map_err(|e| {
            let message = e.to_string();
            failure.get_or_insert(e);
            message
        })
    };
    let out = mlx_sys::vjp(&mut call, &list(primals), &list(cotangents));
    match (out, failure) {
        (Ok(out), _) => Ok((from_list("vjp", &out.outputs)?, from_list("vjp", &out.grads)?)),
        (Err(_), Some(e)) => Err(e),
        (Err(e), None) if e.what().contains(mlx_sys::VJP_PANICKED) => {
            Err(Error::Invalid { op: "vjp", message: e.what().to_string() }.into())
        }
        (Err(e), None) => Err(Error::mlx("vjp", e).into()),
    }
}

/// The value of a scalar function `f` at `params` and its gradient with respect to each of
/// them (`mx.value_and_grad`): [`vjp`] with the cotangent 1. The value comes back as f32
/// (a bf16 loss is cast; its gradients flow through the cast unchanged).
///
/// # Errors
/// [`Error::Invalid`] when `f` returns a non-scalar (the shape is named); otherwise as
/// [`vjp`].
pub fn value_and_grad<F, E>(mut f: F, params: &[Array]) -> std::result::Result<(Array, Vec<Array>), E>
where
    F: FnMut(&[Array]) -> std::result::Result<Array, E>,
    E: From<Error> + std::fmt::Display,
{
    let scalar = |p: &[Array]| -> std::result::Result<Vec<Array>, E> {
        let value = f(p)?;
        if value.ndim() != 0 {
            return Err(Error::Invalid {
                op: "value_and_grad",
                message: format!("the function must return a scalar, it returned shape {:?}", value.shape()),
            }
            .into());
        }
        Ok(vec![value.astype(Dtype::Float32)?])
    };
    let (mut outputs, grads) = vjp(scalar, params, &[Array::scalar(1.0)])?;
    Ok((outputs.remove(0), grads))
}

fn from_list(op: &'static str, l: &ffi::ArrayList) -> Result<Vec<Array>> {
    (0..ffi::list_len(l)).map(|i| wrap(op, ffi::list_get(l, i))).collect()
}
