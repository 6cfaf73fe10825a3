//! The verify/accept executor: one target forward over `[pending] ++ drafts`, a sequential
//! accept walk with the request's sampler, an exact cache rollback, and the re-feed rule.
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use mlx_core::{Array, Dtype, concatenate, memory};
use models::generate::{GenerateParams, PREFILL_CHUNK, PrefillProgress, ids};
use models::{ModelCache, Sampler, Transformer};

use crate::error::Context;
use crate::rejection::{Acceptance, Verdict, rejection_step};
use crate::source::DraftSnapshot;
use crate::stats::RoundProfile;
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

/// Generates up to `params.max_tokens` tokens after `prompt` with speculative decoding,
/// calling `on_token` with each token as soon as it is accepted (return `false` to stop):
/// [`run`] on a fresh target cache, without a prompt cache, cancellation or logprobs. See
/// [`run`] for what a round does and why the tokens are exactly those of
/// [`models::generate::generate`] with the same `params`.
///
/// # Errors
/// As [`run`].
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
/// As [`run`]; [`Error::Invalid`] for a non-empty cache.
pub fn speculative_generate_with_cache(
    target: &Transformer,
    cache: ModelCache,
    source: &mut dyn DraftSource,
    prompt: &[u32],
    params: &GenerateParams,
    options: impl Into<SpecOptions>,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<SpecStats> {
    if cache.offset() != 0 {
        return Err(Error::Invalid(format!("the target cache already holds {} positions", cache.offset())));
    }
    let request = Request::new(prompt, params, options, cache);
    Ok(run(target, source, request, |e| on_token(e.token))?.stats)
}

/// One request for [`run`]. [`Request::new`] makes a plain one (no prompt-cache snapshot,
/// no cancellation, no logprobs); a server sets the other fields.
pub struct Request<'a> {
    /// The prompt's token ids (at least one).
    pub prompt: &'a [u32],
    /// `max_tokens`, the sampler and the EOS ids.
    pub params: &'a GenerateParams,
    /// Drafts per round and the acceptance rule (`num_draft_tokens` 0: plain decoding).
    pub options: SpecOptions,
    /// The target cache: empty (`target.make_cache()`), or holding exactly the first `c`
    /// tokens of `prompt` with `c <= prompt.len() - 1` (a prompt-cache hit, e.g.
    /// [`models::ModelCache::prefix`] of an earlier request's [`Outcome::cache`]). The
    /// executor trusts that those positions are the KV state of `prompt[..c]`.
    pub cache: ModelCache,
    /// The source's [`DraftSource::snapshot`] for at least those `c` tokens, when the earlier
    /// request's source gave one.
    pub draft_state: Option<DraftSnapshot>,
    /// Checked between prefill chunks and before every round: once it reads `true` the
    /// request ends with [`Finish::Cancelled`], within one prefill chunk
    /// ([`PREFILL_CHUNK`] tokens) or one round.
    pub cancel: Option<&'a AtomicBool>,
    /// `Some(k)`: every emitted token carries its log-probability under the target's raw
    /// next-token distribution (the log-softmax of the logits, before temperature and the
    /// sampling filters, as mlx_lm.server and vLLM report it) and the `k` most likely tokens
    /// ([`TokenLogprobs`]). Tokens emitted after a fallback to plain decoding carry none.
    pub logprobs: Option<usize>,
    /// Told how the prompt's prefill goes, in prompt tokens ([`PrefillProgress`]: `total` is
    /// `prompt.len()`, the first call's `done` the `c` cached tokens, and `done == total`
    /// comes once the target and the source both hold the prompt, before the first token
    /// reaches `on_token`). `None` (a server's requests): nothing is told. It does not change
    /// the tokens or the statistics.
    pub progress: Option<PrefillProgress<'a>>,
}

impl<'a> Request<'a> {
    /// A request on `cache` (empty, or a prompt-cache prefix) with no snapshot,
    /// cancellation, logprobs or progress.
    pub fn new(
        prompt: &'a [u32],
        params: &'a GenerateParams,
        options: impl Into<SpecOptions>,
        cache: ModelCache,
    ) -> Self {
        Request {
            prompt,
            params,
            options: options.into(),
            cache,
            draft_state: None,
            cancel: None,
            logprobs: None,
            progress: None,
        }
    }
}

/// One emitted token, as [`run`] hands it to `on_token`.
#[derive(Debug, Clone, PartialEq)]
pub struct Emitted {
    /// The token id.
    pub token: u32,
    /// Its log-probabilities, when the request asked for them ([`Request::logprobs`]).
    pub logprobs: Option<TokenLogprobs>,
}

/// A token's log-probability (natural log) under the target's raw distribution, and the
/// most likely tokens of that distribution, most likely first (ties: lower id first).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// `log p(token)`.
    pub logprob: f32,
    /// `(id, log p(id))` of the `k` most likely tokens.
    pub top: Vec<(u32, f32)>,
}

/// Why a request ended ([`Outcome::finish`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// The target chose an EOS token (not emitted).
    Eos,
    /// `max_tokens` tokens were emitted.
    MaxTokens,
    /// `on_token` returned `false`.
    Stopped,
    /// The request's cancel flag was set ([`Request::cancel`]).
    Cancelled,
}

/// What [`run`] returns: the statistics, why the request ended, and the state a prompt
/// cache keeps for a later request that starts with the same tokens.
pub struct Outcome {
    /// The request's statistics.
    pub stats: SpecStats,
    /// Why it ended.
    pub finish: Finish,
    /// The target cache, holding exactly the KV state of [`Outcome::cached_tokens`] (the
    /// rejected drafts of the last round dropped). `None` after a fallback to plain decoding
    /// or when the cache could not be trimmed exactly.
    pub cache: Option<ModelCache>,
    /// The tokens `cache` holds: a prefix of `prompt ++ emitted` (empty with no cache).
    pub cached_tokens: Vec<u32>,
    /// The source's [`DraftSource::snapshot`] for the same tokens, when it gave one.
    pub draft_state: Option<DraftSnapshot>,
}

