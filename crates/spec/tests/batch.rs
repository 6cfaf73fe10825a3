//! Continuous batching ([`spec::batch::Batch`]) on the tiny fixture models: mixed requests
//! (prompt lengths, drafters, draft counts, greedy and seeded sampling, logprobs) arriving at
//! random steps each produce exactly the tokens of plain decoding and of their own solo run,
//! with log-probabilities equal to the solo run's bit for bit (they are computed from the
//! request's logits rows); cancellation, stops, EOS and max-tokens in the middle of a batch
//! leave the other requests unchanged. Property tests run with a fixed seed.
mod common;

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::plain;
use models::{GenerateParams, LoadOptions, Sampler, Transformer, load_model};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use spec::batch::{Batch, BatchRequest};
use spec::ngram::{DraftSchedule, NgramSource};
use spec::policy::{CostCurve, CostModel};
use spec::suffix::{SuffixProvider, SuffixSource};
use spec::two_model::TwoModelSource;
use spec::{DraftProvider, DraftSource, Emitted, Finish, NoDrafts, Request, SpecOptions, TokenLogprobs};

fn load(name: &str) -> Transformer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name);
    load_model(&dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("load {name}: {e}"))
}

fn runner(cases: u32) -> TestRunner {
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &[11; 32]))
}

/// One request of a case.
#[derive(Debug, Clone)]
struct Case {
    prompt: Vec<u32>,
    max_tokens: usize,
    /// 0: greedy; otherwise the seed of a temperature-0.8 top-p sampler.
    seed: u64,
    /// 0 none, 1 suffix (every token), 2 suffix (cost-aware), 3 n-gram, 4 draft model.
    drafter: usize,
    num_draft_tokens: usize,
    logprobs: bool,
    /// The batch step at which it arrives.
    arrives: usize,
}

impl Case {
    fn params(&self, eos: &[u32]) -> GenerateParams {
        let sampler = match self.seed {
            0 => Sampler::default(),
            seed => Sampler { temp: 0.8, top_p: 0.9, seed, ..Sampler::default() },
        };
        GenerateParams { max_tokens: self.max_tokens, sampler, eos: eos.to_vec() }
    }

    fn source<'a>(
        &self,
        target: &'a Transformer,
        drafter: &'a Transformer,
        suffix: &'a SuffixProvider,
    ) -> Box<dyn DraftSource + 'a> {
        match self.drafter {
            0 => Box::new(NoDrafts),
            1 => Box::new(SuffixSource::fixed()),
            2 => suffix.open(target, &Sampler::default()).unwrap(),
            3 => Box::new(NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Constant)),
            _ => Box::new(TwoModelSource::new(drafter, Sampler::default(), "qwen2")),
        }
    }

    fn options(&self) -> SpecOptions {
        SpecOptions::from(if self.drafter == 0 { 0 } else { self.num_draft_tokens })
    }
}

fn case_strategy() -> impl Strategy<Value = Case> {
    let prompt = (prop_oneof![Just(3u32), Just(16u32), Just(256u32)], proptest::collection::vec(0u32..256, 1..40))
        .prop_map(|(alphabet, raw)| raw.into_iter().map(|t| t % alphabet).collect::<Vec<u32>>());
    (prompt, 1usize..24, prop_oneof![Just(0u64), 1u64..1000], 0usize..5, 1usize..9, any::<bool>(), 0usize..12).prop_map(
        |(prompt, max_tokens, seed, drafter, num_draft_tokens, logprobs, arrives)| Case {
            prompt,
            max_tokens,
            seed,
            drafter,
            num_draft_tokens,
            logprobs,
            arrives,
        },
    )
}

thread_local! {
    /// The most requests one batched forward held so far (on this test's thread).
    static WIDEST: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

type Tokens = Vec<(u32, Option<TokenLogprobs>)>;
type Collected = Rc<RefCell<Tokens>>;

fn collector(out: &Collected) -> Box<dyn FnMut(&Emitted) -> bool + 'static> {
    let out = out.clone();
    Box::new(move |e: &Emitted| {
        out.borrow_mut().push((e.token, e.logprobs.clone()));
        true
    })
}

/// The request alone through `spec::run`.
fn solo(target: &Transformer, drafter: &Transformer, suffix: &SuffixProvider, case: &Case, eos: &[u32]) -> Tokens {
    let params = case.params(eos);
    let mut source = case.source(target, drafter, suffix);
    let mut request = Request::new(&case.prompt, &params, case.options(), target.make_cache());
    request.logprobs = case.logprobs.then_some(2);
    let mut out = Vec::new();
    spec::run(target, source.as_mut(), request, |e| {
        out.push((e.token, e.logprobs.clone()));
        true
    })
    .unwrap();
    out
}

