//! The executor on the tiny random fixture models (vocab 256): speculative output equals
//! plain output token for token, greedy and seeded-sampled, for every num_draft_tokens in
//! 1..=12 and every source (n-gram, suffix with every proposed token or under the cost-aware
//! policy, with a cross-request store shared by every case, two-model with each fixture as
//! drafter, with a fixed or a cost-aware length, a source that proposes garbage); EOS and max_tokens mid-window; a target cache that cannot trim; the
//! stats invariants. Property tests run with a fixed seed, so every run checks the same cases.
mod common;

use std::cell::Cell;
use std::path::PathBuf;
use std::rc::Rc;

use common::{plain, spec_run};
use mlx_core::Array;
use models::{GenerateParams, LayerCache, LoadOptions, ModelCache, Sampler, Transformer, load_model};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use spec::ngram::{DraftSchedule, NgramSource};
use spec::policy::{CostCurve, CostModel};
use spec::suffix::{SuffixProvider, SuffixSource};
use spec::two_model::{DraftSampling, TwoModelProvider, TwoModelSource};
use spec::{DraftProvider, DraftSource, Error, SpecStats, speculative_generate, speculative_generate_with_cache};

const TARGET: &str = "llama";
/// Every tiny fixture shares vocab 256, so each can draft for the llama target.
const DRAFTERS: [&str; 6] = ["llama", "llama_q4", "qwen2", "qwen3", "llama_untied_bias", "qwen2_bf16"];

fn load(name: &str) -> Transformer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name);
    load_model(&dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("load {name}: {e}"))
}

fn runner(cases: u32) -> TestRunner {
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]))
}

/// Checks output equality and the stats invariants, including the ones tying the stats to
/// the output (emitted count, EOS flag).
fn check_run(
    label: &str,
    want: &[u32],
    (got, stats): (Vec<u32>, SpecStats),
    params: &GenerateParams,
) -> Result<SpecStats, TestCaseError> {
    prop_assert_eq!(&got[..], want, "{}: speculative != plain; stats {:?}", label, stats);
    stats.check().map_err(|e| TestCaseError::fail(format!("{label}: {e}")))?;
    prop_assert_eq!(stats.emitted, got.len(), "{}", label);
    prop_assert!(stats.emitted <= params.max_tokens);
    Ok(stats)
}

/// A source that proposes random tokens of random length (0..=n), seeded.
struct Garbage {
    state: u64,
    last: usize,
}

impl Garbage {
    fn new(seed: u64) -> Self {
        Garbage { state: seed | 1, last: 0 }
    }
    fn next(&mut self) -> u64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        self.state
    }
}

impl DraftSource for Garbage {
    fn name(&self) -> &str {
        "garbage"
    }
    fn prefill(&mut self, _prompt: &[u32], _taps: Option<&[Array]>) -> spec::Result<()> {
        Ok(())
    }
    fn draft(&mut self, _feed: &[u32], n: usize, _step: usize) -> spec::Result<Vec<u32>> {
        let len = (self.next() % (n as u64 + 1)) as usize;
        let drafts: Vec<u32> = (0..len).map(|_| (self.next() % 256) as u32).collect();
        self.last = drafts.len();
        Ok(drafts)
    }
    fn commit(&mut self, drafted: usize, accepted: usize, _taps: Option<&[Array]>) -> spec::Result<()> {
        assert_eq!(drafted, self.last);
        assert!(accepted <= drafted);
        Ok(())
    }
}

/// A suffix provider under the cost-aware policy with a cheap linear cost curve (so the
/// random fixtures, which rarely continue a copy, still get drafts to verify).
fn adaptive_suffix() -> SuffixProvider {
    SuffixProvider::new(CostModel::fixed(CostCurve::linear(0.05, 33)))
}

/// Cheap fixed cost curves for a draft model under the cost-aware policy.
fn model_policy(p: TwoModelProvider) -> TwoModelProvider {
    p.with_policy(CostModel::fixed(CostCurve::linear(0.05, 33)), CostModel::fixed(CostCurve::linear(0.05, 33)))
}

