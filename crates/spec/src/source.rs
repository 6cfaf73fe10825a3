//! The seam between decoding and drafting: a [`DraftProvider`] holds whatever outlives a
//! request (drafter weights, options) and opens one [`DraftSource`] per request; the
//! executor ([`crate::speculative_generate`]) drives the source round by round.
//!
//! # The protocol, one request
//!
//! ```text
//! source.prefill(prompt, taps)                 target cache now holds prompt[..n-1]
//! loop {
//!     drafts = source.draft(feed, n, step)     0..=n tokens; the length is authoritative
//!     ... the target verifies [pending] ++ drafts and accepts a prefix ...
//!     source.commit(drafts.len(), accepted, taps)
//! }
//! ```
//!
//! - The first `feed` is `[prompt[n-1]]` (the last prompt token heads the first window).
//! - After a round that accepted every one of its `d > 0` drafts, `feed` is
//!   `[drafts[d-1], bonus]`; after any other round it is `[correction]` (the target's token
//!   at the first rejected position, or its token for a `d = 0` round).
//! - So, if a source appends `feed` at `draft` and `drafts[..min(accepted, d - 1)]` at
//!   `commit`, its history is exactly `prompt ++ emitted tokens` whenever `draft` is called,
//!   and `step` equals the number of emitted tokens (`history.len() == prompt.len() + step`).
//!   The sources of this crate check that identity on every call.
//! - `commit` is not called for the round that ends the request (EOS, `max_tokens`, the
//!   caller stopping), nor after the executor dropped to plain decoding.
//!
//! What a source keeps, it owns and frees by `Drop`; what it borrows (`&Transformer`,
//! `&[Array]`) it cannot free. There is no dispose call.
use mlx_core::Array;
use models::{Sampler, Transformer};

use crate::Result;

/// Long-lived drafting state: drafter weights and options, shared by every request.
pub trait DraftProvider {
    /// A short name for logs, traces and errors (`"ngram"`, the draft model's directory).
    fn name(&self) -> &str;

    /// Opens the per-request source. `target` is the model being decoded (a source may keep
    /// a borrow, e.g. to share its embeddings); `sampler` is the request's sampler (a
    /// source that drafts by sampling may draw with `sampler.key(step + i)` for draft `i`).
    ///
    /// # Errors
    /// Whatever the provider cannot set up (incompatible target, allocation).
    fn open<'a>(&'a self, target: &'a Transformer, sampler: &Sampler) -> Result<Box<dyn DraftSource + 'a>>;

    /// The draft-length policy this provider applies, as `--stats-json` reports it (the cost
    /// curve and the survival estimates of [`crate::policy`]); `None` (the default) for a
    /// provider without one.
    fn describe_policy(&self) -> Option<serde_json::Value> {
        None
    }
}

/// The per-request drafting state behind the seam (see the module docs for the protocol).
pub trait DraftSource {
    /// A short name for traces and errors.
    fn name(&self) -> &str;

    /// Target decoder layers whose output hidden states this source wants (tap `i` is the
    /// residual stream after layer `i`, HF's `hidden_states[i + 1]`); empty (the default)
    /// when the source drafts from token ids alone. The executor reads it once per request.
    fn tap_layers(&self) -> &[usize] {
        &[]
    }

    /// Tells a source under a cost-aware policy that the request decodes in a batch
    /// ([`crate::batch`], `Some`: the other requests of the coming round) or alone (`None`,
    /// the default); the batch calls it before every `draft`. It never changes the tokens.
    fn set_batch(&mut self, batch: Option<crate::policy::BatchLoad>) {
        let _ = batch;
    }

    /// Whether the executor may pipeline the plain step after a round in which this source
    /// drafted nothing: queue the next step's forward before reading this step's token (plain
    /// decoding's speed), which leaves a window drafted next round split into that queued
    /// forward plus one over the drafts. `true` (the default); a source whose next round
    /// would likely be worth an unsplit window returns `false`, and the executor then reads
    /// the token first. The executor asks right after each `draft` that proposed nothing
    /// (sources with tap layers never run pipelined). It never changes the tokens.
    fn pipeline_plain_steps(&self) -> bool {
        true
    }

