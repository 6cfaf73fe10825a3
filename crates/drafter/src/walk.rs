//! The greedy Markov walk and the confidence head of a draft call on the host, for drafters
//! computing in f32 (DSpark paper Eqs. 6-8; DeepSpec `markov_head.py`, `draft_ops.py`).
//!
//! ```text
//! z_k = U_k + W2 W1[prev_k]       U [B, K] base logits, W1 [V, r], W2 [K, r]
//! d_k = argmax z_k                first maximum; a draft-vocabulary row maps to its target id
//! prev_0 = anchor, prev_k = d_{k-1}
//! conf_k = sigmoid((w_h . h_k + w_e . W1[prev_k] + b) / T_k)
//! ```
//!
//! Each step depends on the previous draft, so on the device the walk is a chain of small
//! nodes (gather, matmul, add, argmax) per slot: for a 2-layer SmolLM2-135M drafter it took
//! 1.2 ms (bf16 checkpoint, f32) to 2.6 ms (4-bit) of a 3.2-4.9 ms draft call, as much as the
//! block forward itself (`examples/propose_profile.rs`). Here a slot is `K * r` multiply-adds
//! (192 K for K = 3009, r = 64) over host copies of `W1`, `W2` and the head (dequantized
//! once), after one evaluation of the block's base logits and hidden states.
use mlx_core::{Array, Dtype};
use models::layers::{Embedding, EmbeddingTable, Linear};

use crate::Result;

/// Host f32 copies of the Markov head and the confidence head.
pub(crate) struct HostHeads {
    rank: usize,
    /// `W1` `[V, r]`.
    w1: Vec<f32>,
    /// `W2` `[K, r]`.
    w2: Vec<f32>,
    /// The confidence head's weight `[H + r]` (`[H]` without the Markov features) and bias.
    confidence: Option<(Vec<f32>, f32)>,
}

/// What the walk returns for one block.
pub(crate) struct Walk {
    /// `z` `[B, K]`, row-major.
    pub(crate) logits: Vec<f32>,
    /// `d_0 .. d_{B-1}` as target ids.
    pub(crate) drafts: Vec<u32>,
    /// The confidence logits, when there is a confidence head.
    pub(crate) confidence_logits: Option<Vec<f32>>,
}

impl HostHeads {
    /// Copies of `w1`, `w2` and the confidence head `confidence` (its weight `[1, H + r]` with
    /// the Markov features, `[1, H]` without), f32, dequantized where stored quantized.
    pub(crate) fn new(w1: &Embedding, w2: &Linear, confidence: Option<&Linear>) -> Result<Self> {
        let w1_dense = match &w1.table {
            EmbeddingTable::Dense(w) => w.clone(),
            EmbeddingTable::Quantized(q) => q.dequantize()?,
        };
        let rank = w1_dense.shape()[1] as usize;
        let (w2, _) = host_linear(w2)?;
        let confidence = match confidence {
            Some(head) => {
                let (w, b) = host_linear(head)?;
                Some((w, b.map_or(0.0, |b| b[0])))
            }
            None => None,
        };
        Ok(HostHeads { rank, w1: host(&w1_dense)?, w2, confidence })
    }

    /// The greedy walk over base logits `u` (`[B, K]` row-major) from `anchor`, and the
    /// confidence logits over hidden states `hidden` (`[B, H]`); `ids` maps draft-vocabulary
    /// rows to target ids (increasing; `None`: `K = V`).
    pub(crate) fn greedy(&self, u: &[f32], hidden: &[f32], anchor: u32, ids: Option<&[u32]>) -> Walk {
        let (r, k) = (self.rank, self.w2.len() / self.rank);
        let b = u.len() / k;
        let mut logits = Vec::with_capacity(u.len());
        let mut drafts = Vec::with_capacity(b);
        let mut prevs = Vec::with_capacity(b);
        let mut prev = anchor as usize;
        for slot in 0..b {
            prevs.push(prev);
            let e = &self.w1[prev * r..(prev + 1) * r];
            let mut best = (f32::NEG_INFINITY, 0usize);
            for (j, (&uj, w)) in u[slot * k..(slot + 1) * k].iter().zip(self.w2.chunks_exact(r)).enumerate() {
                let z = uj + dot(w, e);
                logits.push(z);
                if z > best.0 || j == 0 {
                    best = (z, j);
                }
            }
            let d = ids.map_or(best.1 as u32, |ids| ids[best.1]);
            drafts.push(d);
            prev = d as usize;
        }
        let confidence_logits = self.confidence.as_ref().map(|(w, bias)| {
            let h = w.len().min(hidden.len() / b);
            (0..b)
                .map(|slot| {
                    let mut l = dot(&w[..h], &hidden[slot * h..(slot + 1) * h]);
                    if w.len() > h {
                        l += dot(&w[h..], &self.w1[prevs[slot] * r..(prevs[slot] + 1) * r]);
                    }
                    l + bias
                })
                .collect()
        });
        Walk { logits, drafts, confidence_logits }
    }
}

/// `a . b` in f32 over eight partial sums (so that it vectorizes).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// A linear layer's weight `[out, in]` (dequantized) and bias as host f32.
fn host_linear(l: &Linear) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    let (w, b) = match l {
        Linear::Dense { weight, bias, .. } => (weight.clone(), bias.clone()),
        Linear::Quantized { weight, bias, .. } => (weight.dequantize()?, bias.clone()),
    };
    Ok((host(&w)?, b.map(|b| host(&b)).transpose()?))
}

fn host(a: &Array) -> Result<Vec<f32>> {
    Ok(a.astype(Dtype::Float32)?.to_vec::<f32>()?)
}
