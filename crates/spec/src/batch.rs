//! Continuous batching with speculation: several requests decode at once, each round one
//! target forward over all their verify windows ([`Transformer::forward_batch`]: the rows of
//! every request go through each row-wise op together, attention stays per request), and
//! each request walks, rolls back and commits its own window with its own sampler, step
//! counter, drafter and cache.
//!
//! ```text
//! step():  requests whose cancel flag is set leave (Finish::Cancelled)
//!          one prefill chunk (PREFILL_CHUNK tokens) of the oldest request still prefilling
//!          every decoding request drafts:  window_i = [pending_i] ++ drafts_i
//!          rated blocks (DSpark under the policy) cut by the prefix scheduler
//!          one forward over all windows, one evaluation of all logits and sampled tokens
//!          each request: accept walk, rollback, commit; finished requests leave
//! ```
//!
//! **Batch invariance.** A request's tokens do not depend on what else is in the batch: its
//! rows of the batched forward equal, bit for bit, the rows of the same window run alone on
//! its cache (the CPU kernels compute a row with the same operations whatever the number of
//! rows; `models/tests/batch_exact.rs`), and everything else a round does belongs to the
//! request. Under exact-match acceptance its tokens are therefore those of [`crate::run`] on
//! it alone, which are plain decoding's ([`models::generate::generate`]). The Leviathan/Chen
//! rule keeps the target's distribution per request as well; its tokens follow the drafts,
//! which may depend on timing (an adaptive draft model measures its drafting time).
//!
//! Unlike [`crate::run`], rounds without drafts are one-token windows of the batched forward
//! (never pipelined ahead: the next round's forward holds the other requests' windows too),
//! and the prefill of a new request is interleaved with the others' rounds chunk by chunk so
//! running requests keep streaming. A failed rollback finishes that request as plain
//! decoding on its own ([`crate::SpecStats::fallback_at`]) before the batch goes on.
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use mlx_core::{Array, memory};
use models::generate::{GenerateParams, PREFILL_CHUNK};
use models::{BatchPart, ModelCache, Transformer};

use crate::error::Context;
use crate::executor::{
    Emitted, Emitter, Finish, Outcome, TargetRows, WalkEnd, Window, accept_walk, cap_at_rollback_reach, check_request,
    checked_drafts, commit, count_round, count_walk, fall_back, joined_taps, keep_for_prompt_cache, ms_since,
    prefill_chunk, roll_back, sample_rows_lazy, trace_round,
};
use crate::policy::{BatchLoad, schedule_prefixes};
use crate::rejection::Acceptance;
use crate::source::DraftSnapshot;
use crate::{DraftSource, Error, Result, SpecOptions, SpecStats};

/// One request for a [`Batch`]: [`crate::Request`]'s fields, owned.
pub struct BatchRequest {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// `max_tokens`, the sampler and the EOS ids.
    pub params: GenerateParams,
    /// Drafts per round and the acceptance rule.
    pub options: SpecOptions,
    /// An empty target cache or a prompt-cache prefix of `prompt` (as [`crate::Request::cache`]).
    pub cache: ModelCache,
    /// The source's snapshot for the cached prefix ([`crate::Request::draft_state`]).
    pub draft_state: Option<DraftSnapshot>,
    /// Log-probabilities with `k` alternatives per token ([`crate::Request::logprobs`]).
    pub logprobs: Option<usize>,
    /// Checked before every prefill chunk and round: once `true` the request leaves with
    /// [`Finish::Cancelled`].
    pub cancel: Option<Arc<AtomicBool>>,
}

/// Called with each of a request's tokens as soon as it is final; `false` stops the request
/// ([`Finish::Stopped`]).
pub type OnToken<'a> = Box<dyn FnMut(&Emitted) -> bool + 'a>;

/// A request that left the batch: its id ([`Batch::add`]) and its outcome or error.
pub struct Finished {
    /// The id [`Batch::add`] returned.
    pub id: u64,
    /// As [`crate::run`] returns it.
    pub result: Result<Outcome>,
}

/// The shape of the last batched round, for a server's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoundShape {
    /// Requests in the round's forward.
    pub requests: usize,
    /// Rows (tokens) in the round's forward, all windows together.
    pub rows: usize,
}

