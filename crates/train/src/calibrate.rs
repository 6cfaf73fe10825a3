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
    /// Per block, the domain of its sequence (the prompt source before `:`, `"gsm8k"`).
    pub domains: Vec<String>,
    /// Per block, its sequence (the number of the [`ConfidenceData::add`] call) and anchor
    /// position.
    pub anchors: Vec<(usize, usize)>,
    /// Sequences added.
    pub sequences: usize,
}

impl ConfidenceData {
    /// Adds the blocks of one teacher-forced forward (the blocks anchored at `anchors` of a
    /// sequence of prompt source `source`; [`crate::run::Run::evaluate`] anchors at every
    /// candidate): each block's confidence logits over its trained prefix, and whether each
    /// slot's greedy draft is the label.
    ///
    /// # Errors
    /// [`crate::Error::Config`] for a drafter without confidence head, or when `anchors` does
    /// not hold one position per block of `o` (`o.eval_mask` is `[N, B]`); MLX failures.
    pub fn add(&mut self, o: &TrainingOutputs, source: &str, anchors: &[usize]) -> Result<()> {
        let domain = spec::prompts::domain(source);
        let Some(conf) = &o.confidence_logits else {
            let message = "the drafter has no confidence head".to_string();
            return Err(crate::Error::Config { setting: "confidence head", message });
        };
        let (blocks, b) = (o.eval_mask.shape()[0] as usize, o.eval_mask.shape()[1] as usize);
        if anchors.len() != blocks {
            let message = format!("{} anchors for a forward of {blocks} blocks", anchors.len());
            return Err(crate::Error::Config { setting: "anchors", message });
        }
        let drafts = o.draft_logits.argmax(-1, false)?.astype(Dtype::Int32)?.to_vec::<i32>()?;
        let labels = o.target_ids.to_vec::<i32>()?;
        let live = o.eval_mask.to_vec::<f32>()?;
        let logits = conf.to_vec::<f32>()?;
        for (blk, &anchor) in anchors.iter().enumerate() {
            let r = blk * b..(blk + 1) * b;
            let len = live[r.clone()].iter().take_while(|&&m| m > 0.5).count();
            if len == 0 {
                continue;
            }
            self.logits.push(logits[r.start..r.start + len].to_vec());
            self.accepted.push((r.start..r.start + len).map(|i| drafts[i] == labels[i]).collect());
            self.domains.push(domain.to_string());
            self.anchors.push((self.sequences, anchor));
        }
        self.sequences += 1;
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

    /// The tau of greedy speculative decoding itself, replayed on the teacher-forced blocks:
    /// per sequence, the first round anchors at its first anchor and each next one where the
    /// last ended (`p + accepted + 1`), until past its last anchor; emitted tokens over rounds.
    /// The target's greedy tokens are the sequence, and a block anchored at `p` sees the taps
    /// of positions `< p` as a draft call does there (`drafter/training.rs`), so this is what
    /// decoding these prompts measures up to the first round (which anchors at the last prompt
    /// token) and floating-point noise. It is below [`ConfidenceData::greedy_tau`] where
    /// rounds start, after a rejection, at tokens that are harder to draft after. Only
    /// meaningful when every candidate was anchored (as [`crate::run::Run::evaluate`] does).
    pub fn decoding_tau(&self) -> f64 {
        let (emitted, rounds) = self.replay(|_| true);
        emitted as f64 / rounds.max(1) as f64
    }

    /// (emitted tokens, rounds) of [`ConfidenceData::decoding_tau`]'s replay over the blocks
    /// `keep` accepts (by index).
    fn replay(&self, keep: impl Fn(usize) -> bool) -> (usize, usize) {
        let mut by_seq: std::collections::BTreeMap<usize, std::collections::BTreeMap<usize, usize>> =
            Default::default();
        let kept = self.anchors.iter().zip(&self.accepted).enumerate().filter(|(i, _)| keep(*i));
        for (&(seq, p), a) in kept.map(|(_, block)| block) {
            by_seq.entry(seq).or_default().insert(p, a.iter().take_while(|&&x| x).count());
        }
        let (mut emitted, mut rounds) = (0, 0);
        for blocks in by_seq.values() {
            let (Some((&first, _)), Some((&last, _))) = (blocks.first_key_value(), blocks.last_key_value()) else {
                continue;
            };
            let mut p = first;
            while p <= last {
                // an anchor without a block: its first label is outside a reduced draft vocabulary
                let n = blocks.get(&p).copied().unwrap_or(0);
                emitted += n + 1;
                rounds += 1;
                p += n + 1;
            }
        }
        (emitted, rounds)
    }

    /// Per domain: its blocks, [`ConfidenceData::greedy_tau`] and
    /// [`ConfidenceData::decoding_tau`] over them.
    pub fn tau_by_domain(&self) -> std::collections::BTreeMap<String, DomainTau> {
        let mut by: std::collections::BTreeMap<String, DomainTau> = Default::default();
        for (a, d) in self.accepted.iter().zip(&self.domains) {
            let e = by.entry(d.clone()).or_default();
            e.blocks += 1;
            e.greedy_tau += 1.0 + a.iter().take_while(|&&x| x).count() as f64;
        }
        for (d, e) in &mut by {
            e.greedy_tau /= e.blocks as f64;
            let (emitted, rounds) = self.replay(|i| &self.domains[i] == d);
            e.decoding_tau = emitted as f64 / rounds.max(1) as f64;
        }
        by
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
        fn pick<T: Clone>(v: &[T], parity: usize) -> Vec<T> {
            v.iter().enumerate().filter(|(i, _)| i % 2 == parity).map(|(_, x)| x.clone()).collect()
        }
        ConfidenceData {
            logits: pick(&self.logits, parity),
            accepted: pick(&self.accepted, parity),
            domains: pick(&self.domains, parity),
            anchors: pick(&self.anchors, parity),
            sequences: self.sequences,
        }
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

/// One domain's share of a held-out evaluation ([`ConfidenceData::tau_by_domain`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct DomainTau {
    /// Blocks of the domain.
    pub blocks: usize,
    /// Greedy tau with a block at every anchor (tokens per round, bonus included).
    pub greedy_tau: f64,
    /// Greedy tau of the replayed decoding (tokens per round, bonus included).
    pub decoding_tau: f64,
}

/// Sequential Temperature Scaling over `positions` block positions: `T_k` from a log-spaced
/// grid of 81 values in [1/8, 8], fitted in order on `data`. Where the ECE is flat (every grid
/// value within [`FLAT_ECE`] of the best), the value closest to 1 is taken, and a position
/// whose accepted prefixes number fewer than [`MIN_ACCEPTED_PREFIXES`] keeps `T_k = 1`: deep
/// positions that few prefixes reach otherwise get arbitrary extremes (7.6 and 0.2 on the
/// SmolLM2 drafter of `docs/measurements/2026-12-03-train`).
pub fn fit_sts(data: &ConfidenceData, positions: usize) -> Vec<f64> {
    let grid: Vec<f64> = (0..=80).map(|i| 2f64.powf(-3.0 + 6.0 * i as f64 / 80.0)).collect();
    let mut temps = vec![1.0; positions];
    for k in 0..positions {
        let accepted = data.accepted.iter().filter(|a| a.len() > k && a[..=k].iter().all(|&x| x)).count();
        if accepted < MIN_ACCEPTED_PREFIXES {
            continue;
        }
        let eces: Vec<f64> = grid
            .iter()
            .map(|&t| {
                temps[k] = t;
                ece(&data.cumulative(k, &temps))
            })
            .collect();
        let best = eces.iter().copied().fold(f64::INFINITY, f64::min);
        // among the near-best, the least change from the raw confidences
        temps[k] = grid
            .iter()
            .zip(&eces)
            .filter(|&(_, &e)| e <= best + FLAT_ECE)
            .map(|(&t, _)| t)
            .min_by(|a, b| a.ln().abs().total_cmp(&b.ln().abs()))
            .unwrap_or(1.0);
    }
    temps
}

/// Accepted prefixes a position needs in the fitting data before STS moves its temperature.
pub const MIN_ACCEPTED_PREFIXES: usize = 30;
/// ECE differences below this count as equal when choosing a temperature.
pub const FLAT_ECE: f64 = 1e-3;

/// What [`calibrate`] decided, with the ECE (pooled over positions) it was judged by.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// The temperatures to store: the fitted ones when they lowered the ECE on the judging
    /// half, else all 1.
    pub temperatures: Vec<f64>,
    /// Whether the fitted temperatures lowered the judging half's ECE (and are the ones stored).
    pub stored: bool,
    /// The temperatures STS fitted on the fitting half.
    pub fitted: Vec<f64>,
    /// ECE on the judging half without temperatures (per position, pooled).
    pub before: (Vec<f64>, f64),
    /// ECE on the judging half with the fitted temperatures (per position, pooled).
    pub after: (Vec<f64>, f64),
}

/// STS fitted on one half of `data`'s blocks ([`ConfidenceData::half`] 0) and judged on the
/// other: the fitted temperatures are kept only if they lower the pooled ECE there (on a
/// small held-out set they can make it worse: 0.0187 -> 0.0248 on a 1-layer SmolLM2 drafter).
pub fn calibrate(data: &ConfidenceData, positions: usize) -> Calibration {
    let fitted = fit_sts(&data.half(0), positions);
    let judge = data.half(1);
    let before = judge.ece(&vec![1.0; positions], positions);
    let after = judge.ece(&fitted, positions);
    let stored = after.1 < before.1;
    let temperatures = if stored { fitted.clone() } else { vec![1.0; positions] };
    Calibration { temperatures, stored, fitted, before, after }
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
        let c = calibrate(&data, 3);
        assert!(c.stored && c.after.1 < c.before.1 && c.temperatures == c.fitted, "{c:?}");
    }

