//! Calibration of the confidence head: Sequential Temperature Scaling (DSpark paper §3.2.1;
//! not in DeepSpec's repository; `deepspec-port-spec.md` §4.2) and the expected calibration
//! error it is judged by.
//!
//! The draft-length policy multiplies per-position confidences into the probability that a
//! whole prefix is accepted, so what must be calibrated is the cumulative product. For `k = 1
//! .. γ` in order, STS picks the temperature `T_k` (from a grid) that minimises the ECE of
//! `prod_{i<=k} sigmoid(l_i / T_i)` against "the first `k` drafts were all accepted", holding
//! `T_1 .. T_{k-1}` fixed. Temperature scaling keeps each position's order of confidences.
use drafter::training::TrainingOutputs;
use mlx_core::Dtype;

use crate::Result;

/// Held-out confidence data: per block, the confidence logits of its trained slots and
/// whether each slot's greedy draft (the argmax of its corrected logits, teacher-forced on
/// the target's own tokens) equals the target's token.
#[derive(Debug, Clone, Default)]
pub struct ConfidenceData {
    /// Per block, the logits of its slots `0 .. len` (`len` = the block's trained prefix).
    pub logits: Vec<Vec<f32>>,
    /// Per block, whether slot `k`'s draft is the target's token.
    pub accepted: Vec<Vec<bool>>,
}

impl ConfidenceData {
    /// Adds the blocks of one teacher-forced forward (all blocks of a sequence, as
    /// [`crate::run::Run::evaluate`] runs it): each block's confidence logits over its trained
    /// prefix, and whether each slot's greedy draft is the label.
    ///
    /// # Errors
    /// [`crate::Error::Config`] for a drafter without confidence head; MLX failures.
    pub fn add(&mut self, o: &TrainingOutputs) -> Result<()> {
        let Some(conf) = &o.confidence_logits else {
            let message = "the drafter has no confidence head".to_string();
            return Err(crate::Error::Config { setting: "confidence head", message });
        };
        let (blocks, b) = (o.eval_mask.shape()[0] as usize, o.eval_mask.shape()[1] as usize);
        let drafts = o.draft_logits.argmax(-1, false)?.astype(Dtype::Int32)?.to_vec::<i32>()?;
        let labels = o.target_ids.to_vec::<i32>()?;
        let live = o.eval_mask.to_vec::<f32>()?;
        let logits = conf.to_vec::<f32>()?;
        for blk in 0..blocks {
            let r = blk * b..(blk + 1) * b;
            let len = live[r.clone()].iter().take_while(|&&m| m > 0.5).count();
            if len == 0 {
                continue;
            }
            self.logits.push(logits[r.start..r.start + len].to_vec());
            self.accepted.push((r.start..r.start + len).map(|i| drafts[i] == labels[i]).collect());
        }
        Ok(())
    }

    /// Greedy acceptance length per block, bonus included: `1 +` the number of leading slots
    /// whose draft is the target's token, averaged over blocks. Teacher-forced on the target's
    /// own greedy tokens, this is the tau of greedy speculative decoding with blocks of the
    /// full size anchored at every position (real rounds anchor where the last one ended).
    pub fn greedy_tau(&self) -> f64 {
        let n = self.accepted.len().max(1) as f64;
        self.accepted.iter().map(|a| 1.0 + a.iter().take_while(|&&x| x).count() as f64).sum::<f64>() / n
    }

    /// Per position `k`, the fraction of blocks reaching `k` whose prefix through `k` is
    /// accepted (DeepSpec's `accept_rate@k` measured on greedy drafts).
    pub fn prefix_acceptance(&self, positions: usize) -> Vec<f64> {
        (0..positions)
            .map(|k| {
                let reach: Vec<&Vec<bool>> = self.accepted.iter().filter(|a| a.len() > k).collect();
                reach.iter().filter(|a| a[..=k].iter().all(|&x| x)).count() as f64 / reach.len().max(1) as f64
            })
            .collect()
    }

