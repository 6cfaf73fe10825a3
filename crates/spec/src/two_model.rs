//! Two-model speculative decoding (mlx-lm's `--draft-model`): a small model with the
//! target's tokenizer drafts autoregressively with its own KV cache.
use mlx_core::{Array, Dtype};
use models::generate::{PREFILL_CHUNK, ids};
use models::tokenizer::Tokenizer;
use models::{ModelCache, Sampler, Transformer};

use std::sync::{Arc, Mutex};

use crate::error::Context;
use crate::policy::{AcceptanceModel, CostCurve, CostModel, Origin, SurvivalKey};
use crate::{DraftProvider, DraftSnapshot, DraftSource, Error, Result};

/// Default drafts per round for a draft model (mlx_lm's CLI default).
pub const DEFAULT_NUM_DRAFT_TOKENS: usize = 3;
/// Default most drafts per round for a draft model under the cost-aware policy.
pub const DEFAULT_ADAPTIVE_DRAFT_TOKENS: usize = 8;
/// Under the cost-aware policy, a round drafts one token after this many rounds in a row
/// drafted none (a probe, so the estimates can recover), whatever the estimates say.
pub const PROBE_AFTER_PLAIN_ROUNDS: usize = 16;

/// The cost-aware length policy of a draft model ([`crate::policy`]): the target's and the
/// drafter's cost curves, and the acceptance estimates shared by the provider's sources.
#[derive(Debug)]
struct ModelPolicy {
    target: CostModel,
    draft: CostModel,
    acceptance: Arc<Mutex<AcceptanceModel>>,
    /// The measured wall time of drafting, milliseconds per drafted token (a moving average
    /// over the rounds of every source, starting from the drafter's calibrated step), once
    /// measured.
    drafting_ms: Arc<Mutex<Option<f64>>>,
}

/// Weight of the newest round in the moving average of drafting time per token.
const DRAFTING_MS_WEIGHT: f64 = 0.1;

/// A source's view of the policy for one request.
#[derive(Debug, Clone)]
struct RequestPolicy {
    curve: CostCurve,
    /// Cost of one drafted token in target steps: the measured drafting time per token
    /// ([`ModelPolicy::drafting_ms`]) over the target's step, or before any is measured the
    /// drafter's calibrated one-token step over the target's; 0 for synthetic curves.
    per_draft: f64,
    acceptance: Arc<Mutex<AcceptanceModel>>,
    drafting_ms: Arc<Mutex<Option<f64>>>,
    /// The drafter's calibrated one-token step, milliseconds: where the average of measured
    /// drafting times starts (0 for a synthetic curve).
    draft_step_ms: f64,
    /// Whether this request has drafted once (its first drafting round is not timed: it
    /// pays for warming the drafter's caches).
    warmed: bool,
    /// Rounds in a row that drafted nothing.
    plain_rounds: usize,
    /// Whether the last round drafted nothing and the executor pipelined its plain step
    /// (then the next window costs `t(1) + t(k)`).
    after_plain: bool,
    /// Whether this round is a probe (one draft, whatever its rating).
    probe: bool,
}

/// The key of a draft model's survival estimates (no match length: one bucket).
const MODEL_KEY: SurvivalKey = SurvivalKey { origin: Origin::Model, bucket: 4, continues: false };

/// Feeds longer than this are prefilled (no LM head) except their last token.
const SMALL_FEED: usize = 8;

/// How the draft model picks its tokens. Either way the output is the target's; only the
/// acceptance rate moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftSampling {
    /// Argmax of the draft model's logits, whatever the request's sampler.
    Greedy,
    /// The request's sampler (the default): draft `i` of a round is drawn from the draft
    /// model's filtered distribution with the key of step `step + i`, the key the target
    /// uses for that position. The shared Gumbel noise couples the two draws: under exact
    /// match a drafter identical to the target is accepted every time, and a close one about
    /// as often as the two distributions' noisy argmaxes agree (greedy drafting at
    /// temperature 0.7-1.0 matches only the target's mode). The drafts' `q` rows serve the
    /// rejection rule. With a greedy request this is [`DraftSampling::Greedy`].
    #[default]
    Request,
}