/// Runs one request: generates up to `params.max_tokens` tokens after `prompt` with
/// speculative decoding, calling `on_token` with each token as soon as it is accepted
/// (return `false` to stop).
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
/// of plain decoding: the target caches `prompt[c..n-1]` (`c` the positions the request's
/// cache already held) in chunks of [`PREFILL_CHUNK`] and the last prompt token heads the
/// first window, so token 0 sees the same logits on both paths; the source starts with
/// [`DraftSource::prefill`], or [`DraftSource::resume`] after a prompt-cache hit.
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
/// Rounds without drafts run plain decoding's pipelined step while the source allows it
/// ([`DraftSource::pipeline_plain_steps`]): the target forward of the pending token, the
/// lazily sampled token and the forward of that token (the next round's head) are queued
/// before the host reads the token, so a run of plain steps costs what
/// [`models::generate::generate`] costs. When the source then does propose drafts, the
/// round's window is the queued head (already in the cache, its logits kept) followed by a
/// forward over the drafts alone; the accept walk is the same. (Not for sources with tap
/// layers, whose windows must be one forward.) A source that expects its next round to be
/// worth a whole window declines, and the round without drafts is a one-token window.
///
/// Under exact-match acceptance the window's tokens are sampled with its forward, in one
/// evaluation, and read at once; the phases of each round are timed into
/// [`SpecStats::profile`].
///
/// Each round is logged with `tracing` at debug level, target `spec::round` (feed, drafts,
/// accepted, the closing token; `MLX_SPEC_LOG=spec::round=debug` in the CLI).
///
/// When the request ends, the target cache is trimmed to the committed tokens it holds and
/// returned in the [`Outcome`] with the source's snapshot, for a prompt cache.
///
/// # Errors
/// [`Error::Invalid`] for an empty prompt, a cache holding more than `prompt.len() - 1`
/// positions, or a source that cannot resume from the cached prefix
/// ([`DraftSource::can_resume`]); [`Error::Model`]/[`Error::Mlx`] naming the step
/// for model failures; [`Error::Contract`] when the source returns more drafts than asked
/// for, a token id outside the target's vocabulary, or (rejection rule) draft
/// probabilities of the wrong shape or giving its own draft zero probability; the source's
/// own errors.
pub fn run(
    target: &Transformer,
    source: &mut dyn DraftSource,
    request: Request<'_>,
    mut on_token: impl FnMut(&Emitted) -> bool,
) -> Result<Outcome> {
    let Request { prompt, params, options, mut cache, draft_state, cancel, logprobs, progress } = request;
    let SpecOptions { num_draft_tokens, acceptance } = options;
    let rejection = acceptance == Acceptance::Rejection && !params.sampler.is_greedy();
    let (last, cached) = check_request(prompt, &cache, &*source, draft_state.as_ref())?;
    let cancelled = || cancel.is_some_and(|c| c.load(Ordering::Relaxed));
    memory::reset_peak();
    let start = Instant::now();
    let mut stats = SpecStats::new(prompt.len(), num_draft_tokens);
    stats.cached_tokens = cached;
    let num_draft_tokens = cap_at_rollback_reach(&cache, num_draft_tokens, &mut stats);
    let tap_layers = source.tap_layers().to_vec();

    // The tokens whose KV state the target cache holds, in order (the rejected drafts of a
    // round until they are rolled back): what the request leaves for a prompt cache.
    let mut in_cache = prompt[..cached].to_vec();
    let head = &prompt[cached..prompt.len() - 1];
    let mut no_progress = |_: usize, _: usize| {};
    let progress: &mut dyn FnMut(usize, usize) = match progress {
        Some(progress) => progress,
        None => &mut no_progress,
    };
    progress(cached, prompt.len());
    // The target's chunks are told as they finish, except the last: `done == total` waits
    // for the source's prefill, so the caller hears it once the whole prompt is in.
    let mut on_chunk = |done: usize| {
        if cached + done < prompt.len() - 1 {
            progress(cached + done, prompt.len());
        }
    };
    let prefilled = prefill_target(target, &mut cache, head, &tap_layers, &mut stats, &cancelled, &mut on_chunk)?;
    in_cache.extend_from_slice(&head[..cache.offset() - cached]);
    if !prefilled.complete {
        stats.prefill_ms = start.elapsed().as_secs_f64() * 1e3;
        stats.finish();
        return Ok(Outcome {
            stats,
            finish: Finish::Cancelled,
            cache: Some(cache),
            cached_tokens: in_cache,
            draft_state: None,
        });
    }
    // The prefill taps are dropped as soon as the source has read them.
    match cached {
        0 => source.prefill(prompt, prefilled.taps.as_deref())?,
        _ => source.resume(prompt, cached, draft_state, prefilled.taps.as_deref())?,
    }
    progress(prompt.len(), prompt.len());
    stats.prefill_ms = start.elapsed().as_secs_f64() * 1e3;

    let decode_start = Instant::now();
    // Committed tokens: prompt ++ emitted. Its last token is `pending`, which heads the
    // next window and is not yet in the target cache.
    let mut committed = prompt.to_vec();
    let mut pending = last;
    let mut feed = vec![last];
    let pipelined = tap_layers.is_empty();
    // The queued forward of `pending` (in the cache already), when the last round drafted
    // nothing.
    let mut ahead: Option<Ahead> = None;
    let mut finish = Finish::MaxTokens;
    let mut fell_back = false;
    while stats.emitted < params.max_tokens {
        if cancelled() {
            finish = Finish::Cancelled;
            break;
        }
        let step = stats.emitted;
        let n = num_draft_tokens.min(params.max_tokens - step - 1);
        let drafts = checked_drafts(source, &feed, n, step, target.config.vocab_size, &mut stats)?;
        let d = drafts.len();
        let round = Instant::now();
        let pipeline = pipelined && (d > 0 || source.pipeline_plain_steps());
        if d == 0 && pipeline && ahead.is_none() {
            ahead = Some(Ahead::queue(target, &mut cache, &ids(&[pending]).context(|| "ids".into())?, params, step)?);
            in_cache.push(pending);
        }
        let head = ahead.take();
        if let (0, Some(head)) = (d, &head) {
            // A plain step: queue the next one (on the lazy token) before reading this one.
            if step + 1 < params.max_tokens && pipeline {
                ahead = Some(Ahead::queue(target, &mut cache, &head.token, params, step + 1)?);
            }
            let t = head.read(step)?;
            if ahead.is_some() {
                in_cache.push(t);
            }
            count_round(&mut stats, 0);
            stats.pipelined_steps += 1;
            let mut emit = Emitter::new(logprobs, &mut on_token);
            let walk = accept_walk(
                &[],
                params.max_tokens - step,
                &params.eos,
                |_| Ok(t),
                |t| emit.emit(t, |_| Ok(head.logits.clone())),
            )?;
            emit.finish()?;
            count_walk(&mut stats, &walk);
            committed.extend_from_slice(&walk.emitted);
            trace_round(stats.rounds, step, &feed, &[], &walk);
            stats.profile.plain_ms += ms_since(round);
            if walk.end != WalkEnd::Open {
                finish = walk.end.into();
                break;
            }
            commit(source, 0, 0, None, &mut stats)?;
            (feed, pending) = (vec![t], t);
            continue;
        }
        // Exact match samples every row with the forward (one synchronisation); the
        // rejection rule decides from the rows themselves.
        let first_row_step = step + usize::from(head.is_some());
        let sampling = (!rejection).then_some((&params.sampler, first_row_step));
        let verified = match &head {
            Some(_) => verify_drafts(target, &mut cache, &drafts, sampling, &mut stats.profile)?,
            None => {
                in_cache.push(pending);
                verify(target, &mut cache, pending, &drafts, &tap_layers, sampling, &mut stats.profile)?
            }
        };
        in_cache.extend_from_slice(&drafts);
        count_round(&mut stats, d);

        let walk_start = Instant::now();
        let head_row = match &head {
            Some(h) => Some((&h.logits, h.read(step)?)),
            None => None,
        };
        let window = Window { logits: &verified.logits, tokens: verified.tokens.as_deref(), head: head_row };
        let rows = TargetRows::new(window, &params.sampler, &drafts, step, rejection, &*source)?;
        let mut emit = Emitter::new(logprobs, &mut on_token);
        let walk = accept_walk(
            &drafts,
            params.max_tokens - step,
            &params.eos,
            |i| rows.token(i),
            |t| emit.emit(t, |i| rows.row(i)),
        )?;
        emit.finish()?;
        count_walk(&mut stats, &walk);
        committed.extend_from_slice(&walk.emitted);
        trace_round(stats.rounds, step, &feed, &drafts, &walk);
        stats.profile.walk_ms += ms_since(walk_start);
        let (WalkEnd::Open, Some(closing)) = (walk.end, walk.closing) else {
            finish = walk.end.into();
            break;
        };
        let next = closing.token();

        // Roll the target cache back over the rejected drafts, exactly or not at all.
        let rollback = d - walk.accepted;
        let trim = Instant::now();
        let rolled_back = roll_back(&mut cache, rollback);
        stats.profile.rollback_ms += ms_since(trim);
        if !rolled_back {
            tracing::debug!(
                target: "spec::round",
                "target cache cannot drop {rollback} positions: plain decoding from here"
            );
            drop(verified);
            finish = fall_back(target, &committed, prompt.len(), next, params, &mut stats, &mut on_token)?;
            fell_back = true;
            break;
        }
        in_cache.truncate(in_cache.len() - rollback);
        commit(source, d, walk.accepted, verified.taps.as_deref(), &mut stats)?;
        feed = if d > 0 && walk.accepted == d { vec![drafts[d - 1], next] } else { vec![next] };
        pending = next;
    }
    stats.decode_ms = decode_start.elapsed().as_secs_f64() * 1e3;
    stats.peak_memory_bytes = memory::peak();
    stats.finish();
    let mut outcome = Outcome { stats, finish, cache: None, cached_tokens: Vec::new(), draft_state: None };
    if !fell_back {
        keep_for_prompt_cache(&mut outcome, cache, in_cache, &committed, source)?;
    }
    Ok(outcome)
}

