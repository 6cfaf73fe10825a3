//! Plain autoregressive generation, shaped like mlx-lm's `generate_step`: the prompt except
//! its last token is prefilled into the cache, then every step feeds one token and samples
//! the next. The speculative executor uses the same prefill shape, so both paths see the
//! same logits for the first generated token.
//!
//! Decoding is pipelined as in mlx-lm's `generate_step`: the graph of step `n + 1` is built
//! from step `n`'s still-lazy sampled token and queued with `async_eval` before the host
//! waits for token `n`, so building and dispatching a step overlaps the previous step's
//! compute. A step has no other host synchronization.
use std::time::Instant;

use mlx_core::{Array, Dtype, async_eval, memory};

use crate::sampling::Sampler;
use crate::transformer::Transformer;
use crate::{Error, Result};

/// Prompt tokens per prefill forward (bounds the attention score memory).
pub const PREFILL_CHUNK: usize = 512;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Stop after this many generated tokens.
    pub max_tokens: usize,
    /// How tokens are drawn.
    pub sampler: Sampler,
    /// Tokens that end generation (not emitted).
    pub eos: Vec<u32>,
}

/// Timing and size of one generation.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct GenerationStats {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Prompt processing rate, tokens/s (prefill plus the first step).
    pub prompt_tps: f64,
    /// Tokens generated (EOS excluded).
    pub generation_tokens: usize,
    /// Generation rate after the first token, tokens/s.
    pub generation_tps: f64,
    /// MLX peak memory during the request, bytes.
    pub peak_memory_bytes: usize,
    /// Whether an EOS token ended generation.
    pub stopped_on_eos: bool,
}

/// Fills a fresh cache with `prompt[..n-1]`; returns the cache and the last prompt token,
/// which heads the first decode window. [`prefill_with_progress`] without the progress.
///
/// # Errors
/// [`Error::Unsupported`] for an empty prompt; model errors otherwise.
pub fn prefill(model: &Transformer, prompt: &[u32]) -> Result<(crate::ModelCache, u32)> {
    prefill_with_progress(model, prompt, &mut |_, _| {})
}

/// A prefill progress callback, called as `progress(done, total)` in prompt tokens: `total`
/// is the prompt's length (the same on every call) and `done` the prompt tokens prefilled so
/// far. It is called once before the first chunk, after every [`PREFILL_CHUNK`]-token chunk
/// but the last, and once with `done == total` when the prompt is in (the last prompt token
/// heads the first decode step, so it counts as done then); `done` strictly increases from
/// call to call. It is not called again after `done == total`, and not with `done == total`
/// when the prefill fails or is cancelled. It is only told: it cannot fail or stop the
/// prefill.
pub type PrefillProgress<'a> = &'a mut dyn FnMut(usize, usize);

/// [`prefill`], reporting to `progress` (see [`PrefillProgress`] for when it is called).
///
/// # Errors
/// [`Error::Unsupported`] for an empty prompt (`progress` is then never called); model
/// errors otherwise.
pub fn prefill_with_progress(
    model: &Transformer,
    prompt: &[u32],
    progress: PrefillProgress<'_>,
) -> Result<(crate::ModelCache, u32)> {
    let (&last, head) = prompt.split_last().ok_or_else(|| Error::Unsupported("an empty prompt".into()))?;
    let mut cache = model.make_cache();
    progress(0, prompt.len());
    let mut done = 0;
    for chunk in head.chunks(PREFILL_CHUNK) {
        model.prefill(&ids(chunk)?, &mut cache)?;
        done += chunk.len();
        if done < head.len() {
            progress(done, prompt.len());
        }
    }
    progress(prompt.len(), prompt.len());
    Ok((cache, last))
}

/// `tokens` as an int32 `[1, L]` array.
///
/// # Errors
/// [`Error::Mlx`] never in practice (kept fallible like every array constructor).
pub fn ids(tokens: &[u32]) -> Result<Array> {
    let v: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
    Ok(Array::from_slice(&v, &[1, v.len() as i32])?)
}

/// One decode step queued with `async_eval` ([`queue_step`]).
#[derive(Debug)]
pub struct QueuedStep {
    /// The step's last-position logits, float32 `[1, 1, V]` (computed with the token).
    pub logits: Array,
    /// The sampled token, uint32 `[1, 1]` (lazy until read).
    pub token: Array,
}

/// Builds one decode step from `input` (token ids `[1, 1]`, possibly lazy), samples its
/// token lazily with exactly the ops of [`crate::Sampler::sample`] (argmax, or
/// `categorical` of the filtered log-probabilities with the key of `step`) and queues it
/// with `async_eval`. Plain decoding and the speculative executor's plain rounds both use
/// it, so their tokens cannot drift apart.
///
/// # Errors
/// Model and sampling errors.
pub fn queue_step(
    model: &Transformer,
    cache: &mut crate::ModelCache,
    input: &Array,
    params: &GenerateParams,
    step: usize,
) -> Result<QueuedStep> {
    let logits = model.forward(input, cache)?;
    let last = logits.slice_axis(1, -1, i32::MAX)?.astype(Dtype::Float32)?;
    let token = params.sampler.sample_lazy(&last, step)?.reshape(&[1, 1])?;
    async_eval(&[&token])?;
    Ok(QueuedStep { logits: last, token })
}

