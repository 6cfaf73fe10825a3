//! The production [`Backend`]: the target model, the drafters and the prompt cache, on the
//! engine thread.
//!
//! Drafters: the one the server was started with (`--draft-model`, `--draft-kind`, ... as in
//! `mlx-spec generate`; the suffix drafter by default), plus the model-free ones (`suffix`,
//! `ngram`), which cost nothing to keep, so a request may pick any of them with the
//! extension field `draft_kind` (`model` only when a draft model was loaded; `none` decodes
//! plainly, as does `num_draft_tokens: 0`).
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use models::tokenizer::Tokenizer;
use models::{GenerateParams, LoadOptions, ModelCache, Sampler, Transformer, load_model};
use spec::batch::{Batch, BatchRequest};
use spec::providers::{DraftKind, DraftTarget, DrafterArgs, DrafterSpec, LoadedDrafter, NgramSpec, SuffixSpec};
use spec::{Acceptance, DraftSnapshot, DraftSource, Emitted, NoDrafts, Outcome, SpecOptions};

use crate::engine::{
    Admitted, Backend, Gauges, JobQueue, JobSpec, Summary, Token, panicked, publish, serve_one_at_a_time,
};
use crate::prompt_cache::{Payload, PromptCache};

/// The drafter kinds a server started with `drafting` offers per request: `none`, `suffix`,
/// `ngram`, and `model` when `drafting` loads one.
pub fn offered_kinds(drafting: &DrafterSpec) -> Vec<DraftKind> {
    let mut kinds = vec![DraftKind::None, DraftKind::Suffix, DraftKind::Ngram];
    if drafting.kind() == DraftKind::Model {
        kinds.push(DraftKind::Model);
    }
    kinds
}

/// What the engine thread loads.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// The target's directory.
    pub model_dir: PathBuf,
    /// How the target (and drafter weights) are loaded.
    pub load: LoadOptions,
    /// The server's drafter (checked by [`DrafterSpec::from_args`] before loading).
    pub drafting: DrafterArgs,
    /// Prompt-cache entries (0: no prompt cache).
    pub prompt_cache_size: usize,
    /// Prompt-cache byte budget.
    pub prompt_cache_bytes: usize,
    /// Requests decoding together (`--max-batch`; 1: one at a time).
    pub max_batch: usize,
}

/// A prompt-cache entry's payload: the target's KV state and the drafter's snapshot.
pub struct CachedState {
    /// The target cache holding the entry's tokens.
    pub cache: ModelCache,
    /// The drafter's snapshot (taken by the first request that resumes from it).
    pub draft_state: Option<DraftSnapshot>,
    nbytes: usize,
}

impl Payload for CachedState {
    fn nbytes(&self) -> usize {
        self.nbytes
    }
}

/// The target, its drafters, the prompt cache and the request defaults; lives on the engine
/// thread.
pub struct SpecBackend {
    models: Models,
    prompt_cache: PromptCache<CachedState>,
    max_batch: usize,
}

/// What requests read and never change: the target, the drafters and the defaults.
struct Models {
    model: Transformer,
    eos: Vec<u32>,
    default_kind: DraftKind,
    acceptance: Acceptance,
    drafters: Vec<(DraftKind, LoadedDrafter)>,
}

/// A request ready to run: its source, its [`spec::batch::BatchRequest`] (a prompt-cache
/// hit's cache and snapshot in it), and its drafter kind (the prompt cache's key).
struct Opened<'a> {
    source: Box<dyn DraftSource + 'a>,
    request: BatchRequest,
    key: &'static str,
}

