//! DSpark drafting (DeepSpec's `Qwen3DSparkModel` / `Gemma4DSparkModel`, and DFlash): the
//! drafter reads the target's hidden states at its tap layers, and each round proposes a
//! whole block of `block_size` tokens from one parallel pass plus the sequential Markov
//! head (`deepspec-port-spec.md` §2-3; DeepSpec `eval/dspark/evaluator.py`).
//!
//! # Bookkeeping
//!
//! The drafter's context covers the committed positions `0 .. start`, where `start` is the
//! position of the anchor: the newest committed token, which the target has not run yet
//! (the executor's `pending`). So:
//! - `prefill(prompt, taps)`: the target ran `prompt[..n-1]`; its taps become context rows
//!   `0 .. n-1`, and the anchor of the first round is `prompt[n-1]` at `start = n - 1`.
//! - `draft(feed, n, step)`: the anchor is `feed.last()` (the correction or bonus token, or
//!   the last prompt token), at `start = prompt.len() - 1 + step`, which must equal the
//!   context length. The block `[anchor, mask x (B-1)]` yields `B` drafts; the first
//!   `min(n, B)` are proposed (fewer when the confidence head truncates).
//! - `commit(d, a, taps)`: the verify window `[anchor] ++ drafts` ran through the target;
//!   its taps at window positions `0 ..= a` (the anchor and the accepted drafts) are now
//!   committed and become exactly `a + 1` new context rows. The bonus or correction token
//!   is the next anchor; its hidden state arrives with the next verify.
//!
//! Committed rows are queued, not projected at once: the queue joins the context in one
//! pass (`fc` and each layer's K/V over all its rows, so the weights are read once) before
//! the next block, a snapshot, or when 64 rows wait. Rounds that draw no
//! block (the cost-aware policy's plain rounds) then cost the target's step alone.
use std::sync::{Arc, Mutex};

use drafter::{DraftContext, Drafter};
use mlx_core::Array;
use models::{Sampler, Transformer};

use crate::error::Context;
use crate::policy::{AcceptanceModel, CostCurve, CostModel, Origin, SurvivalKey, keep_drafting};
use crate::{DraftProvider, DraftSnapshot, DraftSource, Error, Result};

/// The key of a DSpark drafter's per-position survival estimates (the drafts after the one
/// being rated, [`keep_drafting`]'s `later`).
const BLOCK_KEY: SurvivalKey = SurvivalKey { origin: Origin::Model, bucket: 4, continues: false };

/// The cost-aware length policy of a DSpark provider: the target's cost curve, the
/// acceptance estimates its sources share, and the drafter's measured time per block.
#[derive(Debug)]
struct BlockPolicy {
    target: CostModel,
    acceptance: Arc<Mutex<AcceptanceModel>>,
    /// Milliseconds of one block (the drafter's pass and Markov head).
    block_ms: Arc<Mutex<BlockTime>>,
}

/// The drafter's time per block, milliseconds: a running average over the provider's timed
/// blocks except the first, which pays one-time costs (MLX's first evaluation of the
/// drafter's graph and its weights' conversion to the compute dtype: 8-80 ms against 1-3 ms
/// for a 2-layer SmolLM2-135M drafter) that would keep the policy from drawing blocks for
/// hundreds of rounds.
#[derive(Debug, Default)]
struct BlockTime {
    warmed_up: bool,
    ms: Option<f64>,
}

/// Weight of a new block time in [`BlockPolicy::block_ms`]'s running average.
const BLOCK_MS_WEIGHT: f64 = 0.2;

/// Queued context rows that join the context without waiting for a block (bounds the taps
/// a source holds on to between blocks).
const FLUSH_ROWS: usize = 64;

/// Holds a loaded [`Drafter`] and opens a [`DSparkSource`] per request.
pub struct DSparkProvider {
    drafter: Drafter,
    name: String,
    confidence_threshold: f32,
    tap_layers: Vec<usize>,
    policy: Option<BlockPolicy>,
}