/// Runs `cases` in one batch, each added at its arrival step; returns each one's tokens and
/// finish.
fn batched(
    target: &Transformer,
    drafter: &Transformer,
    suffix: &SuffixProvider,
    cases: &[Case],
    eos: &[u32],
) -> Vec<(Tokens, Finish)> {
    let mut batch = Batch::new(target);
    let outs: Vec<Collected> = cases.iter().map(|_| Collected::default()).collect();
    let mut finish = vec![None; cases.len()];
    let mut ids = vec![u64::MAX; cases.len()];
    let mut step = 0;
    while finish.iter().any(Option::is_none) {
        for (i, case) in cases.iter().enumerate().filter(|(_, c)| c.arrives == step) {
            let request = BatchRequest {
                prompt: case.prompt.clone(),
                params: case.params(eos),
                options: case.options(),
                cache: target.make_cache(),
                draft_state: None,
                logprobs: case.logprobs.then_some(2),
                cancel: None,
            };
            ids[i] = batch.add(case.source(target, drafter, suffix), request, collector(&outs[i])).unwrap();
        }
        let finished = batch.step();
        let shape = batch.last_round().unwrap_or_default();
        WIDEST.with(|w| w.set(w.get().max(shape.requests)));
        assert!(shape.rows >= shape.requests);
        for done in finished {
            let i = ids.iter().position(|&id| id == done.id).unwrap();
            let outcome = done.result.unwrap_or_else(|e| panic!("request {i}: {e}"));
            outcome.stats.check().unwrap();
            assert_eq!(outcome.stats.emitted, outs[i].borrow().len());
            finish[i] = Some(outcome.finish);
        }
        step += 1;
        assert!(step < 10_000, "the batch does not finish");
    }
    outs.into_iter().zip(finish).map(|(o, f)| (o.take(), f.unwrap())).collect()
}

fn check_cases(target_name: &str, cases_per_run: u32) {
    let target = load(target_name);
    let drafter = load("qwen2");
    let suffix = SuffixProvider::new(CostModel::fixed(CostCurve::linear(0.05, 33)));
    runner(cases_per_run)
        .run(&proptest::collection::vec(case_strategy(), 1..6), |cases| {
            let got = batched(&target, &drafter, &suffix, &cases, &[]);
            for (case, (tokens, _)) in cases.iter().zip(&got) {
                let want = plain(&target, &case.prompt, &case.params(&[]));
                let ids: Vec<u32> = tokens.iter().map(|(t, _)| *t).collect();
                prop_assert_eq!(&ids, &want, "batched != plain for {:?}", case);
                let alone = solo(&target, &drafter, &suffix, case, &[]);
                prop_assert_eq!(tokens, &alone, "batched != solo (tokens or logprobs) for {:?}", case);
            }
            Ok(())
        })
        .unwrap();
    assert!(WIDEST.with(|w| w.get()) >= 4, "the cases never batched four requests together");
}

#[test]
fn batched_requests_equal_plain_and_solo_quantized() {
    check_cases("llama_q4", 8);
}

#[test]
fn batched_requests_equal_plain_and_solo_dense() {
    check_cases("llama", 6);
}

