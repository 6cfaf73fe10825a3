//! How the executor decides whether a draft token is accepted.
//!
//! - [`Acceptance::ExactMatch`] (the default, mlx-lm's rule): the target samples position
//!   `i` exactly as plain decoding samples that step, and a draft is accepted when it equals
//!   that token. The output is token-for-token plain decoding's, at any temperature.
//! - [`Acceptance::Rejection`]: the rule of Leviathan et al. 2023 ("Fast Inference from
//!   Transformers via Speculative Decoding", Algorithm 1) and Chen et al. 2023
//!   ("Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2):
//!   a draft `x` drawn from the drafter's `q` is accepted with probability
//!   `min(1, p(x) / q(x))`, otherwise the position is resampled from the residual
//!   `norm(max(0, p - q))`; after an all-accept window the bonus token is drawn from `p`.
//!   Every emitted token is then distributed exactly as the target's `p` (the theorem in
//!   both papers), but the tokens are not plain decoding's tokens for the same seed. A source
//!   that does not expose `q` ([`crate::DraftSource::draft_probs`] is `None`) proposed its
//!   drafts deterministically, so `q` is one-hot on the draft: accept with probability
//!   `p(x)`, else resample `p` without `x`. With a greedy sampler both rules are identical
//!   and the executor uses exact match.

/// The acceptance rule of the verify walk (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Acceptance {
    /// A draft is accepted when it equals the token plain decoding samples at that step.
    #[default]
    ExactMatch,
    /// Leviathan/Chen rejection sampling against the drafter's distribution.
    Rejection,
}

impl std::str::FromStr for Acceptance {
    type Err = String;

    /// Parses `exact` / `exact-match` or `rejection`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "exact" | "exact-match" | "exact_match" => Ok(Acceptance::ExactMatch),
            "rejection" => Ok(Acceptance::Rejection),
            _ => Err(format!("unknown acceptance rule `{s}`: expected `exact` or `rejection`")),
        }
    }
}

/// The outcome of the rejection test at one window position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The draft is emitted.
    Accept,
    /// The draft is rejected and this token, drawn from the residual, is emitted instead.
    Reject(u32),
}

/// One position of the Leviathan/Chen rule.
///
/// - `p`: the target's sampling distribution at this position, `[V]` non-negative weights:
///   the request's filtered, temperature-scaled distribution ([`models::Sampler::probs`]).
///   It is renormalised here over its kept set (weights that do not sum to 1, e.g.
///   `exp` of [`models::Sampler::logprobs`] after top-k/top-p/min-p, are divided by their
///   sum), because the rule compares the two distributions the tokens are really drawn
///   from.
/// - `q`: the drafter's distribution the draft was drawn from, `[V']` weights after the
///   drafter's own filters; only its first `V` entries count and they are renormalised
///   likewise (a drafter with padded rows beyond the target's vocabulary never proposes
///   them). `None` means a deterministic proposal: `q` is one-hot on `draft`.
/// - `u_accept`, `u_residual`: independent uniform draws in `[0, 1)`.
///
/// The draft is accepted when `u_accept * q(x) < p(x)`, i.e. with probability
/// `min(1, p(x) / q(x))`; otherwise the token is the inverse-CDF draw of `u_residual` from
/// `max(0, p - q)` (normalized). If rounding leaves no residual mass, the draw is from `p`.
/// Sums accumulate in f64.
///
/// # Errors
/// A message when `draft` is outside `p`, `p` has no positive mass, or `q` gives the draft
/// zero probability (the drafter could not have drawn it: a source bug).
pub fn rejection_step(
    p: &[f32],
    q: Option<&[f32]>,
    draft: u32,
    u_accept: f64,
    u_residual: f64,
) -> Result<Verdict, String> {
    let x = draft as usize;
    if x >= p.len() {
        return Err(format!("draft token {draft} is outside the target's {} probabilities", p.len()));
    }
    let p_sum: f64 = p.iter().map(|&v| f64::from(v)).sum();
    if !(p_sum > 0.0 && p_sum.is_finite()) {
        return Err(format!("the target's distribution has total mass {p_sum}"));
    }
    let p_of = |y: usize| f64::from(p[y]) / p_sum;
    let q = q.map(|q| &q[..q.len().min(p.len())]);
    let q_sum = q.map_or(1.0, |q| q.iter().map(|&v| f64::from(v)).sum::<f64>());
    let q_of = |y: usize| -> f64 {
        match q {
            Some(q) => q.get(y).map_or(0.0, |&v| f64::from(v) / q_sum),
            None => f64::from(u8::from(y == x)),
        }
    };
    let qx = q_of(x);
    if qx.is_nan() || qx <= 0.0 {
        return Err(format!("draft token {draft} has probability {qx} under the drafter's own distribution"));
    }
    if u_accept * qx < p_of(x) {
        return Ok(Verdict::Accept);
    }
    let residual: Vec<f64> = (0..p.len()).map(|y| (p_of(y) - q_of(y)).max(0.0)).collect();
    let total: f64 = residual.iter().sum();
    let token = if total > 0.0 {
        inverse_cdf(&residual, u_residual * total)
    } else {
        inverse_cdf(&(0..p.len()).map(p_of).collect::<Vec<_>>(), u_residual)
    };
    Ok(Verdict::Reject(token as u32))
}