/// The requests decoding together on one target ([module docs](self)).
pub struct Batch<'t> {
    target: &'t Transformer,
    slots: Vec<Slot<'t>>,
    next_id: u64,
    last_round: Option<RoundShape>,
}

/// Where a request is.
enum Phase {
    /// Its prompt goes into the target cache chunk by chunk; `taps` collects the chunks' tap
    /// layers for the source.
    Prefill { done: usize, taps: Vec<Vec<Array>>, draft_state: Option<DraftSnapshot> },
    /// It decodes: `pending` heads its next window, `feed` is what the source reads next.
    Decode { pending: u32, feed: Vec<u32>, started: Instant },
}

struct Slot<'t> {
    id: u64,
    source: Box<dyn DraftSource + 't>,
    on_token: OnToken<'t>,
    prompt: Vec<u32>,
    params: GenerateParams,
    num_draft_tokens: usize,
    rejection: bool,
    logprobs: Option<usize>,
    cancel: Option<Arc<AtomicBool>>,
    cache: ModelCache,
    tap_layers: Vec<usize>,
    stats: SpecStats,
    /// Prompt ++ emitted.
    committed: Vec<u32>,
    /// The tokens whose KV state `cache` holds, in order.
    in_cache: Vec<u32>,
    phase: Phase,
    arrived: Instant,
    /// Rows of its last window (1 before the first), for the others' [`BatchLoad`].
    rows: usize,
    /// Tokens its last round emitted (1 before the first).
    tokens: f64,
}

/// A decoding request's part of one round: its window's drafts, its forward output, and
/// its sampled rows.
struct Round {
    slot: usize,
    drafts: Vec<u32>,
    logits: Array,
    taps: Vec<Array>,
    tokens: Option<Array>,
}

impl<'t> Batch<'t> {
    /// An empty batch on `target`.
    pub fn new(target: &'t Transformer) -> Self {
        Batch { target, slots: Vec::new(), next_id: 0, last_round: None }
    }

    /// Requests in the batch (prefilling or decoding).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether no request is in the batch.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The last round's forward: requests and rows (`None` before the first).
    pub fn last_round(&self) -> Option<RoundShape> {
        self.last_round
    }

    /// Adds a request, drafted by `source` (opened for it; the batch drops it when the
    /// request leaves); its tokens go to `on_token`. Returns the id [`Finished`] carries.
    /// The request starts prefilling at the next [`Batch::step`].
    ///
    /// # Errors
    /// As [`crate::run`] refuses a request: an empty prompt, a cache holding more than
    /// `prompt.len() - 1` positions, a source that cannot resume from it.
    pub fn add(
        &mut self,
        source: Box<dyn DraftSource + 't>,
        request: BatchRequest,
        on_token: OnToken<'t>,
    ) -> Result<u64> {
        let BatchRequest { prompt, params, options, cache, draft_state, logprobs, cancel } = request;
        let (_, cached) = check_request(&prompt, &cache, &*source, draft_state.as_ref())?;
        let mut stats = SpecStats::new(prompt.len(), options.num_draft_tokens);
        stats.cached_tokens = cached;
        let num_draft_tokens = cap_at_rollback_reach(&cache, options.num_draft_tokens, &mut stats);
        let tap_layers = source.tap_layers().to_vec();
        let id = self.next_id;
        self.next_id += 1;
        self.slots.push(Slot {
            id,
            rejection: options.acceptance == Acceptance::Rejection && !params.sampler.is_greedy(),
            source,
            on_token,
            in_cache: prompt[..cached].to_vec(),
            committed: prompt.clone(),
            prompt,
            params,
            num_draft_tokens,
            logprobs,
            cancel,
            cache,
            phase: Phase::Prefill { done: cached, taps: vec![Vec::new(); tap_layers.len()], draft_state },
            tap_layers,
            stats,
            arrived: Instant::now(),
            rows: 1,
            tokens: 1.0,
        });
        Ok(id)
    }

