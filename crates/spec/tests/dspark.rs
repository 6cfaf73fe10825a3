//! DSpark drafting through the shared executor on the deterministic tiny pairs of
//! `test_support::dspark`, generated into a temporary directory: a 4-layer Qwen3 target with a
//! `Qwen3DSparkModel` drafter, and a 6-layer Gemma 4 target (sliding window 8, KV-shared
//! layers, `k_eq_v`, soft-capping) with a `Gemma4DSparkModel` drafter. Speculative output
//! equals plain output token for token, greedy and seeded-sampled, for the bf16 drafters and
//! their 4-bit and 8-bit quantizations, for several `num_draft_tokens` (on Gemma 4 past the
//! sliding window, with no fallback to plain decoding); the drafter's context after a
//! request holds exactly the committed rows (checked against one fresh pass over the
//! committed tokens); a confidence threshold only shortens blocks; mismatched targets are
//! refused.
mod common;

use std::path::Path;

use common::{plain, spec_run};
use drafter::Drafter;
use mlx_core::quant::QuantSpec;
use mlx_core::{Array, Dtype, concatenate};
use models::generate::ids;
use models::{GenerateParams, LoadOptions, Sampler, Transformer, load_model};
use spec::dspark::{DSparkProvider, DSparkSource};
use spec::{Acceptance, DraftProvider, DraftSource, Error, SpecOptions, speculative_generate};
use test_support::dspark::{
    BLOCK_SIZE, GEMMA4_SLIDING_WINDOW, quantize_drafter_for_tests, write_tiny_dspark, write_tiny_gemma4_target,
    write_tiny_target,
};

const SEED: u64 = 11;

/// The target family of a tiny pair.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Family {
    Qwen3,
    Gemma4,
}

impl Family {
    /// Writes the target into `dir` with the layer gain that makes its drafter draft well.
    fn write_target(self, dir: &Path) {
        match self {
            Family::Qwen3 => write_tiny_target(dir, SEED, 0.3).unwrap(),
            Family::Gemma4 => write_tiny_gemma4_target(dir, SEED, GEMMA4_GAIN).unwrap(),
        }
    }
}

const GEMMA4_GAIN: f32 = 8.0;

struct Pair {
    _dir: tempfile::TempDir,
    target: Transformer,
    /// (label, provider)
    drafters: Vec<(String, DSparkProvider)>,
}

fn f32_load() -> LoadOptions {
    LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() }
}

fn pair(family: Family, variants: &[(&str, Option<QuantSpec>)]) -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let (t, d) = (dir.path().join("target"), dir.path().join("dspark"));
    std::fs::create_dir_all(&t).unwrap();
    std::fs::create_dir_all(&d).unwrap();
    family.write_target(&t);
    write_tiny_dspark(&d, &t, SEED).unwrap();
    let target = load_model(&t, &LoadOptions::default()).unwrap();
    let drafters = variants
        .iter()
        .map(|&(label, spec)| {
            let path = match spec {
                None => d.clone(),
                Some(spec) => {
                    let q = dir.path().join(label);
                    std::fs::create_dir_all(&q).unwrap();
                    let bases = quantize_drafter_for_tests(&d, &q, spec).unwrap();
                    assert!(bases.iter().any(|b| b == "markov_head.markov_w1"), "{bases:?}");
                    q
                }
            };
            let drafter = Drafter::load(&path, &f32_load()).unwrap_or_else(|e| panic!("load {label}: {e}"));
            if spec.is_some() {
                let q = drafter.quantized_modules();
                assert!(q.iter().any(|b| b == "embed_tokens") && !q.iter().any(|b| b.starts_with("confidence_head")));
            }
            (label.to_string(), DSparkProvider::new(drafter, label).unwrap())
        })
        .collect();
    Pair { _dir: dir, target, drafters }
}

fn variants() -> Vec<(&'static str, Option<QuantSpec>)> {
    vec![
        ("bf16", None),
        ("q8g64", Some(QuantSpec::new(64, 8).unwrap())),
        ("q4g64", Some(QuantSpec::new(64, 4).unwrap())),
        ("q4g32", Some(QuantSpec::new(32, 4).unwrap())),
    ]
}

const PROMPTS: [&[u32]; 4] =
    [&[1, 2, 3, 4, 5, 6, 7, 8], &[200], &[17, 99, 17, 99, 3], &[250, 4, 4, 4, 60, 61, 62, 63, 64, 65, 66]];