    /// Starts a request. `prompt` is the whole prompt (`n >= 1` tokens); the target has
    /// prefilled `prompt[..n-1]`, and `prompt[n-1]` arrives as the first `feed`. `taps`, when
    /// [`DraftSource::tap_layers`] is non-empty and `n > 1`, holds one `[1, n-1, H]` array
    /// per tap layer (in the order of `tap_layers`, compute dtype) for the prefilled
    /// positions; otherwise `None`.
    ///
    /// # Errors
    /// Drafter forward failures.
    fn prefill(&mut self, prompt: &[u32], taps: Option<&[Array]>) -> Result<()>;

    /// Absorbs `feed` (1 or 2 committed tokens, see the protocol) and proposes up to `n`
    /// tokens to follow it. `step` is the generation step of the first proposed token (the
    /// number of tokens emitted so far). Returning fewer than `n` tokens, or none, is fine;
    /// returning more is a contract error.
    ///
    /// # Errors
    /// Drafter forward failures; [`crate::Error::Contract`] when the source's bookkeeping
    /// finds its history out of step with `step`.
    fn draft(&mut self, feed: &[u32], n: usize, step: usize) -> Result<Vec<u32>>;

    /// The distributions the drafts of the last [`DraftSource::draft`] call were drawn from,
    /// `[d, V']` probabilities (any float dtype; row `i` is draft `i`'s `q`, after the
    /// drafter's own sampling filters), for the Leviathan/Chen rejection rule
    /// ([`crate::rejection`]). `None` (the default) means the drafts were chosen
    /// deterministically (greedy, lookup), which the rule treats as one-hot `q`. A source
    /// must return `Some` only when its drafts really were drawn from these rows.
    ///
    /// # Errors
    /// Failures assembling the rows.
    fn draft_probs(&self) -> Result<Option<Array>> {
        Ok(None)
    }

    /// The batch scheduler's view of the last [`DraftSource::draft`]'s drafts, for a source
    /// that rates its drafts before they are verified (a DSpark drafter's confidence head
    /// under the cost-aware policy) and decodes in a batch: `a_j` for `j = 1..=d`, the
    /// estimated chance that drafts `1..=j` are all accepted (non-increasing in `j`; draft
    /// `j`'s rating depends on earlier drafts only), with the target's cost curve. A source
    /// that returns `Some` proposes its whole block and leaves the length to the batch's
    /// prefix scheduler ([`crate::policy::schedule_prefixes`], the DSpark paper's Algorithm
    /// 1), which then calls [`DraftSource::truncate_drafts`]. `None` (the default): the
    /// source chose its own length.
    fn prefix_acceptance(&self) -> Option<(Vec<f64>, crate::policy::CostCurve)> {
        None
    }

    /// Keeps the first `k` of the last [`DraftSource::draft`]'s drafts (`k` at most their
    /// number); the next [`DraftSource::commit`] counts `k` drafted.
    ///
    /// # Errors
    /// [`crate::Error::Contract`] for a source that does not rate its drafts (the default)
    /// or `k` above the drafts' number.
    fn truncate_drafts(&mut self, k: usize) -> Result<()> {
        Err(crate::Error::Contract {
            source_name: self.name().to_string(),
            message: format!("asked to keep {k} drafts, but the source leaves no length to the batch"),
        })
    }

    /// Ends a round: of the `drafted` tokens the last [`DraftSource::draft`] returned, the
    /// first `accepted` were emitted. `taps`, when tap layers were requested, holds one
    /// `[1, drafted + 1, H]` array per tap layer: the target's hidden states over the verify
    /// window `[pending] ++ drafts`, of which positions `0..=accepted` are committed context.
    ///
    /// # Errors
    /// Drafter rollback failures; [`crate::Error::Contract`] when `drafted` is not the length
    /// of the last draft or `accepted > drafted`.
    fn commit(&mut self, drafted: usize, accepted: usize, taps: Option<&[Array]>) -> Result<()>;

    /// The state worth keeping for a later request whose tokens start with this request's
    /// first `tokens` tokens of `prompt ++ emitted` (a prompt-cache entry, see
    /// [`crate::run`]), called once after the request ended. Returns how many of those tokens
    /// the snapshot covers (at most `tokens`: the prompt cache keeps the target's state for
    /// as many) and the snapshot. `None` (the default) means the source needs nothing but
    /// the token ids, which the prompt cache keeps anyway.
    ///
    /// # Errors
    /// Failures copying the state.
    fn snapshot(&mut self, tokens: usize) -> Result<Option<(usize, DraftSnapshot)>> {
        let _ = tokens;
        Ok(None)
    }