/// Runs the suffix drafter twice on one case: every proposed token, then the policy's
/// choice (a source of `adaptive`, whose store holds the earlier cases' streams).
fn check_suffix(
    target: &Transformer,
    adaptive: &SuffixProvider,
    want: &[u32],
    prompt: &[u32],
    params: &GenerateParams,
    n: usize,
) -> Result<(), TestCaseError> {
    let mut fixed = SuffixSource::fixed();
    check_run(&format!("suffix n={n}"), want, spec_run(target, &mut fixed, prompt, params, n), params)?;
    let mut source = adaptive.open(target, &params.sampler).unwrap();
    let label = format!("suffix adaptive n={n}");
    check_run(&label, want, spec_run(target, source.as_mut(), prompt, params, n), params)?;
    Ok(())
}

fn prompt_strategy() -> impl Strategy<Value = Vec<u32>> {
    // Small alphabets make repeats (n-gram hits); 256 covers the whole vocabulary.
    (prop_oneof![Just(3u32), Just(16u32), Just(256u32)], proptest::collection::vec(0u32..256, 1..20))
        .prop_map(|(alphabet, raw)| raw.into_iter().map(|t| t % alphabet).collect())
}

#[test]
fn greedy_speculative_equals_greedy_plain() {
    let target = load(TARGET);
    let drafters: Vec<Transformer> = DRAFTERS.iter().map(|d| load(d)).collect();
    let strategy = (prompt_strategy(), 0usize..DRAFTERS.len(), any::<u64>());
    let adaptive = adaptive_suffix();
    let adaptive_two: Vec<TwoModelProvider> =
        DRAFTERS.iter().map(|d| model_policy(TwoModelProvider::new(load(d), *d))).collect();
    runner(4)
        .run(&strategy, |(prompt, drafter, seed)| {
            let params = GenerateParams { max_tokens: 16, sampler: Sampler::default(), eos: vec![] };
            let want = plain(&target, &prompt, &params);
            check_suffix(&target, &adaptive, &want, &prompt, &params, 32)?;
            for n in 1..=12 {
                check_suffix(&target, &adaptive, &want, &prompt, &params, n)?;
                let mut ngram = NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Constant);
                check_run(&format!("ngram n={n}"), &want, spec_run(&target, &mut ngram, &prompt, &params, n), &params)?;
                let mut heuristic = NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Heuristic);
                let label = format!("ngram heuristic n={n}");
                check_run(&label, &want, spec_run(&target, &mut heuristic, &prompt, &params, n), &params)?;
                let mut two = TwoModelSource::new(&drafters[drafter], Sampler::default(), DRAFTERS[drafter]);
                let label = format!("two-model {} n={n}", DRAFTERS[drafter]);
                check_run(&label, &want, spec_run(&target, &mut two, &prompt, &params, n), &params)?;
                let mut two = adaptive_two[drafter].open(&target, &params.sampler).unwrap();
                let label = format!("two-model adaptive {} n={n}", DRAFTERS[drafter]);
                check_run(&label, &want, spec_run(&target, two.as_mut(), &prompt, &params, n), &params)?;
                let mut garbage = Garbage::new(seed ^ n as u64);
                check_run(
                    &format!("garbage n={n}"),
                    &want,
                    spec_run(&target, &mut garbage, &prompt, &params, n),
                    &params,
                )?;
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn seeded_sampled_speculative_equals_seeded_plain() {
    let target = load(TARGET);
    let drafters: Vec<Transformer> = DRAFTERS.iter().map(|d| load(d)).collect();
    let strategy = (prompt_strategy(), 0usize..DRAFTERS.len(), any::<u64>());
    let adaptive = adaptive_suffix();
    runner(3)
        .run(&strategy, |(prompt, drafter, seed)| {
            let sampler = Sampler { temp: 0.8, top_p: 0.9, seed, ..Sampler::default() };
            let params = GenerateParams { max_tokens: 16, sampler, eos: vec![] };
            let want = plain(&target, &prompt, &params);
            let provider =
                TwoModelProvider::new(load(DRAFTERS[drafter]), DRAFTERS[drafter]).with_sampling(DraftSampling::Request);
            let adaptive_two = model_policy(
                TwoModelProvider::new(load(DRAFTERS[drafter]), DRAFTERS[drafter]).with_sampling(DraftSampling::Request),
            );
            check_suffix(&target, &adaptive, &want, &prompt, &params, 32)?;
            for n in 1..=12 {
                check_suffix(&target, &adaptive, &want, &prompt, &params, n)?;
                let mut ngram = NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Constant);
                check_run(&format!("ngram n={n}"), &want, spec_run(&target, &mut ngram, &prompt, &params, n), &params)?;
                let mut coupled = provider.open(&target, &params.sampler).unwrap();
                let label = format!("two-model sampled {} n={n}", DRAFTERS[drafter]);
                check_run(&label, &want, spec_run(&target, coupled.as_mut(), &prompt, &params, n), &params)?;
                let mut adaptive = adaptive_two.open(&target, &params.sampler).unwrap();
                let label = format!("two-model sampled adaptive {} n={n}", DRAFTERS[drafter]);
                check_run(&label, &want, spec_run(&target, adaptive.as_mut(), &prompt, &params, n), &params)?;
                let mut greedy = TwoModelSource::new(&drafters[drafter], Sampler::default(), DRAFTERS[drafter]);
                let label = format!("two-model greedy {} n={n}", DRAFTERS[drafter]);
                check_run(&label, &want, spec_run(&target, &mut greedy, &prompt, &params, n), &params)?;
                let mut garbage = Garbage::new(seed.rotate_left(n as u32));
                check_run(
                    &format!("garbage n={n}"),
                    &want,
                    spec_run(&target, &mut garbage, &prompt, &params, n),
                    &params,
                )?;
            }
            Ok(())
        })
        .unwrap();
}

/// EOS chosen among the tokens plain decoding emits, so it shows up in the drafts of a
/// self-drafting target (which accepts everything) and ends the walk mid-window.
#[test]
fn eos_mid_window_stops_exactly_where_plain_stops() {
    let target = load(TARGET);
    let checked = Cell::new(0);
    runner(6)
        .run(&(prompt_strategy(), 1usize..24), |(prompt, k)| {
            let free = GenerateParams { max_tokens: 24, sampler: Sampler::default(), eos: vec![] };
            let free_out = plain(&target, &prompt, &free);
            let eos = free_out[k.min(free_out.len() - 1)];
            let params = GenerateParams { eos: vec![eos], ..free };
            let want = plain(&target, &prompt, &params);
            prop_assert!(!want.contains(&eos));
            for n in 1..=12 {
                let mut two = TwoModelSource::new(&target, Sampler::default(), "self");
                let stats = check_run(
                    &format!("self n={n}"),
                    &want,
                    spec_run(&target, &mut two, &prompt, &params, n),
                    &params,
                )?;
                prop_assert!(stats.stopped_on_eos, "n={}: {:?}", n, stats);
                let mut ngram = NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Constant);
                let stats = check_run(
                    &format!("ngram n={n}"),
                    &want,
                    spec_run(&target, &mut ngram, &prompt, &params, n),
                    &params,
                )?;
                prop_assert!(stats.stopped_on_eos);
            }
            checked.set(checked.get() + 1);
            Ok(())
        })
        .unwrap();
    assert_eq!(checked.get(), 6);
}

