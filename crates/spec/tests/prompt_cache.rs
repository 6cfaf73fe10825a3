//! [`spec::run`], the executor as a server drives it, on the tiny fixture models: a request
//! that starts from an earlier request's cache ([`spec::Outcome::cache`] cut with
//! [`models::ModelCache::prefix`], plus the drafter's snapshot) emits the tokens of a cold
//! run and re-prefills only the new tokens, for every drafter kind (none, n-gram, suffix, a
//! draft model, DSpark) and after every way a request can end (EOS or `max_tokens`, the
//! caller stopping, a cancel flag); cancellation ends a request within one round or before
//! the next prefill chunk; logprobs are the target's raw log-softmax.
mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use common::plain;
use drafter::Drafter;
use mlx_core::Dtype;
use models::generate::ids;
use models::{GenerateParams, LoadOptions, Sampler, Transformer, load_model};
use spec::dspark::DSparkProvider;
use spec::ngram::NgramProvider;
use spec::policy::{CostCurve, CostModel};
use spec::suffix::SuffixProvider;
use spec::two_model::TwoModelProvider;
use spec::{DraftProvider, Emitted, Finish, NoDrafts, Outcome, Request, SpecOptions, run};

fn fixture(name: &str) -> Transformer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name);
    load_model(&dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("load {name}: {e}"))
}

/// A provider that never drafts, for the plain requests of a server.
struct Plain;

impl DraftProvider for Plain {
    fn name(&self) -> &str {
        "none"
    }
    fn open<'a>(&'a self, _: &'a Transformer, _: &Sampler) -> spec::Result<Box<dyn spec::DraftSource + 'a>> {
        Ok(Box::new(NoDrafts))
    }
}

/// One cold request through `provider`: the emitted tokens and the outcome. `stop_after`
/// makes `on_token` return false after that many tokens.
fn request(
    target: &Transformer,
    provider: &dyn DraftProvider,
    prompt: &[u32],
    params: &GenerateParams,
    stop_after: Option<usize>,
) -> (Vec<u32>, Outcome) {
    let req = Request::new(prompt, params, SpecOptions::from(6), target.make_cache());
    let mut source = provider.open(target, &params.sampler).unwrap();
    let mut out = Vec::new();
    let outcome = run(target, source.as_mut(), req, |e: &Emitted| {
        out.push(e.token);
        stop_after.is_none_or(|n| out.len() < n)
    })
    .unwrap_or_else(|e| panic!("{}: {e}", provider.name()));
    outcome.stats.check().unwrap();
    (out, outcome)
}

/// Turn 1, then turn 2 = turn 1's prompt ++ its output ++ more (and a turn sharing only part
/// of turn 1's prompt), each from the cache and drafter snapshot turn 1 left: the tokens of
/// cold runs, with only the new tokens prefilled.
fn resumes_like_cold(target: &Transformer, provider: &dyn DraftProvider, stop_after: Option<usize>) {
    let name = provider.name().to_string();
    let params = GenerateParams { max_tokens: 12, sampler: Sampler::default(), eos: vec![] };
    let p1: Vec<u32> = vec![5, 9, 17, 33, 9, 17, 33, 9, 17, 60, 61, 62, 5, 9];
    let (t1, o1) = request(target, provider, &p1, &params, stop_after);
    assert_eq!(t1, plain(target, &p1, &params)[..t1.len()], "{name}: turn 1");
    let stream: Vec<u32> = p1.iter().chain(&t1).copied().collect();
    let cache = o1.cache.as_ref().unwrap_or_else(|| panic!("{name}: no cache kept"));
    assert_eq!(cache.offset(), o1.cached_tokens.len(), "{name}");
    assert_eq!(o1.cached_tokens[..], stream[..o1.cached_tokens.len()], "{name}: the cache holds committed tokens");
    assert!(o1.cached_tokens.len() >= p1.len() - 1, "{name}: {} cached", o1.cached_tokens.len());
    let model_drafter = name == "qwen2" || name == "dspark";
    assert_eq!(o1.draft_state.is_some(), model_drafter, "{name}: a snapshot only for a drafter with state");

    for (label, p2) in [
        ("continuation", stream.iter().chain(&[70, 71, 5, 9, 17]).copied().collect::<Vec<u32>>()),
        ("shared head", p1[..7].iter().chain(&[100, 101, 102]).copied().collect()),
    ] {
        let common = o1.cached_tokens.iter().zip(&p2).take_while(|(a, b)| a == b).count().min(p2.len() - 1);
        let mut req = Request::new(&p2, &params, SpecOptions::from(6), cache.prefix(common).unwrap());
        // A snapshot moves into its request: turn 1 again leaves the same one.
        req.draft_state = request(target, provider, &p1, &params, stop_after).1.draft_state;
        let mut source = provider.open(target, &params.sampler).unwrap();
        let mut got = Vec::new();
        let o2 = run(target, source.as_mut(), req, |e| {
            got.push(e.token);
            true
        })
        .unwrap_or_else(|e| panic!("{name} {label}: {e}"));
        assert_eq!(got, plain(target, &p2, &params), "{name} {label}: resumed != cold");
        assert_eq!((o2.stats.cached_tokens, o2.stats.prompt_tokens), (common, p2.len()), "{name} {label}");
        assert!(common > 0);
        assert!(name == "none" || o2.stats.drafted > 0, "{name} {label}: the resumed request still drafts");
        o2.stats.check().unwrap();
    }
}

