//! The Leviathan/Chen rejection rule through the executor, on the tiny random fixtures
//! (vocab 256): a sampling drafter that differs from the target (qwen3 drafting for llama,
//! so most drafts are rejected and resampled from the residual) must leave the distribution
//! of the emitted tokens exactly the target's. Checked by a chi-square test of the first two
//! tokens over 2,000 seeds against the exact marginals computed from the target, with a
//! negative control showing the same test rejects the drafter's own distribution.
use std::path::PathBuf;

use models::generate::{generate, ids};
use models::{GenerateParams, LoadOptions, Sampler, Transformer, load_model};
use spec::two_model::{DraftSampling, TwoModelProvider};
use spec::{Acceptance, DraftProvider, SpecOptions, speculative_generate};

fn load(name: &str) -> Transformer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name);
    load_model(&dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("load {name}: {e}"))
}

/// The sampler's distribution `[V]` after `tokens`, as plain decoding draws the next token.
fn next_distribution(model: &Transformer, tokens: &[u32], sampler: &Sampler) -> Vec<f64> {
    let mut cache = model.make_cache();
    let logits = model.forward(&ids(tokens).unwrap(), &mut cache).unwrap();
    let last = logits.slice_axis(1, -1, i32::MAX).unwrap();
    let p: Vec<f32> = sampler.logprobs(&last).unwrap().exp().unwrap().to_vec().unwrap();
    p.into_iter().map(f64::from).collect()
}

/// Pearson's chi-square of `counts` against `probs`, with the cells of expected count below
/// 5 pooled into one; returns (statistic, degrees of freedom).
fn chi_square(counts: &[usize], probs: &[f64]) -> (f64, usize) {
    let n: usize = counts.iter().sum();
    let (mut stat, mut cells) = (0.0, 0);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e < 5.0 {
            pooled_obs += c as f64;
            pooled_exp += e;
        } else {
            stat += (c as f64 - e).powi(2) / e;
            cells += 1;
        }
    }
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1e-9);
        cells += 1;
    }
    (stat, cells - 1)
}

/// A bound the statistic exceeds with probability far below 1e-6 under the null
/// (mean df, standard deviation sqrt(2 df)).
fn bound(df: usize) -> f64 {
    df as f64 + 7.0 * (2.0 * df as f64).sqrt()
}

#[test]
fn rejection_rule_keeps_the_target_distribution() {
    let target = load("llama");
    let provider = TwoModelProvider::new(load("qwen3"), "qwen3").with_sampling(DraftSampling::Request);
    let prompt = [3u32, 17, 42, 17, 99];
    let base = Sampler { temp: 0.6, ..Sampler::default() };
    let runs = 2000;

    // Exact marginals of the first two tokens under the target.
    let p0 = next_distribution(&target, &prompt, &base);
    let mut p1 = vec![0.0; p0.len()];
    for (t0, &w) in p0.iter().enumerate() {
        if w < 1e-7 {
            continue;
        }
        let mut tokens = prompt.to_vec();
        tokens.push(t0 as u32);
        for (acc, p) in p1.iter_mut().zip(next_distribution(&target, &tokens, &base)) {
            *acc += w * p;
        }
    }

    let (mut c0, mut c1) = (vec![0usize; p0.len()], vec![0usize; p0.len()]);
    let (mut drafted, mut accepted) = (0, 0);
    let options = SpecOptions { num_draft_tokens: 3, acceptance: Acceptance::Rejection };
    for seed in 0..runs {
        let sampler = Sampler { seed, ..base.clone() };
        let params = GenerateParams { max_tokens: 2, sampler, eos: vec![] };
        let mut source = provider.open(&target, &params.sampler).unwrap();
        let mut out = Vec::new();
        let stats = speculative_generate(&target, source.as_mut(), &prompt, &params, options, |t| {
            out.push(t);
            true
        })
        .unwrap();
        stats.check().unwrap();
        drafted += stats.drafted;
        accepted += stats.accepted;
        c0[out[0] as usize] += 1;
        c1[out[1] as usize] += 1;
    }
    // The drafter must really disagree with the target, or the test proves nothing.
    let rate = accepted as f64 / drafted as f64;
    assert!(drafted >= runs as usize && rate < 0.9, "acceptance {rate:.3} over {drafted} drafts");

    for (label, counts, probs) in [("token 0", &c0, &p0), ("token 1", &c1, &p1)] {
        let (stat, df) = chi_square(counts, probs);
        assert!(stat < bound(df), "{label}: chi-square {stat:.1} with {df} df (bound {:.1})", bound(df));
    }

    // Negative control: the drafter's own distribution of token 0 is told apart.
    let q0 = next_distribution(provider.model(), &prompt, &base);
    let (stat, df) = chi_square(&c0, &q0);
    assert!(stat > bound(df), "the test cannot tell the drafter from the target: chi-square {stat:.1}, {df} df");
}

#[test]
fn greedy_requests_ignore_the_rejection_rule() {
    let target = load("llama");
    let provider = TwoModelProvider::new(load("qwen2"), "qwen2").with_sampling(DraftSampling::Request);
    let prompt = [5u32, 6, 7, 5, 6];
    let params = GenerateParams { max_tokens: 24, sampler: Sampler::default(), eos: vec![] };
    let mut want = Vec::new();
    generate(&target, &prompt, &params, |t| {
        want.push(t);
        true
    })
    .unwrap();
    for n in [1, 4, 9] {
        let mut source = provider.open(&target, &params.sampler).unwrap();
        let mut got = Vec::new();
        let options = SpecOptions { num_draft_tokens: n, acceptance: Acceptance::Rejection };
        speculative_generate(&target, source.as_mut(), &prompt, &params, options, |t| {
            got.push(t);
            true
        })
        .unwrap();
        assert_eq!(got, want, "n={n}");
    }
}
