//! The Leviathan/Chen rejection rule through the executor, on the tiny random fixtures
//! (vocab 256): a sampling drafter that differs from the target (qwen3 drafting for llama,
//! so most drafts are rejected and resampled from the residual) must leave the distribution
//! of the emitted tokens exactly the target's. Checked by a chi-square test of the first two
//! tokens over 2,000 seeds against the exact marginals computed from the target, with a
//! negative control showing the same test rejects the drafter's own distribution. The same
//! holds under every sampling filter (top-k, top-p, min-p and their combination), for a
//! sampling drafter and for a deterministic one (one-hot `q`), and a drafter identical to the
//! target is accepted every time under both rules, with any filter and temperature. The
//! suffix drafter under the cost-aware length policy (whose choices depend on every earlier
//! request's outcomes, and whose cross-request store proposes earlier outputs) keeps the
//! distribution too: its length is chosen before the window is verified.
mod common;

use std::path::PathBuf;

use common::next_distribution;
use mlx_core::Array;
use models::generate::generate;
use models::{GenerateParams, LoadOptions, Sampler, Transformer, load_model};
use spec::policy::{CostCurve, CostModel};
use spec::suffix::SuffixProvider;
use spec::two_model::{DraftSampling, TwoModelProvider, TwoModelSource};
use spec::{Acceptance, DraftProvider, DraftSource, SpecOptions, speculative_generate};

fn load(name: &str) -> Transformer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name);
    load_model(&dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("load {name}: {e}"))
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

/// Exact marginals of the first two tokens plain decoding emits after `prompt`.
fn first_two_marginals(target: &Transformer, prompt: &[u32], sampler: &Sampler) -> (Vec<f64>, Vec<f64>) {
    let p0 = next_distribution(target, prompt, sampler);
    let mut p1 = vec![0.0; p0.len()];
    for (t0, &w) in p0.iter().enumerate() {
        if w < 1e-7 {
            continue;
        }
        let mut tokens = prompt.to_vec();
        tokens.push(t0 as u32);
        for (acc, p) in p1.iter_mut().zip(next_distribution(target, &tokens, sampler)) {
            *acc += w * p;
        }
    }
    (p0, p1)
}