#[test]
fn max_tokens_is_respected_at_every_length() {
    let target = load(TARGET);
    let prompt = [5, 9, 5, 9, 17, 5, 9];
    let full = plain(&target, &prompt, &GenerateParams { max_tokens: 20, sampler: Sampler::default(), eos: vec![] });
    for max_tokens in 0..=20 {
        let params = GenerateParams { max_tokens, sampler: Sampler::default(), eos: vec![] };
        for n in [1, 2, 3, 7, 12] {
            let mut two = TwoModelSource::new(&target, Sampler::default(), "self");
            let (got, stats) = spec_run(&target, &mut two, &prompt, &params, n);
            assert_eq!(got, full[..max_tokens], "max_tokens={max_tokens} n={n}");
            stats.check().unwrap();
            let mut ngram = NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Constant);
            let (got, stats) = spec_run(&target, &mut ngram, &prompt, &params, n);
            assert_eq!(got, full[..max_tokens], "ngram max_tokens={max_tokens} n={n}");
            stats.check().unwrap();
        }
    }
}

/// mlx-examples#149 / mlx-lm test_generate: a target drafting for itself accepts every
/// draft (any off-by-one in the rollback or the re-feed would break this), and the round
/// structure is the one the budget implies.
#[test]
fn self_draft_accepts_every_draft() {
    let target = load(TARGET);
    let params = GenerateParams { max_tokens: 5, sampler: Sampler::default(), eos: vec![] };
    let prompt = [1, 2, 3, 4];
    let mut two = TwoModelSource::new(&target, Sampler::default(), "self");
    let (got, stats) = spec_run(&target, &mut two, &prompt, &params, 2);
    assert_eq!(got, plain(&target, &prompt, &params));
    // Round 1: 2 drafts accepted + bonus (3 tokens); round 2: budget 2 -> 1 draft + bonus.
    assert_eq!((stats.rounds, stats.drafted, stats.accepted, stats.bonuses, stats.corrections), (2, 3, 3, 2, 0));
    assert_eq!(stats.drafted_by_pos, vec![2, 1]);
    assert_eq!(stats.accepted_by_pos, vec![2, 1]);
    assert!((stats.tau - 2.5).abs() < 1e-12);

    for n in 1..=12 {
        let params = GenerateParams { max_tokens: 40, ..params.clone() };
        let mut two = TwoModelSource::new(&target, Sampler::default(), "self");
        let (got, stats) = spec_run(&target, &mut two, &[7, 7, 200, 31], &params, n);
        assert_eq!(got, plain(&target, &[7, 7, 200, 31], &params), "n={n}");
        stats.check().unwrap();
        assert_eq!(stats.accepted, stats.drafted, "n={n}: {stats:?}");
        assert_eq!(stats.corrections, 0);
        // Every round but the last asks for n drafts: 40 tokens in ceil(40 / (n + 1)) rounds.
        assert_eq!(stats.rounds, 40usize.div_ceil(n + 1), "n={n}");
    }
}

