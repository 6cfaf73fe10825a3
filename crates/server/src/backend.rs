//! The production [`Backend`]: the target model, the drafters and the prompt cache, on the
//! engine thread.
//!
//! Drafters: the one the server was started with (`--draft-model`, `--draft-kind`, ... as in
//! `mlx-spec generate`; the suffix drafter by default), plus the model-free ones (`suffix`,
//! `ngram`), which cost nothing to keep, so a request may pick any of them with the
//! extension field `draft_kind` (`model` only when a draft model was loaded; `none` decodes
//! plainly, as does `num_draft_tokens: 0`).
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use models::tokenizer::Tokenizer;
use models::{GenerateParams, LoadOptions, ModelCache, Sampler, Transformer, load_model};
use spec::providers::{DraftKind, DraftTarget, DrafterArgs, DrafterSpec, LoadedDrafter, NgramSpec, SuffixSpec};
use spec::{Acceptance, DraftSnapshot, DraftSource, NoDrafts, SpecOptions};

use crate::engine::{Backend, Gauges, JobSpec, Summary, Token};
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
    model: Transformer,
    eos: Vec<u32>,
    default_kind: DraftKind,
    acceptance: Acceptance,
    drafters: Vec<(DraftKind, LoadedDrafter)>,
    prompt_cache: PromptCache<CachedState>,
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
        tracing::info!(model = %dir.display(), drafter = %drafting.describe(), "model loaded");
        Ok(SpecBackend {
            model,
            eos: tokenizer.eos_ids().to_vec(),
            default_kind,
            acceptance: spec.drafting.acceptance,
            drafters,
            prompt_cache: PromptCache::new(spec.prompt_cache_size, spec.prompt_cache_bytes),
        })
    }
}

impl Backend for SpecBackend {
    fn generate(
        &mut self,
        job: &JobSpec,
        cancel: &AtomicBool,
        on_token: &mut dyn FnMut(Token) -> bool,
    ) -> anyhow::Result<Summary> {
        let params = GenerateParams { max_tokens: job.max_tokens, sampler: job.sampler.clone(), eos: self.eos.clone() };
        let kind =
            if job.num_draft_tokens == Some(0) { DraftKind::None } else { job.draft_kind.unwrap_or(self.default_kind) };
        let drafter = self.drafters.iter().find(|(k, _)| *k == kind).map(|(_, d)| d);
        let (mut source, options): (Box<dyn DraftSource + '_>, _) = match drafter {
            Some(d) => {
                let acceptance = if kind == self.default_kind { self.acceptance } else { Acceptance::ExactMatch };
                let n = job.num_draft_tokens.unwrap_or(d.num_draft_tokens);
                (d.provider.open(&self.model, &params.sampler)?, SpecOptions { num_draft_tokens: n, acceptance })
            }
            None => (Box::new(NoDrafts), SpecOptions { num_draft_tokens: 0, acceptance: Acceptance::ExactMatch }),
        };
        let key = kind.as_str();
        // The longest cached prefix this source can resume from (its own snapshot only from
        // an entry of its own kind).
        let hit = self.prompt_cache.lookup(&job.prompt, |e, reuse| {
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
        let request = spec::Request {
            prompt: &job.prompt,
            params: &params,
            options,
            cache,
            draft_state,
            cancel: Some(cancel),
            logprobs: job.logprobs,
            progress: None,
        };
        let outcome = spec::run(&self.model, source.as_mut(), request, |e| {
            on_token(Token { id: e.token, logprobs: e.logprobs.clone() })
        })?;
        drop(source);
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
            self.prompt_cache.insert(outcome.cached_tokens, key, state);
        }
        Ok(summary)
    }

    fn gauges(&self) -> Gauges {
        Gauges {
            cache_bytes: self.prompt_cache.bytes(),
            cache_entries: self.prompt_cache.len(),
            active_memory: mlx_core::memory::active(),
        }
    }
}
