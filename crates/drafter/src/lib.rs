//! DeepSpec DSpark drafters on MLX: loads `Qwen3DSparkModel` and `Gemma4DSparkModel`
//! checkpoints (DFlash ones too: `markov_rank` 0, no confidence head), bf16 or
//! affine-quantized in the mlx-lm layout, and runs their draft call: the context projection
//! of the target's tapped hidden states, the parallel block `[anchor, mask x (B-1)]` over the
//! cached context, the sequential Markov head and the confidence head
//! (`deepspec-port-spec.md`; DeepSpec `deepspec/modeling/dspark/`).
//!
//! - [`Drafter`]: weights and the forward pieces ([`Drafter::project_context`],
//!   [`Drafter::ingest`], [`Drafter::forward_block`], [`Drafter::propose`]);
//!   [`Drafter::check_target`] refuses a target it was not trained for.
//! - [`DraftContext`]: one request's context K/V, grown by exactly the committed rows.
//! - [`quant`]: the drafter quantization policy (the confidence head stays dense) and the
//!   load smoke a quantizer runs on its output.
//!
//! ```no_run
//! use drafter::Drafter;
//! use mlx_core::{Array, Dtype};
//! use models::LoadOptions;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let options = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };
//! let d = Drafter::load("drafter-dir".as_ref(), &options)?;
//! let width = d.config().feature_width() as i32;
//! let c = d.project_context(&Array::zeros(&[1, 1, width], Dtype::Float32)?)?;
//! assert_eq!(c.shape(), vec![1, 1, d.hidden_size() as i32]);
//! let mut ctx = d.new_context();
//! d.ingest(&mut ctx, &Array::zeros(&[1, 5, width], Dtype::Float32)?)?; // taps of positions 0..5
//! let p = d.propose(&mut ctx, 42, 0.0)?; // anchor 42 at position 5
//! println!("{:?}", p.drafts);
//! # Ok(())
//! # }
//! ```

pub mod config;
mod error;
mod model;
pub mod quant;
pub mod training;
mod walk;

pub use config::{Architecture, DrafterConfig};
pub use error::{Error, Result};
pub use model::{BlockOutput, DraftContext, Drafter, Proposal};
