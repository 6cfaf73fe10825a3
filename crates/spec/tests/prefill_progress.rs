//! Prefill progress ([`models::PrefillProgress`]) on the tiny fixture models, for a prompt of
//! three prefill chunks: plain decoding ([`models::generate_with_progress`]) and the
//! speculative executor ([`spec::Request::progress`]) with an n-gram source, a draft model,
//! a DSpark drafter (the tapped prefill) and a prompt-cache hit. Every call has `total` =
//! the prompt's length, `done` strictly increases from the cached tokens to `total`, the
//! last call comes before the first token, and the tokens are those of a run without
//! progress.
mod common;

use std::cell::RefCell;
use std::path::PathBuf;

use common::plain;
use drafter::Drafter;
use mlx_core::Dtype;
use models::generate::PREFILL_CHUNK;
use models::{GenerateParams, LoadOptions, Sampler, Transformer, generate_with_progress, load_model};
use spec::dspark::DSparkProvider;
use spec::ngram::{DraftSchedule, NgramSource};
use spec::two_model::TwoModelSource;
use spec::{DraftProvider, DraftSource, Request, SpecOptions, run};

/// Three prefill chunks' worth: `PROMPT_LEN - 1` tokens go in as 512 + 512 + 275.
const PROMPT_LEN: usize = 2 * PREFILL_CHUNK + 276;

fn load(name: &str) -> Transformer {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/parity").join(name);
    load_model(&dir, &LoadOptions::default()).unwrap_or_else(|e| panic!("load {name}: {e}"))
}

/// A deterministic prompt of `PROMPT_LEN` tokens over the fixtures' vocabulary of 256, with
/// repeats for the n-gram source to find.
fn long_prompt() -> Vec<u32> {
    (0..PROMPT_LEN).map(|i| ((i % 97) * 7 % 256) as u32).collect()
}

fn params(max_tokens: usize) -> GenerateParams {
    GenerateParams { max_tokens, sampler: Sampler::default(), eos: vec![] }
}

/// What a run reported, in order: a progress call or a token.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Event {
    Progress(usize, usize),
    Token(u32),
}

/// Splits `events` into the progress `done` values and the tokens, checking that every call
/// has `total` = `total`, that `done` strictly increases to `total`, and that no call comes
/// after the first token.
fn split(events: &[Event], total: usize) -> (Vec<usize>, Vec<u32>) {
    let first_token = events.iter().position(|e| matches!(e, Event::Token(_))).unwrap_or(events.len());
    let mut done = Vec::new();
    let mut tokens = Vec::new();
    for (i, e) in events.iter().enumerate() {
        match *e {
            Event::Progress(d, t) => {
                assert!(i < first_token, "a progress call after the first token: {events:?}");
                assert_eq!(t, total, "{events:?}");
                done.push(d);
            }
            Event::Token(t) => tokens.push(t),
        }
    }
    assert!(done.windows(2).all(|w| w[0] < w[1]), "done does not strictly increase: {done:?}");
    assert_eq!(done.last(), Some(&total), "done never reaches total: {done:?}");
    (done, tokens)
}

#[test]
fn plain_decoding_reports_every_chunk_and_keeps_its_tokens() {
    let target = load("llama");
    let prompt = long_prompt();
    for p in
        [params(12), GenerateParams { sampler: Sampler { temp: 0.8, seed: 3, ..Sampler::default() }, ..params(12) }]
    {
        let events = RefCell::new(Vec::new());
        let stats = generate_with_progress(
            &target,
            &prompt,
            &p,
            &mut |d: usize, t: usize| events.borrow_mut().push(Event::Progress(d, t)),
            |t| {
                events.borrow_mut().push(Event::Token(t));
                true
            },
        )
        .unwrap();
        let (done, tokens) = split(&events.into_inner(), PROMPT_LEN);
        assert_eq!(done, [0, PREFILL_CHUNK, 2 * PREFILL_CHUNK, PROMPT_LEN]);
        assert_eq!(tokens, plain(&target, &prompt, &p), "the progress changed the tokens");
        assert_eq!(stats.prompt_tokens, PROMPT_LEN);
        assert_eq!(stats.generation_tokens, 12);
    }
}