    /// The blocks with index `i % 2 == parity` (a split into two halves).
    pub fn half(&self, parity: usize) -> Self {
        fn pick<T: Clone>(v: &[Vec<T>], parity: usize) -> Vec<Vec<T>> {
            v.iter().enumerate().filter(|(i, _)| i % 2 == parity).map(|(_, x)| x.clone()).collect()
        }
        ConfidenceData { logits: pick(&self.logits, parity), accepted: pick(&self.accepted, parity) }
    }

    /// Per position `k`, the pairs (cumulative confidence through `k`, whether the prefix
    /// through `k` was accepted) of the blocks reaching `k`, under `temps` (1.0 past their end).
    fn cumulative(&self, k: usize, temps: &[f64]) -> Vec<(f64, bool)> {
        self.logits
            .iter()
            .zip(&self.accepted)
            .filter(|(l, _)| l.len() > k)
            .map(|(l, a)| {
                let p = (0..=k).map(|i| sigmoid(f64::from(l[i]) / temps.get(i).copied().unwrap_or(1.0))).product();
                (p, a[..=k].iter().all(|&x| x))
            })
            .collect()
    }

    /// Expected calibration error (20 equal-width bins) of the cumulative confidence at each
    /// position under `temps`, and pooled over all positions.
    pub fn ece(&self, temps: &[f64], positions: usize) -> (Vec<f64>, f64) {
        let per: Vec<Vec<(f64, bool)>> = (0..positions).map(|k| self.cumulative(k, temps)).collect();
        let pooled: Vec<(f64, bool)> = per.iter().flatten().copied().collect();
        (per.iter().map(|p| ece(p)).collect(), ece(&pooled))
    }
}

/// Sequential Temperature Scaling over `positions` block positions: `T_k` from a log-spaced
/// grid of 81 values in [1/8, 8], fitted in order on `data`.
pub fn fit_sts(data: &ConfidenceData, positions: usize) -> Vec<f64> {
    let grid: Vec<f64> = (0..=80).map(|i| 2f64.powf(-3.0 + 6.0 * i as f64 / 80.0)).collect();
    let mut temps = vec![1.0; positions];
    for k in 0..positions {
        let mut best = (f64::INFINITY, 1.0);
        for &t in &grid {
            temps[k] = t;
            let e = ece(&data.cumulative(k, &temps));
            if e < best.0 - 1e-12 {
                best = (e, t);
            }
        }
        temps[k] = best.1;
    }
    temps
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// ECE with 20 equal-width bins: `sum_b |B_b| / n * |mean confidence - accuracy|` (0 for no data).
fn ece(pairs: &[(f64, bool)]) -> f64 {
    if pairs.is_empty() {
        return 0.0;
    }
    let mut bins = [(0.0f64, 0.0f64, 0usize); 20];
    for &(p, y) in pairs {
        let b = ((p * 20.0) as usize).min(19);
        bins[b].0 += p;
        bins[b].1 += f64::from(u8::from(y));
        bins[b].2 += 1;
    }
    let n = pairs.len() as f64;
    bins.iter().filter(|b| b.2 > 0).map(|b| (b.0 - b.1).abs() / n).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Confidences that are systematically too high get a temperature that lowers the ECE.
    #[test]
    fn sts_fixes_overconfidence() {
        let mut data = ConfidenceData::default();
        let mut state = 7u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as f64 / (1u64 << 31) as f64
        };
        for _ in 0..4000 {
            let l: Vec<f32> = (0..3).map(|_| (next() * 8.0 - 2.0) as f32).collect();
            // true acceptance probability sigmoid(l / 3): the raw logits are 3x overconfident
            let a: Vec<bool> = l.iter().map(|&x| next() < sigmoid(f64::from(x) / 3.0)).collect();
            data.logits.push(l);
            data.accepted.push(a);
        }
        let (_, before) = data.ece(&[1.0; 3], 3);
        let temps = fit_sts(&data, 3);
        let (_, after) = data.ece(&temps, 3);
        assert!(after < before / 2.0, "ECE {before} -> {after} with {temps:?}");
        assert!(temps[0] > 2.0 && temps[0] < 4.5, "{temps:?}");
    }
}
