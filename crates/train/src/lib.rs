//! Training on MLX, for drafters: the optimizer, its learning-rate schedule, gradient
//! clipping and resumable optimizer state, as DeepSpec trains DSpark drafters
//! (`deepspec/utils/optim.py`'s `BF16Optimizer`, FSDP's `clip_grad_norm_`).
//!
//! - [`AdamW`] (Loshchilov & Hutter 2019; the update of `torch.optim.AdamW`) keeps f32 master
//!   weights and moments and hands back parameters in the model's dtype (bf16 for a DeepSpec
//!   drafter), so low-precision weights never accumulate rounding across steps.
//! - [`WarmupCosine`] is the learning rate per step: linear warm-up, then cosine decay.
//! - [`clip_grad_norm`] scales all gradients together to a maximum global L2 norm.
//! - [`AdamW::save`] / [`AdamW::load`] write and read the whole optimizer state (master
//!   weights, moments, step, hyper-parameters) as one safetensors file, atomically.
//! - [`DSparkLoss`]: DeepSpec's objective on [`drafter::Drafter::training_forward`]'s outputs.
//! - [`distill`]: the target's answers to a prompt set and its hidden states on them;
//!   [`init`]: a drafter's shape, initial weights and DeepSpec-format checkpoints for a
//!   target; [`run`]: a resumable training run; [`calibrate`]: Sequential Temperature Scaling
//!   of the confidence head; [`plot`]: the loss curve. `mlx-spec train-drafter` strings them
//!   together.
//!
//! Gradients come from [`mlx_core::autograd`]. A training step:
//!
//! ```
//! use mlx_core::{Array, autograd};
//! use train::{AdamW, AdamWConfig, WarmupCosine, clip_grad_norm};
//! # fn main() -> Result<(), train::Error> {
//! let names = vec!["w".to_string()];
//! let mut params = vec![Array::from_slice(&[3f32, -2.], &[2])?];
//! let mut opt = AdamW::new(AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() }, &names, &params)?;
//! let schedule = WarmupCosine::new(0.1, 100, 4, 0.0)?;
//! for step in 0..100 {
//!     // loss(w) = sum(w^2), minimised at 0
//!     let (_loss, grads) = autograd::value_and_grad(|p| p[0].square()?.sum(&[], false), &params)?;
//!     let (grads, _norm) = clip_grad_norm(&grads, 1.0)?;
//!     params = opt.step(&grads, schedule.lr(step))?;
//! }
//! assert!(params[0].abs()?.max(&[], false)?.item()? < 0.5);
//! # Ok(())
//! # }
//! ```
pub mod calibrate;
pub mod distill;
pub mod dspark;
mod error;
pub mod init;
mod optim;
pub mod plot;
pub mod run;
mod schedule;

pub use dspark::{DSparkLoss, LossTerms};
pub use error::{Error, Result};
pub use optim::{AdamW, AdamWConfig, clip_grad_norm};
pub use schedule::WarmupCosine;