/// EOS, max-tokens, a stop from `on_token` and a cancellation in the middle of a batch: the
/// other requests' tokens are what they are alone.
#[test]
fn requests_ending_mid_batch_leave_the_others_unchanged() {
    let target = load("llama_q4");
    let drafter = load("qwen2");
    let suffix = SuffixProvider::new(CostModel::fixed(CostCurve::linear(0.05, 33)));
    let base = Case {
        prompt: vec![1, 2, 3, 1, 2, 3, 1, 2],
        max_tokens: 30,
        seed: 0,
        drafter: 1,
        num_draft_tokens: 4,
        logprobs: false,
        arrives: 0,
    };
    let plain_run = plain(&target, &base.prompt, &base.params(&[]));
    // An EOS the plain run reaches at its fifth token.
    let eos = vec![plain_run[4]];
    let cases = vec![
        Case { max_tokens: 3, ..base.clone() },
        Case { prompt: vec![9, 8, 7, 6, 5], seed: 42, drafter: 4, ..base.clone() },
        Case { prompt: vec![4, 4, 4, 4], drafter: 3, arrives: 2, ..base.clone() },
        base.clone(),
    ];
    let with_eos = batched(&target, &drafter, &suffix, &cases, &eos);
    for (case, (tokens, finish)) in cases.iter().zip(&with_eos) {
        let want = plain(&target, &case.prompt, &case.params(&eos));
        assert_eq!(tokens.iter().map(|(t, _)| *t).collect::<Vec<_>>(), want, "{case:?}");
        let expected = if want.len() < case.max_tokens { Finish::Eos } else { Finish::MaxTokens };
        assert_eq!(*finish, expected, "{case:?}");
    }

    // A stop after 2 tokens and a cancellation after 4 tokens, with two others running.
    let mut batch = Batch::new(&target);
    let cancel = Arc::new(AtomicBool::new(false));
    let outs: Vec<Collected> = (0..4).map(|_| Collected::default()).collect();
    let mut ids = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let request = BatchRequest {
            prompt: case.prompt.clone(),
            params: case.params(&[]),
            options: case.options(),
            cache: target.make_cache(),
            draft_state: None,
            logprobs: None,
            cancel: (i == 3).then(|| cancel.clone()),
        };
        let out = outs[i].clone();
        let cancel = cancel.clone();
        let on_token: Box<dyn FnMut(&Emitted) -> bool> = Box::new(move |e: &Emitted| {
            out.borrow_mut().push((e.token, None));
            let n = out.borrow().len();
            if i == 3 && n >= 4 {
                cancel.store(true, Ordering::Relaxed);
            }
            !(i == 1 && n >= 2)
        });
        ids.push(batch.add(case.source(&target, &drafter, &suffix), request, on_token).unwrap());
    }
    let mut finish = [None; 4];
    while !batch.is_empty() {
        for done in batch.step() {
            let i = ids.iter().position(|&id| id == done.id).unwrap();
            finish[i] = Some(done.result.unwrap().finish);
        }
    }
    assert_eq!(finish[1], Some(Finish::Stopped));
    assert_eq!(finish[3], Some(Finish::Cancelled));
    for (i, case) in cases.iter().enumerate() {
        let want = plain(&target, &case.prompt, &case.params(&[]));
        let got: Vec<u32> = outs[i].borrow().iter().map(|(t, _)| *t).collect();
        assert_eq!(got[..], want[..got.len()], "request {i}");
        if i == 0 || i == 2 {
            assert_eq!(got, want, "request {i} ran to the end");
        }
    }
}

/// A request's failure (here a drafter breaking its contract) fails that request only.
#[test]
fn a_failing_drafter_fails_its_request_only() {
    struct TooMany;
    impl DraftSource for TooMany {
        fn name(&self) -> &str {
            "too-many"
        }
        fn prefill(&mut self, _: &[u32], _: Option<&[mlx_core::Array]>) -> spec::Result<()> {
            Ok(())
        }
        fn draft(&mut self, _: &[u32], n: usize, _: usize) -> spec::Result<Vec<u32>> {
            Ok(vec![1; n + 1])
        }
        fn commit(&mut self, _: usize, _: usize, _: Option<&[mlx_core::Array]>) -> spec::Result<()> {
            Ok(())
        }
    }
    let target = load("llama_q4");
    let mut batch = Batch::new(&target);
    let params = GenerateParams { max_tokens: 8, sampler: Sampler::default(), eos: vec![] };
    let good = Collected::default();
    let request = |prompt: Vec<u32>| BatchRequest {
        prompt,
        params: params.clone(),
        options: SpecOptions::from(3),
        cache: target.make_cache(),
        draft_state: None,
        logprobs: None,
        cancel: None,
    };
    let bad = batch.add(Box::new(TooMany), request(vec![5, 6]), collector(&Collected::default())).unwrap();
    batch.add(Box::new(SuffixSource::fixed()), request(vec![5, 6, 5, 6]), collector(&good)).unwrap();
    let mut errors = Vec::new();
    while !batch.is_empty() {
        for done in batch.step() {
            if let Err(e) = done.result {
                errors.push((done.id, e.to_string()));
            }
        }
    }
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].0, bad);
    assert!(errors[0].1.contains("too-many"), "{}", errors[0].1);
    let got: Vec<u32> = good.borrow().iter().map(|(t, _)| *t).collect();
    assert_eq!(got, plain(&target, &[5, 6, 5, 6], &params));
}
