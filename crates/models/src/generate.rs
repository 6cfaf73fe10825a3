//! Plain autoregressive generation, shaped like mlx-lm's `generate_step`: the prompt except
//! its last token is prefilled into the cache, then every step feeds one token and samples
//! the next. The speculative executor uses the same prefill shape, so both paths see the
//! same logits for the first generated token.
use std::time::Instant;

use mlx_core::{Array, Dtype, memory};

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
/// which heads the first decode window.
///
/// # Errors
/// [`Error::Unsupported`] for an empty prompt; model errors otherwise.
pub fn prefill(model: &Transformer, prompt: &[u32]) -> Result<(crate::ModelCache, u32)> {
    let (&last, head) = prompt.split_last().ok_or_else(|| Error::Unsupported("an empty prompt".into()))?;
    let mut cache = model.make_cache();
    for chunk in head.chunks(PREFILL_CHUNK) {
        model.prefill(&ids(chunk)?, &mut cache)?;
    }
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

/// Generates up to `params.max_tokens` tokens after `prompt`, calling `on_token` with each
/// token as soon as it is sampled (return `false` to stop early).
///
/// # Errors
/// Model and sampling errors; [`Error::Unsupported`] for an empty prompt.
pub fn generate(
    model: &Transformer,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<GenerationStats> {
    memory::reset_peak();
    let start = Instant::now();
    let (mut cache, mut token) = prefill(model, prompt)?;
    let mut stats = GenerationStats { prompt_tokens: prompt.len(), ..Default::default() };
    let mut first_token_at = None;
    for step in 0..params.max_tokens {
        let logits = model.forward(&ids(&[token])?, &mut cache)?;
        let last = logits.slice_axis(1, -1, i32::MAX)?.astype(Dtype::Float32)?;
        token = params.sampler.sample(&last, step)?;
        if first_token_at.is_none() {
            first_token_at = Some(Instant::now());
        }
        if params.eos.contains(&token) {
            stats.stopped_on_eos = true;
            break;
        }
        stats.generation_tokens += 1;
        if !on_token(token) {
            break;
        }
    }
    let end = Instant::now();
    if let Some(t1) = first_token_at {
        stats.prompt_tps = prompt.len() as f64 / (t1 - start).as_secs_f64();
        let rest = stats.generation_tokens.saturating_sub(1);
        let dt = (end - t1).as_secs_f64();
        stats.generation_tps = if rest > 0 && dt > 0.0 { rest as f64 / dt } else { 0.0 };
    }
    stats.peak_memory_bytes = memory::peak();
    Ok(stats)
}
