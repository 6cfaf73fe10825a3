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
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use models::tokenizer::Tokenizer;
use models::{GenerateParams, LoadOptions, Transformer, load_model};
use spec::providers::{DraftKind, DraftTarget, DrafterArgs, DrafterSpec, LoadedDrafter, NgramSpec, SuffixSpec};
use spec::{Acceptance, SpecOptions};

use crate::engine::{Backend, Finish, Gauges, JobSpec, Summary, Token};

/// The drafter kind a spec builds (`model` for draft models and DSpark drafters).
pub fn kind_of(spec: &DrafterSpec) -> DraftKind {
    match spec {
        DrafterSpec::None => DraftKind::None,
        DrafterSpec::Suffix(_) => DraftKind::Suffix,
        DrafterSpec::Ngram(_) => DraftKind::Ngram,
        DrafterSpec::Model { .. } | DrafterSpec::DSpark { .. } => DraftKind::Model,
    }
}

/// The word a request uses for `kind`.
pub fn kind_name(kind: DraftKind) -> &'static str {
    match kind {
        DraftKind::None => "none",
        DraftKind::Suffix => "suffix",
        DraftKind::Ngram => "ngram",
        DraftKind::Model => "model",
    }
}

/// The drafter kinds a server started with `drafting` offers per request: `none`, `suffix`,
/// `ngram`, and `model` when `drafting` loads one.
pub fn offered_kinds(drafting: &DrafterSpec) -> Vec<DraftKind> {
    let mut kinds = vec![DraftKind::None, DraftKind::Suffix, DraftKind::Ngram];
    if kind_of(drafting) == DraftKind::Model {
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
}

/// The target, its drafters and the request defaults; lives on the engine thread.
pub struct SpecBackend {
    model: Transformer,
    eos: Vec<u32>,
    default_kind: DraftKind,
    acceptance: Acceptance,
    drafters: Vec<(DraftKind, LoadedDrafter)>,
}

impl SpecBackend {
    /// Loads the target of `spec.model_dir` and the drafters (the configured one, and the
    /// model-free ones besides it).
    ///
    /// # Errors
    /// Invalid drafting options, or weights that do not load.
    pub fn load(spec: &LoadSpec, tokenizer: &Arc<Tokenizer>) -> anyhow::Result<SpecBackend> {
        let drafting = DrafterSpec::from_args(&spec.drafting)?;
        let dir: &Path = &spec.model_dir;
        let model = load_model(dir, &spec.load).with_context(|| format!("loading {}", dir.display()))?;
        let target = DraftTarget { dir, tokenizer, load: &spec.load };
        let default_kind = kind_of(&drafting);
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
        tracing::info!(model = %dir.display(), drafter = %drafting.describe(), "model loaded");
        Ok(SpecBackend {
            model,
            eos: tokenizer.eos_ids().to_vec(),
            default_kind,
            acceptance: spec.drafting.acceptance,
            drafters,
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
        let kind = job.draft_kind.unwrap_or(self.default_kind);
        let mut stopped = false;
        let mut emit = |id: u32| {
            if cancel.load(Ordering::Relaxed) || !on_token(Token { id, logprobs: None }) {
                stopped = true;
                return false;
            }
            true
        };
        let drafter = self.drafters.iter().find(|(k, _)| *k == kind).map(|(_, d)| d);
        let mut summary = Summary { prompt_tokens: job.prompt.len(), ..Summary::default() };
        let eos = match drafter {
            Some(d) if job.num_draft_tokens != Some(0) => {
                let acceptance = if kind == self.default_kind { self.acceptance } else { Acceptance::ExactMatch };
                let options = SpecOptions { num_draft_tokens: job.num_draft_tokens.unwrap_or(d.num_draft_tokens), acceptance };
                let mut source = d.provider.open(&self.model, &params.sampler)?;
                let stats = spec::speculative_generate(&self.model, source.as_mut(), &job.prompt, &params, options, &mut emit)?;
                summary.completion_tokens = stats.emitted;
                summary.rounds = stats.rounds;
                summary.draft_rounds = stats.rounds - stats.empty_rounds;
                summary.drafted = stats.drafted;
                summary.accepted = stats.accepted;
                summary.accepted_by_pos = stats.accepted_by_pos.clone();
                summary.tau = stats.tau;
                summary.prefill_ms = stats.prefill_ms;
                summary.decode_ms = stats.decode_ms;
                summary.fell_back = stats.fallback_at.is_some();
                stats.stopped_on_eos
            }
            _ => {
                let stats = models::generate(&self.model, &job.prompt, &params, &mut emit)?;
                summary.completion_tokens = stats.generation_tokens;
                summary.rounds = stats.generation_tokens;
                summary.tau = if stats.generation_tokens > 0 { 1.0 } else { 0.0 };
                summary.prefill_ms =
                    if stats.prompt_tps > 0.0 { stats.prompt_tokens as f64 / stats.prompt_tps * 1e3 } else { 0.0 };
                summary.decode_ms = if stats.generation_tps > 0.0 {
                    stats.generation_tokens as f64 / stats.generation_tps * 1e3
                } else {
                    0.0
                };
                stats.stopped_on_eos
            }
        };
        summary.finish = Some(if eos {
            Finish::Eos
        } else if stopped {
            if cancel.load(Ordering::Relaxed) { Finish::Cancelled } else { Finish::Stopped }
        } else {
            Finish::Length
        });
        Ok(summary)
    }

    fn gauges(&self) -> Gauges {
        Gauges { active_memory: mlx_core::memory::active(), ..Gauges::default() }
    }
}