/// A source that never drafts: every round is one plain step, pipelined when `.0` says so.
struct Never(bool);

impl DraftSource for Never {
    fn name(&self) -> &str {
        "never"
    }
    fn pipeline_plain_steps(&self) -> bool {
        self.0
    }
    fn prefill(&mut self, _: &[u32], _: Option<&[Array]>) -> spec::Result<()> {
        Ok(())
    }
    fn draft(&mut self, _: &[u32], _: usize, _: usize) -> spec::Result<Vec<u32>> {
        Ok(Vec::new())
    }
    fn commit(&mut self, drafted: usize, accepted: usize, _: Option<&[Array]>) -> spec::Result<()> {
        assert_eq!((drafted, accepted), (0, 0));
        Ok(())
    }
}

#[test]
fn rounds_without_drafts_are_plain_steps() {
    let target = load(TARGET);
    let prompt = [3, 1, 4, 1, 5, 9, 2, 6];
    let params =
        GenerateParams { max_tokens: 16, sampler: Sampler { temp: 0.7, seed: 3, ..Sampler::default() }, eos: vec![] };
    let want = plain(&target, &prompt, &params);
    for (n, pipeline) in [(0, true), (1, true), (5, true), (5, false)] {
        let (got, stats) = spec_run(&target, &mut Never(pipeline), &prompt, &params, n);
        assert_eq!(got, want, "n {n}, pipelined {pipeline}");
        stats.check().unwrap();
        assert_eq!((stats.rounds, stats.empty_rounds, stats.bonuses, stats.drafted), (16, 16, 16, 0));
        assert_eq!(stats.tau, 1.0);
        // A source that declines the pipeline gets one-token windows instead.
        assert_eq!(stats.pipelined_steps, if pipeline { 16 } else { 0 }, "n {n}");
    }
    // num_draft_tokens = 0 with real sources: the feeds are absorbed without drafting.
    let mut two = TwoModelSource::new(&target, Sampler::default(), "self");
    let (got, _) = spec_run(&target, &mut two, &prompt, &params, 0);
    assert_eq!(got, want);
    let mut ngram = NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Constant);
    let (got, _) = spec_run(&target, &mut ngram, &prompt, &params, 0);
    assert_eq!(got, want);
}