fn equality(family: Family, params_for: impl Fn(u64) -> GenerateParams, label: &str) {
    let p = pair(family, &variants());
    for (vi, (name, provider)) in p.drafters.iter().enumerate() {
        let (mut drafted, mut accepted, mut full, mut zero) = (0, 0, 0, 0);
        for (i, prompt) in PROMPTS.iter().enumerate() {
            let params = params_for(i as u64);
            let want = plain(&p.target, prompt, &params);
            for n in [2, BLOCK_SIZE, BLOCK_SIZE + 3] {
                let mut source = provider.open(&p.target, &params.sampler).unwrap();
                let (got, stats) = spec_run(&p.target, source.as_mut(), prompt, &params, n);
                assert_eq!(got, want, "{family:?} {label} {name} prompt {i} n={n}: speculative != plain; {stats:?}");
                assert_eq!(stats.fallback_at, None, "{family:?} {label} {name} prompt {i} n={n}: fell back: {stats:?}");
                assert!(stats.drafted_by_pos.iter().skip(BLOCK_SIZE).all(|&c| c == 0), "at most block_size drafts");
                drafted += stats.drafted;
                accepted += stats.accepted;
                if n == BLOCK_SIZE {
                    full += stats.accepted_by_pos[BLOCK_SIZE - 1];
                    zero += stats.drafted_by_pos[0] - stats.accepted_by_pos[0];
                }
            }
        }
        let rate = accepted as f64 / drafted as f64;
        eprintln!(
            "{family:?} {label} {name}: acceptance {accepted}/{drafted} = {rate:.3}, all-7-accepted rounds {full}, none-accepted rounds {zero}"
        );
        // The pair is built to draft well; every round shape must occur (only checked for the
        // bf16 drafter and greedy decoding, where the numbers do not depend on quantization noise).
        if vi == 0 && label == "greedy" {
            assert!(rate > 0.3 && rate < 0.98, "acceptance {rate} outside (0.3, 0.98)");
            assert!(full > 0 && zero > 0, "all-accept rounds {full}, none-accepted rounds {zero}");
        }
    }
}

fn greedy(_: u64) -> GenerateParams {
    GenerateParams { max_tokens: 40, sampler: Sampler::default(), eos: vec![] }
}

fn sampled(i: u64) -> GenerateParams {
    GenerateParams {
        max_tokens: 40,
        sampler: Sampler { temp: 0.7, top_p: 0.95, seed: 1234 + i, ..Sampler::default() },
        eos: vec![7, 100],
    }
}

#[test]
fn greedy_speculative_equals_plain_for_bf16_q8_q4_drafters() {
    equality(Family::Qwen3, greedy, "greedy");
}

#[test]
fn seeded_sampled_speculative_equals_plain_for_bf16_q8_q4_drafters() {
    equality(Family::Qwen3, sampled, "sampled");
}

/// The Gemma 4 drafter against a Gemma 4 target: 40 tokens after prompts of up to 11 wrap
/// the target's 8-position sliding-window caches several times; the rotating caches roll
/// every rejected window back exactly (no fallback to plain decoding).
#[test]
fn gemma4_greedy_speculative_equals_plain_past_the_window() {
    const { assert!(40 > 4 * GEMMA4_SLIDING_WINDOW) };
    equality(Family::Gemma4, greedy, "greedy");
}

#[test]
fn gemma4_seeded_sampled_speculative_equals_plain_past_the_window() {
    equality(Family::Gemma4, sampled, "sampled");
}

/// After a request the drafter's context holds the taps of exactly the committed positions
/// (anchor + accepted drafts of each round, never the bonus or rejected drafts): the same
/// K/V a fresh context computes from one target pass over those tokens.
#[test]
fn context_holds_exactly_the_committed_rows() {
    context_rows(Family::Qwen3);
    context_rows(Family::Gemma4);
}

fn context_rows(family: Family) {
    let p = pair(family, &[("bf16", None)]);
    let provider = &p.drafters[0].1;
    let prompt = PROMPTS[3];
    let params = GenerateParams { max_tokens: 30, sampler: Sampler::default(), eos: vec![] };
    let mut source = DSparkSource::new(provider, &p.target).unwrap();
    let (out, stats) = spec_run(&p.target, &mut source, prompt, &params, BLOCK_SIZE);
    assert!(stats.rounds > 2);
    let rows = source.context().unwrap().len();
    let committed: Vec<u32> = prompt.iter().chain(&out).copied().collect();
    // Every round but the last committed its anchor and accepted drafts.
    assert!(rows >= prompt.len() - 1 && rows < committed.len(), "{rows} rows for {} committed", committed.len());

    assert_context_is_one_pass(&p, &mut source, &committed[..rows], &format!("{family:?}"));
}

