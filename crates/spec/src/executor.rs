//! The verify/accept executor: one target forward over `[pending] ++ drafts`, a sequential
//! accept walk with the request's sampler, an exact cache rollback, and the re-feed rule.
use std::time::Instant;

use mlx_core::{Array, Dtype, concatenate, memory};
use models::generate::{GenerateParams, PREFILL_CHUNK, ids};
use models::{ModelCache, Transformer};

use crate::error::Context;
use crate::rejection::{Acceptance, Verdict, rejection_step};
use crate::{DraftSource, Error, Result, SpecStats};

/// Per-request options of the executor. A bare `usize` converts into options with that
/// `num_draft_tokens` and the default (exact-match) acceptance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpecOptions {
    /// The most drafts per round (γ, `--num-draft-tokens`); `0` makes every round a plain
    /// decoding step.
    pub num_draft_tokens: usize,
    /// The acceptance rule (see [`crate::rejection`]); ignored by greedy samplers, for which
    /// both rules are the same.
    pub acceptance: Acceptance,
}

impl From<usize> for SpecOptions {
    fn from(num_draft_tokens: usize) -> Self {
        SpecOptions { num_draft_tokens, acceptance: Acceptance::ExactMatch }
    }
}

/// Environment variable: `MLX_SPEC_TRACE=1` prints every round (feed, drafts, accepted, the
/// closing token) to stderr.
pub const TRACE_ENV: &str = "MLX_SPEC_TRACE";

/// Generates up to `params.max_tokens` tokens after `prompt` with speculative decoding,
/// calling `on_token` with each token as soon as it is accepted (return `false` to stop).
/// The tokens are exactly those [`models::generate::generate`] produces with the same
/// `params` (see below); `num_draft_tokens` (`n`) bounds the drafts per round.
///
/// Each round asks `source` for up to `min(n, reach, max_tokens - emitted - 1)` drafts, with
/// `reach` the target cache's exact-rollback reach ([`models::ModelCache::rollback_reach`]:
/// 32 for the rotating sliding-window caches of [`Transformer::make_cache`], unbounded for
/// full caches; a cap below `n` is recorded in [`SpecStats::draft_cap`]), runs one
/// target forward (and one LM head) over `[pending] ++ drafts`, and walks the window: the
/// token at position `i` is `params.sampler.sample(logits[i], step)` with `step` the number
/// of tokens emitted so far, exactly as plain decoding samples step `step`. A draft equal to
/// that token is accepted and the walk goes on; otherwise that token is emitted (a
/// correction, or a bonus at the window's end) and closes the round. An EOS token is never
/// emitted and ends the request, even mid-window. The target cache then drops the
/// `d - accepted` rejected positions; [`models::ModelCache::trim`] must report exactly that
/// count (and every layer must say it can trim), otherwise the request re-prefills a fresh
/// cache with `prompt ++ emitted` and continues as plain decoding
/// ([`SpecStats::fallback_at`]) with the pipelined step of [`models::generate::decode`], as
/// fast as [`models::generate::generate`]. With drafts capped at the reach, only a cache
/// that breaks its reach promise (or cannot trim at all) falls back. Prefill has the shape
/// of plain decoding: the target caches `prompt[..n-1]` in chunks of [`PREFILL_CHUNK`] and
/// the last prompt token heads the first window, so token 0 sees the same logits on both
/// paths.
///
/// Losslessness holds when a window forward gives the same logits as one-token forwards;
/// a backend whose window kernels round differently can flip a near-tie (see
/// `docs/architecture.md`, "Lossless").
///
/// With [`Acceptance::Rejection`] and a sampling (temperature > 0) request, drafts are
/// instead tested with the Leviathan/Chen rule ([`crate::rejection::rejection_step`])
/// against the source's [`DraftSource::draft_probs`]: every token is then distributed as
/// the target's, but the tokens differ from plain decoding's for the same seed. The accept
/// and residual draws use [`models::Sampler::uniform`] streams 1 and 2 of the position's
/// step; the bonus token is sampled as plain decoding samples it.
///
/// `MLX_SPEC_TRACE=1` prints each round to stderr.
///
/// # Errors
/// [`Error::Invalid`] for an empty prompt; [`Error::Model`]/[`Error::Mlx`] naming the step
/// for model failures; [`Error::Contract`] when the source returns more drafts than asked
/// for, a token id outside the target's vocabulary, or (rejection rule) draft
/// probabilities of the wrong shape or giving its own draft zero probability; the source's
/// own errors.
pub fn speculative_generate(
    target: &Transformer,
    source: &mut dyn DraftSource,
    prompt: &[u32],
    params: &GenerateParams,
    options: impl Into<SpecOptions>,
    on_token: impl FnMut(u32) -> bool,
) -> Result<SpecStats> {
    speculative_generate_with_cache(target, target.make_cache(), source, prompt, params, options, on_token)
}