impl DSparkProvider {
    /// A provider for `drafter`; `name` (usually the drafter directory) appears in traces and
    /// errors. The confidence threshold starts at 0 (off: every block is proposed whole).
    ///
    /// # Errors
    /// [`Error::Incompatible`] when the drafter taps the target's embedding output
    /// (`target_layer_ids` holds `-1`): the executor supplies decoder-layer outputs only.
    pub fn new(drafter: Drafter, name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let ids = drafter.target_layer_ids();
        if ids.contains(&-1) {
            return Err(Error::Incompatible {
                draft: name,
                target: "any target".into(),
                message: format!(
                    "target_layer_ids {ids:?} taps the embedding output (-1); the executor taps decoder-layer outputs only"
                ),
            });
        }
        let tap_layers = ids.iter().map(|&l| l as usize).collect();
        Ok(DSparkProvider { drafter, name, confidence_threshold: 0.0, tap_layers, policy: None })
    }

    /// Truncates each block before the first position whose confidence (the per-position
    /// sigmoid of the confidence head, not the cumulative product) is below `threshold`;
    /// `0` (the default) keeps every block whole. No effect on drafters without a
    /// confidence head (DFlash).
    pub fn with_confidence_threshold(mut self, threshold: f32) -> Self {
        self.confidence_threshold = threshold;
        self
    }

    /// The same provider under the cost-aware length policy ([`crate::policy`]): each block
    /// is cut where [`keep_drafting`] stops, walking its slots in order, with slot `k`'s
    /// acceptance estimated from its rating (the confidence head's sigmoid; for a drafter
    /// without one, the largest probability of the slot's distribution), calibrated online
    /// by this provider's rounds ([`SurvivalKey::rated`]), and `t` the target's curve. The
    /// block itself is one drafter pass whatever its length, so drafting costs nothing in
    /// the choice. A slot's rating depends on the drafts before it only (the head reads
    /// `[h_k; W1[d_{k-1}]]`), so the cut is a stopping time: exact under both acceptance
    /// rules; `--confidence-threshold` is the special case of a fixed cut-off.
    ///
    /// Before a block is drawn, the round is also weighed as a whole: with `s_i` the
    /// provider's per-position survival so far and `c` the block's measured time over the
    /// target's step, no block is drawn (a plain round, the drafter's pass saved) when
    /// [`crate::policy::choose`] with a cost of `c` for any `k > 0` drafts picks none;
    /// after [`crate::two_model::PROBE_AFTER_PLAIN_ROUNDS`] such rounds in a row one block
    /// (a probe) is drawn whatever the estimate, so the estimates can recover. Each probe
    /// after which blocks still do not pay doubles the plain rounds before the next, up to
    /// [`MAX_PROBE_AFTER_PLAIN_ROUNDS`] (a probe costs a block and its window); a block that
    /// pays resets it. The choice uses earlier rounds only (a stopping time).
    pub fn with_policy(mut self, target: CostModel) -> Self {
        self.policy = Some(BlockPolicy { target, acceptance: Arc::default(), block_ms: Arc::default() });
        self
    }

    /// The drafter.
    pub fn drafter(&self) -> &Drafter {
        &self.drafter
    }
}

impl DraftProvider for DSparkProvider {
    fn name(&self) -> &str {
        &self.name
    }

    /// # Errors
    /// [`Error::Incompatible`] naming both sides when the drafter's `num_target_layers`,
    /// hidden size or vocabulary does not fit `target`.
    fn open<'a>(&'a self, target: &'a Transformer, sampler: &Sampler) -> Result<Box<dyn DraftSource + 'a>> {
        let mut source = DSparkSource::new(self, target)?.with_sampler(sampler.clone());
        if let Some(p) = &self.policy {
            source.policy = Some(SourcePolicy {
                curve: p.target.curve(target)?,
                acceptance: p.acceptance.clone(),
                block_ms: p.block_ms.clone(),
                plain_rounds: 0,
                probe_after: crate::two_model::PROBE_AFTER_PLAIN_ROUNDS,
            });
        }
        Ok(Box::new(source))
    }

    fn describe_policy(&self) -> Option<serde_json::Value> {
        let p = self.policy.as_ref()?;
        Some(serde_json::json!({
            "policy": "cost-aware",
            "cost_curve": p.target.current()?.describe(),
            "survival": p.acceptance.lock().ok()?.describe(),
            "block_ms": p.block_ms.lock().ok()?.ms,
        }))
    }
}

