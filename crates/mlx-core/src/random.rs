//! Random numbers with explicit keys (`mlx.core.random`, threefry-based counter PRNG).
//!
//! A [`Key`] fully determines the numbers drawn with it, so a seeded request is
//! reproducible: derive one key per step with [`Key::split`] instead of reusing a key.
use mlx_sys::ffi;

use crate::array::wrap;
use crate::{Array, Dtype, Result};

/// A PRNG key: a uint32 array `[2]` (MLX's threefry key).
#[derive(Debug, Clone)]
pub struct Key(Array);

impl Key {
    /// The key for `seed` (`mlx.core.random.key(seed)`).
    pub fn new(seed: u64) -> Key {
        Key(wrap("random::key", ffi::random_key(seed)).expect("random::key cannot fail"))
    }

    /// The key as an array (uint32 `[2]`).
    pub fn as_array(&self) -> &Array {
        &self.0
    }

    /// `num` independent keys derived from this one (`mlx.core.random.split`).
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] when `num` is not positive.
    pub fn split(&self, num: i32) -> Result<Vec<Key>> {
        if num <= 0 {
            return Err(crate::Error::Invalid {
                op: "random::split",
                message: format!("num must be positive, got {num}"),
            });
        }
        let keys = wrap("random::split", ffi::random_split(self.0.raw(), num))?;
        (0..num).map(|i| Ok(Key(keys.slice_axis(0, i, i + 1)?.squeeze(&[0])?))).collect()
    }
}

/// Uniform samples in `[low, high)` of `shape` and float `dtype`.
///
/// # Errors
/// [`crate::Error::Mlx`] for a non-float dtype.
pub fn uniform(low: f32, high: f32, shape: &[i32], dtype: Dtype, key: &Key) -> Result<Array> {
    let (lo, hi) = (Array::scalar(low), Array::scalar(high));
    wrap("random::uniform", ffi::random_uniform(lo.raw(), hi.raw(), shape, dtype.to_ffi(), key.0.raw()))
}

/// Normal samples with mean `loc` and standard deviation `scale`.
///
/// # Errors
/// [`crate::Error::Mlx`] for a non-float dtype.
pub fn normal(shape: &[i32], dtype: Dtype, loc: f32, scale: f32, key: &Key) -> Result<Array> {
    wrap("random::normal", ffi::random_normal(shape, dtype.to_ffi(), loc, scale, key.0.raw()))
}

/// Samples one index per row from the categorical distribution `softmax(logits)` along
/// `axis` (unnormalized log-probabilities; the Gumbel-max trick, as mlx-lm samples).
/// Output: uint32, `logits`' shape without `axis`.
///
/// # Errors
/// [`crate::Error::Mlx`] for an out-of-range axis.
pub fn categorical(logits: &Array, axis: i32, key: &Key) -> Result<Array> {
    wrap("random::categorical", ffi::random_categorical(logits.raw(), axis, key.0.raw()))
}