    /// Whether [`DraftSource::resume`] can start a request whose first `cached` prompt tokens
    /// the target cache already holds, given the snapshot an earlier request left (`None`:
    /// none). The default: always for a source without tap layers (it re-reads the ids);
    /// a source drafting from the target's hidden states needs its own snapshot.
    fn can_resume(&self, cached: usize, snapshot: Option<&DraftSnapshot>) -> bool {
        let _ = snapshot;
        cached == 0 || self.tap_layers().is_empty()
    }

    /// [`DraftSource::prefill`] for a request whose first `cached` prompt tokens the target
    /// cache already held (a prompt-cache hit): `snapshot` is what an earlier request's
    /// [`DraftSource::snapshot`] returned for at least `cached` tokens, and `taps` covers
    /// only the newly prefilled positions `prompt[cached..n-1]`. Called only when
    /// [`DraftSource::can_resume`] said yes. The default re-reads the whole prompt with
    /// `prefill(prompt, taps)` (right for sources without tap layers, which get no taps).
    ///
    /// # Errors
    /// As [`DraftSource::prefill`].
    fn resume(
        &mut self,
        prompt: &[u32],
        cached: usize,
        snapshot: Option<DraftSnapshot>,
        taps: Option<&[Array]>,
    ) -> Result<()> {
        let _ = (cached, snapshot);
        self.prefill(prompt, taps)
    }
}

/// A draft source's state over a prefix of tokens, kept by a prompt cache beside the
/// target's KV cache ([`DraftSource::snapshot`]) and handed back to a source of the same
/// kind ([`DraftSource::resume`]), which downcasts it. Opaque to everyone else.
pub type DraftSnapshot = Box<dyn std::any::Any>;

/// A source that never drafts: every round is a plain decoding step (what a request with
/// no drafter, or `num_draft_tokens` 0, runs through [`crate::run`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoDrafts;

impl DraftSource for NoDrafts {
    fn name(&self) -> &str {
        "none"
    }

    fn prefill(&mut self, _prompt: &[u32], _taps: Option<&[Array]>) -> Result<()> {
        Ok(())
    }

    fn draft(&mut self, _feed: &[u32], _n: usize, _step: usize) -> Result<Vec<u32>> {
        Ok(Vec::new())
    }

    fn commit(&mut self, _drafted: usize, _accepted: usize, _taps: Option<&[Array]>) -> Result<()> {
        Ok(())
    }
}

/// Test support: drives `src` through the executor's protocol over `prompt` for `rounds` of
/// `(n, accepted, fresh)` (ask for `n` drafts, accept `min(accepted, d)`, close with a token
/// that differs from the rejected draft or a bonus, re-feed after all-accept rounds) and
/// checks after every draft that `history(src)` is prompt ++ emitted and at most `n` came.
#[cfg(test)]
pub(crate) fn drive_protocol<S: DraftSource>(
    src: &mut S,
    history: impl Fn(&S) -> Vec<u32>,
    prompt: &[u32],
    rounds: &[(usize, usize, u32)],
) -> std::result::Result<(), String> {
    src.prefill(prompt, None).map_err(|e| e.to_string())?;
    let mut stream = prompt.to_vec();
    let mut feed = vec![*prompt.last().ok_or("an empty prompt")?];
    for &(n, acc, fresh) in rounds {
        let step = stream.len() - prompt.len();
        let drafts = src.draft(&feed, n, step).map_err(|e| e.to_string())?;
        if drafts.len() > n {
            return Err(format!("{} drafts asked for {n}", drafts.len()));
        }
        if history(src) != stream {
            return Err(format!("history {:?} is not prompt ++ emitted {stream:?}", history(src)));
        }
        let d = drafts.len();
        let accepted = acc.min(d);
        stream.extend(&drafts[..accepted]);
        let next = if accepted < d { drafts[accepted] + 1 + fresh } else { fresh };
        stream.push(next);
        src.commit(d, accepted, None).map_err(|e| e.to_string())?;
        feed = if d > 0 && accepted == d { vec![drafts[d - 1], next] } else { vec![next] };
    }
    Ok(())
}
