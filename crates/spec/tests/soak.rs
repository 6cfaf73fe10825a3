//! The lossless soak: random requests — prompt, drafter (n-gram with random settings, the
//! suffix drafter with every proposal or under the cost-aware policy with a store shared by
//! every case, a draft model, a DSpark drafter), draft length, temperature, filters, seed and
//! `max_tokens` — on the tiny fixture models and on SmolLM2-135M (the default model), each
//! compared token for token with plain decoding under exact-match acceptance, with the
//! statistics invariants checked.
//!
//! The case count is proptest's `PROPTEST_CASES` (default here: 24, with a fixed seed, so the
//! test suite runs a bounded slice); `cargo xtask soak-lossless --cases N` runs it at length
//! in release mode with a fresh seed (`PROPTEST_RNG_SEED` replays one).
mod common;

use std::path::PathBuf;

use common::{plain, spec_open};
use drafter::Drafter;
use mlx_core::Dtype;
use models::default_model::ensure_default_model;
use models::{GenerateParams, LoadOptions, Sampler, Transformer, load_model};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestRunner};
use spec::DraftProvider;
use spec::dspark::DSparkProvider;
use spec::ngram::{DraftSchedule, NgramProvider};
use spec::policy::{CostCurve, CostModel};
use spec::suffix::{SuffixProvider, SuffixSource};
use spec::two_model::{DraftSampling, TwoModelProvider};

/// The targets of the soak and the drafters each can use.
struct World {
    tiny: Transformer,
    tiny_drafter: TwoModelProvider,
    dspark_target: Transformer,
    dspark: DSparkProvider,
    smollm2: Transformer,
    smollm2_drafter: TwoModelProvider,
    suffix: SuffixProvider,
    _dir: tempfile::TempDir,
}

fn world() -> World {
    {
        let fixture = |name: &str| {
            let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name);
            load_model(&dir, &LoadOptions::default()).unwrap()
        };
        let dir = tempfile::tempdir().unwrap();
        let (t, d) = test_support::dspark::write_tiny_pair(dir.path()).unwrap();
        let f32 = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };
        let smollm2 = ensure_default_model(&mut |_| {}).expect("fetch and import SmolLM2");
        let cheap = || CostModel::fixed(CostCurve::linear(0.05, 33));
        World {
            tiny: fixture("llama"),
            tiny_drafter: TwoModelProvider::new(fixture("qwen2"), "qwen2").with_sampling(DraftSampling::Request),
            dspark_target: load_model(&t, &LoadOptions::default()).unwrap(),
            dspark: DSparkProvider::new(Drafter::load(&d, &f32).unwrap(), "dspark").unwrap(),
            smollm2: load_model(&smollm2, &f32).unwrap(),
            smollm2_drafter: TwoModelProvider::new(load_model(&smollm2, &f32).unwrap(), "smollm2")
                .with_sampling(DraftSampling::Request),
            suffix: SuffixProvider::new(cheap()),
            _dir: dir,
        }
    }
}

/// One soak case.
#[derive(Debug, Clone)]
struct Case {
    /// 0 = tiny llama, 1 = the DSpark pair's target, 2 = SmolLM2.
    target: usize,
    /// 0 n-gram, 1 suffix (every proposal), 2 suffix (policy), 3 draft model, 4 DSpark.
    drafter: usize,
    prompt: Vec<u32>,
    num_draft_tokens: usize,
    max_tokens: usize,
    sampler: Sampler,
    ngram: (usize, usize, bool),
}

fn case() -> impl Strategy<Value = Case> {
    let sampler = prop_oneof![
        Just(Sampler::default()),
        (0.3f32..1.5, 0.5f32..=1.0, 0usize..40, prop_oneof![Just(0.0f32), 0.0f32..0.2], any::<u64>())
            .prop_map(|(temp, top_p, top_k, min_p, seed)| Sampler { temp, top_p, top_k, min_p, seed }),
    ];
    (
        prop_oneof![3 => Just(0usize), 1 => Just(1), 1 => Just(2)],
        0usize..5,
        (prop_oneof![Just(4u32), Just(32), Just(256)], prop::collection::vec(0u32..256, 1..40)),
        0usize..=16,
        1usize..40,
        sampler,
        (1usize..=4, 1usize..=4, any::<bool>()),
    )
        .prop_map(|(target, drafter, (alphabet, raw), num_draft_tokens, max_tokens, sampler, (a, b, constant))| {
            // A DSpark drafter only drafts for its own target.
            let target = if drafter == 4 { 1 } else { target };
            let drafter = if target == 1 { 4 } else { drafter };
            let prompt = raw.into_iter().map(|t| t % alphabet).collect();
            Case {
                target,
                drafter,
                prompt,
                num_draft_tokens,
                max_tokens,
                sampler,
                ngram: (a.max(b), a.min(b), constant),
            }
        })
}

fn check(world: &World, c: &Case) -> Result<(), TestCaseError> {
    let target = [&world.tiny, &world.dspark_target, &world.smollm2][c.target];
    let params = GenerateParams { max_tokens: c.max_tokens, sampler: c.sampler.clone(), eos: vec![2] };
    let want = plain(target, &c.prompt, &params);
    let ngram;
    let mut fixed;
    let (got, stats) = match c.drafter {
        0 => {
            let (max, min, constant) = c.ngram;
            let schedule = if constant { DraftSchedule::Constant } else { DraftSchedule::Heuristic };
            ngram = NgramProvider::new(max, min).unwrap().with_schedule(schedule);
            spec_open(target, &ngram, &c.prompt, &params, c.num_draft_tokens)
        }
        1 => {
            fixed = SuffixSource::fixed();
            common::spec_run(target, &mut fixed, &c.prompt, &params, c.num_draft_tokens)
        }
        2 => spec_open(target, &world.suffix, &c.prompt, &params, c.num_draft_tokens),
        3 => {
            let drafter: &dyn DraftProvider = if c.target == 2 { &world.smollm2_drafter } else { &world.tiny_drafter };
            spec_open(target, drafter, &c.prompt, &params, c.num_draft_tokens)
        }
        _ => spec_open(target, &world.dspark, &c.prompt, &params, c.num_draft_tokens),
    };
    prop_assert_eq!(&got, &want, "speculative != plain: {:?}, stats {:?}", c, stats);
    stats.check().map_err(|e| TestCaseError::fail(format!("{c:?}: {e}")))?;
    Ok(())
}

#[test]
fn random_requests_are_lossless() {
    let default = Config::default();
    let cases = if std::env::var_os("PROPTEST_CASES").is_some() { default.cases } else { 24 };
    let rng_seed =
        if std::env::var_os("PROPTEST_RNG_SEED").is_some() { default.rng_seed } else { RngSeed::Fixed(20_261_202) };
    let mut runner = TestRunner::new(Config { cases, rng_seed, failure_persistence: None, ..default });
    let world = world();
    runner.run(&case(), |c| check(&world, &c)).unwrap();
}