/// The most plain rounds in a row before a probe block, after probes that found blocks
/// still not worth drawing ([`DSparkProvider::with_policy`]).
pub const MAX_PROBE_AFTER_PLAIN_ROUNDS: usize = 4 * crate::two_model::PROBE_AFTER_PLAIN_ROUNDS;

/// A source's share of the [`BlockPolicy`]: the target's curve, the provider's estimates and
/// block time, the rounds in a row that drew no block, and how many such rounds the next
/// probe waits for.
struct SourcePolicy {
    curve: CostCurve,
    acceptance: Arc<Mutex<AcceptanceModel>>,
    block_ms: Arc<Mutex<BlockTime>>,
    plain_rounds: usize,
    probe_after: usize,
}

impl SourcePolicy {
    /// Whether a round of up to `n` drafts should draw a block (see
    /// [`DSparkProvider::with_policy`]); counts the rounds that do not.
    fn draw_block(&mut self, n: usize) -> bool {
        let cost = match self.block_ms.lock().expect("block time lock").ms {
            Some(ms) if self.curve.step_ms > 0.0 && self.curve.batch.is_none() => ms / self.curve.step_ms,
            _ => return true,
        };
        let survival = self.acceptance.lock().expect("acceptance lock").survival(BLOCK_KEY, n);
        let worth = crate::policy::choose(&self.curve, &survival, |k| if k > 0 { cost } else { 0.0 }) > 0;
        if worth {
            (self.plain_rounds, self.probe_after) = (0, crate::two_model::PROBE_AFTER_PLAIN_ROUNDS);
            true
        } else if self.plain_rounds >= self.probe_after {
            self.plain_rounds = 0;
            self.probe_after = (2 * self.probe_after).min(MAX_PROBE_AFTER_PLAIN_ROUNDS);
            true
        } else {
            self.plain_rounds += 1;
            false
        }
    }

    /// Adds a block's time to the provider's average (the provider's first block only warms up).
    fn time_block(&self, ms: f64) {
        let mut t = self.block_ms.lock().expect("block time lock");
        if std::mem::replace(&mut t.warmed_up, true) {
            t.ms = Some(t.ms.map_or(ms, |a| a + BLOCK_MS_WEIGHT * (ms - a)));
        }
    }
}

/// One request's DSpark drafting state: the drafter's context K/V (see the module docs for
/// the bookkeeping, which every call checks).
pub struct DSparkSource<'a> {
    drafter: &'a Drafter,
    name: &'a str,
    tap_layers: &'a [usize],
    confidence_threshold: f32,
    /// Draws each block slot ([`Drafter::propose_sampled`]); greedy by default.
    sampler: Sampler,
    ctx: DraftContext,
    /// Committed rows not yet in `ctx`, oldest first: each entry's taps (`[1, >= rows, H]`
    /// per tap layer) and its rows (see the module docs).
    queued: Vec<(Vec<Array>, usize)>,
    /// The rows of `queued`, together.
    queued_rows: usize,
    prompt_len: usize,
    last_drafts: Vec<u32>,
    /// The Markov-corrected logits `[1, B, V]` of the last block, when sampling.
    last_logits: Option<Array>,
    /// Under the policy: the target's cost curve, the provider's estimates and block time.
    policy: Option<SourcePolicy>,
    /// Under the policy: the rating of each of `last_drafts`.
    last_ratings: Vec<f64>,
    /// Under the policy in a batch: `a_j` of the whole last block, for the batch's prefix
    /// scheduler ([`DraftSource::prefix_acceptance`]).
    last_prefix: Option<Vec<f64>>,
}

impl<'a> DSparkSource<'a> {
    /// A source for one request of `target`.
    ///
    /// # Errors
    /// [`Error::Incompatible`] naming both sides when the drafter's `num_target_layers`,
    /// hidden size or vocabulary does not fit `target`.
    pub fn new(provider: &'a DSparkProvider, target: &Transformer) -> Result<Self> {
        let d = &provider.drafter;
        let c = &target.config;
        let target_name = format!("{} target ({} layers)", c.model_type, c.num_hidden_layers);
        d.check_target(c, &target_name).map_err(|e| match e {
            drafter::Error::Incompatible { drafter, target, message } => {
                Error::Incompatible { draft: drafter, target, message }
            }
            e => Error::Drafter { context: format!("checking drafter `{}`", provider.name), source: e },
        })?;
        Ok(DSparkSource {
            drafter: d,
            name: &provider.name,
            tap_layers: &provider.tap_layers,
            confidence_threshold: provider.confidence_threshold,
            sampler: Sampler::default(),
            ctx: d.new_context(),
            queued: Vec::new(),
            queued_rows: 0,
            prompt_len: 0,
            last_drafts: Vec::new(),
            last_logits: None,
            policy: None,
            last_ratings: Vec::new(),
            last_prefix: None,
        })
    }