/// [`speculative_generate`] with a caller-made target cache (for example one whose layers
/// are rotating windows, or a test double). `cache` must be empty and have one layer per
/// decoder layer of `target`. A fallback to plain decoding replaces it with
/// `target.make_cache()`.
///
/// # Errors
/// As [`speculative_generate`]; [`Error::Invalid`] for a non-empty cache.
pub fn speculative_generate_with_cache(
    target: &Transformer,
    cache: ModelCache,
    source: &mut dyn DraftSource,
    prompt: &[u32],
    params: &GenerateParams,
    options: impl Into<SpecOptions>,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<SpecStats> {
    let SpecOptions { num_draft_tokens, acceptance } = options.into();
    let rejection = acceptance == Acceptance::Rejection && !params.sampler.is_greedy();
    let Some((&last, head)) = prompt.split_last() else {
        return Err(Error::Invalid("an empty prompt".into()));
    };
    if cache.offset() != 0 {
        return Err(Error::Invalid(format!("the target cache already holds {} positions", cache.offset())));
    }
    let trace = std::env::var(TRACE_ENV).is_ok_and(|v| v == "1");
    memory::reset_peak();
    let start = Instant::now();
    let mut stats = SpecStats::new(prompt.len(), num_draft_tokens);
    // Never draft more than the target cache can drop exactly: a window of `k + 1` tokens
    // whose `k` drafts are all rejected must still roll back.
    let reach = cache.rollback_reach().unwrap_or(usize::MAX);
    stats.draft_cap = (reach < num_draft_tokens).then_some(reach);
    let num_draft_tokens = num_draft_tokens.min(reach);
    let tap_layers = source.tap_layers().to_vec();

    let mut cache = cache;
    let prefill_taps = prefill_target(target, &mut cache, head, &tap_layers, &mut stats)?;
    source.prefill(prompt, prefill_taps.as_deref())?;
    drop(prefill_taps);
    stats.prefill_ms = start.elapsed().as_secs_f64() * 1e3;

    let decode_start = Instant::now();
    // Committed tokens: prompt ++ emitted. Its last token is `pending`, which heads the
    // next window and is not yet in the target cache.
    let mut committed = prompt.to_vec();
    let mut pending = last;
    let mut feed = vec![last];
    'rounds: while stats.emitted < params.max_tokens {
        let step = stats.emitted;
        let n = num_draft_tokens.min(params.max_tokens - step - 1);
        let drafts = {
            let t = Instant::now();
            let drafts = source.draft(&feed, n, step)?;
            stats.draft_ms += t.elapsed().as_secs_f64() * 1e3;
            let vocab = target.config.vocab_size;
            let problem = if drafts.len() > n {
                Some(format!("asked for at most {n} drafts at step {step}, got {}: {drafts:?}", drafts.len()))
            } else {
                drafts
                    .iter()
                    .find(|&&t| t as usize >= vocab)
                    .map(|t| format!("draft token {t} at step {step} is outside the target's vocabulary of {vocab}"))
            };
            if let Some(message) = problem {
                return Err(Error::Contract { source_name: source.name().to_string(), message });
            }
            drafts
        };
        let d = drafts.len();
        let window: Vec<u32> = std::iter::once(pending).chain(drafts.iter().copied()).collect();
        let what = || format!("target forward over the verify window {window:?} at step {step}");
        let tokens = ids(&window).context(what)?;
        let (logits, taps) = if tap_layers.is_empty() {
            (target.forward(&tokens, &mut cache).context(what)?, None)
        } else {
            let out = target.forward_with_taps(&tokens, &mut cache, &tap_layers).context(what)?;
            (out.logits, Some(out.taps))
        };
        logits.eval().context(what)?;
        stats.rounds += 1;
        stats.target_forwards += 1;
        if d == 0 {
            stats.empty_rounds += 1;
        }
        for slot in &mut stats.drafted_by_pos[..d] {
            *slot += 1;
        }
        stats.drafted += d;

        // The accept walk: position i is sampled exactly as plain decoding samples `step`
        // (or, under the rejection rule, drafts are tested against the drafter's q).
        let draft_probs = if rejection && d > 0 { Some(draft_probs(source, d, step)?) } else { None };
        let mut accepted = 0;
        let mut closing = None;
        let mut finished = false;
        for i in 0..=d {
            let row = logits.slice_axis(1, i as i32, i as i32 + 1).and_then(|r| r.astype(Dtype::Float32));
            let row = row.context(|| format!("logits of window position {i}"))?;
            let at = stats.emitted;
            let t = match &draft_probs {
                Some(q) if i < d => {
                    let what = || format!("target distribution at step {at}");
                    let p: Vec<f32> = params.sampler.probs(&row).context(what)?.to_vec().context(what)?;
                    let q_row = q.as_ref().map(|q| &q[i * q.len() / d..(i + 1) * q.len() / d]);
                    let (ua, ur) = (params.sampler.uniform(at, 1), params.sampler.uniform(at, 2));
                    match rejection_step(&p, q_row, drafts[i], ua, ur) {
                        Ok(Verdict::Accept) => drafts[i],
                        Ok(Verdict::Reject(t)) => t,
                        Err(message) => {
                            return Err(Error::Contract {
                                source_name: source.name().to_string(),
                                message: format!("draft {i} at step {step}: {message}"),
                            });
                        }
                    }
                }
                _ => params.sampler.sample(&row, at).context(|| format!("sampling step {at}"))?,
            };
            if params.eos.contains(&t) {
                stats.stopped_on_eos = true;
                finished = true;
                break;
            }
            stats.emitted += 1;
            committed.push(t);
            let is_draft = drafts.get(i) == Some(&t);
            if is_draft {
                accepted += 1;
                stats.accepted_by_pos[i] += 1;
            } else if i < d {
                stats.corrections += 1;
            } else {
                stats.bonuses += 1;
            }
            if !on_token(t) || stats.emitted >= params.max_tokens {
                finished = true;
                break;
            }
            if !is_draft {
                closing = Some(t);
                break;
            }
        }
        stats.accepted += accepted;
        if trace {
            let end = match closing {
                Some(t) => t.to_string(),
                None if stats.stopped_on_eos => "EOS".to_string(),
                None => "stop".to_string(),
            };
            eprintln!(
                "[spec] round {} step {step} feed {feed:?} drafts {drafts:?} accepted {accepted}/{d} next {end}",
                stats.rounds
            );
        }
        if finished {
            break 'rounds;
        }
        let next = closing.expect("an unfinished walk ends with a correction or bonus token");

        // Roll the target cache back over the rejected drafts, exactly or not at all.
        let rollback = d - accepted;
        if rollback > 0 && !(cache.can_trim(rollback) && cache.trim(rollback) == rollback) {
            if trace {
                eprintln!("[spec] target cache cannot drop {rollback} positions: plain decoding from here");
            }
            drop((logits, taps));
            stats.fallback_at = Some(stats.emitted);
            cache = target.make_cache();
            let head = &committed[..committed.len() - 1];
            prefill_target(target, &mut cache, head, &[], &mut stats)?;
            plain_decode(target, &mut cache, next, params, &mut stats, &mut on_token)?;
            break 'rounds;
        }
        let t = Instant::now();
        source.commit(d, accepted, taps.as_deref())?;
        stats.draft_ms += t.elapsed().as_secs_f64() * 1e3;
        feed = if d > 0 && accepted == d { vec![drafts[d - 1], next] } else { vec![next] };
        pending = next;
    }
    stats.decode_ms = decode_start.elapsed().as_secs_f64() * 1e3;
    stats.peak_memory_bytes = memory::peak();
    stats.finish();
    Ok(stats)
}