fn decode_step(
    model: &Transformer,
    cache: &mut crate::ModelCache,
    input: &Array,
    params: &GenerateParams,
    step: usize,
) -> Result<Array> {
    Ok(queue_step(model, cache, input, params, step)?.token)
}

/// Generates up to `params.max_tokens` tokens after `prompt`, calling `on_token` with each
/// token as soon as it is sampled (return `false` to stop early).
///
/// # Errors
/// Model and sampling errors; [`Error::Unsupported`] for an empty prompt.
pub fn generate(
    model: &Transformer,
    prompt: &[u32],
    params: &GenerateParams,
    on_token: impl FnMut(u32) -> bool,
) -> Result<GenerationStats> {
    generate_with_progress(model, prompt, params, &mut |_, _| {}, on_token)
}

/// [`generate`], reporting the prompt's prefill to `progress` ([`PrefillProgress`]: its
/// last call, with `done == total`, comes before the first token reaches `on_token`). The
/// tokens and statistics are those of [`generate`].
///
/// # Errors
/// As [`generate`].
pub fn generate_with_progress(
    model: &Transformer,
    prompt: &[u32],
    params: &GenerateParams,
    progress: PrefillProgress<'_>,
    on_token: impl FnMut(u32) -> bool,
) -> Result<GenerationStats> {
    memory::reset_peak();
    let start = Instant::now();
    let (mut cache, token) = prefill_with_progress(model, prompt, progress)?;
    let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
    let decoded = decode(model, &mut cache, token, 0, params, on_token)?;
    let end = Instant::now();
    stats.generation_tokens = decoded.tokens;
    stats.stopped_on_eos = decoded.stopped_on_eos;
    if let Some(t1) = decoded.first_token_at {
        stats.prompt_tps = prompt.len() as f64 / (t1 - start).as_secs_f64();
        let rest = stats.generation_tokens.saturating_sub(1);
        let dt = (end - t1).as_secs_f64();
        stats.generation_tps = if rest > 0 && dt > 0.0 { rest as f64 / dt } else { 0.0 };
    }
    stats.peak_memory_bytes = memory::peak();
    Ok(stats)
}

/// What one [`decode`] call did.
#[derive(Debug, Clone, Copy, Default)]
pub struct Decoded {
    /// Decode steps whose token was read (emitted tokens plus a final EOS). A step queued
    /// ahead and never read (the pipeline's look-ahead after the last token) is not counted.
    pub steps: usize,
    /// Tokens handed to `on_token` (EOS excluded).
    pub tokens: usize,
    /// Whether an EOS token ended decoding.
    pub stopped_on_eos: bool,
    /// When the first step's token was read (`None` when no step ran).
    pub first_token_at: Option<Instant>,
}

/// Plain decoding from a filled cache, with the pipelined step of [`generate`] (which is
/// this function after [`prefill`]): `cache` holds every committed position except the
/// last, `token`, which is fed first and is not yet in the cache. Steps `first_step ..
/// params.max_tokens` run, step `s` sampling with the sampler's key of step `s`, so a
/// request that continues here after `first_step` tokens from elsewhere (the speculative
/// executor's fallback) emits exactly the tokens [`generate`] emits from that step on.
/// Stops at EOS (not emitted), after step `params.max_tokens - 1`, or when `on_token`
/// returns `false`. The cache is left one or two positions past the last token read (the
/// look-ahead step); it is meant to be dropped afterwards.
///
/// # Errors
/// Model and sampling errors.
pub fn decode(
    model: &Transformer,
    cache: &mut crate::ModelCache,
    token: u32,
    first_step: usize,
    params: &GenerateParams,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<Decoded> {
    let mut out = Decoded::default();
    // The step in flight: its lazy token id, uint32 [1, 1].
    let mut pending = if first_step < params.max_tokens {
        Some(decode_step(model, cache, &ids(&[token])?, params, first_step)?)
    } else {
        None
    };
    let mut step = first_step;
    while let Some(cur) = pending.take() {
        if step + 1 < params.max_tokens {
            // Queue step + 1 before reading this step's token (its input is `cur`, still lazy).
            // If `cur` turns out to be EOS the extra step is wasted work on a cache that is
            // dropped with this request.
            pending = Some(decode_step(model, cache, &cur, params, step + 1)?);
        }
        let token = cur.to_vec::<u32>()?[0];
        out.steps += 1;
        if out.first_token_at.is_none() {
            out.first_token_at = Some(Instant::now());
        }
        if params.eos.contains(&token) {
            out.stopped_on_eos = true;
            break;
        }
        out.tokens += 1;
        if !on_token(token) {
            break;
        }
        step += 1;
    }
    Ok(out)
}