impl SpecBackend {
    /// Loads the target of `spec.model_dir` and the drafters (the configured one, and the
    /// model-free ones besides it), and opens each drafter once (the suffix drafter reads or
    /// measures the target's cost curve then, not on the first request).
    ///
    /// # Errors
    /// Invalid drafting options, or weights that do not load.
    pub fn load(spec: &LoadSpec, tokenizer: &Arc<Tokenizer>) -> anyhow::Result<SpecBackend> {
        let drafting = DrafterSpec::from_args(&spec.drafting)?;
        let dir: &Path = &spec.model_dir;
        let model = load_model(dir, &spec.load).with_context(|| format!("loading {}", dir.display()))?;
        let target = DraftTarget { dir, tokenizer, load: &spec.load };
        let default_kind = drafting.kind();
        let mut drafters = Vec::new();
        if let Some(d) = drafting.load(target)? {
            drafters.push((default_kind, d));
        }
        for (kind, extra) in [
            (DraftKind::Suffix, DrafterSpec::Suffix(SuffixSpec::default())),
            (DraftKind::Ngram, DrafterSpec::Ngram(NgramSpec::default())),
        ] {
            if kind != default_kind
                && let Some(d) = extra.load(target)?
            {
                drafters.push((kind, d));
            }
        }
        for (kind, d) in &drafters {
            d.provider
                .open(&model, &Sampler::default())
                .with_context(|| format!("opening the {} drafter", kind.as_str()))?;
        }
        tracing::info!(model = %dir.display(), drafter = %drafting.describe(), max_batch = spec.max_batch, "model loaded");
        let models = Models {
            model,
            eos: tokenizer.eos_ids().to_vec(),
            default_kind,
            acceptance: spec.drafting.acceptance,
            drafters,
        };
        Ok(SpecBackend {
            models,
            prompt_cache: PromptCache::new(spec.prompt_cache_size, spec.prompt_cache_bytes),
            max_batch: spec.max_batch.max(1),
        })
    }
}

impl Models {
    /// Opens `job`'s drafter and takes the longest prompt-cache prefix its source can resume
    /// from (its own snapshot only from an entry of its own kind).
    fn open(&self, job: &JobSpec, prompt_cache: &mut PromptCache<CachedState>) -> anyhow::Result<Opened<'_>> {
        let params = GenerateParams { max_tokens: job.max_tokens, sampler: job.sampler.clone(), eos: self.eos.clone() };
        let kind =
            if job.num_draft_tokens == Some(0) { DraftKind::None } else { job.draft_kind.unwrap_or(self.default_kind) };
        let drafter = self.drafters.iter().find(|(k, _)| *k == kind).map(|(_, d)| d);
        let (source, options): (Box<dyn DraftSource + '_>, _) = match drafter {
            Some(d) => {
                let acceptance = if kind == self.default_kind { self.acceptance } else { Acceptance::ExactMatch };
                let n = job.num_draft_tokens.unwrap_or(d.num_draft_tokens);
                (d.provider.open(&self.model, &params.sampler)?, SpecOptions { num_draft_tokens: n, acceptance })
            }
            None => (Box::new(NoDrafts), SpecOptions { num_draft_tokens: 0, acceptance: Acceptance::ExactMatch }),
        };
        let key = kind.as_str();
        let hit = prompt_cache.lookup(&job.prompt, |e, reuse| {
            let snapshot = if e.kind == key { e.payload.draft_state.as_ref() } else { None };
            source.can_resume(reuse, snapshot)
        });
        let (cache, draft_state) = match hit.and_then(|h| Some((h.entry.payload.cache.prefix(h.reuse)?, h))) {
            Some((cache, h)) => {
                let snapshot = if h.entry.kind == key { h.entry.payload.draft_state.take() } else { None };
                (cache, snapshot)
            }
            None => (self.model.make_cache(), None),
        };
        let request = BatchRequest {
            prompt: job.prompt.clone(),
            params,
            options,
            cache,
            draft_state,
            logprobs: job.logprobs,
            cancel: None,
        };
        Ok(Opened { source, request, key })
    }
}

/// The request's [`Summary`]; its cache goes into the prompt cache under `key`.
fn conclude(outcome: Outcome, key: &'static str, prompt_cache: &mut PromptCache<CachedState>) -> Summary {
    let stats = &outcome.stats;
    let summary = Summary {
        finish: Some(outcome.finish),
        prompt_tokens: stats.prompt_tokens,
        cached_tokens: stats.cached_tokens,
        completion_tokens: stats.emitted,
        rounds: stats.rounds,
        draft_rounds: stats.rounds - stats.empty_rounds,
        drafted: stats.drafted,
        accepted: stats.accepted,
        accepted_by_pos: stats.accepted_by_pos.clone(),
        tau: stats.tau,
        prefill_ms: stats.prefill_ms,
        decode_ms: stats.decode_ms,
        fell_back: stats.fallback_at.is_some(),
    };
    if let Some(cache) = outcome.cache
        && !outcome.cached_tokens.is_empty()
    {
        let nbytes = cache.nbytes();
        let state = CachedState { cache, draft_state: outcome.draft_state, nbytes };
        prompt_cache.insert(outcome.cached_tokens, key, state);
    }
    summary
}