/// Fills the prompt-cache part of `outcome`: trims `cache` (which holds `in_cache`) to the
/// longest prefix of `in_cache` that was committed and the source's snapshot covers.
pub(crate) fn keep_for_prompt_cache(
    outcome: &mut Outcome,
    mut cache: ModelCache,
    mut in_cache: Vec<u32>,
    committed: &[u32],
    source: &mut dyn DraftSource,
) -> Result<()> {
    debug_assert_eq!(in_cache.len(), cache.offset(), "the executor's record of the target cache");
    let mut keep = in_cache.iter().zip(committed).take_while(|(a, b)| a == b).count();
    if let Some((covered, snapshot)) = source.snapshot(keep)? {
        keep = keep.min(covered);
        outcome.draft_state = Some(snapshot);
    }
    let drop = in_cache.len() - keep;
    if drop == 0 || (cache.can_trim(drop) && cache.trim(drop) == drop) {
        in_cache.truncate(keep);
        outcome.cache = Some(cache);
        outcome.cached_tokens = in_cache;
    } else {
        outcome.draft_state = None;
    }
    Ok(())
}

/// Hands the tokens of one accept walk to the caller's `on_token`, with their
/// log-probabilities when the request asked for them; the `i`-th token of the walk is the
/// target's token at window position `i`, whose logits `row(i)` gives.
pub(crate) struct Emitter<'f, F> {
    logprobs: Option<usize>,
    on_token: &'f mut F,
    position: usize,
    failed: Option<Error>,
}

impl<'f, F: FnMut(&Emitted) -> bool> Emitter<'f, F> {
    pub(crate) fn new(logprobs: Option<usize>, on_token: &'f mut F) -> Self {
        Emitter { logprobs, on_token, position: 0, failed: None }
    }

    /// Emits `token` (window position `self.position`); `false` stops the walk (the caller
    /// said so, or the log-probabilities failed: [`Emitter::finish`] reports it).
    pub(crate) fn emit(&mut self, token: u32, row: impl FnOnce(usize) -> Result<Array>) -> bool {
        let i = self.position;
        self.position += 1;
        let logprobs = match self.logprobs.map(|k| row(i).and_then(|r| token_logprobs(&r, token, k))) {
            None => None,
            Some(Ok(l)) => Some(l),
            Some(Err(e)) => {
                self.failed = Some(e);
                return false;
            }
        };
        (self.on_token)(&Emitted { token, logprobs })
    }

    pub(crate) fn finish(self) -> Result<()> {
        self.failed.map_or(Ok(()), Err)
    }
}