    /// One step ([module docs](self)): cancelled requests leave, one prefill chunk runs, and
    /// every decoding request gets one round in one batched forward. Returns the requests
    /// that finished (or failed) in this step. A failure of a request's own (its drafter, its
    /// fallback) fails that request only; a failed batched forward fails the requests in it.
    pub fn step(&mut self) -> Vec<Finished> {
        let mut ended: Vec<(usize, Result<Finish>)> = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            if slot.cancelled() {
                ended.push((i, Ok(Finish::Cancelled)));
            }
        }
        let prefilling = self.slots.iter().position(|s| matches!(s.phase, Phase::Prefill { .. }));
        if let Some(i) = prefilling.filter(|i| !ended.iter().any(|(e, _)| e == i)) {
            let target = self.target;
            if let Err(e) = self.slots[i].prefill_step(target) {
                ended.push((i, Err(e)));
            }
        }
        let leaving: Vec<usize> = ended.iter().map(|(i, _)| *i).collect();
        ended.extend(self.round(&leaving));
        // Leave in decreasing index order, so the indices stay valid and the others keep
        // their order (the oldest prefilling request goes first).
        ended.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        ended
            .into_iter()
            .map(|(i, result)| {
                let mut slot = self.slots.remove(i);
                Finished { id: slot.id, result: result.map(|finish| slot.finish(finish)) }
            })
            .collect()
    }

    /// One round over every decoding request but those `leaving`; returns `(slot index, how
    /// it ended)` of the requests that ended (`Ok(finish)`: finished; `Err`: failed).
    fn round(&mut self, leaving: &[usize]) -> Vec<(usize, Result<Finish>)> {
        let mut ended = Vec::new();
        // Drafts first: a drafter's failure ends its request only.
        // Each request drafts given the others' windows (this round's where drafted already,
        // else their last round's) and their last round's tokens.
        let mut windows: Vec<(usize, Vec<u32>)> = Vec::new();
        let decoding: Vec<usize> = (0..self.slots.len())
            .filter(|&i| matches!(self.slots[i].phase, Phase::Decode { .. }) && !leaving.contains(&i))
            .collect();
        let (mut all_rows, all_tokens) =
            decoding.iter().fold((0, 0.0), |(r, t), &i| (r + self.slots[i].rows, t + self.slots[i].tokens));
        for &i in &decoding {
            let slot = &mut self.slots[i];
            let load = BatchLoad { rows: all_rows - slot.rows, tokens: all_tokens - slot.tokens };
            slot.source.set_batch(Some(load));
            match slot.draft(self.target.config.vocab_size) {
                Ok(drafts) => {
                    all_rows = all_rows - slot.rows + drafts.len() + 1;
                    slot.rows = drafts.len() + 1;
                    windows.push((i, drafts));
                }
                Err(e) => ended.push((i, Err(e))),
            }
        }
        self.schedule_rated(&mut windows, &mut ended);
        if windows.is_empty() {
            return ended;
        }
        let build = Instant::now();
        let rounds = match self.forward(&windows) {
            Ok(rounds) => rounds,
            Err(e) => {
                let message = e.to_string();
                ended.extend(windows.iter().map(|(i, _)| (*i, Err(Error::Batch(message.clone())))));
                return ended;
            }
        };
        let forward_ms = ms_since(build);
        self.last_round =
            Some(RoundShape { requests: rounds.len(), rows: rounds.iter().map(|r| r.drafts.len() + 1).sum() });
        for round in rounds {
            let slot = &mut self.slots[round.slot];
            slot.stats.profile.forward_ms += forward_ms;
            let i = round.slot;
            match slot.walk(self.target, round) {
                Ok(None) => {}
                Ok(Some(finish)) => ended.push((i, Ok(finish))),
                Err(e) => ended.push((i, Err(e))),
            }
        }
        ended
    }

    /// Cuts the windows of the requests whose sources leave their length to the batch
    /// ([`DraftSource::prefix_acceptance`]: DSpark drafters under the cost-aware policy) with
    /// the prefix scheduler ([`schedule_prefixes`], the DSpark paper's Algorithm 1), over
    /// the rest of the forward (the other windows' rows, their requests' last tokens). A
    /// source that refuses the cut fails its request.
    fn schedule_rated(&mut self, windows: &mut Vec<(usize, Vec<u32>)>, ended: &mut Vec<(usize, Result<Finish>)>) {
        let mut rated = Vec::new();
        let mut curve = None;
        let mut base = BatchLoad::default();
        for (w, (i, drafts)) in windows.iter().enumerate() {
            match self.slots[*i].source.prefix_acceptance() {
                Some((prefix, c)) => {
                    rated.push((w, prefix));
                    curve.get_or_insert(c);
                }
                None => {
                    base.rows += drafts.len() + 1;
                    base.tokens += self.slots[*i].tokens;
                }
            }
        }
        let Some(curve) = curve else { return };
        let prefixes: Vec<Vec<f64>> = rated.iter().map(|(_, p)| p.clone()).collect();
        let lengths = schedule_prefixes(&curve, &prefixes, base);
        let mut failed = Vec::new();
        for ((w, _), k) in rated.into_iter().zip(lengths) {
            let (i, drafts) = &mut windows[w];
            let slot = &mut self.slots[*i];
            match slot.source.truncate_drafts(k) {
                Ok(()) => {
                    drafts.truncate(k);
                    slot.rows = k + 1;
                }
                Err(e) => failed.push((w, e)),
            }
        }
        for (w, e) in failed.into_iter().rev() {
            let (i, _) = windows.remove(w);
            ended.push((i, Err(e)));
        }
    }

    /// The batched forward over `windows` (`[pending] ++ drafts` of each slot), its logits
    /// and sampled tokens evaluated together (one synchronisation for the whole batch).
    fn forward(&mut self, windows: &[(usize, Vec<u32>)]) -> Result<Vec<Round>> {
        let mut taps: Vec<usize> = windows.iter().flat_map(|(i, _)| self.slots[*i].tap_layers.clone()).collect();
        taps.sort_unstable();
        taps.dedup();
        let mut pendings = Vec::with_capacity(windows.len());
        let mut parts = Vec::with_capacity(windows.len());
        let mut window_of = windows.iter().peekable();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some((_, drafts)) = window_of.next_if(|(w, _)| *w == i) else { continue };
            let Phase::Decode { pending, .. } = slot.phase else { unreachable!("only decoding slots draft") };
            pendings.push(pending);
            slot.in_cache.push(pending);
            slot.in_cache.extend_from_slice(drafts);
            let tokens = std::iter::once(pending).chain(drafts.iter().copied()).collect();
            parts.push(BatchPart { tokens, cache: &mut slot.cache });
        }
        let what = || format!("batched target forward over {} windows", windows.len());
        let outputs = self.target.forward_batch(&mut parts, &taps).context(what)?;
        drop(parts);
        let mut rounds = Vec::with_capacity(windows.len());
        let mut to_eval = Vec::new();
        for ((i, drafts), out) in windows.iter().zip(outputs) {
            let slot = &self.slots[*i];
            let sampling = (!slot.rejection).then_some((&slot.params.sampler, slot.stats.emitted));
            let tokens = sample_rows_lazy(&out.logits, sampling).context(what)?;
            to_eval.push(out.logits.clone());
            to_eval.extend(tokens.iter().cloned());
            let own_taps =
                slot.tap_layers.iter().map(|t| out.taps[taps.binary_search(t).expect("in the union")].clone());
            rounds.push(Round {
                slot: *i,
                drafts: drafts.clone(),
                logits: out.logits,
                taps: own_taps.collect(),
                tokens,
            });
        }
        mlx_core::eval(&to_eval.iter().collect::<Vec<_>>()).context(what)?;
        Ok(rounds)
    }
}

