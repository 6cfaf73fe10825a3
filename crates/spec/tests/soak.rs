//! The lossless soak: random requests — prompt, drafter (n-gram with random settings, the
//! suffix drafter with every proposal or under the cost-aware policy with a store shared by
//! every case, a draft model, a DSpark drafter), draft length, temperature, filters, seed and
//! `max_tokens` — on the tiny fixture models and on SmolLM2-135M (the default model), each
//! compared token for token with plain decoding under exact-match acceptance, with the
//! statistics invariants checked.
//!
//! Cases run in proptest runs of [`BATCH`] until `MLX_SPEC_SOAK_TOKENS` speculative tokens
//! (default [`CI_TOKENS`], with a fixed seed: the bounded slice of the test suite) have been
//! compared; `cargo xtask soak-lossless --tokens N` runs it at length in release mode with a
//! fresh seed (`PROPTEST_RNG_SEED` replays one).
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
    /// One cross-request suffix store per target (index as [`Case::target`]): a store
    /// holds one vocabulary's tokens, as a server's holds its one target's.
    suffix: [SuffixProvider; 3],
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
            suffix: [(); 3].map(|()| SuffixProvider::new(cheap())),
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
        // SmolLM2 costs ~30x a tiny model per token: 1 case in 33 (about 2% of the
        // tokens) keeps real weights in every slice without dominating its time.
        prop_oneof![24 => Just(0usize), 8 => Just(1), 1 => Just(2)],
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

/// Runs one case; returns the number of speculative tokens compared with plain decoding.
fn check(world: &World, c: &Case) -> Result<usize, TestCaseError> {
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
        2 => spec_open(target, &world.suffix[c.target], &c.prompt, &params, c.num_draft_tokens),
        3 => {
            let drafter: &dyn DraftProvider = if c.target == 2 { &world.smollm2_drafter } else { &world.tiny_drafter };
            spec_open(target, drafter, &c.prompt, &params, c.num_draft_tokens)
        }
        _ => spec_open(target, &world.dspark, &c.prompt, &params, c.num_draft_tokens),
    };
    prop_assert_eq!(&got, &want, "speculative != plain: {:?}, stats {:?}", c, stats);
    stats.check().map_err(|e| TestCaseError::fail(format!("{c:?}: {e}")))?;
    Ok(got.len())
}

/// Generated tokens the soak compares before it stops: `MLX_SPEC_SOAK_TOKENS`, default
/// [`CI_TOKENS`] (the bounded slice of the test suite).
const CI_TOKENS: u64 = 20_000;

/// Cases per proptest run; runs repeat, each with the next seed, until the token budget is
/// reached.
const BATCH: u32 = 64;

#[test]
fn random_requests_are_lossless() {
    let budget: u64 = match std::env::var("MLX_SPEC_SOAK_TOKENS") {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("MLX_SPEC_SOAK_TOKENS: expected a token count, got {v:?}")),
        Err(_) => CI_TOKENS,
    };
    let default = Config::default();
    let seed = match (std::env::var_os("PROPTEST_RNG_SEED"), default.rng_seed) {
        (Some(_), RngSeed::Fixed(s)) => s,
        _ => 20_261_202,
    };
    let world = world();
    // Per target (tiny llama, the DSpark pair's target, SmolLM2): requests, tokens, seconds.
    let tally = std::cell::RefCell::new([(0u64, 0u64, 0.0f64); 3]);
    let tokens = || tally.borrow().iter().map(|t| t.1).sum::<u64>();
    for batch in 0.. {
        if tokens() >= budget {
            break;
        }
        let rng_seed = RngSeed::Fixed(seed.wrapping_add(batch));
        let mut runner =
            TestRunner::new(Config { cases: BATCH, rng_seed, failure_persistence: None, ..default.clone() });
        runner
            .run(&case(), |c| {
                let t0 = std::time::Instant::now();
                let n = check(&world, &c)?;
                let t = &mut tally.borrow_mut()[c.target];
                *t = (t.0 + 1, t.1 + n as u64, t.2 + t0.elapsed().as_secs_f64());
                Ok(())
            })
            .unwrap_or_else(|e| panic!("seed {seed}, batch {batch}: {e}"));
        eprintln!("batch {batch}: {} tokens", tokens());
    }
    for (name, (cases, tokens, secs)) in ["tiny llama", "DSpark pair", "SmolLM2-135M"].iter().zip(tally.borrow().iter())
    {
        eprintln!("{name:>12}: {cases} requests, {tokens} speculative tokens equal to plain decoding, {secs:.1} s");
    }
    eprintln!("lossless soak: {} tokens in all (seed {seed})", tokens());
}
