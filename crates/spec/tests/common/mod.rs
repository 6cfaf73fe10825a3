//! Helpers shared by the `spec` integration tests: plain greedy/sampled decoding and one
//! speculative request, both collecting the emitted tokens.
#![allow(dead_code)]

use models::generate::{generate, ids};
use models::{GenerateParams, Sampler, Transformer};
use spec::{DraftProvider, DraftSource, SpecOptions, SpecStats, speculative_generate};

/// The tokens plain decoding emits.
pub fn plain(target: &Transformer, prompt: &[u32], params: &GenerateParams) -> Vec<u32> {
    let mut out = Vec::new();
    generate(target, prompt, params, |t| {
        out.push(t);
        true
    })
    .unwrap();
    out
}

/// One speculative request through `source`; the stats invariants are checked.
pub fn spec_run(
    target: &Transformer,
    source: &mut dyn DraftSource,
    prompt: &[u32],
    params: &GenerateParams,
    options: impl Into<SpecOptions>,
) -> (Vec<u32>, SpecStats) {
    let mut out = Vec::new();
    let stats = speculative_generate(target, source, prompt, params, options, |t| {
        out.push(t);
        true
    })
    .unwrap_or_else(|e| panic!("speculative_generate: {e}"));
    stats.check().unwrap();
    (out, stats)
}

/// [`spec_run`] with a source freshly opened from `provider`.
pub fn spec_open(
    target: &Transformer,
    provider: &dyn DraftProvider,
    prompt: &[u32],
    params: &GenerateParams,
    options: impl Into<SpecOptions>,
) -> (Vec<u32>, SpecStats) {
    let mut source = provider.open(target, &params.sampler).unwrap();
    spec_run(target, source.as_mut(), prompt, params, options)
}

/// The sampler's distribution `[V]` of the token after `tokens` (`Sampler::probs`: filtered,
/// renormalised), exactly as plain decoding draws it.
pub fn next_distribution(model: &Transformer, tokens: &[u32], sampler: &Sampler) -> Vec<f64> {
    let mut cache = model.make_cache();
    let logits = model.forward(&ids(tokens).unwrap(), &mut cache).unwrap();
    let last = logits.slice_axis(1, -1, i32::MAX).unwrap();
    let p: Vec<f32> = sampler.probs(&last).unwrap().to_vec().unwrap();
    p.into_iter().map(f64::from).collect()
}
