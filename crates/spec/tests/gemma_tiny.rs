//! Speculative decoding on tiny random Gemma 3 / Gemma 4 targets (`fixtures/gemma`, made by
//! mlx-lm's classes, sliding window 8): greedy speculative output equals greedy plain output
//! for 120 tokens (the rotating caches wrap every 39 positions, so three to four times), with
//! n-gram, suffix (every proposed token, and the cost-aware policy) and two-model drafting and
//! `num_draft_tokens` from 1 to 32, on prompts where most
//! drafts are rejected; no request falls back to plain decoding (every rollback, at every
//! ring offset, is exact). Drafts requested beyond the cache's rollback reach are capped at
//! it (no fallback, same output); a cache that does not declare its too-small reach still
//! gives the same output, through the executor's fallback to (pipelined) plain decoding.
use std::path::PathBuf;

use mlx_core::Array;
use models::generate::generate;
use models::{GenerateParams, LayerCache, LoadOptions, ModelCache, Sampler, Transformer, load_model};
use spec::ngram::{DraftSchedule, NgramProvider};
use spec::policy::{CostCurve, CostModel};
use spec::suffix::SuffixProvider;
use spec::two_model::TwoModelProvider;
use spec::{DraftProvider, SpecStats, speculative_generate, speculative_generate_with_cache};

const MAX_TOKENS: usize = 120;

fn load(name: &str) -> Transformer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gemma").join(name);
    load_model(&dir, &LoadOptions::default()).unwrap()
}

fn params() -> GenerateParams {
    GenerateParams { max_tokens: MAX_TOKENS, sampler: Sampler::default(), eos: vec![] }
}

fn plain(target: &Transformer, prompt: &[u32]) -> Vec<u32> {
    let mut out = Vec::new();
    generate(target, prompt, &params(), |t| {
        out.push(t);
        true
    })
    .unwrap();
    out
}

fn spec(target: &Transformer, provider: &dyn DraftProvider, prompt: &[u32], n: usize) -> (Vec<u32>, SpecStats) {
    let mut source = provider.open(target, &params().sampler).unwrap();
    let mut out = Vec::new();
    let stats = speculative_generate(target, source.as_mut(), prompt, &params(), n, |t| {
        out.push(t);
        true
    })
    .unwrap();
    stats.check().unwrap();
    (out, stats)
}

/// Prompts with repeats (so the n-gram source drafts) that the random models do not continue.
fn prompts() -> Vec<Vec<u32>> {
    let a: Vec<u32> = [2, 17, 33, 200, 5, 99, 42, 7].into_iter().cycle().take(30).collect();
    let b: Vec<u32> = (0..45).map(|i| [2, 250, 7, 7, 64, 128, 3, 9, 11, 13][i % 10] + (i / 10) as u32).collect();
    vec![a, b]
}

fn check(target_name: &str, drafter_name: &str) {
    let target = load(target_name);
    let ngram = NgramProvider::default().with_schedule(DraftSchedule::Constant);
    let other = TwoModelProvider::new(load(drafter_name), drafter_name);
    let myself = TwoModelProvider::new(load(target_name), target_name);
    let suffix = SuffixProvider::new(CostModel::fixed(CostCurve::linear(0.2, 33))).fixed_length();
    let adaptive = SuffixProvider::new(CostModel::fixed(CostCurve::linear(0.05, 33)));
    let runs: [(&str, &dyn DraftProvider, usize); 9] = [
        ("ngram", &ngram, 3),
        ("ngram", &ngram, 12),
        ("suffix", &suffix, 12),
        ("suffix", &suffix, 32),
        ("suffix adaptive", &adaptive, 32),
        ("two-model", &other, 1),
        ("two-model", &other, 12),
        ("self", &myself, 5),
        ("self", &myself, 12),
    ];
    let (mut drafted, mut rejected) = (0, 0);
    let mut by_label: std::collections::BTreeMap<&str, usize> = Default::default();
    for (p, prompt) in prompts().iter().enumerate() {
        let want = plain(&target, prompt);
        assert_eq!(want.len(), MAX_TOKENS);
        {
            for (label, provider, n) in runs {
                let (got, stats) = spec(&target, provider, prompt, n);
                let what = format!("{target_name} prompt {p} {label} n={n}");
                if let Some(i) = want.iter().zip(&got).position(|(a, b)| a != b) {
                    panic!("{what}: speculative output differs from plain at token {i}: {stats:?}");
                }
                assert_eq!(got.len(), want.len(), "{what}");
                assert_eq!(stats.fallback_at, None, "{what}: fell back to plain decoding: {stats:?}");
                if label == "self" {
                    assert_eq!(stats.corrections, 0, "{what}: self-drafting was corrected");
                }
                drafted += stats.drafted;
                *by_label.entry(label).or_default() += stats.drafted;
                rejected += stats.drafted - stats.accepted;
            }
        }
    }
    eprintln!("{target_name}: {drafted} drafts, {rejected} rejected and rolled back; by drafter {by_label:?}");
    assert!(by_label.values().all(|&d| d > 0), "{target_name}: a drafter never drafted: {by_label:?}");
    assert!(rejected > 200, "{target_name}: too few rollbacks to mean anything ({rejected})");
}

#[test]
fn gemma3_speculative_equals_plain_past_the_window_without_fallback() {
    check("gemma3", "gemma3_untied");
}

#[test]
fn gemma4_speculative_equals_plain_past_the_window_without_fallback() {
    check("gemma4", "gemma4_plain");
}

