//! The drafter's quantization policy and the load smoke a quantizer runs after writing a
//! quantized drafter (mlx-bun `quantize-drafter.ts`; the quantizer itself lives elsewhere).
//!
//! Policy: every shape-eligible module is quantized except `confidence_head.*`, which is
//! threshold-sensitive (truncation compares its sigmoid) and tiny. Quantized
//! `embed_tokens` and `markov_head.markov_w1` are gather tables: [`crate::Drafter`] gathers
//! their rows, then dequantizes.
use std::path::Path;

use mlx_core::Array;
use models::LoadOptions;

use crate::{Drafter, Error, Result};

/// Module bases the policy keeps dense whatever their shape.
pub const KEEP_DENSE_PREFIXES: [&str; 1] = ["confidence_head."];

/// Whether the drafter policy allows quantizing module `base` (e.g. `layers.0.mlp.up_proj`,
/// `markov_head.markov_w1`); shape eligibility is the quantizer's own rule on top.
pub fn quantize_predicate(base: &str) -> bool {
    !KEEP_DENSE_PREFIXES.iter().any(|p| base.starts_with(p))
}

/// What [`load_smoke`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadSmoke {
    /// Shape of the context projection of one zero row: `[1, 1, H]`.
    pub projection_shape: Vec<i32>,
    /// Module bases stored quantized, sorted.
    pub quantized_modules: Vec<String>,
}

/// Reloads the drafter in `dir` with its stored dtypes (quantized detection and layer
/// building included) and runs one context projection (`fc`, quantized or not, then
/// `hidden_norm`) on a zero row `[1, 1, T*H]`, checking the result is `[1, 1, H]`, so a
/// wrong layout fails here and not at serving time.
///
/// # Errors
/// Every load error of [`Drafter::load`]; [`Error::Invalid`] when the projection has
/// another shape.
pub fn load_smoke(dir: &Path) -> Result<LoadSmoke> {
    let d = Drafter::load(dir, &LoadOptions::default())?;
    let width = d.config().feature_width() as i32;
    let c = d.project_context(&Array::zeros(&[1, 1, width], d.dtype())?)?;
    c.eval()?;
    let want = vec![1, 1, d.hidden_size() as i32];
    if c.shape() != want {
        return Err(Error::Invalid(format!(
            "load smoke of {}: the context projection has shape {:?}, expected {want:?}",
            dir.display(),
            c.shape()
        )));
    }
    Ok(LoadSmoke { projection_shape: want, quantized_modules: d.quantized_modules().to_vec() })
}