impl Backend for SpecBackend {
    fn generate(
        &mut self,
        job: &JobSpec,
        cancel: &AtomicBool,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> anyhow::Result<Summary> {
        let Opened { mut source, request, key } = self.models.open(job, &mut self.prompt_cache)?;
        let BatchRequest { prompt, params, options, cache, draft_state, logprobs, .. } = request;
        let request = spec::Request {
            prompt: &prompt,
            params: &params,
            options,
            cache,
            draft_state,
            cancel: Some(cancel),
            logprobs,
            progress: None,
        };
        let outcome = spec::run(&self.models.model, source.as_mut(), request, |e| {
            on_token(Token { id: e.token, logprobs: e.logprobs.clone() })
        })?;
        drop(source);
        Ok(conclude(outcome, key, &mut self.prompt_cache))
    }

    fn gauges(&self) -> Gauges {
        gauges(&self.prompt_cache)
    }

    /// Continuous batching ([`spec::batch::Batch`]) with `--max-batch` above 1: new requests
    /// join between rounds (up to `max_batch` at once) and prefill chunk by chunk while the
    /// others decode; each request's tokens are those it gets alone. With `--max-batch 1`,
    /// one request at a time through [`spec::run`].
    fn serve(&mut self, queue: &mut dyn JobQueue) {
        if self.max_batch <= 1 {
            return serve_one_at_a_time(self, queue);
        }
        let SpecBackend { models, prompt_cache, max_batch } = self;
        // A panic inside a round fails the requests of that batch; the next batch starts
        // afresh.
        while !queue.is_closed() {
            let mut running: HashMap<u64, (Admitted, &'static str)> = HashMap::new();
            let mut batch = Batch::new(&models.model);
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                serve_batch(models, prompt_cache, *max_batch, queue, &mut batch, &mut running)
            }));
            drop(batch);
            if let Err(p) = outcome {
                let message = format!("{:#}", panicked(p.as_ref()));
                for (_, (job, _)) in running.drain() {
                    job.finish(Err(anyhow::anyhow!("{message}")));
                }
            }
        }
    }
}

fn gauges(prompt_cache: &PromptCache<CachedState>) -> Gauges {
    Gauges {
        cache_bytes: prompt_cache.bytes(),
        cache_entries: prompt_cache.len(),
        active_memory: mlx_core::memory::active(),
    }
}

/// Runs batch steps until the queue closes: takes new jobs into `batch` while it has room
/// (waiting for one when it is empty), steps it, and finishes the requests that end.
fn serve_batch<'m>(
    models: &'m Models,
    prompt_cache: &mut PromptCache<CachedState>,
    max_batch: usize,
    queue: &mut dyn JobQueue,
    batch: &mut Batch<'m>,
    running: &mut HashMap<u64, (Admitted, &'static str)>,
) {
    loop {
        while batch.len() < max_batch {
            let Some(job) = queue.next(batch.is_empty()) else { break };
            let opened = models.open(job.spec(), prompt_cache);
            let added = opened.and_then(|Opened { source, mut request, key }| {
                request.cancel = Some(job.cancel_flag());
                let mut sink = job.sink();
                let on_token =
                    Box::new(move |e: &Emitted| sink.send(Token { id: e.token, logprobs: e.logprobs.clone() }));
                Ok((batch.add(source, request, on_token)?, key))
            });
            match added {
                Ok((id, key)) => {
                    running.insert(id, (job, key));
                }
                Err(e) => job.finish(Err(e)),
            }
        }
        if queue.is_closed() || batch.is_empty() {
            return;
        }
        let finished = batch.step();
        let metrics = queue.metrics();
        if let Some(shape) = batch.last_round() {
            metrics.batch_size.set(shape.requests as i64);
            metrics.batch_rows.observe(shape.rows as f64);
        }
        for done in finished {
            let Some((job, key)) = running.remove(&done.id) else { continue };
            let result = done.result.map(|outcome| conclude(outcome, key, prompt_cache)).map_err(anyhow::Error::from);
            publish(metrics, gauges(prompt_cache));
            job.finish(result);
        }
    }
}