/// The drafter context of `source` equals (1e-4) the one a fresh context gets from one
/// target pass over `tokens`.
fn assert_context_is_one_pass(p: &Pair, source: &mut DSparkSource<'_>, tokens: &[u32], what: &str) {
    let d = p.drafters[0].1.drafter();
    let mut cache = p.target.make_cache();
    let taps: Vec<usize> = d.target_layer_ids().iter().map(|&l| l as usize).collect();
    let fwd = p.target.forward_with_taps(&ids(tokens).unwrap(), &mut cache, &taps).unwrap();
    let mut fresh = d.new_context();
    d.ingest(&mut fresh, &d.concat_taps(&fwd.taps).unwrap()).unwrap();
    let ctx = source.context().unwrap();
    assert_eq!(ctx.len(), tokens.len(), "{what}");
    for layer in 0..d.config().num_layers {
        let (k, v) = ctx.layer_kv(layer).unwrap().unwrap();
        let (fk, fv) = fresh.layer_kv(layer).unwrap().unwrap();
        for (a, b, name) in [(&k, &fk, "K"), (&v, &fv, "V")] {
            let diff = a.subtract(b).unwrap().abs().unwrap().max(&[], false).unwrap().item().unwrap();
            assert!(diff < 1e-4, "{what} layer {layer} {name}: max |diff| {diff} against a fresh pass");
        }
    }
}

/// Rounds that draw no block only queue their rows: the rows of several such rounds join
/// the context together, before the next block, and it equals one target pass over the
/// committed tokens; a block drawn then still sits at the right position.
#[test]
fn rows_of_rounds_without_a_block_join_the_context_before_the_next() {
    let p = pair(Family::Qwen3, &[("bf16", None)]);
    let provider = &p.drafters[0].1;
    let taps: Vec<usize> = provider.drafter().target_layer_ids().iter().map(|&l| l as usize).collect();
    let prompt = PROMPTS[3];
    let mut cache = p.target.make_cache();
    let head = p.target.forward_with_taps(&ids(&prompt[..prompt.len() - 1]).unwrap(), &mut cache, &taps).unwrap();
    let mut source = DSparkSource::new(provider, &p.target).unwrap();
    source.prefill(prompt, Some(&head.taps)).unwrap();
    // Plain rounds: no drafts asked for, the anchor committed with its one-token window's taps.
    let mut committed = prompt.to_vec();
    for step in 0..5 {
        let anchor = *committed.last().unwrap();
        assert!(source.draft(&[anchor], 0, step).unwrap().is_empty());
        let window = p.target.forward_with_taps(&ids(&[anchor]).unwrap(), &mut cache, &taps).unwrap();
        source.commit(0, 0, Some(&window.taps)).unwrap();
        committed.push(40 + step as u32);
    }
    let drafts = source.draft(&[*committed.last().unwrap()], BLOCK_SIZE, 5).unwrap();
    assert!(!drafts.is_empty());
    assert_context_is_one_pass(&p, &mut source, &committed[..committed.len() - 1], "after 5 plain rounds");
}

/// A confidence threshold truncates blocks (never lengthens them) and stays lossless.
#[test]
fn confidence_threshold_truncates_blocks_losslessly() {
    let dir = tempfile::tempdir().unwrap();
    let (t, d) = (dir.path().join("target"), dir.path().join("dspark"));
    std::fs::create_dir_all(&t).unwrap();
    std::fs::create_dir_all(&d).unwrap();
    Family::Qwen3.write_target(&t);
    write_tiny_dspark(&d, &t, SEED).unwrap();
    let target = load_model(&t, &LoadOptions::default()).unwrap();
    let params = GenerateParams { max_tokens: 40, sampler: Sampler::default(), eos: vec![] };
    let mut drafted = Vec::new();
    for threshold in [0.0, 0.6, 0.8, 1.01] {
        let provider = DSparkProvider::new(Drafter::load(&d, &f32_load()).unwrap(), "dspark")
            .unwrap()
            .with_confidence_threshold(threshold);
        let want = plain(&target, PROMPTS[0], &params);
        let mut source = provider.open(&target, &params.sampler).unwrap();
        let (got, stats) = spec_run(&target, source.as_mut(), PROMPTS[0], &params, BLOCK_SIZE);
        assert_eq!(got, want, "threshold {threshold}");
        drafted.push(stats.drafted as f64 / stats.rounds as f64);
        if threshold > 1.0 {
            assert_eq!(stats.drafted, 0, "a threshold above 1 keeps no draft");
        }
    }
    eprintln!("drafts per round at thresholds 0, 0.6, 0.8, 1.01: {drafted:?}");
    assert!(drafted[1] < drafted[0], "threshold 0.6 must truncate some block: {drafted:?}");
}