/// The rest of a request after a fallback, at plain decoding's speed: `cache` holds
/// `prompt ++ emitted` except its last token `next`, and [`models::generate::decode`]
/// continues from step `stats.emitted` with the same pipelined step and per-step sampler keys
/// as [`models::generate::generate`]. Every step counts as a round with no drafts whose token
/// is a bonus (the step that samples EOS counts as a round and emits nothing).
fn plain_decode(
    target: &Transformer,
    cache: &mut ModelCache,
    next: u32,
    params: &GenerateParams,
    stats: &mut SpecStats,
    on_token: &mut impl FnMut(u32) -> bool,
) -> Result<()> {
    let step = stats.emitted;
    let emitted = &mut stats.emitted;
    let decoded = models::generate::decode(target, cache, next, step, params, |t| {
        *emitted += 1;
        on_token(t)
    })
    .context(|| format!("plain decoding from step {step} after the fallback"))?;
    stats.rounds += decoded.steps;
    stats.target_forwards += decoded.steps;
    stats.empty_rounds += decoded.steps;
    stats.bonuses += decoded.tokens;
    stats.stopped_on_eos |= decoded.stopped_on_eos;
    Ok(())
}

/// Prefills `cache` with `head` in chunks of [`PREFILL_CHUNK`], as
/// [`models::generate::prefill`] does. With `tap_layers`, the chunks run through
/// `forward_with_taps` (the logits are never evaluated) and the taps of all chunks are
/// concatenated, one `[1, head.len(), H]` array per tap layer; `None` without tap layers or
/// for an empty `head`.
fn prefill_target(
    target: &Transformer,
    cache: &mut ModelCache,
    head: &[u32],
    tap_layers: &[usize],
    stats: &mut SpecStats,
) -> Result<Option<Vec<Array>>> {
    let what = |len: usize| move || format!("target prefill of a {len}-token chunk");
    if tap_layers.is_empty() || head.is_empty() {
        for chunk in head.chunks(PREFILL_CHUNK) {
            target.prefill(&ids(chunk).context(what(chunk.len()))?, cache).context(what(chunk.len()))?;
            stats.prefill_forwards += 1;
        }
        return Ok(None);
    }
    let mut per_layer: Vec<Vec<Array>> = vec![Vec::new(); tap_layers.len()];
    for chunk in head.chunks(PREFILL_CHUNK) {
        let out = target.forward_with_taps(&ids(chunk).context(what(chunk.len()))?, cache, tap_layers);
        let out = out.context(what(chunk.len()))?;
        let mut to_eval = cache.state();
        to_eval.extend(out.taps.iter().cloned());
        mlx_core::eval(&to_eval.iter().collect::<Vec<_>>()).context(what(chunk.len()))?;
        for (acc, tap) in per_layer.iter_mut().zip(out.taps) {
            acc.push(tap);
        }
        stats.prefill_forwards += 1;
    }
    let taps = per_layer
        .iter()
        .map(|parts| concatenate(&parts.iter().collect::<Vec<_>>(), 1))
        .collect::<mlx_core::Result<Vec<_>>>()
        .context(|| "concatenating prefill taps".to_string())?;
    Ok(Some(taps))
}

/// The drafter's distributions of the last `d` drafts as one host vector of `d` rows
/// (`None`: a deterministic proposal, one-hot on each draft).
fn draft_probs(source: &dyn DraftSource, d: usize, step: usize) -> Result<Option<Vec<f32>>> {
    let Some(q) = source.draft_probs()? else {
        return Ok(None);
    };
    let what = || format!("draft probabilities of {d} drafts at step {step}");
    let shape = q.shape();
    if shape.len() != 2 || shape[0] as usize != d {
        return Err(Error::Contract {
            source_name: source.name().to_string(),
            message: format!("draft_probs has shape {shape:?} for {d} drafts at step {step}; expected [{d}, V]"),
        });
    }
    let host: Vec<f32> = q.astype(Dtype::Float32).and_then(|q| q.to_vec()).context(what)?;
    Ok(Some(host))
}