fn providers() -> Vec<Box<dyn DraftProvider>> {
    let curve = || CostModel::fixed(CostCurve::linear(0.05, 33));
    vec![
        Box::new(Plain),
        Box::new(NgramProvider::default()),
        Box::new(SuffixProvider::new(curve())),
        Box::new(TwoModelProvider::new(fixture("qwen2"), "qwen2")),
    ]
}

#[test]
fn resumed_requests_emit_the_cold_tokens_for_every_model_free_and_draft_model_source() {
    let target = fixture("llama");
    for provider in providers() {
        resumes_like_cold(&target, provider.as_ref(), None);
        resumes_like_cold(&target, provider.as_ref(), Some(3));
    }
}

#[test]
fn a_dspark_drafter_resumes_from_its_context_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (t, d) = test_support::dspark::write_tiny_pair(dir.path()).unwrap();
    let target = load_model(&t, &LoadOptions::default()).unwrap();
    let load = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };
    let provider = DSparkProvider::new(Drafter::load(&d, &load).unwrap(), "dspark").unwrap();
    resumes_like_cold(&target, &provider, None);
    resumes_like_cold(&target, &provider, Some(3));

    // Without its snapshot a DSpark source cannot start from a cached prefix.
    let params = GenerateParams { max_tokens: 4, sampler: Sampler::default(), eos: vec![] };
    let prompt = [1, 2, 3, 4, 5, 6];
    let (_, o) = request(&target, &provider, &prompt, &params, None);
    let req = Request::new(&prompt, &params, 4, o.cache.unwrap().prefix(3).unwrap());
    let mut source = provider.open(&target, &params.sampler).unwrap();
    let err = run(&target, source.as_mut(), req, |_| true).err().expect("refused");
    assert!(err.to_string().contains("cached prefix of 3 tokens"), "{err}");
}

#[test]
fn a_set_cancel_flag_ends_the_request_before_the_prefill_or_within_one_round() {
    let target = fixture("llama");
    let params = GenerateParams { max_tokens: 40, sampler: Sampler::default(), eos: vec![] };
    let prompt: Vec<u32> = (0..700).map(|i| (i * 7 % 250) as u32).collect();
    let cancel = AtomicBool::new(true);
    let mut req = Request::new(&prompt, &params, 6, target.make_cache());
    req.cancel = Some(&cancel);
    let o = run(&target, &mut NoDrafts, req, |_| panic!("no token after a cancel")).unwrap();
    assert_eq!((o.finish, o.stats.prefill_forwards), (Finish::Cancelled, 0));
    assert_eq!(o.cache.unwrap().offset(), 0);

    // Set while decoding: the round in flight finishes, no new round starts.
    let cancel = AtomicBool::new(false);
    let provider = NgramProvider::default();
    let mut source = provider.open(&target, &params.sampler).unwrap();
    let prompt: Vec<u32> = [5, 9, 17, 33].repeat(6);
    let mut req = Request::new(&prompt, &params, 6, target.make_cache());
    req.cancel = Some(&cancel);
    let mut n = 0;
    let o = run(&target, source.as_mut(), req, |_| {
        n += 1;
        if n == 2 {
            cancel.store(true, Ordering::Relaxed);
        }
        true
    })
    .unwrap();
    assert_eq!(o.finish, Finish::Cancelled);
    assert!((2..=2 + 6).contains(&o.stats.emitted), "{} emitted", o.stats.emitted);
    let cache = o.cache.unwrap();
    assert_eq!(cache.offset(), o.cached_tokens.len());
}

#[test]
fn logprobs_are_the_targets_raw_log_softmax_with_the_top_tokens_first() {
    let target = fixture("llama");
    let sampler = Sampler { temp: 0.8, top_k: 20, seed: 3, ..Sampler::default() };
    let params = GenerateParams { max_tokens: 10, sampler, eos: vec![] };
    let prompt: Vec<u32> = [5, 9, 17, 33].repeat(4);
    for provider in providers() {
        let mut source = provider.open(&target, &params.sampler).unwrap();
        let mut req = Request::new(&prompt, &params, 4, target.make_cache());
        req.logprobs = Some(3);
        let mut got = Vec::new();
        run(&target, source.as_mut(), req, |e| {
            got.push(e.clone());
            true
        })
        .unwrap();
        let mut tokens = prompt.clone();
        for e in &got {
            let mut cache = target.make_cache();
            let logits = target.forward(&ids(&tokens).unwrap(), &mut cache).unwrap();
            let z: Vec<f32> = logits.slice_axis(1, -1, i32::MAX).unwrap().to_vec().unwrap();
            let lse = z.iter().map(|v| (*v as f64).exp()).sum::<f64>().ln();
            let lp = e.logprobs.as_ref().unwrap();
            assert!((lp.logprob as f64 - (z[e.token as usize] as f64 - lse)).abs() < 1e-3, "{}", provider.name());
            assert_eq!(lp.top.len(), 3);
            let argmax = (0..z.len()).max_by(|&a, &b| z[a].total_cmp(&z[b])).unwrap() as u32;
            assert_eq!(lp.top[0].0, argmax);
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
            tokens.push(e.token);
        }
        assert_eq!(got.iter().map(|e| e.token).collect::<Vec<_>>(), plain(&target, &prompt, &params));
    }
}
