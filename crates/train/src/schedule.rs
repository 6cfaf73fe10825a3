//! The learning rate per optimizer step: linear warm-up, then cosine decay.
use crate::{Error, Result};

/// Linear warm-up over `warmup_steps` steps, then cosine decay from `base_lr` to `eta_min`
/// over the remaining `total_steps - warmup_steps` (Loshchilov & Hutter 2017, SGDR without
/// restarts), as DeepSpec's `CosineAnnealingWarmupLR` (`deepspec/utils/optim.py`), with
/// steps counted from 0:
///
/// - step `s < w`: `base_lr * (s + 1) / w`;
/// - step `s >= w`: `eta_min + (base_lr - eta_min) * (1 + cos(pi * (s - w) / (T - w))) / 2`.
///
/// This is the closed form of the schedule. DeepSpec's runs PyTorch's recursive
/// (`chainable`) form, which with torch 2.9 starts the cosine phase from the ratio of its second
/// step: it multiplies the whole phase by `2 / (1 + cos(pi / (T - w)))`, about
/// `1 + pi^2 / (4 (T - w)^2)` (2.5e-6 relative at 1,000 decay steps; 4% at 8, which
/// `fixtures/train/make_optim_golden.py` records and `crates/train/tests/optim.rs` checks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupCosine {
    base_lr: f64,
    total_steps: u64,
    warmup_steps: u64,
    eta_min: f64,
}

impl WarmupCosine {
    /// The schedule; DeepSpec's defaults are `base_lr` 6e-4, `warmup_steps` 4% of
    /// `total_steps`, `eta_min` 0.
    ///
    /// # Errors
    /// [`Error::Config`] when `base_lr` is not finite and positive, `eta_min` is negative or
    /// above `base_lr`, `total_steps` is 0, or `warmup_steps > total_steps`.
    pub fn new(base_lr: f64, total_steps: u64, warmup_steps: u64, eta_min: f64) -> Result<Self> {
        let bad = |setting, message: String| Err(Error::Config { setting, message });
        if !(base_lr.is_finite() && base_lr > 0.0) {
            return bad("lr", format!("expected a positive learning rate, found {base_lr}"));
        }
        if !(eta_min >= 0.0 && eta_min <= base_lr) {
            return bad("eta_min", format!("expected 0 <= eta_min <= lr ({base_lr}), found {eta_min}"));
        }
        if total_steps == 0 {
            return bad("total_steps", "expected at least one step".into());
        }
        if warmup_steps > total_steps {
            return bad("warmup_steps", format!("{warmup_steps} exceeds total_steps {total_steps}"));
        }
        Ok(Self { base_lr, total_steps, warmup_steps, eta_min })
    }

    /// The learning rate of step `step` (0-based); steps past `total_steps` stay at `eta_min`.
    pub fn lr(&self, step: u64) -> f64 {
        let (w, t) = (self.warmup_steps, self.total_steps);
        if step < w {
            return self.base_lr * (step + 1) as f64 / w as f64;
        }
        let decay = (t - w).max(1) as f64;
        let progress = ((step - w) as f64 / decay).min(1.0);
        self.eta_min + (self.base_lr - self.eta_min) * (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0
    }

    /// The number of optimizer steps the schedule spans.
    pub fn total_steps(&self) -> u64 {
        self.total_steps
    }
}
