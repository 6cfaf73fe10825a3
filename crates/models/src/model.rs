//! Loading a model directory (mlx-lm layout) into a [`Transformer`].
use std::path::Path;

use mlx_core::{Dtype, KernelPolicy};

use crate::Result;
use crate::config::{ModelConfig, QuantizationConfig, config_path};
use crate::layers::LoadContext;
use crate::loader::Loader;
use crate::transformer::Transformer;
use crate::weights::Weights;

/// Options for [`load_model`].
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Compute dtype for dense weights, norms and quantization scales (`None` = as stored,
    /// which is what mlx-lm does; `Some(Float32)` is the fast choice on the CPU backend).
    pub dtype: Option<Dtype>,
    /// The CPU kernels the model runs on ([`KernelPolicy::default`]: as the environment
    /// says, see `mlx_core::settings`). The loaded model keeps it: another model in the
    /// process may use other kernels.
    pub kernels: KernelPolicy,
}

/// Loads `dir` (`config.json` + safetensors weights, dense or quantized per the config's
/// `quantization` block).
///
/// # Errors
/// [`crate::Error::Io`]/[`crate::Error::Json`] for an unreadable config,
/// [`crate::Error::Unsupported`] for an unknown `model_type`, [`crate::Error::Weight`] for a
/// missing or misshapen tensor, [`crate::Error::Unused`] naming the tensors the model does not
/// use and its family does not list in [`crate::Family::ignored_tensors`] (mlx-lm's strict
/// load).
pub fn load_model(dir: &Path, options: &LoadOptions) -> Result<Transformer> {
    let config = ModelConfig::from_dir(dir)?;
    let quant = QuantizationConfig::from_config(&config, &config_path(dir))?;
    let mut weights = Weights::load(dir)?;
    let ctx = LoadContext { quant, dtype: options.dtype, kernels: options.kernels.clone() };
    let mut loader = Loader::new(&mut weights, &ctx);
    let model = Transformer::build(config, &mut loader)?;
    loader.finish(model.family.ignored_tensors())?;
    Ok(model)
}