    /// Draws block slot `k` with `sampler` and the key of generation step `step + k` (the
    /// request's sampler couples drafts and target, see [`Drafter::propose_sampled`]) instead
    /// of the argmax; at temperature > 0 [`DraftSource::draft_probs`] then returns the
    /// drafts' filtered distributions for the rejection rule.
    pub fn with_sampler(mut self, sampler: Sampler) -> Self {
        self.sampler = sampler;
        self
    }

    /// The drafter's context (every committed row and its K/V; queued rows join it first).
    ///
    /// # Errors
    /// MLX failures of the queued rows' pass.
    pub fn context(&mut self) -> Result<&DraftContext> {
        self.flush()?;
        Ok(&self.ctx)
    }

    /// Context rows committed so far, queued ones included.
    fn rows(&self) -> usize {
        self.ctx.len() + self.queued_rows
    }

    fn contract(&self, message: String) -> Error {
        Error::Contract { source_name: self.name.to_string(), message }
    }

    /// The largest probability of each of the first `d` slots' distributions (the request's
    /// [`Sampler::probs`] of the Markov-corrected logits `[1, B, V]`): the ratings of a
    /// drafter without a confidence head.
    fn slot_ratings(&self, logits: &Array, d: usize) -> models::Result<Vec<f64>> {
        (0..d as i32)
            .map(|k| {
                let top = self.sampler.probs(&logits.slice_axis(1, k, k + 1)?)?.max(&[0], false)?;
                Ok(f64::from(top.to_vec::<f32>()?[0]))
            })
            .collect()
    }

    /// Under the policy, how many of the block's drafts to propose: the first `k` whose
    /// next slot [`keep_drafting`] declines, walking the slots in order. In a batch, the
    /// whole block, its prefix estimates kept for the batch's scheduler.
    fn policy_cut(&mut self, ratings: &[f64]) -> usize {
        let Some(SourcePolicy { curve, acceptance, .. }) = &self.policy else { return ratings.len() };
        let acc = acceptance.lock().expect("acceptance lock");
        if curve.batch.is_some() {
            let prefix = ratings
                .iter()
                .enumerate()
                .scan(1.0, |a, (k, &rating)| {
                    *a *= acc.rated(rating, BLOCK_KEY, k);
                    Some(*a)
                })
                .collect();
            drop(acc);
            self.last_prefix = Some(prefix);
            return ratings.len();
        }
        let mut survival = Vec::with_capacity(ratings.len());
        for (k, &rating) in ratings.iter().enumerate() {
            let next = acc.rated(rating, BLOCK_KEY, k);
            if !keep_drafting(curve, &survival, next, acc.conditional(BLOCK_KEY, k + 1), ratings.len(), |_| 0.0) {
                return k;
            }
            survival.push(survival.last().copied().unwrap_or(1.0) * next);
        }
        ratings.len()
    }

    /// Queues window rows `0 .. rows` of each tap (`[1, >= rows, H]` each) as the next
    /// context rows; they join the context at the next [`DSparkSource::flush`], which runs
    /// here once [`FLUSH_ROWS`] rows wait.
    fn queue(&mut self, taps: &[Array], rows: usize, what: &str) -> Result<()> {
        let expected = self.drafter.target_layer_ids().len();
        if taps.len() != expected {
            return Err(self.contract(format!("{what}: {} tap arrays for {expected} tap layers", taps.len())));
        }
        if let Some(bad) = taps.iter().find(|t| t.shape().get(1).is_none_or(|&n| n < rows as i32)) {
            return Err(self.contract(format!("{what}: a tap of shape {:?} holds fewer than {rows} rows", bad.shape())));
        }
        if rows > 0 {
            self.queued.push((taps.to_vec(), rows));
            self.queued_rows += rows;
        }
        if self.queued_rows >= FLUSH_ROWS {
            self.flush()?;
        }
        Ok(())
    }