/// The log-probability of `token` and the `k` most likely tokens under the raw
/// distribution of `logits` (one row, any float dtype), computed on the host.
fn token_logprobs(logits: &Array, token: u32, k: usize) -> Result<TokenLogprobs> {
    let what = || format!("log-probabilities of token {token}");
    let z: Vec<f32> = logits.astype(Dtype::Float32).and_then(|r| r.to_vec()).context(what)?;
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_total = max + z.iter().map(|&v| (v - max).exp()).sum::<f32>().ln();
    let logprob = z
        .get(token as usize)
        .map(|&v| v - log_total)
        .ok_or_else(|| Error::Invalid(format!("token {token} is outside the logits' vocabulary of {}", z.len())))?;
    let mut order: Vec<u32> = (0..z.len() as u32).collect();
    let k = k.min(z.len());
    let by_logit = |a: &u32, b: &u32| z[*b as usize].total_cmp(&z[*a as usize]).then(a.cmp(b));
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, by_logit);
    }
    order.truncate(k);
    order.sort_by(by_logit);
    let top = order.into_iter().map(|id| (id, z[id as usize] - log_total)).collect();
    Ok(TokenLogprobs { logprob, top })
}

impl From<WalkEnd> for Finish {
    fn from(end: WalkEnd) -> Self {
        match end {
            WalkEnd::Eos => Finish::Eos,
            WalkEnd::MaxTokens | WalkEnd::Open => Finish::MaxTokens,
            WalkEnd::Stopped => Finish::Stopped,
        }
    }
}

/// The prompt's last token (the head of the first window) and the number of prompt tokens
/// the request's cache already holds, after checking that the request can start.
pub(crate) fn check_request(
    prompt: &[u32],
    cache: &ModelCache,
    source: &dyn DraftSource,
    snapshot: Option<&DraftSnapshot>,
) -> Result<(u32, usize)> {
    let Some(&last) = prompt.last() else {
        return Err(Error::Invalid("an empty prompt".into()));
    };
    let cached = cache.offset();
    if cached >= prompt.len() {
        return Err(Error::Invalid(format!(
            "the target cache holds {cached} positions, but a {}-token prompt leaves at most {} for it",
            prompt.len(),
            prompt.len() - 1
        )));
    }
    if !source.can_resume(cached, snapshot) {
        return Err(Error::Invalid(format!(
            "the draft source `{}` cannot start from a cached prefix of {cached} tokens without its own snapshot",
            source.name()
        )));
    }
    Ok((last, cached))
}

/// Logs a round at debug level to the `tracing` target `spec::round`.
pub(crate) fn trace_round(round: usize, step: usize, feed: &[u32], drafts: &[u32], walk: &WalkOutcome) {
    tracing::debug!(
        target: "spec::round",
        "round {round} step {step} feed {feed:?} drafts {drafts:?} accepted {}/{} next {}",
        walk.accepted,
        drafts.len(),
        walk.describe_end()
    );
}

/// How an accept walk ended ([`WalkOutcome::end`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WalkEnd {
    /// A correction or bonus token closed the round; the request goes on.
    Open,
    /// The target chose an EOS token (not emitted): the request is finished.
    Eos,
    /// The request reached `max_tokens`.
    MaxTokens,
    /// The caller's `on_token` returned `false`.
    Stopped,
}

/// The target's token that closed a round: it is not a draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Closing {
    /// The target's token at the first rejected draft's position.
    Correction(u32),
    /// The target's token after the last draft, every draft accepted (or none drafted).
    Bonus(u32),
}

impl Closing {
    /// The token.
    pub fn token(self) -> u32 {
        match self {
            Closing::Correction(t) | Closing::Bonus(t) => t,
        }
    }
}

/// What one accept walk did: `emitted` is `drafts[..accepted]` followed by the closing
/// token when there is one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalkOutcome {
    /// Drafts accepted, a prefix of the round's drafts.
    pub accepted: usize,
    /// The tokens handed to `on_token`, in order.
    pub emitted: Vec<u32>,
    /// The correction or bonus token, when the walk got that far (an EOS, `max_tokens` or
    /// the caller can end it on an accepted draft).
    pub closing: Option<Closing>,
    /// Why the walk stopped.
    pub end: WalkEnd,
}

impl WalkOutcome {
    /// The round's end for traces: the next token of an open round, `EOS`, or `stop`.
    fn describe_end(&self) -> String {
        match (self.end, self.closing) {
            (WalkEnd::Open, Some(c)) => c.token().to_string(),
            (WalkEnd::Eos, _) => "EOS".to_string(),
            _ => "stop".to_string(),
        }
    }
}