    fn lcg(seed: u64) -> impl FnMut() -> f64 {
        let mut state = seed;
        move || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as f64 / (1u64 << 31) as f64
        }
    }

    /// Calibrated confidences keep temperatures near 1; temperatures fitted on one half that
    /// make the other half's ECE worse are not stored.
    #[test]
    fn temperatures_are_stored_only_when_they_help() {
        let blocks = |skew_even: f64, skew_odd: f64| {
            let mut next = lcg(11);
            let mut data = ConfidenceData::default();
            for i in 0..4000 {
                let skew = if i % 2 == 0 { skew_even } else { skew_odd };
                let l: Vec<f32> = (0..4).map(|_| (next() * 6.0 - 2.0) as f32).collect();
                let a: Vec<bool> = l.iter().map(|&x| next() < sigmoid(f64::from(x) / skew)).collect();
                data.logits.push(l);
                data.accepted.push(a);
            }
            data
        };
        let c = calibrate(&blocks(1.0, 1.0), 4);
        assert!(c.fitted.iter().all(|t| (0.7..1.45).contains(t)), "{c:?}");
        // fitted on overconfident blocks, judged on calibrated ones
        let c = calibrate(&blocks(3.0, 1.0), 4);
        assert!(c.fitted[0] > 2.0, "{c:?}");
        assert!(c.after.1 > c.before.1 && !c.stored, "{c:?}");
        assert_eq!(c.temperatures, vec![1.0; 4]);
    }

    /// A position whose prefixes are almost never accepted keeps T = 1 instead of an extreme.
    #[test]
    fn rare_positions_keep_unit_temperature() {
        let mut next = lcg(5);
        let mut data = ConfidenceData::default();
        for _ in 0..2000 {
            let l: Vec<f32> = vec![(next() * 4.0 - 1.0) as f32, -6.0];
            let first = next() < sigmoid(f64::from(l[0]) / 2.0);
            // the second draft is accepted in 10 of the 2000 blocks
            let second = first && next() < 0.01;
            data.logits.push(l);
            data.accepted.push(vec![first, second]);
        }
        let temps = fit_sts(&data, 2);
        assert!(temps[0] > 1.4 && temps[0] < 3.0, "{temps:?}");
        assert_eq!(temps[1], 1.0, "{temps:?}");
    }

    /// Greedy tau per domain counts each domain's blocks only, and the halves keep each
    /// block's domain.
    #[test]
    fn greedy_tau_is_reported_per_domain() {
        let data = ConfidenceData {
            logits: vec![vec![0.0; 3]; 3],
            accepted: vec![vec![true, true, false], vec![false, true, true], vec![true, false, false]],
            domains: vec!["gsm8k".into(), "mt-bench".into(), "gsm8k".into()],
            anchors: vec![(0, 5), (1, 5), (2, 5)],
            sequences: 3,
        };
        let by = data.tau_by_domain();
        assert_eq!((by["gsm8k"].blocks, by["gsm8k"].greedy_tau), (2, 2.5));
        assert_eq!((by["mt-bench"].blocks, by["mt-bench"].greedy_tau), (1, 1.0));
        assert!((data.greedy_tau() - 2.0).abs() < 1e-12);
        assert_eq!(data.half(0).domains, vec!["gsm8k".to_string(), "gsm8k".to_string()]);
        assert_eq!(data.half(0).anchors, vec![(0, 5), (2, 5)]);
    }

    /// The decoding replay starts at a sequence's first anchor and jumps past what each round
    /// accepted plus the bonus token; an anchor without a block drafts nothing.
    #[test]
    fn decoding_tau_replays_rounds_where_the_last_one_ended() {
        let (t, f) = (true, false);
        // sequence 0, anchors 10..=15: rounds at 10 (2 accepted), 13 (0), 14 (1, its second
        // slot rejected), then 16 is past the last anchor
        // sequence 1, anchors 3..=5 with no block at 4: rounds at 3 (0), 4 (none: 0), 5 (0)
        let blocks = [
            ((0, 10), vec![t, t, f]),
            ((0, 11), vec![t, t, t]),
            ((0, 12), vec![t, t, t]),
            ((0, 13), vec![f, t, t]),
            ((0, 14), vec![t, f]),
            ((0, 15), vec![t]),
            ((1, 3), vec![f, f, f]),
            ((1, 5), vec![f]),
        ];
        let data = ConfidenceData {
            logits: blocks.iter().map(|(_, a)| vec![0.0; a.len()]).collect(),
            accepted: blocks.iter().map(|(_, a)| a.clone()).collect(),
            domains: blocks.iter().map(|((s, _), _)| format!("d{s}")).collect(),
            anchors: blocks.iter().map(|(p, _)| *p).collect(),
            sequences: 2,
        };
        // sequence 0: 3 + 1 + 2 tokens in 3 rounds; sequence 1: 1 + 1 + 1 in 3
        assert_eq!(data.replay(|_| true), (9, 6));
        assert!((data.decoding_tau() - 1.5).abs() < 1e-12);
        let by = data.tau_by_domain();
        assert_eq!((by["d0"].decoding_tau, by["d1"].decoding_tau), (2.0, 1.0));
        assert!(data.decoding_tau() < data.greedy_tau());
    }
}