/// Under the cost-aware policy a block is cut by the drafter's ratings and the target's cost
/// curve: nearly whole when a verified token costs little, never drafted when each costs a
/// whole step (no window then beats a plain step); lossless greedy and seeded-sampled, under
/// exact match and (sampled) the rejection rule.
#[test]
fn the_cost_aware_policy_cuts_blocks_losslessly() {
    use spec::policy::{CostCurve, CostModel};
    let p = pair(Family::Qwen3, &[("bf16", None)]);
    let load = || Drafter::load(&p._dir.path().join("dspark"), &f32_load()).unwrap();
    let mut per_round = Vec::new();
    for c in [0.02, 1.0] {
        let provider =
            DSparkProvider::new(load(), "dspark").unwrap().with_policy(CostModel::fixed(CostCurve::linear(c, 33)));
        let (mut drafted, mut rounds) = (0, 0);
        for (i, prompt) in PROMPTS.iter().enumerate() {
            for (params, acceptance) in [
                (greedy(0), Acceptance::ExactMatch),
                (sampled(i as u64), Acceptance::ExactMatch),
                (sampled(i as u64), Acceptance::Rejection),
            ] {
                let mut source = provider.open(&p.target, &params.sampler).unwrap();
                let options = SpecOptions { num_draft_tokens: BLOCK_SIZE, acceptance };
                let mut got = Vec::new();
                let stats = speculative_generate(&p.target, source.as_mut(), prompt, &params, options, |t| {
                    got.push(t);
                    true
                })
                .unwrap();
                stats.check().unwrap();
                if acceptance == Acceptance::ExactMatch {
                    assert_eq!(got, plain(&p.target, prompt, &params), "c {c} prompt {i} {:?}", params.sampler);
                }
                drafted += stats.drafted;
                rounds += stats.rounds;
            }
        }
        per_round.push(drafted as f64 / rounds as f64);
        assert!(provider.describe_policy().is_some());
    }
    eprintln!("drafts per round at c = 0.02 and 1.0: {per_round:?}");
    assert!(per_round[0] > 2.0, "a cheap window drafts most of the block: {per_round:?}");
    assert_eq!(per_round[1], 0.0, "no window beats a plain step at c = 1: {per_round:?}");
}

/// A drafter trained for another target is refused with both sides named.
#[test]
fn mismatched_target_is_refused() {
    let p = pair(Family::Qwen3, &[("bf16", None)]);
    let provider = &p.drafters[0].1;
    let other = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity/qwen3");
    let other = load_model(&other, &LoadOptions::default()).unwrap();
    let err = match provider.open(&other, &Sampler::default()) {
        Err(e) => e,
        Ok(_) => panic!("a 2-layer target must be refused"),
    };
    let msg = err.to_string();
    assert!(matches!(err, Error::Incompatible { .. }), "{msg}");
    assert!(msg.contains("num_target_layers 4") && msg.contains("num_hidden_layers 2"), "{msg}");
}

/// Feeding taps that do not fit (wrong row count) is a contract error, not a panic.
#[test]
fn malformed_taps_are_refused() {
    let p = pair(Family::Qwen3, &[("bf16", None)]);
    let provider = &p.drafters[0].1;
    let mut source = DSparkSource::new(provider, &p.target).unwrap();
    let taps: Vec<Array> = (0..3).map(|_| Array::zeros(&[1, 2, 64], Dtype::Float32).unwrap()).collect();
    let err = source.prefill(&[1, 2, 3, 4], Some(&taps)).unwrap_err();
    assert!(matches!(err, Error::Contract { .. }), "{err}");
    let err = source.prefill(&[1, 2, 3, 4], None).unwrap_err();
    assert!(matches!(err, Error::Contract { .. }), "{err}");
    let one = concatenate(&[&taps[0]], 1).unwrap();
    let err = source.prefill(&[1, 2, 3], Some(&[one])).unwrap_err();
    assert!(err.to_string().contains("tap"), "{err}");
}

/// A drafter that taps the embedding output (`-1`, as the Gemma4 golden does) cannot be fed
/// by the executor, which taps decoder-layer outputs: refused when the provider is made.
#[test]
fn embedding_tap_is_refused() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/deepspec/gemma4/k_eq_v");
    let d = Drafter::load(&dir, &f32_load()).unwrap();
    let err = match DSparkProvider::new(d, "gemma4") {
        Err(e) => e,
        Ok(_) => panic!("a -1 tap must be refused"),
    };
    assert!(matches!(err, Error::Incompatible { .. }) && err.to_string().contains("-1"), "{err}");
}