#[test]
fn a_source_that_breaks_the_contract_is_an_error() {
    struct Over;
    impl DraftSource for Over {
        fn name(&self) -> &str {
            "over"
        }
        fn prefill(&mut self, _: &[u32], _: Option<&[Array]>) -> spec::Result<()> {
            Ok(())
        }
        fn draft(&mut self, _: &[u32], n: usize, _: usize) -> spec::Result<Vec<u32>> {
            Ok(vec![1; n + 1])
        }
        fn commit(&mut self, _: usize, _: usize, _: Option<&[Array]>) -> spec::Result<()> {
            Ok(())
        }
    }
    let target = load(TARGET);
    let params = GenerateParams { max_tokens: 8, sampler: Sampler::default(), eos: vec![] };
    let err = speculative_generate(&target, &mut Over, &[1, 2], &params, 3, |_| true).unwrap_err();
    assert!(matches!(err, Error::Contract { .. }), "{err}");
    assert!(err.to_string().contains("over"), "{err}");
    struct Outside;
    impl DraftSource for Outside {
        fn name(&self) -> &str {
            "outside"
        }
        fn prefill(&mut self, _: &[u32], _: Option<&[Array]>) -> spec::Result<()> {
            Ok(())
        }
        fn draft(&mut self, _: &[u32], _: usize, _: usize) -> spec::Result<Vec<u32>> {
            Ok(vec![3, 256])
        }
        fn commit(&mut self, _: usize, _: usize, _: Option<&[Array]>) -> spec::Result<()> {
            Ok(())
        }
    }
    let err = speculative_generate(&target, &mut Outside, &[1, 2], &params, 3, |_| true).unwrap_err();
    assert!(matches!(err, Error::Contract { .. }) && err.to_string().contains("256"), "{err}");
    let err = speculative_generate(&target, &mut Over, &[], &params, 3, |_| true).unwrap_err();
    assert!(matches!(err, Error::Invalid(_)), "{err}");
}

#[test]
fn on_token_false_stops_mid_window() {
    let target = load(TARGET);
    let prompt = [9, 8, 7];
    let params = GenerateParams { max_tokens: 30, sampler: Sampler::default(), eos: vec![] };
    let want = plain(&target, &prompt, &params);
    for stop_after in 1..=6 {
        let mut two = TwoModelSource::new(&target, Sampler::default(), "self");
        let mut got = Vec::new();
        let stats = speculative_generate(&target, &mut two, &prompt, &params, 8, |t| {
            got.push(t);
            got.len() < stop_after
        })
        .unwrap();
        assert_eq!(got, want[..stop_after]);
        assert_eq!(stats.emitted, stop_after);
        stats.check().unwrap();
    }
}

#[derive(Clone, Copy, Debug)]
enum Flaw {
    /// `can_trim` says no after a few trims (a rotating window that wrapped).
    Refuses,
    /// `trim` removes one position fewer than asked and says so.
    Short,
    /// `can_trim` says yes, `trim` removes nothing and reports 0 (mlx-lm's trim_prompt_cache).
    Noop,
}

/// A full KV cache whose rollback stops being exact after `good` trims (every layer sees the
/// same calls, so the per-layer counts agree).
struct FlakyCache {
    inner: Box<dyn LayerCache>,
    flaw: Flaw,
    trims: usize,
    good: usize,
}

impl LayerCache for FlakyCache {
    fn offset(&self) -> usize {
        self.inner.offset()
    }
    fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> models::Result<(Array, Array)> {
        self.inner.update_and_fetch(keys, values)
    }
    fn can_trim(&self, n: usize) -> bool {
        match self.flaw {
            Flaw::Refuses => self.trims < self.good && self.inner.can_trim(n),
            Flaw::Short | Flaw::Noop => true,
        }
    }
    fn trim(&mut self, n: usize) -> usize {
        let broken = self.trims >= self.good;
        self.trims += 1;
        match (broken, self.flaw) {
            (false, _) | (true, Flaw::Refuses) => self.inner.trim(n),
            (true, Flaw::Short) => self.inner.trim(n.saturating_sub(1)),
            (true, Flaw::Noop) => 0,
        }
    }
    fn state(&self) -> Vec<Array> {
        self.inner.state()
    }
}

fn flaky_cache(model: &Transformer, flaw: Flaw, good: usize) -> ModelCache {
    let layers = model
        .make_cache()
        .layers
        .into_iter()
        .map(|inner| Box::new(FlakyCache { inner, flaw, trims: 0, good }) as Box<dyn LayerCache>)
        .collect();
    ModelCache { layers }
}