/// Checks that a draft model's tokenizer is the target's: the same vocabulary size, the same
/// token string for every id, the same added tokens (id, text and `special` flag) and the
/// same BOS/EOS tokens. Only the tokenizers are compared: padded embedding rows beyond the
/// tokenizer's vocabulary (Qwen2.5 checkpoints pad to 151936 or 152064 rows) are fine (a
/// [`TwoModelSource`] opened by [`TwoModelProvider`] never proposes an id the target has no
/// row for), and the executor stops at the target's EOS ids whatever the draft model's are.
///
/// # Errors
/// [`Error::Incompatible`] naming both models and the first difference.
pub fn check_tokenizers(draft: &Tokenizer, target: &Tokenizer, draft_name: &str, target_name: &str) -> Result<()> {
    let fail = |message: String| {
        Err(Error::Incompatible { draft: draft_name.to_string(), target: target_name.to_string(), message })
    };
    if draft.vocab_size() != target.vocab_size() {
        return fail(format!(
            "vocabulary sizes differ: {} tokens in the draft model, {} in the target",
            draft.vocab_size(),
            target.vocab_size()
        ));
    }
    for id in 0..target.vocab_size() as u32 {
        let (a, b) = (draft.id_to_token(id), target.id_to_token(id));
        if a != b {
            return fail(format!("token {id} is {a:?} in the draft model and {b:?} in the target"));
        }
    }
    let added = |t: &Tokenizer| {
        let mut v: Vec<(u32, String, bool)> = t
            .inner()
            .get_added_tokens_decoder()
            .iter()
            .map(|(&id, tok)| (id, tok.content.clone(), tok.special))
            .collect();
        v.sort();
        v
    };
    let (da, ta) = (added(draft), added(target));
    if da != ta {
        let diff = da.iter().zip(&ta).find(|(a, b)| a != b).map_or_else(
            || format!("{} added tokens in the draft model, {} in the target", da.len(), ta.len()),
            |(a, b)| format!("added token {a:?} in the draft model, {b:?} in the target"),
        );
        return fail(format!("special tokens differ: {diff}"));
    }
    if draft.bos_token() != target.bos_token() {
        return fail(format!(
            "BOS token {:?} in the draft model, {:?} in the target",
            draft.bos_token(),
            target.bos_token()
        ));
    }
    if draft.eos_token() != target.eos_token() {
        return fail(format!(
            "EOS token {:?} in the draft model, {:?} in the target",
            draft.eos_token(),
            target.eos_token()
        ));
    }
    Ok(())
}

/// Holds a draft model and opens a [`TwoModelSource`] per request. Check the tokenizers
/// with [`check_tokenizers`] when loading the pair.
pub struct TwoModelProvider {
    model: Transformer,
    name: String,
    sampling: DraftSampling,
    policy: Option<ModelPolicy>,
}

impl TwoModelProvider {
    /// A drafter sampling as the request does ([`DraftSampling::Request`]); `name` (usually
    /// the model directory) appears in traces and errors.
    pub fn new(model: Transformer, name: impl Into<String>) -> Self {
        TwoModelProvider { model, name: name.into(), sampling: DraftSampling::default(), policy: None }
    }

    /// The same provider under the cost-aware length policy: each round plans the `k` (up
    /// to the executor's `n`) that maximises `(1 + sum s_i) / (t(1 + k) + k c)`, with `t`
    /// the target's curve, `c` the cost of a drafted token in target steps (the measured
    /// drafting time per token over the target's step; before the first drafting round the
    /// drafter's calibrated step over the target's; 0 when either curve is synthetic) and
    /// `s_i` learnt from this provider's rounds; then drafts one token at a time while
    /// [`crate::policy::keep_drafting`] says the next one, rated by the draft model's
    /// largest probability ([`SurvivalKey::rated`]), still pays. Both decisions use only
    /// earlier rounds and the drafts before the next one (a stopping time: exact under both
    /// acceptance rules). Plain steps run pipelined only while an unsplit window would not
    /// pay more ([`DraftSource::pipeline_plain_steps`]).
    pub fn with_policy(mut self, target: CostModel, draft: CostModel) -> Self {
        self.policy = Some(ModelPolicy { target, draft, acceptance: Arc::default(), drafting_ms: Arc::default() });
        self
    }

    /// Chooses how the draft model picks tokens.
    pub fn with_sampling(mut self, sampling: DraftSampling) -> Self {
        self.sampling = sampling;
        self
    }

    /// The draft model.
    pub fn model(&self) -> &Transformer {
        &self.model
    }
}

impl DraftProvider for TwoModelProvider {
    fn name(&self) -> &str {
        &self.name
    }