    /// Appends the queued rows to the context in one pass: per tap layer, its rows of every
    /// queued window joined, then `[1, rows, T*H]` through [`Drafter::ingest`]. Lazy.
    fn flush(&mut self) -> Result<()> {
        if self.queued.is_empty() {
            return Ok(());
        }
        let rows = self.queued_rows;
        let what = || format!("drafter `{}` ingesting {rows} context rows", self.name);
        let per_tap = (0..self.drafter.target_layer_ids().len())
            .map(|i| {
                let parts = self
                    .queued
                    .iter()
                    .map(|(taps, n)| taps[i].slice_axis(1, 0, *n as i32))
                    .collect::<mlx_core::Result<Vec<_>>>()?;
                match parts.as_slice() {
                    [one] => Ok(one.clone()),
                    _ => mlx_core::concatenate(&parts.iter().collect::<Vec<_>>(), 1),
                }
            })
            .collect::<mlx_core::Result<Vec<_>>>()
            .context(what)?;
        let feats = self.drafter.concat_taps(&per_tap).context(what)?;
        self.drafter.ingest(&mut self.ctx, &feats).context(what)?;
        self.queued.clear();
        self.queued_rows = 0;
        Ok(())
    }

    /// Forgets the context and the queue.
    fn reset_context(&mut self, ctx: DraftContext) {
        self.ctx = ctx;
        self.queued.clear();
        self.queued_rows = 0;
    }
}