impl Slot<'_> {
    fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed))
    }

    /// One prefill chunk; when the prompt is in (all but its last token, which heads the
    /// first window), the source reads it and the request starts decoding.
    fn prefill_step(&mut self, target: &Transformer) -> Result<()> {
        let Phase::Prefill { done, taps, draft_state } = &mut self.phase else { return Ok(()) };
        let head_end = self.prompt.len() - 1;
        if *done < head_end {
            let chunk = &self.prompt[*done..head_end.min(*done + PREFILL_CHUNK)];
            prefill_chunk(target, &mut self.cache, chunk, &self.tap_layers, taps)?;
            self.in_cache.extend_from_slice(chunk);
            self.stats.prefill_forwards += 1;
            *done += chunk.len();
            if *done < head_end {
                return Ok(());
            }
        }
        let taps = joined_taps(taps)?;
        let cached = self.stats.cached_tokens;
        match cached {
            0 => self.source.prefill(&self.prompt, taps.as_deref())?,
            _ => self.source.resume(&self.prompt, cached, draft_state.take(), taps.as_deref())?,
        }
        self.stats.prefill_ms = ms_since(self.arrived);
        let last = self.prompt[head_end];
        self.phase = Phase::Decode { pending: last, feed: vec![last], started: Instant::now() };
        Ok(())
    }

    /// This round's drafts.
    fn draft(&mut self, vocab: usize) -> Result<Vec<u32>> {
        let Phase::Decode { feed, .. } = &self.phase else { unreachable!("only decoding slots draft") };
        let step = self.stats.emitted;
        let n = self.num_draft_tokens.min(self.params.max_tokens - step - 1);
        checked_drafts(self.source.as_mut(), feed, n, step, vocab, &mut self.stats)
    }

    /// The accept walk over this request's verified window, then its rollback and commit;
    /// `Some(finish)` when the request ended.
    fn walk(&mut self, target: &Transformer, round: Round) -> Result<Option<Finish>> {
        let Round { drafts, logits, taps, tokens, .. } = round;
        let d = drafts.len();
        count_round(&mut self.stats, d);
        let step = self.stats.emitted;
        let walk_start = Instant::now();
        let tokens =
            tokens.map(|t| t.to_vec::<u32>()).transpose().context(|| format!("reading the tokens of step {step}"))?;
        let window = Window { logits: &logits, tokens: tokens.as_deref(), head: None };
        let rows = TargetRows::new(window, &self.params.sampler, &drafts, step, self.rejection, &*self.source)?;
        let mut emit = Emitter::new(self.logprobs, &mut self.on_token);
        let walk = accept_walk(
            &drafts,
            self.params.max_tokens - step,
            &self.params.eos,
            |i| rows.token(i),
            |t| emit.emit(t, |i| rows.row(i)),
        )?;
        emit.finish()?;
        count_walk(&mut self.stats, &walk);
        self.committed.extend_from_slice(&walk.emitted);
        self.tokens = walk.emitted.len().max(1) as f64;
        let Phase::Decode { feed, pending, .. } = &mut self.phase else { unreachable!("only decoding slots walk") };
        trace_round(self.stats.rounds, step, feed, &drafts, &walk);
        self.stats.profile.walk_ms += ms_since(walk_start);
        let (WalkEnd::Open, Some(closing)) = (walk.end, walk.closing) else {
            return Ok(Some(walk.end.into()));
        };
        let next = closing.token();
        let rollback = d - walk.accepted;
        let trim = Instant::now();
        let rolled_back = roll_back(&mut self.cache, rollback);
        self.stats.profile.rollback_ms += ms_since(trim);
        if !rolled_back {
            tracing::debug!(target: "spec::round", "target cache cannot drop {rollback} positions: plain decoding from here");
            let finish = fall_back(
                target,
                &self.committed,
                self.prompt.len(),
                next,
                &self.params,
                &mut self.stats,
                &mut self.on_token,
            )?;
            self.in_cache.clear();
            return Ok(Some(finish));
        }
        self.in_cache.truncate(self.in_cache.len() - rollback);
        commit(self.source.as_mut(), d, walk.accepted, (!taps.is_empty()).then_some(&taps[..]), &mut self.stats)?;
        *feed = if d > 0 && walk.accepted == d { vec![drafts[d - 1], next] } else { vec![next] };
        *pending = next;
        Ok(None)
    }

    /// The request's [`Outcome`] as it leaves the batch with `finish`.
    fn finish(&mut self, finish: Finish) -> Outcome {
        if let Phase::Decode { started, .. } = self.phase {
            self.stats.decode_ms = ms_since(started);
        } else {
            self.stats.prefill_ms = ms_since(self.arrived);
        }
        self.stats.peak_memory_bytes = memory::peak();
        self.stats.finish();
        let mut outcome = Outcome {
            stats: std::mem::take(&mut self.stats),
            finish,
            cache: None,
            cached_tokens: Vec::new(),
            draft_state: None,
        };
        let fell_back = outcome.stats.fallback_at.is_some();
        let cache = std::mem::replace(&mut self.cache, ModelCache::full(0));
        let in_cache = std::mem::take(&mut self.in_cache);
        let prefilled = matches!(self.phase, Phase::Decode { .. });
        if !fell_back && prefilled {
            // A failed snapshot only costs the prompt cache its entry.
            let _ = keep_for_prompt_cache(&mut outcome, cache, in_cache, &self.committed, self.source.as_mut());
        } else if !fell_back && !in_cache.is_empty() {
            outcome.cached_tokens = in_cache;
            outcome.cache = Some(cache);
        }
        outcome
    }
}