#[test]
fn a_one_token_prompt_reports_start_and_end() {
    let target = load("llama");
    let events = RefCell::new(Vec::new());
    generate_with_progress(
        &target,
        &[5],
        &params(3),
        &mut |d: usize, t: usize| events.borrow_mut().push(Event::Progress(d, t)),
        |t| {
            events.borrow_mut().push(Event::Token(t));
            true
        },
    )
    .unwrap();
    let (done, tokens) = split(&events.into_inner(), 1);
    assert_eq!(done, [0, 1]);
    assert_eq!(tokens.len(), 3);
}

/// One speculative request through `source` on `request`'s cache with progress; returns
/// the reported `done` values and the tokens, checked by [`split`].
fn spec_with_progress(
    target: &Transformer,
    source: &mut dyn DraftSource,
    prompt: &[u32],
    params: &GenerateParams,
    options: impl Into<SpecOptions>,
    cache: models::ModelCache,
) -> (Vec<usize>, Vec<u32>) {
    let events = RefCell::new(Vec::new());
    let mut progress = |d: usize, t: usize| events.borrow_mut().push(Event::Progress(d, t));
    let request = Request { progress: Some(&mut progress), ..Request::new(prompt, params, options, cache) };
    let outcome = run(target, source, request, |e| {
        events.borrow_mut().push(Event::Token(e.token));
        true
    })
    .unwrap_or_else(|e| panic!("run: {e}"));
    outcome.stats.check().unwrap();
    split(&events.into_inner(), prompt.len())
}

#[test]
fn speculative_decoding_reports_the_target_and_drafter_prefill() {
    let target = load("llama");
    let drafter = load("qwen2");
    let prompt = long_prompt();
    let p = params(16);
    let want = plain(&target, &prompt, &p);
    let chunks = [0, PREFILL_CHUNK, 2 * PREFILL_CHUNK, PROMPT_LEN];

    let mut ngram = NgramSource::new(3, 1).unwrap().with_schedule(DraftSchedule::Constant);
    let (done, tokens) = spec_with_progress(&target, &mut ngram, &prompt, &p, 5, target.make_cache());
    assert_eq!(done, chunks, "n-gram");
    assert_eq!(tokens, want, "n-gram: the progress changed the tokens");

    let mut two = TwoModelSource::new(&drafter, Sampler::default(), "qwen2");
    let (done, tokens) = spec_with_progress(&target, &mut two, &prompt, &p, 3, target.make_cache());
    assert_eq!(done, chunks, "draft model");
    assert_eq!(tokens, want, "draft model: the progress changed the tokens");
}

#[test]
fn a_dspark_request_reports_its_tapped_prefill() {
    let dir = tempfile::tempdir().unwrap();
    let (t, d) = test_support::dspark::write_tiny_pair(dir.path()).unwrap();
    let target = load_model(&t, &LoadOptions::default()).unwrap();
    let f32_load = LoadOptions { dtype: Some(Dtype::Float32), ..LoadOptions::default() };
    let provider = DSparkProvider::new(Drafter::load(&d, &f32_load).unwrap(), "dspark").unwrap();
    let prompt = long_prompt();
    let p = params(16);
    let mut source = provider.open(&target, &p.sampler).unwrap();
    let (done, tokens) = spec_with_progress(&target, source.as_mut(), &prompt, &p, 4, target.make_cache());
    assert_eq!(done, [0, PREFILL_CHUNK, 2 * PREFILL_CHUNK, PROMPT_LEN]);
    assert_eq!(tokens, plain(&target, &prompt, &p), "DSpark: the progress changed the tokens");
}

/// A prompt-cache hit of `c` tokens: the first call says `c`, and only the new tokens'
/// chunks follow.
#[test]
fn a_prompt_cache_hit_starts_at_the_cached_tokens() {
    let target = load("llama");
    let prompt = long_prompt();
    let p = params(8);
    let mut first = NgramSource::new(3, 1).unwrap();
    let outcome = run(&target, &mut first, Request::new(&prompt[..700], &p, 4, target.make_cache()), |_| true).unwrap();
    let cached = 600;
    assert!(outcome.cached_tokens.len() >= cached && outcome.cached_tokens[..cached] == prompt[..cached]);
    let cache = outcome.cache.unwrap().prefix(cached).unwrap();
    let mut second = NgramSource::new(3, 1).unwrap();
    let (done, tokens) = spec_with_progress(&target, &mut second, &prompt, &p, 4, cache);
    assert_eq!(done, [cached, cached + PREFILL_CHUNK, PROMPT_LEN]);
    assert_eq!(tokens, plain(&target, &prompt, &p));
}