impl DraftSource for DSparkSource<'_> {
    fn set_batch(&mut self, batch: Option<crate::policy::BatchLoad>) {
        if let Some(p) = &mut self.policy {
            p.curve.batch = batch;
        }
    }

    fn name(&self) -> &str {
        self.name
    }

    fn tap_layers(&self) -> &[usize] {
        self.tap_layers
    }

    fn prefill(&mut self, prompt: &[u32], taps: Option<&[Array]>) -> Result<()> {
        if prompt.is_empty() {
            return Err(Error::Invalid("an empty prompt".into()));
        }
        self.reset_context(self.drafter.new_context());
        self.prompt_len = prompt.len();
        self.last_drafts.clear();
        self.last_logits = None;
        let rows = prompt.len() - 1;
        match taps {
            Some(taps) => self.queue(taps, rows, "prefill")?,
            None if rows == 0 => {}
            None => return Err(self.contract(format!("prefill of a {}-token prompt without taps", prompt.len()))),
        }
        Ok(())
    }

    fn draft(&mut self, feed: &[u32], n: usize, step: usize) -> Result<Vec<u32>> {
        let Some(&anchor) = feed.last() else {
            return Err(self.contract(format!("empty feed at step {step}")));
        };
        let start = self.prompt_len - 1 + step;
        if self.rows() != start {
            return Err(self.contract(format!(
                "at step {step} the anchor sits at position {start} (prompt {} + {step} - 1), but the drafter's context holds {} rows",
                self.prompt_len,
                self.rows()
            )));
        }
        self.last_drafts.clear();
        self.last_ratings.clear();
        self.last_prefix = None;
        self.last_logits = None;
        if n == 0 || self.policy.as_mut().is_some_and(|p| !p.draw_block(n)) {
            return Ok(Vec::new());
        }
        self.flush()?;
        let what = || format!("drafter `{}` block for anchor {anchor} at position {start}", self.name);
        if self.policy.is_some() {
            // Queued rows join the context whether or not blocks are drawn: not a block's cost.
            mlx_core::eval(&self.ctx.state().iter().collect::<Vec<_>>()).context(what)?;
        }
        let started = std::time::Instant::now();
        let p = self.drafter.propose_sampled(&mut self.ctx, anchor, self.confidence_threshold, &self.sampler, step);
        let p = p.context(what)?;
        if let Some(policy) = &self.policy {
            policy.time_block(started.elapsed().as_secs_f64() * 1e3);
        }
        let mut drafts = p.drafts;
        drafts.truncate(n);
        if self.policy.is_some() {
            let ratings = match &p.confidence {
                Some(c) => c.iter().map(|&c| f64::from(c)).collect(),
                None => self.slot_ratings(&p.logits, drafts.len()).context(what)?,
            };
            drafts.truncate(self.policy_cut(&ratings[..drafts.len()]));
            self.last_ratings = ratings[..drafts.len()].to_vec();
        }
        self.last_drafts = drafts.clone();
        if !self.sampler.is_greedy() {
            self.last_logits = Some(p.logits);
        }
        Ok(drafts)
    }

    fn prefix_acceptance(&self) -> Option<(Vec<f64>, CostCurve)> {
        let prefix = self.last_prefix.clone()?;
        Some((prefix, self.policy.as_ref()?.curve.clone()))
    }

    fn truncate_drafts(&mut self, k: usize) -> Result<()> {
        if self.last_prefix.is_none() || k > self.last_drafts.len() {
            return Err(self.contract(format!(
                "asked to keep {k} of {} drafts{}",
                self.last_drafts.len(),
                if self.last_prefix.is_none() { " outside a batch's schedule" } else { "" }
            )));
        }
        self.last_drafts.truncate(k);
        self.last_ratings.truncate(k);
        self.last_prefix = None;
        Ok(())
    }

    /// At temperature > 0: the `[d, V]` filtered distributions ([`Sampler::probs`]) of the
    /// block slots the drafts were drawn from; `None` for a greedy source.
    fn draft_probs(&self) -> Result<Option<Array>> {
        let Some(z) = &self.last_logits else { return Ok(None) };
        let what = || format!("drafter `{}` distributions of {} drafts", self.name, self.last_drafts.len());
        let rows = (0..self.last_drafts.len() as i32)
            .map(|k| z.slice_axis(1, k, k + 1).map_err(models::Error::from).and_then(|row| self.sampler.probs(&row)))
            .collect::<models::Result<Vec<_>>>()
            .context(what)?;
        mlx_core::stack(&rows.iter().collect::<Vec<_>>(), 0).map(Some).context(what)
    }

    /// The drafter's context rows (a [`DraftContext`] copy sharing the arrays) for the first
    /// `min(tokens, rows ingested)` tokens.
    fn snapshot(&mut self, tokens: usize) -> Result<Option<(usize, DraftSnapshot)>> {
        self.flush()?;
        let mut ctx = self.ctx.clone();
        ctx.truncate(tokens);
        Ok(Some((ctx.len(), Box::new(ctx))))
    }

    /// Only with a context snapshot covering the cached tokens: the drafter cannot rebuild
    /// its context without the target's hidden states of those positions.
    fn can_resume(&self, cached: usize, snapshot: Option<&DraftSnapshot>) -> bool {
        cached == 0 || snapshot.and_then(|s| s.downcast_ref::<DraftContext>()).is_some_and(|c| c.len() >= cached)
    }

    fn resume(
        &mut self,
        prompt: &[u32],
        cached: usize,
        snapshot: Option<DraftSnapshot>,
        taps: Option<&[Array]>,
    ) -> Result<()> {
        let ctx = snapshot.and_then(|s| s.downcast::<DraftContext>().ok());
        let Some(mut ctx) = ctx.filter(|c| c.len() >= cached) else {
            return match cached {
                0 => self.prefill(prompt, taps),
                _ => Err(self.contract(format!("resuming after {cached} cached tokens without a context snapshot"))),
            };
        };
        ctx.truncate(cached);
        self.reset_context(*ctx);
        self.prompt_len = prompt.len();
        self.last_drafts.clear();
        self.last_logits = None;
        let rows = prompt.len() - 1 - cached;
        match taps {
            Some(taps) if rows > 0 => self.queue(taps, rows, "resume"),
            None if rows == 0 => Ok(()),
            _ => Err(self.contract(format!("resume of {rows} new prompt rows with taps {:?}", taps.map(<[_]>::len)))),
        }
    }

    fn commit(&mut self, drafted: usize, accepted: usize, taps: Option<&[Array]>) -> Result<()> {
        if drafted != self.last_drafts.len() || accepted > drafted {
            return Err(self
                .contract(format!("commit({drafted}, {accepted}) after drafting {} tokens", self.last_drafts.len())));
        }
        let Some(taps) = taps else {
            return Err(self.contract(format!("commit({drafted}, {accepted}) without the verify window's taps")));
        };
        self.queue(taps, accepted + 1, "commit")?;
        if let Some(SourcePolicy { acceptance, .. }) = &self.policy {
            let mut acc = acceptance.lock().expect("acceptance lock");
            for (j, &rating) in self.last_ratings.iter().enumerate().take(accepted + 1) {
                acc.observe(BLOCK_KEY, j, j < accepted);
                acc.observe(SurvivalKey::rated(rating), 0, j < accepted);
            }
        }
        self.last_drafts.clear();
        self.last_ratings.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source policy whose blocks were accepted at every position with probability
    /// `rate` (0, 1/2 or 1), on a 10 ms target step.
    fn policy(block_ms: Option<f64>, rate: f64) -> SourcePolicy {
        let mut curve = CostCurve::linear(0.1, 16);
        curve.step_ms = 10.0;
        let mut acc = AcceptanceModel::default();
        for i in 0..400 {
            for j in 0..7 {
                let accepted = rate == 1.0 || (rate > 0.0 && (i + j) % 2 == 0);
                acc.observe(BLOCK_KEY, j, accepted);
                if !accepted {
                    break;
                }
            }
        }
        SourcePolicy {
            curve,
            acceptance: Arc::new(Mutex::new(acc)),
            block_ms: Arc::new(Mutex::new(BlockTime { warmed_up: true, ms: block_ms })),
            plain_rounds: 0,
            probe_after: crate::two_model::PROBE_AFTER_PLAIN_ROUNDS,
        }
    }

    #[test]
    fn a_block_is_drawn_only_while_it_pays_for_its_drafter_pass() {
        // Blocks that are always rejected and cost half a target step: no block, except
        // probes, the first after PROBE_AFTER_PLAIN_ROUNDS plain rounds, each next after
        // twice as many, up to MAX_PROBE_AFTER_PLAIN_ROUNDS.
        let mut p = policy(Some(5.0), 0.0);
        let probe = crate::two_model::PROBE_AFTER_PLAIN_ROUNDS;
        let draws: Vec<bool> = (0..2000).map(|_| p.draw_block(7)).collect();
        let at: Vec<usize> = (0..draws.len()).filter(|&i| draws[i]).collect();
        let gaps: Vec<usize> = std::iter::once(at[0]).chain(at.windows(2).map(|w| w[1] - w[0] - 1)).collect();
        assert_eq!(
            &gaps[..5],
            &[probe, 2 * probe, 4 * probe, MAX_PROBE_AFTER_PLAIN_ROUNDS, MAX_PROBE_AFTER_PLAIN_ROUNDS]
        );
        // A block that pays resets the wait.
        *p.acceptance.lock().unwrap() = policy(None, 1.0).acceptance.lock().unwrap().clone();
        assert!(p.draw_block(7));
        assert_eq!(p.probe_after, probe);
        // Accepted blocks pay for the pass; an untimed drafter, a synthetic curve or a batch
        // (the batch scheduler decides there) always draw.
        assert!(policy(Some(5.0), 1.0).draw_block(7));
        // Half the drafts accepted: worth a cheap block, not one that costs a target step.
        assert!(policy(Some(0.1), 0.5).draw_block(7));
        assert!(!policy(Some(10.0), 0.5).draw_block(7));
        assert!(policy(None, 0.0).draw_block(7));
        let mut synthetic = policy(Some(5.0), 0.0);
        synthetic.curve.step_ms = 0.0;
        assert!(synthetic.draw_block(7));
        let mut batched = policy(Some(5.0), 0.0);
        batched.curve.batch = Some(crate::policy::BatchLoad::default());
        assert!(batched.draw_block(7));
        // The running average of block times, after a first block that only warms up.
        let p = policy(None, 1.0);
        *p.block_ms.lock().unwrap() = BlockTime::default();
        p.time_block(80.0);
        assert_eq!(p.block_ms.lock().unwrap().ms, None);
        p.time_block(10.0);
        p.time_block(20.0);
        assert_eq!(p.block_ms.lock().unwrap().ms, Some(12.0));
    }
}