/// At temperature > 0 the DSpark source draws its drafts with the request's sampler and
/// keys and exposes their `q`: a sampled request runs under both rules and keeps the stats
/// invariants, and both rules accept a comparable number of drafts (exact match through the
/// shared noise, the Leviathan/Chen rule with min(1, p/q)).
#[test]
fn sampled_drafts_under_both_rules() {
    let p = pair(Family::Qwen3, &[("bf16", None)]);
    let provider = &p.drafters[0].1;
    let (mut exact, mut rejection) = (0, 0);
    for (i, prompt) in PROMPTS.iter().enumerate() {
        let params = GenerateParams {
            max_tokens: 40,
            sampler: Sampler { temp: 0.7, seed: 99 + i as u64, ..Sampler::default() },
            eos: vec![],
        };
        for (acceptance, total) in [(Acceptance::ExactMatch, &mut exact), (Acceptance::Rejection, &mut rejection)] {
            let mut source = provider.open(&p.target, &params.sampler).unwrap();
            let options = SpecOptions { num_draft_tokens: BLOCK_SIZE, acceptance };
            let mut out = Vec::new();
            let stats = speculative_generate(&p.target, source.as_mut(), prompt, &params, options, |t| {
                out.push(t);
                true
            })
            .unwrap();
            stats.check().unwrap();
            assert_eq!(out.len(), 40);
            *total += stats.accepted;
        }
    }
    eprintln!("accepted drafts: exact match {exact}, rejection rule {rejection}");
    let (lo, hi) = (exact.min(rejection) as f64, exact.max(rejection) as f64);
    assert!(lo > 0.0 && hi / lo < 1.3, "exact {exact}, rejection {rejection}");
}

/// DSpark drafters in a batch (their taps come from the batched forward, each request's rows
/// of the tap layers): every request's tokens equal plain decoding's, greedy and seeded,
/// with fixed blocks and under the cost-aware policy, for the Qwen3 pair (one forward over
/// all windows) and the Gemma 4 pair (parts run one after another).
#[test]
fn batched_dspark_requests_equal_plain() {
    use spec::batch::{Batch, BatchRequest};
    for family in [Family::Qwen3, Family::Gemma4] {
        let p = pair(family, &[("bf16", None)]);
        let provider = &p.drafters[0].1;
        let adaptive_dir = p._dir.path().join("dspark");
        let adaptive = DSparkProvider::new(Drafter::load(&adaptive_dir, &f32_load()).unwrap(), "dspark")
            .unwrap()
            .with_policy(spec::policy::CostModel::fixed(spec::policy::CostCurve::linear(0.05, 33)));
        let mut batch = Batch::new(&p.target);
        let outs: Vec<std::rc::Rc<std::cell::RefCell<Vec<u32>>>> =
            (0..2 * PROMPTS.len()).map(|_| Default::default()).collect();
        let mut want = Vec::new();
        let mut ids = Vec::new();
        for (i, out) in outs.iter().enumerate() {
            let prompt = PROMPTS[i % PROMPTS.len()];
            let params = if i % 2 == 0 { greedy(i as u64) } else { sampled(i as u64) };
            want.push(plain(&p.target, prompt, &params));
            let source = if i < PROMPTS.len() {
                provider.open(&p.target, &params.sampler)
            } else {
                adaptive.open(&p.target, &params.sampler)
            };
            let request = BatchRequest {
                prompt: prompt.to_vec(),
                params,
                options: SpecOptions::from(BLOCK_SIZE),
                cache: p.target.make_cache(),
                draft_state: None,
                logprobs: None,
                cancel: None,
            };
            let out = out.clone();
            let on_token = Box::new(move |e: &spec::Emitted| {
                out.borrow_mut().push(e.token);
                true
            });
            ids.push(batch.add(source.unwrap(), request, on_token).unwrap());
        }
        let mut drafted = 0;
        while !batch.is_empty() {
            for done in batch.step() {
                let outcome = done.result.unwrap_or_else(|e| panic!("{family:?}: {e}"));
                assert_eq!(outcome.stats.fallback_at, None);
                drafted += outcome.stats.drafted;
            }
        }
        for (i, out) in outs.iter().enumerate() {
            assert_eq!(*out.borrow(), want[i], "{family:?} request {i}: batched != plain");
        }
        assert!(drafted > 0, "{family:?}: nothing drafted");
    }
}