/// A run on a caller-made target cache.
fn spec_with_cache(
    target: &Transformer,
    provider: &dyn DraftProvider,
    cache: ModelCache,
    prompt: &[u32],
    params: &GenerateParams,
    n: usize,
) -> (Vec<u32>, SpecStats) {
    let mut source = provider.open(target, &params.sampler).unwrap();
    let mut out = Vec::new();
    let stats = speculative_generate_with_cache(target, cache, source.as_mut(), prompt, params, n, |t| {
        out.push(t);
        true
    })
    .unwrap();
    stats.check().unwrap();
    assert_eq!(stats.emitted, out.len());
    (out, stats)
}

/// Drafts requested beyond the target cache's exact-rollback reach are capped at it, so
/// every rejected window still rolls back: no fallback, and the output is plain decoding's.
/// The default reach (32; `n` 64, a drafter whose drafts are mostly rejected, so 32-token
/// rollbacks happen on rings of 39 rows) and a reach of 3 (`n` 12).
#[test]
fn drafts_beyond_the_rollback_reach_are_capped_without_fallback() {
    let target = load("gemma3");
    let ngram = NgramProvider::default().with_schedule(DraftSchedule::Constant);
    let other = TwoModelProvider::new(load("gemma3_untied"), "gemma3_untied");
    for (p, prompt) in prompts().iter().enumerate() {
        let want = plain(&target, prompt);
        let runs: [(&str, &dyn DraftProvider, usize, usize); 3] =
            [("two-model", &other, 64, 32), ("two-model", &other, 12, 3), ("ngram", &ngram, 12, 3)];
        for (label, provider, n, reach) in runs {
            let what = format!("prompt {p} {label} n={n} reach={reach}");
            let cache = target.make_cache_with_rollback(reach);
            assert_eq!(cache.rollback_reach(), Some(reach), "{what}");
            let (got, stats) = spec_with_cache(&target, provider, cache, prompt, &params(), n);
            assert_eq!(got, want, "{what}: {stats:?}");
            assert_eq!(stats.fallback_at, None, "{what}: fell back: {stats:?}");
            assert_eq!(stats.draft_cap, Some(reach), "{what}");
            assert_eq!(stats.num_draft_tokens, n, "{what}");
            assert!(stats.drafted_by_pos[reach..].iter().all(|&c| c == 0), "{what}: drafted past the cap: {stats:?}");
            if label == "two-model" {
                // The drafter always proposes the full budget, so windows reach the cap and
                // the rejected part of a full-length window is rolled back.
                assert!(stats.drafted_by_pos[reach - 1] > 0, "{what}: never drafted up to the cap: {stats:?}");
                assert!(stats.drafted_by_pos[reach - 1] > stats.accepted_by_pos[reach - 1], "{what}: {stats:?}");
            }
        }
    }
    // A reach at or above the request does not cap.
    let (got, stats) = spec(&target, &other, &prompts()[0], 12);
    assert_eq!(got, plain(&target, &prompts()[0]));
    assert_eq!(stats.draft_cap, None);
}

/// A rotating layer that does not declare its reach ([`LayerCache::rollback_reach`] `None`,
/// as a cache type written before the query would): the executor drafts past what it can
/// roll back and has to fall back.
struct Undeclared(Box<dyn LayerCache>);

impl LayerCache for Undeclared {
    fn offset(&self) -> usize {
        self.0.offset()
    }
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> models::Result<(Array, Array)> {
        self.0.update_and_fetch(keys, values)
    }
    fn can_trim(&self, n: usize) -> bool {
        self.0.can_trim(n)
    }
    fn trim(&mut self, n: usize) -> usize {
        self.0.trim(n)
    }
    fn state(&self) -> Vec<Array> {
        self.0.state()
    }
    fn attention_mask(&self) -> models::Result<Option<Array>> {
        self.0.attention_mask()
    }
}

/// A forced fallback: rotating layers with a reach of 2 that do not declare it, 12 drafts per
/// round. Once a rollback of more than 2 positions fails on a wrapped ring, the request
/// continues as plain decoding (re-prefilled, pipelined) and the output is still plain
/// decoding's, greedy and seeded-sampled, at the fallback and to the end.
#[test]
fn a_rollback_beyond_the_ring_falls_back_and_stays_lossless() {
    let target = load("gemma3");
    let ngram = NgramProvider::default().with_schedule(DraftSchedule::Constant);
    let other = TwoModelProvider::new(load("gemma3_untied"), "gemma3_untied");
    let sampled =
        GenerateParams { sampler: Sampler { temp: 0.8, top_p: 0.95, seed: 5, ..Sampler::default() }, ..params() };
    let prompt = &prompts()[1];
    let mut fallbacks = 0;
    for params in [params(), sampled] {
        let mut want = Vec::new();
        generate(&target, prompt, &params, |t| {
            want.push(t);
            true
        })
        .unwrap();
        let runs: [(&str, &dyn DraftProvider); 2] = [("ngram", &ngram), ("two-model", &other)];
        for (label, provider) in runs {
            let what = format!("{label} temp {}", params.sampler.temp);
            let layers = target.make_cache_with_rollback(2).layers;
            let cache = ModelCache {
                layers: layers.into_iter().map(|l| Box::new(Undeclared(l)) as Box<dyn LayerCache>).collect(),
            };
            assert_eq!(cache.rollback_reach(), None);
            let (got, stats) = spec_with_cache(&target, provider, cache, prompt, &params, 12);
            assert_eq!(got, want, "{what}: {stats:?}");
            assert_eq!(stats.draft_cap, None, "{what}");
            let Some(at) = stats.fallback_at else { panic!("{what}: expected a fallback: {stats:?}") };
            assert!(at < MAX_TOKENS - 10, "{what}: fell back too late to test the plain part: {stats:?}");
            fallbacks += 1;
        }
    }
    assert_eq!(fallbacks, 4);
}