/// The accept walk over one verify window `[pending] ++ drafts` (`d = drafts.len()`), on
/// plain data: `target_token(i)` is the target's token at window position `i` (the token of
/// step `step + i`: the request's sample under exact match, the Leviathan/Chen decision for
/// draft `i < d` under the rejection rule); it is called for `i = 0, 1, ...` in order and
/// only as far as the walk goes. A token equal to `drafts[i]` is accepted and the walk goes
/// on; any other token is emitted as the [`Closing`] token (a correction, or the bonus at
/// `i == d`) and ends the round. An EOS token (in `eos`) is never emitted and ends the
/// request; so do `room` tokens emitted (the request's `max_tokens` minus the tokens emitted
/// before this round, at least 1) and `on_token` returning `false`. Every emitted token goes
/// to `on_token` as soon as it is decided.
///
/// # Errors
/// Only those of `target_token`.
pub fn accept_walk(
    drafts: &[u32],
    room: usize,
    eos: &[u32],
    mut target_token: impl FnMut(usize) -> Result<u32>,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<WalkOutcome> {
    let mut walk = WalkOutcome { accepted: 0, emitted: Vec::new(), closing: None, end: WalkEnd::Open };
    for i in 0..=drafts.len() {
        let t = target_token(i)?;
        if eos.contains(&t) {
            walk.end = WalkEnd::Eos;
            break;
        }
        walk.emitted.push(t);
        if drafts.get(i) == Some(&t) {
            walk.accepted += 1;
        } else {
            walk.closing = Some(if i < drafts.len() { Closing::Correction(t) } else { Closing::Bonus(t) });
        }
        if !on_token(t) {
            walk.end = WalkEnd::Stopped;
            break;
        }
        if walk.emitted.len() >= room {
            walk.end = WalkEnd::MaxTokens;
            break;
        }
        if walk.closing.is_some() {
            break;
        }
    }
    Ok(walk)
}

/// Caps the drafts per round at the target cache's exact-rollback reach: a window of `k + 1`
/// tokens whose `k` drafts are all rejected must still roll back. Records a cap below `n`
/// in [`SpecStats::draft_cap`].
pub(crate) fn cap_at_rollback_reach(cache: &ModelCache, n: usize, stats: &mut SpecStats) -> usize {
    let reach = cache.rollback_reach().unwrap_or(usize::MAX);
    stats.draft_cap = (reach < n).then_some(reach);
    n.min(reach)
}

/// Tells `source` how the round went ([`DraftSource::commit`]), timing it.
pub(crate) fn commit(
    source: &mut dyn DraftSource,
    drafted: usize,
    accepted: usize,
    taps: Option<&[Array]>,
    stats: &mut SpecStats,
) -> Result<()> {
    let t = Instant::now();
    source.commit(drafted, accepted, taps)?;
    let ms = ms_since(t);
    stats.draft_ms += ms;
    stats.profile.commit_ms += ms;
    Ok(())
}

/// Asks `source` for up to `n` drafts after `feed` and checks them against the contract: at
/// most `n` tokens, each inside the target's vocabulary of `vocab` ids.
pub(crate) fn checked_drafts(
    source: &mut dyn DraftSource,
    feed: &[u32],
    n: usize,
    step: usize,
    vocab: usize,
    stats: &mut SpecStats,
) -> Result<Vec<u32>> {
    let t = Instant::now();
    let drafts = source.draft(feed, n, step)?;
    let ms = ms_since(t);
    stats.draft_ms += ms;
    stats.profile.draft_ms += ms;
    let problem = if drafts.len() > n {
        Some(format!("asked for at most {n} drafts at step {step}, got {}: {drafts:?}", drafts.len()))
    } else {
        drafts
            .iter()
            .find(|&&t| t as usize >= vocab)
            .map(|t| format!("draft token {t} at step {step} is outside the target's vocabulary of {vocab}"))
    };
    match problem {
        Some(message) => Err(Error::Contract { source_name: source.name().to_string(), message }),
        None => Ok(drafts),
    }
}

/// A target forward of one token queued ahead (plain decoding's pipelined step): the input
/// is in the cache, `logits` (`[1, 1, V]` float32) are its next-token logits and `token`
/// (`[1, 1]` uint32) the request's lazily sampled token of its step.
struct Ahead {
    logits: Array,
    token: Array,
}

impl Ahead {
    /// Queues the forward of `input` (`[1, 1]` token ids, possibly lazy) and the sample of
    /// step `step` with [`models::generate::queue_step`], as plain decoding does.
    fn queue(
        target: &Transformer,
        cache: &mut ModelCache,
        input: &Array,
        params: &GenerateParams,
        step: usize,
    ) -> Result<Self> {
        let what = || format!("target forward of the plain step {step}");
        let models::generate::QueuedStep { logits, token } =
            models::generate::queue_step(target, cache, input, params, step).context(what)?;
        Ok(Ahead { logits, token })
    }

    /// The sampled token (waits for the forward).
    fn read(&self, step: usize) -> Result<u32> {
        let v: Vec<u32> = self.token.to_vec().context(|| format!("reading the token of plain step {step}"))?;
        Ok(v[0])
    }
}

/// The target's verify forward: logits `[1, d + 1, V]` over the window (evaluated), and the
/// hidden states of `tap_layers` (`[1, d + 1, H]` each) when the source wants them. After a
/// queued head ([`Ahead`]) the logits are `[1, d, V]` over the drafts alone. `tokens`: the
/// request's sample at every row of `logits` (row `j` sampled as step `first_step + j`),
/// evaluated with the logits in one synchronisation, when the round samples (exact-match
/// acceptance); `None` under the rejection rule.
struct Verified {
    logits: Array,
    taps: Option<Vec<Array>>,
    tokens: Option<Vec<u32>>,
}

/// How a verify forward samples its rows: `Some((sampler, step of row 0))` under exact-match
/// acceptance, `None` under the rejection rule (the walk decides from the rows).
pub(crate) type RowSampling<'a> = Option<(&'a Sampler, usize)>;

/// One target forward (and one LM head) over `[pending] ++ drafts`, appending the window to
/// `cache`.
fn verify(
    target: &Transformer,
    cache: &mut ModelCache,
    pending: u32,
    drafts: &[u32],
    tap_layers: &[usize],
    sampling: RowSampling<'_>,
    profile: &mut RoundProfile,
) -> Result<Verified> {
    let window: Vec<u32> = std::iter::once(pending).chain(drafts.iter().copied()).collect();
    let what = || format!("target forward over the verify window {window:?}");
    let build = Instant::now();
    let tokens = ids(&window).context(what)?;
    let (logits, taps) = if tap_layers.is_empty() {
        (target.forward(&tokens, cache).context(what)?, None)
    } else {
        let out = target.forward_with_taps(&tokens, cache, tap_layers).context(what)?;
        (out.logits, Some(out.taps))
    };
    let tokens = evaluate_window(&logits, sampling, build, profile).context(what)?;
    Ok(Verified { logits, taps, tokens })
}

/// The forward over `drafts` alone, after a queued head already put the window's first
/// token into `cache`: logits `[1, d, V]` (evaluated), row `j` after draft `j`.
fn verify_drafts(
    target: &Transformer,
    cache: &mut ModelCache,
    drafts: &[u32],
    sampling: RowSampling<'_>,
    profile: &mut RoundProfile,
) -> Result<Verified> {
    let what = || format!("target forward over the drafts {drafts:?}");
    let build = Instant::now();
    let logits = target.forward(&ids(drafts).context(what)?, cache).context(what)?;
    let tokens = evaluate_window(&logits, sampling, build, profile).context(what)?;
    Ok(Verified { logits, taps: None, tokens })
}

/// Evaluates a window's `logits` `[1, T, V]` and, with `sampling`, the request's token at
/// every row (row `j`: [`Sampler::sample_lazy`] of the row as float32, step `first + j`,
/// exactly the ops of [`Sampler::sample`] on that row) in one synchronisation, and reads the
/// tokens; records the graph-building time since `build` and the evaluation time.
fn evaluate_window(
    logits: &Array,
    sampling: RowSampling<'_>,
    build: Instant,
    profile: &mut RoundProfile,
) -> models::Result<Option<Vec<u32>>> {
    let tokens = sample_rows_lazy(logits, sampling)?;
    let forward = Instant::now();
    profile.build_ms += ms_since(build);
    match &tokens {
        Some(t) => mlx_core::eval(&[logits, t])?,
        None => logits.eval()?,
    }
    let host = tokens.map(|t| t.to_vec::<u32>()).transpose()?;
    profile.forward_ms += ms_since(forward);
    Ok(host)
}