/// Counts of the first two emitted tokens over `runs` seeds of speculative decoding with
/// `provider`'s sources, `max_tokens` tokens a request, and the (drafted, accepted) totals.
fn first_two_counts(
    target: &Transformer,
    provider: &dyn DraftProvider,
    prompt: &[u32],
    base: &Sampler,
    runs: u64,
    acceptance: Acceptance,
    max_tokens: usize,
) -> (Vec<usize>, Vec<usize>, usize, usize) {
    let v = target.config.vocab_size;
    let (mut c0, mut c1) = (vec![0usize; v], vec![0usize; v]);
    let (mut drafted, mut accepted) = (0, 0);
    let options = SpecOptions { num_draft_tokens: 3, acceptance };
    for seed in 0..runs {
        let sampler = Sampler { seed, ..base.clone() };
        let params = GenerateParams { max_tokens, sampler, eos: vec![] };
        let mut source = provider.open(target, &params.sampler).unwrap();
        let mut out = Vec::new();
        let stats = speculative_generate(target, source.as_mut(), prompt, &params, options, |t| {
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
    (c0, c1, drafted, accepted)
}

/// A deterministic source proposing the same tokens every round (one-hot `q`).
struct Fixed(Vec<u32>);

impl DraftProvider for Fixed {
    fn name(&self) -> &str {
        "fixed"
    }
    fn open<'a>(&'a self, _target: &'a Transformer, _sampler: &Sampler) -> spec::Result<Box<dyn DraftSource + 'a>> {
        Ok(Box::new(Fixed(self.0.clone())))
    }
}

impl DraftSource for Fixed {
    fn name(&self) -> &str {
        "fixed"
    }
    fn prefill(&mut self, _prompt: &[u32], _taps: Option<&[Array]>) -> spec::Result<()> {
        Ok(())
    }
    fn draft(&mut self, _feed: &[u32], n: usize, _step: usize) -> spec::Result<Vec<u32>> {
        Ok(self.0.iter().copied().take(n).collect())
    }
    fn commit(&mut self, _drafted: usize, _accepted: usize, _taps: Option<&[Array]>) -> spec::Result<()> {
        Ok(())
    }
}

/// A draft model that samples with the request's filters at a quarter of its temperature.
struct Tempered(Transformer);

impl DraftProvider for Tempered {
    fn name(&self) -> &str {
        "tempered"
    }
    fn open<'a>(&'a self, _target: &'a Transformer, sampler: &Sampler) -> spec::Result<Box<dyn DraftSource + 'a>> {
        let sampler = Sampler { temp: sampler.temp * 0.25, ..sampler.clone() };
        Ok(Box::new(TwoModelSource::new(&self.0, sampler, "tempered")))
    }
}

/// The filters of the distribution tests: each alone and all together, at temperatures
/// where the filters cut a large part of the mass.
fn filtered_samplers() -> Vec<(&'static str, Sampler)> {
    let s = |temp, top_k, top_p, min_p| Sampler { temp, top_k, top_p, min_p, seed: 0 };
    vec![
        ("top-k 3", s(1.5, 3, 0.0, 0.0)),
        ("top-p 0.5", s(1.0, 0, 0.5, 0.0)),
        ("min-p 0.2", s(0.1, 0, 0.0, 0.2)),
        ("top-k 8 + top-p 0.8 + min-p 0.05", s(1.0, 8, 0.8, 0.05)),
    ]
}

/// Under every filter the rejection rule emits the target's filtered distribution, both for
/// a sampling drafter (its own filtered `q`) and for deterministic drafts (one-hot `q`):
/// each cell's share within 5 points is resolved (3,000 seeds: a 5-point shift of a cell
/// near 50% is about 5.5 standard errors).
#[test]
fn rejection_rule_keeps_the_filtered_target_distribution() {
    let target = load("llama");
    // The target itself at a lower temperature: its kept sets overlap the target's, so drafts
    // are accepted and rejected alike (a drafter whose kept set is disjoint from the target's
    // is always rejected, and the residual is then p however p is scaled: no test at all).
    let provider = Tempered(load("llama"));
    let prompt = [3u32, 17, 42, 17, 99];
    let runs = 3000;
    for (label, base) in filtered_samplers() {
        let (p0, p1) = first_two_marginals(&target, &prompt, &base);
        let mode = (0..p0.len()).max_by(|&a, &b| p0[a].total_cmp(&p0[b])).unwrap() as u32;
        let fixed = Fixed(vec![mode, mode, mode]);
        let sources: [(&str, &dyn DraftProvider); 2] = [("sampling drafter", &provider), ("one-hot drafts", &fixed)];
        for (source, provider) in sources {
            let (c0, c1, drafted, accepted) =
                first_two_counts(&target, provider, &prompt, &base, runs, Acceptance::Rejection, 2);
            assert!(drafted >= runs as usize, "{label}, {source}: only {drafted} drafts");
            assert!(accepted < drafted, "{label}, {source}: every draft accepted, nothing was tested");
            eprintln!("{label}, {source}: {accepted} of {drafted} drafts accepted");
            for (which, counts, probs) in [("token 0", &c0, &p0), ("token 1", &c1, &p1)] {
                let (stat, df) = chi_square(counts, probs);
                assert!(
                    stat < bound(df),
                    "{label}, {source}, {which}: chi-square {stat:.1} with {df} df (bound {:.1})",
                    bound(df)
                );
                // And no cell's share is off by 5 points.
                for (y, (&c, &p)) in counts.iter().zip(probs.iter()).enumerate() {
                    let share = c as f64 / runs as f64;
                    assert!((share - p).abs() < 0.05, "{label}, {source}, {which}: token {y} {share:.3} vs {p:.3}");
                }
            }
        }
    }
}

/// A draft model identical to the target, sampling with the request's keys, is accepted
/// every time under both rules with any filter and temperature, and under exact match its
/// output is plain decoding's.
#[test]
fn an_identical_drafter_is_always_accepted() {
    let target = load("llama");
    let provider = TwoModelProvider::new(load("llama"), "llama (self)");
    let prompt = [3u32, 17, 42, 17, 99, 5];
    let mut samplers = filtered_samplers();
    samplers.push(("temp 0.7", Sampler { temp: 0.7, ..Sampler::default() }));
    samplers.push(("temp 1.0", Sampler { temp: 1.0, ..Sampler::default() }));
    for (label, base) in samplers {
        for acceptance in [Acceptance::ExactMatch, Acceptance::Rejection] {
            for seed in 0..4 {
                let sampler = Sampler { seed, ..base.clone() };
                let params = GenerateParams { max_tokens: 24, sampler, eos: vec![] };
                let mut want = Vec::new();
                generate(&target, &prompt, &params, |t| {
                    want.push(t);
                    true
                })
                .unwrap();
                let mut source = provider.open(&target, &params.sampler).unwrap();
                let mut got = Vec::new();
                let options = SpecOptions { num_draft_tokens: 4, acceptance };
                let stats = speculative_generate(&target, source.as_mut(), &prompt, &params, options, |t| {
                    got.push(t);
                    true
                })
                .unwrap();
                assert!(stats.drafted > 0);
                assert_eq!(stats.accepted, stats.drafted, "{label}, {acceptance:?}, seed {seed}: {stats:?}");
                if acceptance == Acceptance::ExactMatch {
                    assert_eq!(got, want, "{label}, seed {seed}");
                }
            }
        }
    }
}

#[test]
fn rejection_rule_keeps_the_target_distribution() {
    let target = load("llama");
    let provider = TwoModelProvider::new(load("qwen3"), "qwen3").with_sampling(DraftSampling::Request);
    let prompt = [3u32, 17, 42, 17, 99];
    let base = Sampler { temp: 0.6, ..Sampler::default() };
    let runs = 2000;

    let (p0, p1) = first_two_marginals(&target, &prompt, &base);
    let (c0, c1, drafted, accepted) =
        first_two_counts(&target, &provider, &prompt, &base, runs, Acceptance::Rejection, 2);
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

/// The adaptive suffix drafter under the rejection rule: one provider serves every seed, so
/// each request's draft lengths depend on the acceptance estimates of all earlier requests
/// and its drafts often come from earlier outputs (the store); the first two tokens still
/// follow the target's distribution.
#[test]
fn the_adaptive_suffix_drafter_keeps_the_target_distribution() {
    let target = load("llama");
    let provider = SuffixProvider::new(CostModel::fixed(CostCurve::linear(0.02, 33)));
    // A top-k filter keeps the mass on a few tokens, so a copied token is often accepted.
    let base = Sampler { temp: 1.0, top_k: 3, ..Sampler::default() };
    // The prompt ends in a repeat ([3, 17]), so the first round already has a match, whose
    // continuation `m` is the token the target most favours there (drafts get accepted).
    let with = |m: u32| [3u32, 17, m, 5, 3, 17];
    let m = (0..256u32)
        .map(|m| (next_distribution(&target, &with(m), &base)[m as usize], m))
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap()
        .1;
    let prompt = with(m);
    let runs = 2000;
    let (p0, p1) = first_two_marginals(&target, &prompt, &base);
    let (c0, c1, drafted, accepted) =
        first_two_counts(&target, &provider, &prompt, &base, runs, Acceptance::Rejection, 2);
    eprintln!("adaptive suffix: {accepted} of {drafted} drafts accepted");
    assert!(drafted >= runs as usize / 2 && accepted > 0 && accepted < drafted, "{accepted} of {drafted}");
    for (label, counts, probs) in [("token 0", &c0, &p0), ("token 1", &c1, &p1)] {
        let (stat, df) = chi_square(counts, probs);
        assert!(stat < bound(df), "{label}: chi-square {stat:.1} with {df} df (bound {:.1})", bound(df));
    }
}

/// A draft model under the cost-aware policy stops drafting where its rating of the next
/// draft says so (a stopping time of the drafts): under the rejection rule the first two
/// tokens still follow the target's distribution.
#[test]
fn the_rated_draft_model_policy_keeps_the_target_distribution() {
    let target = load("llama");
    // Verified tokens free: any draft whose estimate is above the minimum gain is drawn,
    // and the tiny drafter's flat distributions land in every rating bucket.
    let curve = || CostModel::fixed(CostCurve::linear(0.0, 33));
    let provider = TwoModelProvider::new(load("qwen3"), "qwen3").with_policy(curve(), curve());
    let prompt = [3u32, 17, 42, 17, 99];
    let base = Sampler { temp: 0.6, ..Sampler::default() };
    let runs = 1200;
    let (p0, p1) = first_two_marginals(&target, &prompt, &base);
    // Six tokens a request, so rounds end open and commit (the estimates learn from them).
    let (c0, c1, drafted, accepted) =
        first_two_counts(&target, &provider, &prompt, &base, runs, Acceptance::Rejection, 6);
    eprintln!("rated draft model: {accepted} of {drafted} drafts accepted");
    assert!(drafted >= 200 && accepted < drafted, "{accepted} of {drafted}");
    for (label, counts, probs) in [("token 0", &c0, &p0), ("token 1", &c1, &p1)] {
        let (stat, df) = chi_square(counts, probs);
        assert!(stat < bound(df), "{label}: chi-square {stat:.1} with {df} df (bound {:.1})", bound(df));
    }
}