/// Each flaw, from the first rollback or after two or 40 good ones (the fallback then
/// re-runs more tokens than one window of its re-prefill holds), greedy and sampled: the
/// output is still plain decoding's, and the request fell back exactly when the flaw appeared.
#[test]
fn a_cache_that_cannot_trim_exactly_falls_back_to_plain_decoding() {
    let target = load(TARGET);
    let prompt = [2, 7, 1, 8, 2, 8];
    for sampler in [Sampler::default(), Sampler { temp: 0.8, top_p: 0.9, seed: 11, ..Sampler::default() }] {
        let params = GenerateParams { max_tokens: 56, sampler, eos: vec![] };
        let want = plain(&target, &prompt, &params);
        for flaw in [Flaw::Refuses, Flaw::Short, Flaw::Noop] {
            for good in [0, 2, 40] {
                for n in [1, 4, 12] {
                    let cache = flaky_cache(&target, flaw, good);
                    let trims = Rc::new(Cell::new(0));
                    let mut source = CountingGarbage { inner: Garbage::new(99 + n as u64), trims: trims.clone() };
                    let mut got = Vec::new();
                    let stats =
                        speculative_generate_with_cache(&target, cache, &mut source, &prompt, &params, n, |t| {
                            got.push(t);
                            true
                        })
                        .unwrap();
                    let label = format!("{flaw:?} good={good} n={n}");
                    assert_eq!(got, want, "{label}: {stats:?}");
                    stats.check().unwrap();
                    assert!(stats.fallback_at.is_some(), "{label}: the flaw was never hit: {stats:?}");
                    assert_eq!(trims.get(), good, "{label}: commits before the fallback");
                }
            }
        }
    }
}

/// Garbage drafts (always at least one, so almost every round rolls back), counting the
/// rounds that rolled back and were committed.
struct CountingGarbage {
    inner: Garbage,
    trims: Rc<Cell<usize>>,
}

impl DraftSource for CountingGarbage {
    fn name(&self) -> &str {
        "counting-garbage"
    }
    fn prefill(&mut self, p: &[u32], t: Option<&[Array]>) -> spec::Result<()> {
        self.inner.prefill(p, t)
    }
    fn draft(&mut self, f: &[u32], n: usize, s: usize) -> spec::Result<Vec<u32>> {
        let mut d = self.inner.draft(f, n, s)?;
        if d.is_empty() && n > 0 {
            d.push(255);
            self.inner.last = 1;
        }
        Ok(d)
    }
    fn commit(&mut self, drafted: usize, accepted: usize, t: Option<&[Array]>) -> spec::Result<()> {
        if accepted < drafted {
            self.trims.set(self.trims.get() + 1);
        }
        self.inner.commit(drafted, accepted, t)
    }
}

/// A source asking for target taps gets `[1, n-1, H]` at prefill and `[1, d+1, H]` per
/// round, and the output does not change.
#[test]
fn taps_reach_the_source() {
    struct Tapping {
        inner: NgramSource,
        hidden: usize,
        seen: Vec<(usize, Vec<Vec<i32>>)>,
        last: usize,
    }
    impl DraftSource for Tapping {
        fn name(&self) -> &str {
            "tapping"
        }
        fn tap_layers(&self) -> &[usize] {
            &[1, 0]
        }
        fn prefill(&mut self, p: &[u32], taps: Option<&[Array]>) -> spec::Result<()> {
            let taps = taps.expect("prefill taps for a multi-token prompt");
            assert_eq!(taps.len(), 2);
            for t in taps {
                assert_eq!(t.shape(), vec![1, p.len() as i32 - 1, self.hidden as i32]);
            }
            self.inner.prefill(p, None)
        }
        fn draft(&mut self, f: &[u32], n: usize, s: usize) -> spec::Result<Vec<u32>> {
            let d = self.inner.draft(f, n, s)?;
            self.last = d.len();
            Ok(d)
        }
        fn commit(&mut self, drafted: usize, accepted: usize, taps: Option<&[Array]>) -> spec::Result<()> {
            let taps = taps.expect("window taps");
            self.seen.push((drafted, taps.iter().map(|t| t.shape()).collect()));
            assert_eq!(drafted, self.last);
            self.inner.commit(drafted, accepted, None)
        }
    }
    let target = load(TARGET);
    let hidden = target.config.hidden_size;
    let prompt = [4, 5, 6, 4, 5, 6, 4, 5];
    let params = GenerateParams { max_tokens: 20, sampler: Sampler::default(), eos: vec![] };
    let mut src = Tapping {
        inner: NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Constant),
        hidden,
        seen: vec![],
        last: 0,
    };
    let (got, stats) = spec_run(&target, &mut src, &prompt, &params, 5);
    assert_eq!(got, plain(&target, &prompt, &params));
    stats.check().unwrap();
    assert!(!src.seen.is_empty());
    for (d, shapes) in &src.seen {
        assert_eq!(shapes, &vec![vec![1, *d as i32 + 1, hidden as i32]; 2]);
    }
}