/// The request's token at every row of a window's `logits` `[1, T, V]`, lazily (`[T]`
/// uint32; row `j` is [`Sampler::sample_lazy`] of the row as float32 at step `first + j`,
/// exactly the ops of [`Sampler::sample`] on that row); `None` without `sampling`.
pub(crate) fn sample_rows_lazy(logits: &Array, sampling: RowSampling<'_>) -> models::Result<Option<Array>> {
    Ok(match sampling {
        None => None,
        // Greedy: one argmax over every row (the same comparisons as a row's own argmax).
        Some((sampler, _)) if sampler.is_greedy() => {
            Some(logits.astype(Dtype::Float32)?.argmax(-1, false)?.astype(Dtype::Uint32)?.reshape(&[-1])?)
        }
        Some((sampler, first)) => {
            let rows = logits.shape()[1];
            let samples = (0..rows)
                .map(|j| {
                    let row = logits.slice_axis(1, j, j + 1)?.astype(Dtype::Float32)?;
                    sampler.sample_lazy(&row, first + j as usize)
                })
                .collect::<models::Result<Vec<_>>>()?;
            Some(mlx_core::stack(&samples.iter().collect::<Vec<_>>(), 0)?)
        }
    })
}

/// Milliseconds since `t`.
pub(crate) fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Counts a verified round of `d` drafts.
pub(crate) fn count_round(stats: &mut SpecStats, d: usize) {
    stats.rounds += 1;
    stats.target_forwards += 1;
    if d == 0 {
        stats.empty_rounds += 1;
    }
    for slot in &mut stats.drafted_by_pos[..d] {
        *slot += 1;
    }
    stats.drafted += d;
}

/// Counts what an accept walk emitted.
pub(crate) fn count_walk(stats: &mut SpecStats, walk: &WalkOutcome) {
    stats.emitted += walk.emitted.len();
    stats.accepted += walk.accepted;
    for slot in &mut stats.accepted_by_pos[..walk.accepted] {
        *slot += 1;
    }
    match walk.closing {
        Some(Closing::Correction(_)) => stats.corrections += 1,
        Some(Closing::Bonus(_)) => stats.bonuses += 1,
        None => {}
    }
    stats.stopped_on_eos |= walk.end == WalkEnd::Eos;
}

/// A verified window as the accept walk reads it.
pub(crate) struct Window<'a> {
    /// The verify forward's logits (`[1, T, V]`).
    pub(crate) logits: &'a Array,
    /// The request's token at every row of `logits`, sampled with the forward
    /// ([`Verified::tokens`]; `None` under the rejection rule).
    pub(crate) tokens: Option<&'a [u32]>,
    /// Window position 0 when a queued head computed it: its logits `[1, 1, V]` and its
    /// sampled token (then `logits` row `i - 1` is position `i`).
    pub(crate) head: Option<(&'a Array, u32)>,
}

/// The target's side of the accept walk, from the verify logits: at window position `i`
/// (step `step + i`), the request's sample, or under the rejection rule the Leviathan/Chen
/// decision on draft `i` against the source's `q` (the bonus is sampled either way).
pub(crate) struct TargetRows<'a> {
    window: Window<'a>,
    sampler: &'a Sampler,
    drafts: &'a [u32],
    step: usize,
    /// `Some` under the rejection rule: the drafter's `[d, V]` rows on the host (`None`
    /// inside: one-hot on each draft).
    q: Option<Option<Vec<f32>>>,
    source_name: &'a str,
}

impl<'a> TargetRows<'a> {
    /// Reads the source's draft distributions when the rejection rule applies.
    pub(crate) fn new(
        window: Window<'a>,
        sampler: &'a Sampler,
        drafts: &'a [u32],
        step: usize,
        rejection: bool,
        source: &'a dyn DraftSource,
    ) -> Result<Self> {
        let d = drafts.len();
        let q = if rejection && d > 0 { Some(draft_probs(source, d, step)?) } else { None };
        Ok(TargetRows { window, sampler, drafts, step, q, source_name: source.name() })
    }

    /// The target's logits `[1, 1, V]` (float32) at window position `i`.
    pub(crate) fn row(&self, i: usize) -> Result<Array> {
        let logits = self.window.logits;
        let row = match (self.window.head, i) {
            (Some((head, _)), 0) => Ok(head.clone()),
            (Some(_), _) => logits.slice_axis(1, i as i32 - 1, i as i32).and_then(|r| r.astype(Dtype::Float32)),
            (None, _) => logits.slice_axis(1, i as i32, i as i32 + 1).and_then(|r| r.astype(Dtype::Float32)),
        };
        row.context(|| format!("logits of window position {i}"))
    }

    /// The target's token at window position `i`.
    pub(crate) fn token(&self, i: usize) -> Result<u32> {
        if let Some(tokens) = self.window.tokens {
            return Ok(match (self.window.head, i) {
                (Some((_, t)), 0) => t,
                (Some(_), _) => tokens[i - 1],
                (None, _) => tokens[i],
            });
        }
        let row = self.row(i)?;
        let (at, d) = (self.step + i, self.drafts.len());
        let Some(q) = self.q.as_ref().filter(|_| i < d) else {
            return self.sampler.sample(&row, at).context(|| format!("sampling step {at}"));
        };
        let what = || format!("target distribution at step {at}");
        let p: Vec<f32> = self.sampler.probs(&row).context(what)?.to_vec().context(what)?;
        let q_row = q.as_ref().map(|q| &q[i * q.len() / d..(i + 1) * q.len() / d]);
        let (ua, ur) = (self.sampler.uniform(at, 1), self.sampler.uniform(at, 2));
        match rejection_step(&p, q_row, self.drafts[i], ua, ur) {
            Ok(Verdict::Accept) => Ok(self.drafts[i]),
            Ok(Verdict::Reject(t)) => Ok(t),
            Err(message) => Err(Error::Contract {
                source_name: self.source_name.to_string(),
                message: format!("draft {i} at step {}: {message}", self.step),
            }),
        }
    }
}

/// Drops the `n` rejected positions from the target cache; `false` when the cache cannot
/// drop exactly that many (it may then hold anything: the caller starts a new one).
pub(crate) fn roll_back(cache: &mut ModelCache, n: usize) -> bool {
    n == 0 || (cache.can_trim(n) && cache.trim(n) == n)
}

