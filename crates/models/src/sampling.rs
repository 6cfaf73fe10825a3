//! Token sampling from logits with mlx-lm's filters (temperature, top-p, min-p, top-k) and a
//! per-step random key derived from `(seed, step)`, so a seeded generation is reproducible
//! token for token and a speculative executor can re-sample any position exactly.
use mlx_core::random::{Key, categorical};
use mlx_core::{Array, Dtype};

use crate::Result;

/// Sampling parameters, with mlx_lm's meanings and defaults (all filters off).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampler {
    /// Temperature; `0` = greedy (argmax).
    pub temp: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p`
    /// (`0` or `1` = off).
    pub top_p: f32,
    /// Keep tokens with probability at least `min_p` times the top token's (`0` = off).
    pub min_p: f32,
    /// Keep the `top_k` most likely tokens (`0` = off).
    pub top_k: usize,
    /// Seed of the per-step keys.
    pub seed: u64,
}

impl Default for Sampler {
    fn default() -> Self {
        Sampler { temp: 0.0, top_p: 0.0, min_p: 0.0, top_k: 0, seed: 0 }
    }
}

/// SplitMix64 finalizer (Steele et al. 2014): a bijective 64-bit mixer.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Sampler {
    /// Whether this sampler is greedy.
    pub fn is_greedy(&self) -> bool {
        self.temp <= 0.0
    }

    /// The random key of generation step `step` (0 = the first generated token):
    /// `key(mix(seed ^ mix(step)))`.
    pub fn key(&self, step: usize) -> Key {
        Key::new(mix(self.seed ^ mix(step as u64)))
    }

    /// A uniform draw in `[0, 1)` (f64, 53 random bits) for generation step `step` and
    /// `stream`, independent of [`Sampler::key`]`(step)` and of every other `(step, stream)`
    /// pair: SplitMix64 of `seed`, `step` and `stream`. Used by speculative executors for
    /// the accept test (`stream` 1) and the residual draw (`stream` 2) of the
    /// Leviathan/Chen rejection rule, so a seeded request is reproducible.
    pub fn uniform(&self, step: usize, stream: u64) -> f64 {
        let bits = mix(mix(self.seed ^ mix(step as u64)) ^ mix(stream.wrapping_add(0x005E_ED0F_5AFE)));
        (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// The filtered, temperature-scaled log-probabilities `[V]` (f32) the token is drawn
    /// from: `-inf` outside the kept set. Greedy samplers return the plain log-softmax.
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] when `logits` is not 1-D or `[1, V]`.
    pub fn logprobs(&self, logits: &Array) -> Result<Array> {
        let x = logits.reshape(&[-1])?.astype(Dtype::Float32)?;
        let x = if self.is_greedy() { x } else { x.multiply(&Array::scalar(1.0 / self.temp))? };
        let neg_inf = Array::scalar(f32::NEG_INFINITY);
        let mut lp = x.subtract(&x.logsumexp(&[0], true)?)?;
        if !self.is_greedy() && self.top_p > 0.0 && self.top_p < 1.0 {
            // mlx-lm apply_top_p: ascending sort, keep where the cumulative mass exceeds 1 - p.
            let order = lp.argsort(0)?;
            let cum = lp.exp()?.take(&order, 0)?.cumsum(0, false, true)?;
            let keep_sorted = cum.greater(&Array::scalar(1.0 - self.top_p))?;
            let keep = keep_sorted.put_along_axis(&order, &keep_sorted, 0)?;
            lp = keep.where_(&lp, &neg_inf)?;
        }
        if !self.is_greedy() && self.min_p > 0.0 {
            let top = lp.max(&[0], true)?;
            let keep = lp.greater_equal(&top.add(&Array::scalar(self.min_p.ln()))?)?;
            lp = keep.where_(&lp, &neg_inf)?;
        }
        if !self.is_greedy() && self.top_k > 0 && self.top_k < lp.size() {
            let kth = lp.topk(self.top_k as i32, 0)?.min(&[0], true)?;
            lp = lp.greater_equal(&kth)?.where_(&lp, &neg_inf)?;
        }
        Ok(lp)
    }

    /// The distribution `[V]` (f32 probabilities summing to 1) the token at a step is drawn
    /// from: [`Sampler::logprobs`] renormalised over the kept set, i.e. the softmax of the
    /// temperature-scaled logits restricted to the tokens that survive top-p, min-p and top-k
    /// (`0` elsewhere). [`Sampler::sample`] draws from exactly this distribution (the
    /// Gumbel-max draw is invariant to the constant the renormalisation subtracts). This is
    /// the `p` (target) and `q` (drafter) of the Leviathan/Chen rejection rule; comparing
    /// unnormalised filtered masses instead accepts drafts with `p(x) / S` for a kept mass
    /// `S < 1` and breaks the rule's guarantee.
    ///
    /// # Errors
    /// As [`Sampler::logprobs`].
    pub fn probs(&self, logits: &Array) -> Result<Array> {
        Ok(self.logprobs(logits)?.softmax(&[0], true)?)
    }

    /// Samples the token at generation step `step` from `logits` (`[V]` or `[1, V]`).
    ///
    /// # Errors
    /// [`crate::Error::Mlx`] for a malformed `logits` array.
    pub fn sample(&self, logits: &Array, step: usize) -> Result<u32> {
        Ok(self.sample_lazy(logits, step)?.to_vec::<u32>()?[0])
    }

    /// [`Sampler::sample`] without reading the result: the token of step `step` as a lazy
    /// uint32 scalar (argmax, or `categorical` of [`Sampler::logprobs`] with the key of
    /// `step`), so several positions can be evaluated with one synchronisation.
    ///
    /// # Errors
    /// As [`Sampler::sample`].
    pub fn sample_lazy(&self, logits: &Array, step: usize) -> Result<Array> {
        let tok = if self.is_greedy() {
            logits.reshape(&[-1])?.argmax(0, false)?
        } else {
            categorical(&self.logprobs(logits)?, 0, &self.key(step))?
        };
        Ok(tok.astype(Dtype::Uint32)?)
    }
}
