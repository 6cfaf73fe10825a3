//! Speculative decoding on tiny random Gemma 3 / Gemma 4 targets (`fixtures/gemma`, made by
//! mlx-lm's classes, sliding window 8): greedy speculative output equals greedy plain output
//! for 120 tokens (the rotating caches wrap every 39 positions, so three to four times), with
//! n-gram and two-model drafting and `num_draft_tokens` from 1 to 12, on prompts where most
//! drafts are rejected; no request falls back to plain decoding (every rollback, at every
//! ring offset, is exact). A cache whose rollback reach is smaller than the verify window
//! still gives the same output, through the executor's fallback.
use std::path::PathBuf;

use models::generate::generate;
use models::{GenerateParams, LoadOptions, Sampler, Transformer, load_model};
use spec::ngram::NgramProvider;
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
    let ngram = NgramProvider::default();
    let other = TwoModelProvider::new(load(drafter_name), drafter_name);
    let myself = TwoModelProvider::new(load(target_name), target_name);
    let runs: [(&str, &dyn DraftProvider, usize); 6] = [
        ("ngram", &ngram, 3),
        ("ngram", &ngram, 12),
        ("two-model", &other, 1),
        ("two-model", &other, 12),
        ("self", &myself, 5),
        ("self", &myself, 12),
    ];
    let (mut drafted, mut rejected) = (0, 0);
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
                rejected += stats.drafted - stats.accepted;
            }
        }
    }
    eprintln!("{target_name}: {drafted} drafts, {rejected} rejected and rolled back");
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

#[test]
fn a_rollback_beyond_the_ring_falls_back_and_stays_lossless() {
    let target = load("gemma3");
    let ngram = NgramProvider::default();
    let prompt = &prompts()[1];
    let want = plain(&target, prompt);
    // A reach of 2: 13-token windows go through the concatenation path, and rejecting more
    // than 2 of their drafts cannot be rolled back once the ring has wrapped.
    let mut source = ngram.open(&target, &params().sampler).unwrap();
    let mut got = Vec::new();
    let stats = speculative_generate_with_cache(
        &target,
        target.make_cache_with_rollback(2),
        source.as_mut(),
        prompt,
        &params(),
        12,
        |t| {
            got.push(t);
            true
        },
    )
    .unwrap();
    assert_eq!(got, want);
    assert!(stats.fallback_at.is_some(), "expected a fallback: {stats:?}");
}