    fn open<'a>(&'a self, target: &'a Transformer, sampler: &Sampler) -> Result<Box<dyn DraftSource + 'a>> {
        let sampler = match self.sampling {
            DraftSampling::Greedy => Sampler::default(),
            DraftSampling::Request => sampler.clone(),
        };
        let mut source = TwoModelSource::new(&self.model, sampler, &self.name);
        source.vocab_limit = target.config.vocab_size;
        if let Some(p) = &self.policy {
            let curve = p.target.curve(target)?;
            let draft = p.draft.curve(&self.model)?;
            let per_draft =
                if curve.step_ms > 0.0 && draft.step_ms > 0.0 { draft.step_ms / curve.step_ms } else { 0.0 };
            source.policy = Some(RequestPolicy {
                curve,
                per_draft,
                acceptance: p.acceptance.clone(),
                drafting_ms: p.drafting_ms.clone(),
                draft_step_ms: draft.step_ms,
                warmed: false,
                plain_rounds: 0,
                after_plain: false,
                probe: false,
            });
        }
        Ok(Box::new(source))
    }

    fn describe_policy(&self) -> Option<serde_json::Value> {
        let p = self.policy.as_ref()?;
        let (curve, draft) = (p.target.current()?, p.draft.current()?);
        Some(serde_json::json!({
            "policy": "cost-aware",
            "cost_curve": curve.describe(),
            "draft_step_ms": draft.step_ms,
            "survival": p.acceptance.lock().ok()?.describe(),
        }))
    }
}

/// A draft model's per-request state: its KV cache and the committed tokens it has not run
/// yet.
///
/// Bookkeeping (mlx-lm's `speculative_generate_step`): `draft(feed, n)` runs the unfed
/// tokens (`feed`, plus anything deferred) and then its own drafts one at a time, so after
/// `d` drafts its cache holds `d - 1` of them (the last one was never run). `commit(d, a)`
/// keeps the `min(a, d - 1)` accepted drafts it ran and trims the rest, `max(d - a - 1, 0)`
/// positions; after an all-accept round the executor feeds `[last_draft, bonus]`. A cache
/// that cannot trim exactly is rebuilt from the committed tokens. On every `draft` it
/// checks that `cache + unfed == committed == prompt + step` tokens.
pub struct TwoModelSource<'a> {
    model: &'a Transformer,
    name: String,
    sampler: Sampler,
    cache: ModelCache,
    /// Tokens the draft model must have seen: `prompt ++ emitted` as of the last feed,
    /// plus accepted drafts.
    committed: Vec<u32>,
    /// Committed tokens not yet in `cache` (always a suffix of `committed`).
    unfed: Vec<u32>,
    prompt_len: usize,
    last_drafts: Vec<u32>,
    /// With a sampling drafter: the logits `[1, V]` each of `last_drafts` was drawn from.
    last_logits: Vec<Array>,
    /// Drafts of the last round that went through the model (are in `cache`).
    fed_drafts: usize,
    /// Drafts at or above this id are never proposed (the target has no such row).
    vocab_limit: usize,
    rebuilds: usize,
    policy: Option<RequestPolicy>,
    /// Under the policy: the draft model's rating of each of `last_drafts` (the largest
    /// probability of the distribution it was drawn from).
    last_ratings: Vec<f64>,
}

impl<'a> TwoModelSource<'a> {
    /// A source drafting with `model` and `sampler` (use `Sampler::default()` for greedy).
    pub fn new(model: &'a Transformer, sampler: Sampler, name: &str) -> Self {
        TwoModelSource {
            model,
            name: name.to_string(),
            sampler,
            cache: model.make_cache(),
            committed: Vec::new(),
            unfed: Vec::new(),
            prompt_len: 0,
            last_drafts: Vec::new(),
            last_logits: Vec::new(),
            fed_drafts: 0,
            vocab_limit: usize::MAX,
            rebuilds: 0,
            policy: None,
            last_ratings: Vec::new(),
        }
    }

    /// Uses `cache` (empty, one layer per draft-model layer, e.g. rotating windows) instead
    /// of `model.make_cache()` for this request. If it cannot roll back exactly, the source
    /// replaces it with a fresh `make_cache()` rebuilt from the committed tokens.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a non-empty cache or one with the wrong number of layers.
    pub fn with_cache(mut self, cache: ModelCache) -> Result<Self> {
        if cache.offset() != 0 || cache.layers.len() != self.model.num_layers() {
            return Err(Error::Invalid(format!(
                "a draft cache must be empty with {} layers; got {} layers holding {} positions",
                self.model.num_layers(),
                cache.layers.len(),
                cache.offset()
            )));
        }
        self.cache = cache;
        Ok(self)
    }