/// Rows per forward when [`fall_back`] re-runs the tokens plain decoding ran one at a time.
const FALLBACK_WINDOW: usize = if mlx_core::cpu_quant::DENSE_MAX_ROWS < mlx_core::cpu_quant::WINDOW_MAX_ROWS {
    mlx_core::cpu_quant::DENSE_MAX_ROWS
} else {
    mlx_core::cpu_quant::WINDOW_MAX_ROWS
};

/// Finishes the request as plain decoding after a failed rollback: a fresh target cache is
/// prefilled with `committed` (the `prompt_len` prompt tokens ++ emitted) except its last
/// token `next`, then [`plain_decode`] goes on from there. Every row gets the bits plain
/// decoding gave it: the prompt's head in plain prefill's chunks, the rest (rows plain
/// decoding ran as one-token steps) in windows of at most [`FALLBACK_WINDOW`] rows, which
/// keep one-token bits on the CPU kernels (longer inputs leave them: dense products for
/// BLAS past [`mlx_core::cpu_quant::DENSE_MAX_ROWS`] rows, quantized ones for the prompt GEMM
/// past [`mlx_core::cpu_quant::WINDOW_MAX_ROWS`]).
pub(crate) fn fall_back(
    target: &Transformer,
    committed: &[u32],
    prompt_len: usize,
    next: u32,
    params: &GenerateParams,
    stats: &mut SpecStats,
    on_token: &mut impl FnMut(&Emitted) -> bool,
) -> Result<Finish> {
    stats.fallback_at = Some(stats.emitted);
    let mut cache = target.make_cache();
    let (head, stepped) = committed[..committed.len() - 1].split_at(prompt_len - 1);
    prefill_target(target, &mut cache, head, &[], stats, &|| false, &mut |_| {})?;
    for window in stepped.chunks(FALLBACK_WINDOW) {
        prefill_chunk(target, &mut cache, window, &[], &mut [])?;
        stats.prefill_forwards += 1;
    }
    plain_decode(target, &mut cache, next, params, stats, on_token)
}

/// The rest of a request after a fallback, at plain decoding's speed: `cache` holds
/// `prompt ++ emitted` except its last token `next`, and [`models::generate::decode`]
/// continues from step `stats.emitted` with the same pipelined step and per-step sampler keys
/// as [`models::generate::generate`]. Every step counts as a round with no drafts whose token
/// is a bonus (the step that samples EOS counts as a round and emits nothing). The tokens
/// carry no log-probabilities.
fn plain_decode(
    target: &Transformer,
    cache: &mut ModelCache,
    next: u32,
    params: &GenerateParams,
    stats: &mut SpecStats,
    on_token: &mut impl FnMut(&Emitted) -> bool,
) -> Result<Finish> {
    let step = stats.emitted;
    let emitted = &mut stats.emitted;
    let mut stopped = false;
    let decoded = models::generate::decode(target, cache, next, step, params, |token| {
        *emitted += 1;
        stopped = !on_token(&Emitted { token, logprobs: None });
        !stopped
    })
    .context(|| format!("plain decoding from step {step} after the fallback"))?;
    stats.rounds += decoded.steps;
    stats.target_forwards += decoded.steps;
    stats.empty_rounds += decoded.steps;
    stats.bonuses += decoded.tokens;
    stats.stopped_on_eos |= decoded.stopped_on_eos;
    Ok(match (decoded.stopped_on_eos, stopped) {
        (true, _) => Finish::Eos,
        (_, true) => Finish::Stopped,
        _ => Finish::MaxTokens,
    })
}

/// What [`prefill_target`] did: `complete` is false when the request was cancelled between
/// two chunks (the cache then holds the chunks before).
struct Prefill {
    taps: Option<Vec<Array>>,
    complete: bool,
}

/// Prefills `cache` with `head` in chunks of [`PREFILL_CHUNK`], as
/// [`models::generate::prefill`] does, checking `cancelled` before each chunk and calling
/// `on_chunk` with the number of `head` tokens in the cache after each. With
/// `tap_layers`, the chunks run through `forward_with_taps` (the logits are never evaluated)
/// and the taps of all chunks are concatenated, one `[1, head.len(), H]` array per tap
/// layer; `None` without tap layers or for an empty `head`.
fn prefill_target(
    target: &Transformer,
    cache: &mut ModelCache,
    head: &[u32],
    tap_layers: &[usize],
    stats: &mut SpecStats,
    cancelled: &dyn Fn() -> bool,
    on_chunk: &mut dyn FnMut(usize),
) -> Result<Prefill> {
    let mut per_layer: Vec<Vec<Array>> = vec![Vec::new(); tap_layers.len()];
    let mut done = 0;
    for chunk in head.chunks(PREFILL_CHUNK) {
        if cancelled() {
            return Ok(Prefill { taps: None, complete: false });
        }
        prefill_chunk(target, cache, chunk, tap_layers, &mut per_layer)?;
        stats.prefill_forwards += 1;
        done += chunk.len();
        on_chunk(done);
    }
    Ok(Prefill { taps: joined_taps(&per_layer)?, complete: true })
}

/// Prefills `cache` with one `chunk` (evaluated); with `tap_layers`, through
/// `forward_with_taps` (the logits are never evaluated), pushing each tap layer's
/// `[1, chunk.len(), H]` onto `per_layer`.
pub(crate) fn prefill_chunk(
    target: &Transformer,
    cache: &mut ModelCache,
    chunk: &[u32],
    tap_layers: &[usize],
    per_layer: &mut [Vec<Array>],
) -> Result<()> {
    let what = || format!("target prefill of a {}-token chunk", chunk.len());
    let tokens = ids(chunk).context(what)?;
    if tap_layers.is_empty() {
        return target.prefill(&tokens, cache).context(what);
    }
    let out = target.forward_with_taps(&tokens, cache, tap_layers).context(what)?;
    let mut to_eval = cache.state();
    to_eval.extend(out.taps.iter().cloned());
    mlx_core::eval(&to_eval.iter().collect::<Vec<_>>()).context(what)?;
    for (acc, tap) in per_layer.iter_mut().zip(out.taps) {
        acc.push(tap);
    }
    Ok(())
}