/// The first index whose cumulative weight exceeds `target`; the last index with positive
/// weight when rounding keeps the cumulative sum at or below it.
fn inverse_cdf(weights: &[f64], target: f64) -> usize {
    let mut cum = 0.0;
    let mut last_positive = 0;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            cum += w;
            last_positive = i;
            if cum > target {
                return i;
            }
        }
    }
    last_positive
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The exact output distribution of [`rejection_step`] for a draft drawn from `q`
    /// (one-hot when `None`), integrated over a fine grid of both uniforms.
    fn output_distribution(p: &[f32], q: Option<&[f32]>, grid: usize) -> Vec<f64> {
        let v = p.len();
        let mut out = vec![0.0; v];
        let drafts: Vec<(u32, f64)> = match q {
            Some(q) => {
                let s: f64 = q[..v].iter().map(|&x| f64::from(x)).sum();
                (0..v).filter(|&x| q[x] > 0.0).map(|x| (x as u32, f64::from(q[x]) / s)).collect()
            }
            None => vec![(1, 1.0)],
        };
        for (x, weight) in drafts {
            for a in 0..grid {
                let ua = (a as f64 + 0.5) / grid as f64;
                match rejection_step(p, q, x, ua, 0.0).unwrap() {
                    Verdict::Accept => out[x as usize] += weight / grid as f64,
                    Verdict::Reject(_) => {
                        for r in 0..grid {
                            let ur = (r as f64 + 0.5) / grid as f64;
                            let Verdict::Reject(y) = rejection_step(p, q, x, ua, ur).unwrap() else {
                                panic!("the accept test must not depend on u_residual")
                            };
                            out[y as usize] += weight / (grid * grid) as f64;
                        }
                    }
                }
            }
        }
        out
    }

    fn normalized(v: &[f32]) -> Vec<f32> {
        let s: f32 = v.iter().sum();
        v.iter().map(|x| x / s).collect()
    }

    #[test]
    fn output_is_distributed_as_the_target() {
        let p = normalized(&[0.05, 0.4, 0.0, 0.25, 0.3]);
        // q with padded rows beyond V and a different shape than p.
        let q = normalized(&[0.3, 0.1, 0.2, 0.1, 0.2, 0.1]);
        for q in [Some(q.as_slice()), None] {
            let out = output_distribution(&p, q, 400);
            for (y, (&o, &e)) in out.iter().zip(&p).enumerate() {
                assert!((o - f64::from(e)).abs() < 5e-3, "token {y}: {o} vs target {e} (q {q:?})");
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(16))]
        #[test]
        fn random_distributions(p in proptest::collection::vec(0.0f32..1.0, 2..7),
                                q in proptest::collection::vec(0.01f32..1.0, 7..8)) {
            proptest::prop_assume!(p.iter().sum::<f32>() > 0.1);
            let p = normalized(&p);
            let out = output_distribution(&p, Some(&q), 200);
            for (&o, &e) in out.iter().zip(&p) {
                proptest::prop_assert!((o - f64::from(e)).abs() < 1.5e-2, "{out:?} vs {p:?}");
            }
        }
    }

    /// The filtered masses of a top-k/top-p/min-p sampler do not sum to 1 before
    /// renormalisation: the rule must treat them as the distribution they are sampled as.
    #[test]
    fn unnormalised_filtered_masses_are_renormalised() {
        // The softmax of the full logits, masked to the two kept tokens (mass 0.5).
        let p_masked = [0.0, 0.35, 0.0, 0.15, 0.0];
        let p = normalized(&p_masked);
        for q in [None, Some(&[0.1f32, 0.3, 0.2, 0.3, 0.1][..])] {
            let out = output_distribution(&p_masked, q, 400);
            for (y, (&o, &e)) in out.iter().zip(&p).enumerate() {
                assert!((o - f64::from(e)).abs() < 5e-3, "token {y}: {o} vs target {e} (q {q:?})");
            }
        }
        // The same masked distribution drafting for itself is always accepted.
        for x in [1, 3] {
            assert_eq!(rejection_step(&p_masked, Some(&p_masked), x, 0.999_999, 0.5), Ok(Verdict::Accept));
            assert_eq!(rejection_step(&p_masked, Some(&p), x, 0.999_999, 0.5), Ok(Verdict::Accept));
        }
        assert!(rejection_step(&[0.0, 0.0], None, 1, 0.5, 0.5).is_err());
    }

    #[test]
    fn equal_distributions_always_accept() {
        let p = normalized(&[0.2, 0.3, 0.5]);
        for x in 0..3 {
            assert_eq!(rejection_step(&p, Some(&p), x, 0.999_999, 0.5), Ok(Verdict::Accept));
        }
    }

    #[test]
    fn a_draft_the_drafter_could_not_draw_is_a_contract_error() {
        let p = [0.5, 0.5];
        assert!(rejection_step(&p, Some(&[1.0, 0.0]), 1, 0.1, 0.1).is_err());
        assert!(rejection_step(&p, None, 2, 0.1, 0.1).is_err());
    }

    #[test]
    fn one_hot_rejection_never_returns_the_draft() {
        let p = normalized(&[0.1, 0.6, 0.3]);
        for r in 0..50 {
            let v = rejection_step(&p, None, 1, 0.99, r as f64 / 50.0).unwrap();
            assert!(matches!(v, Verdict::Reject(y) if y != 1), "{v:?}");
        }
    }
}