    /// Positions in the draft model's cache.
    pub fn cache_offset(&self) -> usize {
        self.cache.offset()
    }

    /// How often the draft cache could not trim exactly and was rebuilt.
    pub fn rebuilds(&self) -> usize {
        self.rebuilds
    }

    fn contract(&self, message: String) -> Error {
        Error::Contract { source_name: self.name.clone(), message }
    }

    /// Under the cost-aware policy, whether to draw the next draft from `logits` (its
    /// distribution, known before the draw): the draft model's rating of it (the largest
    /// probability of [`Sampler::probs`], recorded) gives its acceptance estimate, and
    /// [`crate::policy::keep_drafting`] decides with the drafts kept so far, up to `n`.
    /// Always `true` without the policy.
    fn rate_and_continue(&mut self, logits: &Array, n: usize, step: usize) -> Result<bool> {
        let Some(p) = &self.policy else { return Ok(true) };
        let i = self.last_ratings.len();
        let what = || format!("draft model `{}` rating draft {i} at step {step}", self.name);
        let probs = self.sampler.probs(logits).context(what)?;
        let rating = f64::from(probs.max(&[0], false).context(what)?.to_vec::<f32>().context(what)?[0]);
        let acc = p.acceptance.lock().expect("acceptance lock");
        let rated = |r: f64, j: usize| acc.rated(r, MODEL_KEY, j);
        let survival: Vec<f64> = self
            .last_ratings
            .iter()
            .enumerate()
            .scan(1.0, |s, (j, &r)| {
                *s *= rated(r, j);
                Some(*s)
            })
            .collect();
        let (next, later) = (rated(rating, i), acc.conditional(MODEL_KEY, i + 1));
        drop(acc);
        let (per_draft, after_plain, curve) = (p.per_draft, p.after_plain, &p.curve);
        let keep = (p.probe && i == 0)
            || crate::policy::keep_drafting(curve, &survival, next, later, n, |k| {
                k as f64 * per_draft + crate::policy::split_window_cost(curve, k, after_plain)
            });
        if keep {
            self.last_ratings.push(rating);
        }
        Ok(keep)
    }

    /// Under the policy, the bookkeeping after a round's drafting: `d` drafts (0: a plain
    /// step, chosen before drafting or stopped by the ratings), drafted since `started`
    /// when the round is timed (the drafting time per token joins the provider's average).
    fn end_round(&mut self, d: usize, started: Option<std::time::Instant>) {
        let pipelined = d == 0 && self.pipeline_plain_steps();
        let Some(p) = &mut self.policy else { return };
        p.plain_rounds = if d == 0 { p.plain_rounds + 1 } else { 0 };
        p.after_plain = pipelined;
        if let (Some(started), true, true) = (started, d > 0, p.warmed && p.draft_step_ms > 0.0) {
            let ms = started.elapsed().as_secs_f64() * 1e3 / d as f64;
            let mut avg = p.drafting_ms.lock().expect("drafting time lock");
            let a = avg.unwrap_or(p.draft_step_ms);
            *avg = Some(a + DRAFTING_MS_WEIGHT * (ms - a));
        }
        p.warmed |= d > 0;
    }

    /// Runs the unfed tokens through the draft model; returns the logits `[1, 1, V]` after
    /// the last one.
    fn run_unfed(&mut self) -> Result<Array> {
        let unfed = std::mem::take(&mut self.unfed);
        let what = || format!("draft model `{}` forward over {} tokens", self.name, unfed.len());
        let Some((&last, head)) = unfed.split_last() else {
            return Err(self.contract("nothing to run: an empty feed".into()));
        };
        let logits = if unfed.len() <= SMALL_FEED {
            self.model.forward(&ids(&unfed).context(what)?, &mut self.cache).context(what)?
        } else {
            for chunk in head.chunks(PREFILL_CHUNK) {
                self.model.prefill(&ids(chunk).context(what)?, &mut self.cache).context(what)?;
            }
            self.model.forward(&ids(&[last]).context(what)?, &mut self.cache).context(what)?
        };
        logits.slice_axis(1, -1, i32::MAX).and_then(|l| l.astype(Dtype::Float32)).context(what)
    }
}

