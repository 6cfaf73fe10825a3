//! The DSpark training objective (DSpark paper Eqs. 9-12; DeepSpec
//! `deepspec/modeling/dspark/loss.py: compute_dspark_loss`), on the outputs of
//! [`drafter::Drafter::training_forward`].
//!
//! With `p_d = softmax(z)` the draft distribution, `p_t` the target's, `w_{b,k} =
//! eval_mask_{b,k} exp(-k / gamma)` the position weights and `W = sum w + 1e-6`:
//!
//! ```text
//! CE   = sum w * (-log p_d[label]) / W
//! TV   = sum w * ||p_d - p_t||_1 / W                 (the "l1" term: twice the total variation)
//! c*   = clamp(1 - ||p_d - p_t||_1 / 2, 0, 1)        acceptance probability of the draft (no gradient)
//! BCE  = sum w * bce_with_logits(confidence, c*) / W
//! loss = 0.1 CE + 0.9 TV + 1.0 BCE                   (the released configs' alphas)
//! ```
use drafter::training::TrainingOutputs;
use mlx_core::{Array, Dtype};

use crate::Result;

/// The weights of the DSpark objective (DeepSpec's config names; defaults are those of every
/// released DSpark config, `config/dspark/*.py`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DSparkLoss {
    /// Weight of the cross entropy against the data's next tokens (`ce_loss_alpha`, 0.1).
    pub ce_alpha: f32,
    /// Weight of the L1 distance to the target's distribution (`l1_loss_alpha`, 0.9).
    pub l1_alpha: f32,
    /// Weight of the confidence head's binary cross entropy (`confidence_head_alpha`, 1.0).
    pub confidence_alpha: f32,
    /// Position decay `gamma` of the weights `exp(-k / gamma)` (`loss_decay_gamma`, 4.0);
    /// `None` weighs every position 1.
    pub decay_gamma: Option<f32>,
}

impl Default for DSparkLoss {
    fn default() -> Self {
        Self { ce_alpha: 0.1, l1_alpha: 0.9, confidence_alpha: 1.0, decay_gamma: Some(4.0) }
    }
}

/// The objective and its terms for one forward (f32 scalars; `total` carries the gradient).
pub struct LossTerms {
    /// `ce_alpha CE + l1_alpha TV + confidence_alpha BCE`.
    pub total: Array,
    /// The weighted cross entropy.
    pub ce: Array,
    /// The weighted L1 distance `||p_d - p_t||_1`.
    pub l1: Array,
    /// The weighted confidence BCE (0 without a confidence head).
    pub confidence: Array,
    /// Expected acceptance length per block under the target's distribution, bonus included:
    /// `mean_b (1 + sum_k prod_{i<=k} c*_{b,i})` over the blocks with a trained slot
    /// (DeepSpec's `tau_probabilistic` metric; no gradient).
    pub expected_tau: Array,
    /// Per position `k`, the mean `c*` of the trained slots: DeepSpec's `accept_rate@k`
    /// (`[B]`, no gradient).
    pub accept_rate: Array,
}

impl DSparkLoss {
    /// The objective of `out`.
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] when an op fails (shapes are those `training_forward` makes).
    pub fn terms(&self, out: &TrainingOutputs) -> Result<LossTerms> {
        let s = |v: f32| Array::scalar(v);
        let mask = &out.eval_mask; // [N, B]
        let b = mask.shape()[1];
        let weights = match self.decay_gamma {
            Some(g) if g > 0.0 => {
                let k = Array::arange(0.0, f64::from(b), 1.0, Dtype::Float32)?;
                mask.multiply(&k.divide(&s(-g))?.exp()?.expand_dims(&[0])?)?
            }
            _ => mask.clone(),
        };
        let den = weights.sum(&[], false)?.add(&s(1e-6))?;
        let weighted = |t: &Array| -> Result<Array> { Ok(t.multiply(&weights)?.sum(&[], false)?.divide(&den)?) };

        let z = out.draft_logits.astype(Dtype::Float32)?;
        let log_z = z.logsumexp(&[-1], true)?;
        let picked = z.take_along_axis(&out.target_ids.expand_dims(&[-1])?, -1)?;
        let ce = log_z.subtract(&picked)?.squeeze(&[-1])?; // [N, B]
        let p_d = z.subtract(&log_z)?.exp()?;
        let p_t = out.target_logits.astype(Dtype::Float32)?.softmax(&[-1], true)?;
        let l1 = p_d.subtract(&p_t)?.abs()?.sum(&[-1], false)?; // [N, B]
        let c_star = s(1.0).subtract(&l1.multiply(&s(0.5))?)?.clip(Some(&s(0.0)), Some(&s(1.0)))?.stop_gradient()?;

        let confidence = match &out.confidence_logits {
            Some(x) => {
                // bce_with_logits(x, c) = max(x, 0) - x c + log(1 + e^-|x|)
                let bce =
                    x.maximum(&s(0.0))?.subtract(&x.multiply(&c_star)?)?.add(&x.abs()?.negative()?.exp()?.log1p()?)?;
                weighted(&bce)?
            }
            None => s(0.0),
        };
        let (ce, l1w) = (weighted(&ce)?, weighted(&l1)?);
        let total = ce
            .multiply(&s(self.ce_alpha))?
            .add(&l1w.multiply(&s(self.l1_alpha))?)?
            .add(&confidence.multiply(&s(self.confidence_alpha))?)?;

        let accepted = c_star.multiply(mask)?; // [N, B]
        let live = mask.max(&[-1], false)?; // blocks with a trained slot
        let tau = accepted.cumprod(-1, false, true)?.sum(&[-1], false)?.add(&s(1.0))?;
        let expected_tau = tau.multiply(&live)?.sum(&[], false)?.divide(&live.sum(&[], false)?.maximum(&s(1.0))?)?;
        let accept_rate = accepted.sum(&[0], false)?.divide(&mask.sum(&[0], false)?.maximum(&s(1.0))?)?;
        Ok(LossTerms { total, ce, l1: l1w, confidence, expected_tau, accept_rate })
    }
}