#[test]
fn stats_serialize() {
    let target = load(TARGET);
    let params = GenerateParams { max_tokens: 6, sampler: Sampler::default(), eos: vec![] };
    let mut ngram = NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Constant);
    let (_, stats) = spec_run(&target, &mut ngram, &[1, 2, 1, 2], &params, 4);
    let json = serde_json::to_value(&stats).unwrap();
    for key in ["rounds", "target_forwards", "drafted", "accepted", "emitted", "tau", "accepted_by_pos", "decode_ms"] {
        assert!(json.get(key).is_some(), "{key} missing from {json}");
    }
}

/// The draft model's cache failing to trim: the source rebuilds it from the committed tokens
/// and drafts exactly as with a healthy cache (same acceptance), and the output is plain's.
#[test]
fn a_draft_cache_that_cannot_trim_is_rebuilt() {
    let target = load(TARGET);
    let drafter = load("qwen2");
    let prompt = [2, 7, 1, 8, 2, 8, 1, 8];
    let params = GenerateParams { max_tokens: 24, sampler: Sampler::default(), eos: vec![] };
    let want = plain(&target, &prompt, &params);
    for n in [2, 5, 9] {
        let mut healthy = TwoModelSource::new(&drafter, Sampler::default(), "qwen2");
        let (got, reference) = spec_run(&target, &mut healthy, &prompt, &params, n);
        assert_eq!(got, want);
        assert_eq!(healthy.rebuilds(), 0);
        for flaw in [Flaw::Refuses, Flaw::Short, Flaw::Noop] {
            let cache = flaky_cache(&drafter, flaw, 1);
            let mut flaky = TwoModelSource::new(&drafter, Sampler::default(), "qwen2").with_cache(cache).unwrap();
            let (got, stats) = spec_run(&target, &mut flaky, &prompt, &params, n);
            assert_eq!(got, want, "{flaw:?} n={n}");
            stats.check().unwrap();
            assert_eq!(flaky.rebuilds(), 1, "{flaw:?} n={n}: {stats:?}");
            assert_eq!(stats.accepted_by_pos, reference.accepted_by_pos, "{flaw:?} n={n}");
        }
    }
}

/// omlx#3370 (acceptance collapsing at temp > 0): a target drafting for itself with the
/// request's sampler draws each draft with the key the target uses at that step, so at any
/// temperature every draft is accepted.
#[test]
fn coupled_sampling_accepts_every_self_draft() {
    let target = load(TARGET);
    let prompt = [11, 12, 13, 11, 12];
    for (temp, top_p) in [(0.8, 0.9), (1.0, 0.0), (1.5, 0.95)] {
        let sampler = Sampler { temp, top_p, seed: 5, ..Sampler::default() };
        let params = GenerateParams { max_tokens: 30, sampler, eos: vec![] };
        let want = plain(&target, &prompt, &params);
        for n in [1, 3, 8] {
            let mut two = TwoModelSource::new(&target, params.sampler.clone(), "self");
            let (got, stats) = spec_run(&target, &mut two, &prompt, &params, n);
            assert_eq!(got, want, "temp {temp} n={n}");
            stats.check().unwrap();
            assert_eq!((stats.corrections, stats.accepted), (0, stats.drafted), "temp {temp} n={n}: {stats:?}");
        }
    }
}