impl TwoModelSource<'_> {
    /// Starts a request on `cache`, which holds the draft model's state for a prefix of
    /// `prompt[..n-1]` (nothing, or a prompt-cache snapshot): runs the rest of it.
    fn start_on(&mut self, cache: ModelCache, prompt: &[u32]) -> Result<()> {
        let Some((_, head)) = prompt.split_last() else {
            return Err(Error::Invalid("an empty prompt".into()));
        };
        self.cache = cache;
        for chunk in head[self.cache.offset()..].chunks(PREFILL_CHUNK) {
            let what = || format!("draft model `{}` prefill of {} tokens", self.name, chunk.len());
            self.model.prefill(&ids(chunk).context(what)?, &mut self.cache).context(what)?;
        }
        self.committed = head.to_vec();
        self.unfed.clear();
        self.prompt_len = prompt.len();
        self.last_drafts.clear();
        self.last_logits.clear();
        self.fed_drafts = 0;
        Ok(())
    }
}

impl DraftSource for TwoModelSource<'_> {
    fn name(&self) -> &str {
        &self.name
    }

    fn prefill(&mut self, prompt: &[u32], _taps: Option<&[Array]>) -> Result<()> {
        // An empty cache (the one `with_cache` set) is used as it is.
        let cache = match self.cache.offset() {
            0 => std::mem::replace(&mut self.cache, ModelCache { layers: Vec::new() }),
            _ => self.model.make_cache(),
        };
        self.start_on(cache, prompt)
    }

    /// The draft model's cache for the first `min(tokens, tokens it ran)` committed tokens
    /// (a copy sharing the arrays, [`ModelCache::prefix`]); `None` when it cannot be copied.
    fn snapshot(&mut self, tokens: usize) -> Result<Option<(usize, DraftSnapshot)>> {
        let covered = tokens.min(self.committed.len() - self.unfed.len());
        Ok(self.cache.prefix(covered).map(|cache| (covered, Box::new(cache) as DraftSnapshot)))
    }

    /// Restores the draft model's cache from the snapshot (cut to `cached` tokens) and runs
    /// only the new prompt tokens; without a usable snapshot, a full prefill.
    fn resume(
        &mut self,
        prompt: &[u32],
        cached: usize,
        snapshot: Option<DraftSnapshot>,
        taps: Option<&[Array]>,
    ) -> Result<()> {
        let restored = snapshot
            .and_then(|s| s.downcast::<ModelCache>().ok())
            .filter(|c| c.layers.len() == self.model.num_layers() && c.offset() >= cached)
            .and_then(|c| c.prefix(cached));
        match restored {
            Some(cache) => self.start_on(cache, prompt),
            None => self.prefill(prompt, taps),
        }
    }

    fn draft(&mut self, feed: &[u32], n: usize, step: usize) -> Result<Vec<u32>> {
        if feed.is_empty() {
            return Err(self.contract(format!("empty feed at step {step}")));
        }
        self.committed.extend_from_slice(feed);
        self.unfed.extend_from_slice(feed);
        let (len, cached) = (self.committed.len(), self.cache.offset() + self.unfed.len());
        if len != self.prompt_len + step || cached != len {
            return Err(self.contract(format!(
                "at step {step}: {len} committed tokens (expected prompt {} + {step}), cache {} + unfed {}",
                self.prompt_len,
                self.cache.offset(),
                self.unfed.len()
            )));
        }
        self.last_drafts.clear();
        self.last_logits.clear();
        self.last_ratings.clear();
        self.fed_drafts = 0;
        let n = match &mut self.policy {
            None => n,
            Some(p) => {
                let survival = p.acceptance.lock().expect("acceptance lock").survival(MODEL_KEY, n);
                if let (Some(ms), true) = (*p.drafting_ms.lock().expect("drafting time lock"), p.curve.step_ms > 0.0) {
                    p.per_draft = ms / p.curve.step_ms;
                }
                let (per_draft, after_plain, curve) = (p.per_draft, p.after_plain, &p.curve);
                let k = crate::policy::choose(curve, &survival, |k| {
                    k as f64 * per_draft + crate::policy::split_window_cost(curve, k, after_plain)
                });
                // After many rounds without a draft (chosen before drafting, or stopped by the
                // ratings), one draft whatever its estimate, so the estimates can recover.
                p.probe = p.plain_rounds >= PROBE_AFTER_PLAIN_ROUNDS;
                if p.probe { n.min(1) } else { k }
            }
        };
        if n == 0 {
            // Defer the feed: it is run with the next round's.
            self.end_round(0, None);
            return Ok(Vec::new());
        }
        // A round that feeds one or two tokens runs `d` drafter steps for `d` drafts (the
        // feed, then every draft but the last): its time per draft is the drafting cost. A
        // round catching up after plain steps (a longer feed) is not timed.
        let started = (self.unfed.len() <= 2).then(std::time::Instant::now);
        let mut logits = self.run_unfed()?;
        let mut drafts = Vec::with_capacity(n);
        loop {
            let i = drafts.len();
            if !self.rate_and_continue(&logits, n, step)? {
                break;
            }
            let what = || format!("draft model `{}` sampling draft {i} at step {step}", self.name);
            let t = self.sampler.sample(&logits, step + i).context(what)?;
            if t as usize >= self.vocab_limit {
                self.last_ratings.truncate(i);
                break;
            }
            if !self.sampler.is_greedy() {
                self.last_logits.push(logits.clone());
            }
            drafts.push(t);
            if drafts.len() == n {
                break;
            }
            let what = || format!("draft model `{}` forward of draft {i} at step {step}", self.name);
            let out = self.model.forward(&ids(&[t]).context(what)?, &mut self.cache).context(what)?;
            self.fed_drafts += 1;
            logits = out.astype(Dtype::Float32).context(what)?;
        }
        self.end_round(drafts.len(), started);
        self.last_drafts = drafts.clone();
        Ok(drafts)
    }

    /// With [`DraftSampling::Request`] at temperature > 0: the `[d, V_draft]` distributions
    /// the drafts were drawn from ([`Sampler::probs`] of each draft's logits); `None` for a
    /// greedy drafter.
    fn draft_probs(&self) -> Result<Option<Array>> {
        if self.last_logits.is_empty() {
            return Ok(None);
        }
        let what = || format!("draft model `{}` stacking {} draft distributions", self.name, self.last_logits.len());
        let rows = self.last_logits.iter().map(|l| self.sampler.probs(l)).collect::<models::Result<Vec<_>>>();
        let rows = rows.context(what)?;
        mlx_core::stack(&rows.iter().collect::<Vec<_>>(), 0).map(Some).context(what)
    }

    /// Without the policy, always; under it, while an unsplit window of the expected
    /// acceptance, drafting cost included, would not beat the pipeline
    /// ([`crate::policy::CostCurve::pipeline_plain_steps`]).
    fn set_batch(&mut self, batch: Option<crate::policy::BatchLoad>) {
        if let Some(p) = &mut self.policy {
            p.curve.batch = batch;
        }
    }

    fn pipeline_plain_steps(&self) -> bool {
        let Some(p) = &self.policy else { return true };
        let survival = p.acceptance.lock().expect("acceptance lock").survival(MODEL_KEY, DEFAULT_ADAPTIVE_DRAFT_TOKENS);
        let value = crate::policy::best_round_ratio(&p.curve, &survival, |k| k as f64 * p.per_draft);
        p.curve.pipeline_plain_steps(value)
    }

    fn commit(&mut self, drafted: usize, accepted: usize, _taps: Option<&[Array]>) -> Result<()> {
        if drafted != self.last_drafts.len() || accepted > drafted {
            return Err(self
                .contract(format!("commit({drafted}, {accepted}) after drafting {} tokens", self.last_drafts.len())));
        }
        if let Some(p) = &self.policy {
            let mut acc = p.acceptance.lock().expect("acceptance lock");
            for j in 0..drafted.min(accepted + 1) {
                acc.observe(MODEL_KEY, j, j < accepted);
                if let Some(&rating) = self.last_ratings.get(j) {
                    acc.observe(SurvivalKey::rated(rating), 0, j < accepted);
                }
            }
        }
        self.last_ratings.clear();
        // An all-accept round's last draft comes back in the next feed: do not keep it.
        let keep = accepted.min(drafted.saturating_sub(1));
        let in_cache = keep.min(self.fed_drafts);
        let rollback = self.fed_drafts - in_cache;
        self.committed.extend_from_slice(&self.last_drafts[..keep]);
        // Accepted drafts that were never run (none in the normal case) join the unfed tail.
        self.unfed.extend_from_slice(&self.last_drafts[in_cache..keep]);
        if rollback > 0 && !(self.cache.can_trim(rollback) && self.cache.trim(rollback) == rollback) {
            self.cache = self.model.make_cache();
            self.unfed = self.committed.clone();
            self.rebuilds += 1;
        }
        self.last_drafts.clear();
        self.last_logits.clear();
        self.fed_drafts = 0;
        Ok(())
    }
}
