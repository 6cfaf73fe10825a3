//! The drafter's quantization policy, the load smoke run after writing a quantized drafter,
//! and [`quantize_drafter_dir`], which applies both on top of the generic quantizer
//! ([`quantize::quantize_model_dir`]) (mlx-bun `quantize-drafter.ts`).
//!
//! Policy: every shape-eligible module is quantized except `confidence_head.*`, which is
//! threshold-sensitive (truncation compares its sigmoid) and tiny. Quantized
//! `embed_tokens` and `markov_head.markov_w1` are gather tables: [`crate::Drafter`] gathers
//! their rows, then dequantizes.
use std::path::Path;

use mlx_core::Array;
use models::LoadOptions;
use quantize::{Progress, QuantizeOptions, QuantizeResult, quantize_to_staging};

use crate::{Drafter, DrafterConfig, Error, Result};

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
/// Every load error of [`Drafter::load`]; [`Error::Unsupported`] naming `dir` when the
/// projection has another shape.
pub fn load_smoke(dir: &Path) -> Result<LoadSmoke> {
    let d = Drafter::load(dir, &LoadOptions::default())?;
    let width = d.config().feature_width() as i32;
    let c = d.project_context(&Array::zeros(&[1, 1, width], d.dtype())?)?;
    c.eval()?;
    let want = vec![1, 1, d.hidden_size() as i32];
    if c.shape() != want {
        return Err(Error::Unsupported {
            path: dir.into(),
            message: format!("load smoke: the context projection has shape {:?}, expected {want:?}", c.shape()),
        });
    }
    Ok(LoadSmoke { projection_shape: want, quantized_modules: d.quantized_modules().to_vec() })
}

/// Bits [`quantize_drafter_dir`] accepts.
pub const DRAFTER_BITS: [i32; 2] = [4, 8];
/// Group sizes [`quantize_drafter_dir`] accepts.
pub const DRAFTER_GROUP_SIZES: [i32; 2] = [32, 64];

/// What [`quantize_drafter_dir`] wrote.
#[derive(Debug, Clone)]
pub struct QuantizeDrafterResult {
    /// The generic quantizer's report (modules, bits per weight, files, seconds).
    pub quantize: QuantizeResult,
    /// The load smoke of the written directory.
    pub smoke: LoadSmoke,
}

/// Quantizes a DeepSpec drafter checkpoint `src` into `dst` with the drafter policy: every
/// shape-eligible tensor is quantized (`bits` 4 or 8, `group_size` 32 or 64, affine) except
/// `confidence_head.*`, which stays dense and is recorded as `"<base>": false` in
/// `quantization`. The result is written to a staging directory beside `dst`, reloaded and
/// smoke-tested there ([`load_smoke`]: one quantized context projection of a zero row must
/// give `[1, 1, hidden]`), and only then renamed to `dst` (an existing `dst` is replaced when
/// `force`, refused otherwise). `progress` receives the quantizer's events.
///
/// # Errors
/// [`Error::Invalid`] for other bits / group sizes or a source that is already quantized;
/// [`Error::Unsupported`] for a checkpoint that is not a DeepSpec drafter (the message points
/// to `mlx-spec quantize`); the load errors of [`load_smoke`] on the source (its config and
/// weights disagree: named in `src`) and on the output (named in `dst`); [`Error::Quantize`]
/// for the quantizer's own failures: a `dst` that exists without `force`, that is not a model
/// directory, or that is, holds or lies inside `src` (with `force` or not), unreadable
/// tensors, an unwritable destination. On any error nothing is left at `dst` and no staging
/// directory remains.
pub fn quantize_drafter_dir(
    src: &Path,
    dst: &Path,
    bits: i32,
    group_size: i32,
    force: bool,
    progress: &mut dyn FnMut(Progress),
) -> Result<QuantizeDrafterResult> {
    if !DRAFTER_BITS.contains(&bits) || !DRAFTER_GROUP_SIZES.contains(&group_size) {
        return Err(Error::Invalid(format!(
            "drafters are quantized with bits {DRAFTER_BITS:?} and group size {DRAFTER_GROUP_SIZES:?}; got bits \
             {bits}, group size {group_size}"
        )));
    }
    let config = DrafterConfig::from_dir(src).map_err(|e| match e {
        Error::Unsupported { path, message } => Error::Unsupported {
            path,
            message: format!("{message}; this is not a DeepSpec drafter: quantize models with `mlx-spec quantize`"),
        },
        other => other,
    })?;
    if config.raw.quantization.is_some() || config.raw.quantization_config.is_some() {
        return Err(Error::Invalid(format!(
            "{}: the drafter is already quantized; quantize-drafter starts from the bf16 checkpoint",
            src.display()
        )));
    }
    // A source whose config and weights disagree is refused naming the source, before any
    // work (the same check on the output would name the output). The destination is checked
    // by the quantizer (`quantize::quantize_to_staging`), before it writes anything.
    load_smoke(src)?;
    let options = QuantizeOptions {
        bits,
        group_size,
        predicate: Some(Box::new(|base: &str, _shape: &[usize]| quantize_predicate(base))),
        allow_quantized_source: false,
        force,
        ..QuantizeOptions::default()
    };
    // Written and smoke-tested in the staging directory; renamed to `dst` only when both pass.
    let (staged, quantize) = quantize_to_staging(src, dst, &options, progress)?;
    let smoke = load_smoke(staged.path()).map_err(|e| e.with_paths(&|p| staged.shown(p)))?;
    staged.commit(force).map_err(|e| Error::Invalid(format!("cannot move the quantized drafter into place: {e}")))?;
    progress(Progress::Done { out_dir: dst.into(), seconds: quantize.seconds });
    Ok(QuantizeDrafterResult { quantize, smoke })
}