/// The prefill taps of all chunks, one `[1, head, H]` array per tap layer; `None` without
/// tap layers or chunks.
pub(crate) fn joined_taps(per_layer: &[Vec<Array>]) -> Result<Option<Vec<Array>>> {
    if per_layer.first().is_none_or(Vec::is_empty) {
        return Ok(None);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The walk over `drafts` with the target's tokens `target` (one per window position it
    /// reaches), collecting what `on_token` saw; `stop_after` makes `on_token` refuse more
    /// after that many tokens.
    fn walk(drafts: &[u32], target: &[u32], room: usize, eos: &[u32], stop_after: usize) -> (WalkOutcome, Vec<u32>) {
        let mut seen = Vec::new();
        let mut asked = 0;
        let outcome = accept_walk(
            drafts,
            room,
            eos,
            |i| {
                assert_eq!(i, asked, "positions are asked for in order");
                asked += 1;
                Ok(target[i])
            },
            |t| {
                seen.push(t);
                seen.len() < stop_after
            },
        )
        .unwrap();
        assert_eq!(outcome.emitted, seen, "every emitted token reaches on_token");
        assert_eq!(outcome.emitted.len(), outcome.accepted + usize::from(outcome.closing.is_some()));
        (outcome, seen)
    }

    #[test]
    fn all_accepted_ends_with_the_bonus() {
        let (w, _) = walk(&[4, 5, 6], &[4, 5, 6, 7], 100, &[], usize::MAX);
        assert_eq!(
            w,
            WalkOutcome {
                accepted: 3,
                emitted: vec![4, 5, 6, 7],
                closing: Some(Closing::Bonus(7)),
                end: WalkEnd::Open
            }
        );
        // No drafts: one plain step, whose token is a bonus.
        let (w, _) = walk(&[], &[9], 100, &[], usize::MAX);
        assert_eq!(
            w,
            WalkOutcome { accepted: 0, emitted: vec![9], closing: Some(Closing::Bonus(9)), end: WalkEnd::Open }
        );
    }

    #[test]
    fn the_first_mismatch_is_the_correction() {
        // Position 3 would match draft 3, but the walk never gets there.
        let (w, _) = walk(&[4, 5, 6, 7], &[4, 8, 6, 7, 1], 100, &[], usize::MAX);
        assert_eq!(
            w,
            WalkOutcome { accepted: 1, emitted: vec![4, 8], closing: Some(Closing::Correction(8)), end: WalkEnd::Open }
        );
        let (w, _) = walk(&[4, 5], &[3, 5, 6], 100, &[], usize::MAX);
        assert_eq!((w.accepted, w.closing), (0, Some(Closing::Correction(3))));
    }

    #[test]
    fn eos_inside_the_window_ends_the_request_unemitted() {
        let (w, seen) = walk(&[4, 2, 6], &[4, 2, 6, 7], 100, &[2], usize::MAX);
        assert_eq!(w, WalkOutcome { accepted: 1, emitted: vec![4], closing: None, end: WalkEnd::Eos });
        assert_eq!(seen, [4]);
        // EOS as the correction.
        let (w, _) = walk(&[4, 5], &[4, 2, 6], 100, &[2, 3], usize::MAX);
        assert_eq!((w.accepted, w.emitted, w.closing, w.end), (1, vec![4], None, WalkEnd::Eos));
        // EOS as the bonus.
        let (w, _) = walk(&[4], &[4, 3], 100, &[2, 3], usize::MAX);
        assert_eq!((w.accepted, w.closing, w.end), (1, None, WalkEnd::Eos));
    }

    #[test]
    fn max_tokens_mid_window_stops_on_the_last_allowed_token() {
        let (w, _) = walk(&[4, 5, 6], &[4, 5, 6, 7], 2, &[], usize::MAX);
        assert_eq!(w, WalkOutcome { accepted: 2, emitted: vec![4, 5], closing: None, end: WalkEnd::MaxTokens });
        // The last allowed token is a correction: counted as one, and the request ends.
        let (w, _) = walk(&[4, 5, 6], &[4, 9, 6, 7], 2, &[], usize::MAX);
        assert_eq!(
            w,
            WalkOutcome {
                accepted: 1,
                emitted: vec![4, 9],
                closing: Some(Closing::Correction(9)),
                end: WalkEnd::MaxTokens
            }
        );
        let (w, _) = walk(&[], &[9], 1, &[], usize::MAX);
        assert_eq!((w.closing, w.end), (Some(Closing::Bonus(9)), WalkEnd::MaxTokens));
    }

    #[test]
    fn the_caller_can_stop_the_walk() {
        let (w, seen) = walk(&[4, 5, 6], &[4, 5, 6, 7], 100, &[], 2);
        assert_eq!((w.accepted, w.closing, w.end), (2, None, WalkEnd::Stopped));
        assert_eq!(seen, [4, 5]);
    }

    #[test]
    fn target_errors_end_the_walk() {
        let err =
            accept_walk(&[1, 2], 10, &[], |i| if i == 0 { Ok(1) } else { Err(Error::Invalid("row".into())) }, |_| true);
        assert!(matches!(err, Err(Error::Invalid(_))));
    }

    /// The rejection rule with the drafter's `q` equal to the target's `p` accepts every
    /// draft whatever the uniforms, then samples the bonus.
    #[test]
    fn rejection_with_q_equal_to_p_accepts_every_draft() {
        let p: Vec<Vec<f32>> =
            vec![vec![0.1, 0.6, 0.3], vec![0.5, 0.25, 0.25], vec![0.2, 0.2, 0.6], vec![1.0, 0.0, 0.0]];
        let drafts = [2, 1, 0];
        for (ua, ur) in [(0.0, 0.5), (0.5, 0.5), (0.999, 0.001)] {
            let target = |i: usize| -> Result<u32> {
                if i == drafts.len() {
                    return Ok(0); // the bonus, as plain decoding samples it
                }
                match rejection_step(&p[i], Some(&p[i]), drafts[i], ua, ur) {
                    Ok(Verdict::Accept) => Ok(drafts[i]),
                    Ok(Verdict::Reject(t)) => Ok(t),
                    Err(message) => Err(Error::Invalid(message)),
                }
            };
            let w = accept_walk(&drafts, 100, &[], target, |_| true).unwrap();
            assert_eq!((w.accepted, w.closing, w.end), (3, Some(Closing::Bonus(0)), WalkEnd::Open), "u = {ua}");
        }
    }
}
